"""`--tensor-parallel N`: this process becomes rank 0 of a gloo group and starts ranks 1..N-1 as
processes of their own; every rank loads the model and keeps only its shard
(`tensor_parallel.ShardedModel`). Rank 0 wraps its shard as the engine's model
(`TensorParallelModel`, eager runtime: the step is the sharded torch forward) and the `LLM` it
returns serves, generates and chats as usual; the other ranks follow its step descriptions until
`TensorParallelGroup.close()`.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from slipstream.errors import SlipstreamError

# a follower waits in a broadcast for rank 0's next step: an idle server must not time it out
IDLE_TIMEOUT = datetime.timedelta(days=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _threads(world: int) -> int:
    env = os.environ.get("SLIPSTREAM_THREADS")
    if env:
        return max(1, int(env))
    return max(1, (os.cpu_count() or 1) // world)


def _follower(rank: int, world: int, init_method: str, model: str | None, threads: int) -> None:
    from slipstream.distributed.tensor_parallel import Collectives, ShardedModel, follow
    from slipstream.models import build_model
    from slipstream.weights import load_model

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
    try:
        loaded = load_model(model)
        shard = ShardedModel(build_model(loaded.config, loaded.weights), Collectives())
        del loaded
        follow(shard)
    finally:
        dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's side of the group: the follower processes, and the model that drives them."""

    def __init__(self, model: Any, processes: list[Any]):
        self.model = model
        self.processes = processes

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.model.stop()
        except Exception:
            pass
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


def tensor_parallel_llm(model: str | None, config: Any, world: int,
                        progress: Callable[[str], None] | None = None) -> tuple[Any, TensorParallelGroup]:
    """An `LLM` whose engine runs `model` split over `world` gloo ranks (this process is rank 0)."""
    from slipstream.api import LLM
    from slipstream.distributed.tensor_parallel import Collectives, ShardedModel, TensorParallelModel
    from slipstream.engine.engine import Engine

    if world < 2:
        raise SlipstreamError("--tensor-parallel needs at least 2 ranks")
    if config.speculative:
        raise SlipstreamError("--tensor-parallel does not combine with --speculative yet")
    if config.runtime not in ("auto", "eager"):
        raise SlipstreamError(f"--tensor-parallel runs the sharded eager step; --runtime {config.runtime} "
                              "does not apply")
    config = replace(config, runtime="eager")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    threads = _threads(world)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower, args=(r, world, init_method, model, threads), daemon=True,
                         name=f"slipstream-tp-{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world, timeout=IDLE_TIMEOUT)
    try:
        llm = LLM(model, config=replace(config, kv_cache_tokens=config.block_size * 4), progress=progress)
        shard = ShardedModel(llm.model, Collectives())
        tp = TensorParallelModel(shard)
        if progress:
            progress(f"sharded over {world} ranks")
        llm.model = tp
        llm.engine = Engine(tp, llm.tokenizer, config)
    except BaseException:
        for p in procs:
            p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return llm, TensorParallelGroup(tp, procs)
