"""Tasks taken over by a waiting thread (step.c's split tasks): results bitwise the same whoever runs what,
including when the team's threads preempt each other on one core, and the in-place path's bits kept."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from support import decode_step, prefill_step, skip_unless_default_model

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel
from slipstream.runtime.cpu_team import CpuTeamDecoder

from tests.runtime.test_cpu_team import PROMPTS, _packed_random, _run

lib = load_library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native step is not built")

DEFAULT_STEAL = (200, 3)   # step.c's defaults (SLIPSTREAM_STEAL unset)


@pytest.fixture(autouse=True)
def two_threads_throughout(monkeypatch):
    """The team keeps both threads even while other processes (another pytest worker) keep a core busy:
    a team shrunk to one thread has nobody to take a task over."""
    monkeypatch.setenv("SLIPSTREAM_ADAPTIVE_THREADS", "0")


@pytest.fixture(scope="module")
def smollm2() -> LlamaModel:
    skip_unless_default_model()
    from slipstream.weights import load_model
    m = load_model(None)
    return LlamaModel(m.config, m.weights)


@contextmanager
def steal(min_us: int, factor: int) -> Iterator[None]:
    lib.ss_set_steal(min_us, factor)
    try:
        yield
    finally:
        lib.ss_set_steal(*DEFAULT_STEAL)


@contextmanager
def one_core() -> Iterator[None]:
    """Every thread of this process on one CPU: the team's threads preempt each other mid-task."""
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    before = {t: os.sched_getaffinity(t) for t in tasks}
    cpu = min(os.sched_getaffinity(0))
    for t in tasks:
        os.sched_setaffinity(t, {cpu})
    try:
        yield
    finally:
        for t, cpus in before.items():
            try:
                os.sched_setaffinity(t, cpus)
            except OSError:   # a thread that has ended since
                pass
        for t in os.listdir("/proc/self/task"):   # threads started meanwhile (the team's, resized)
            if int(t) not in before:
                try:
                    os.sched_setaffinity(int(t), before[min(before)])
                except OSError:
                    pass


def _logits(model: LlamaModel, prompts: list[list[int]], steps: int, exact: bool, threads: int) -> list[torch.Tensor]:
    return [lt for _, lt in _run(model, prompts, steps, exact=exact, threads=threads)]


@pytest.mark.parametrize("exact", [False, True])
def test_taking_over_every_task_gives_the_same_bits(smollm2, exact):
    """min 0 us, factor 0: a waiting thread takes over any task that signals what it waits for, even one the
    other thread is computing, so both compute it and one commits: the logits of batch 1 and batch 3 are bitwise
    those with no task taken over, and of one thread."""
    for prompts in PROMPTS:
        alone = _logits(smollm2, prompts, 3, exact, threads=1)
        with steal(-1, 0):
            kept = _logits(smollm2, prompts, 3, exact, threads=2)
        before = lib.ss_steals()
        with steal(0, 0):
            taken = _logits(smollm2, prompts, 3, exact, threads=2)
        assert lib.ss_steals() > before, "no task was taken over"
        for a, b, c in zip(alone, kept, taken):
            assert torch.equal(a, b)
            assert torch.equal(a, c)


@pytest.mark.parametrize("qwen", [None, "qwen2", "qwen3"])
def test_taken_over_tasks_on_biased_and_normed_heads(qwen):
    """q/k/v biases and per-head q/k norms go through the split QKV tasks' own buffers too."""
    model = _packed_random(qwen)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    alone = _logits(model, prompts, 3, False, threads=1)
    with steal(0, 0):
        taken = _logits(model, prompts, 3, False, threads=2)
    for a, b in zip(alone, taken):
        assert torch.equal(a, b)


def _greedy_decode(model: LlamaModel, prompts: list[list[int]], steps: int, threads: int,
                   on_one_core: bool = False) -> list[torch.Tensor]:
    """Prefill eagerly, then `steps` greedy decode steps on the team (on one CPU if asked: only the team's
    steps, the eager prefill's OpenMP regions would spin against each other there)."""
    kv = model.new_kv_cache(64)
    team = CpuTeamDecoder(model, kv, exact=False, threads=threads)
    seqs = [SequenceKV(kv) for _ in prompts]
    for p, s in zip(prompts, seqs):
        model.forward(prefill_step(s, p, extra=steps + 2), kv)
    tokens, positions, out = [1] * len(prompts), [len(p) for p in prompts], []
    with one_core() if on_one_core else nullcontext():
        for _ in range(steps):
            logits = team.forward(decode_step(seqs, tokens, positions))
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
    return out


def test_threads_preempting_each_other_on_one_core(smollm2):
    """Two threads on one CPU, default thresholds: the OS preempts a thread in the middle of its tasks and the
    other takes them over; the tokens and logits stay those of one thread."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity here")
    alone = _greedy_decode(smollm2, PROMPTS[1], 6, threads=1)
    shared = _greedy_decode(smollm2, PROMPTS[1], 6, threads=2, on_one_core=True)
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)


def test_the_split_path_keeps_the_in_place_bits(smollm2):
    """Products computed into a thread's buffer and then added (split) give the bits of the kernels'
    accumulating stores (in place, ss_set_split(0))."""
    split = _logits(smollm2, PROMPTS[1], 3, False, threads=2)
    lib.ss_set_split(0)
    try:
        in_place = _logits(smollm2, PROMPTS[1], 3, False, threads=2)
    finally:
        lib.ss_set_split(1)
    for a, b in zip(split, in_place):
        assert torch.equal(a, b)
