"""The CPU team's size under a busy neighbour (runtime/cpu_load.py): the load it reads, the size it
picks, and the decoder resizing its team between steps without changing a result."""
from __future__ import annotations

import sys

import pytest
import torch
from support import decode_step, prefill_step

from slipstream.kernels.cpu import load_library
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel
from slipstream.models.random_init import random_llama, shape_config
from slipstream.runtime.cpu_load import NeighbourLoad, team_size
from slipstream.runtime.cpu_team import CpuTeamDecoder


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_load_is_the_machines_busy_time_less_our_own_per_second():
    clock, busy, own = _Clock(), [50.0], [3.0]
    load = NeighbourLoad(window_s=0.5, machine_busy=lambda: busy[0], own_cpu=lambda: own[0], clock=clock)
    clock.t += 0.2
    busy[0] += 0.4
    assert load.sample() is None                 # the window is still open
    clock.t += 0.8                               # 1 s in all: 1.6 s busy, 0.5 s of it ours
    busy[0] += 1.2
    own[0] += 0.5
    assert load.sample() == pytest.approx(1.1)
    clock.t += 1.0                               # next window: only our own work
    busy[0] += 0.7
    own[0] += 0.75                               # rounding of the two clocks: never below zero
    assert load.sample() == 0.0


def test_no_proc_stat_means_no_reading():
    clock = _Clock()
    load = NeighbourLoad(window_s=0.1, machine_busy=lambda: None, own_cpu=lambda: 0.0, clock=clock)
    clock.t += 1
    assert load.sample() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat")
def test_reads_this_machine():
    load = NeighbourLoad(window_s=0.0)
    other = load.sample()
    assert other is not None and other >= 0.0


@pytest.mark.parametrize("configured, cores, other, want", [
    (2, 2, 0.0, 2), (2, 2, 0.3, 2), (2, 2, 1.0, 1), (2, 2, 1.3, 1), (2, 2, 2.0, 1),
    (8, 8, 3.0, 5), (4, 8, 1.0, 4), (2, 2, 0.6, 1)])
def test_team_size_is_the_free_cores_rounded(configured, cores, other, want):
    assert team_size(configured, cores, other) == want


class _Script:
    """A NeighbourLoad stand-in that reports the given readings, one per step."""

    def __init__(self, readings: list[float | None]) -> None:
        self.readings = list(readings)

    def sample(self) -> float | None:
        return self.readings.pop(0) if self.readings else None


@pytest.mark.skipif(load_library() is None, reason="native CPU kernels unavailable")
def test_decoder_shrinks_and_grows_its_team_with_the_same_results(monkeypatch):
    cfg = shape_config("tiny", hidden_size=128, head_dim=32, intermediate_size=256, num_layers=2)
    model: LlamaModel = random_llama(cfg, seed=11)
    kv_e, kv_t = model.new_kv_cache(64), model.new_kv_cache(64)
    team = CpuTeamDecoder(model, kv_t, exact=True, threads=2)
    assert team.active_threads == 2
    team._neighbours = _Script([None, 1.4, None, 0.1])   # type: ignore[assignment]
    se, st = SequenceKV(kv_e), SequenceKV(kv_t)
    prompt = [1, 5, 9, 2]
    tok = int(model.forward(prefill_step(se, prompt, extra=8), kv_e).argmax())
    model.forward(prefill_step(st, prompt, extra=8), kv_t)
    sizes = []
    for i in range(4):
        le = model.forward(decode_step([se], [tok], [len(prompt) + i]), kv_e)
        lt = team.forward(decode_step([st], [tok], [len(prompt) + i]))
        sizes.append(team.active_threads)
        torch.testing.assert_close(lt, le, rtol=1e-4, atol=1e-4)
        tok = int(le.argmax())
    assert sizes == [2, 1, 1, 2]
    # a fixed team: SLIPSTREAM_ADAPTIVE_THREADS=0
    monkeypatch.setenv("SLIPSTREAM_ADAPTIVE_THREADS", "0")
    assert CpuTeamDecoder(model, model.new_kv_cache(64), threads=2)._neighbours is None
