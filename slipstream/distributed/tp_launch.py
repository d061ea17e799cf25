"""`--tensor-parallel N`: this process becomes rank 0 of a process group (gloo on the CPU; NCCL with
rank r on cuda:r where CUDA is available, `tensor_parallel.rank_device`) and starts ranks 1..N-1 as
processes of their own; every rank opens the checkpoint and cuts only its shard from it
(`tensor_parallel.ShardedModel.from_weights`). Rank 0 wraps its shard as the engine's model
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


def _init_group(backend: str, device: torch.device, init_method: str, rank: int, world: int) -> Any:
    """Joins the group; returns `Collectives` over it (with a gloo control group beside NCCL)."""
    from slipstream.distributed.tensor_parallel import Collectives, control_group

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
    return Collectives(control=control_group())


def _follower(rank: int, world: int, init_method: str, model: str | None, threads: int,
              backend: str = "gloo", device: str = "cpu") -> None:
    from slipstream.distributed.tensor_parallel import ShardedModel, follow
    from slipstream.weights import load_model

    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(threads)
    comm = _init_group(backend, torch.device(device), init_method, rank, world)
    try:
        loaded = load_model(model)
        shard = ShardedModel.from_weights(loaded.config, loaded.weights, comm, device)
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
    """An `LLM` whose engine runs `model` split over `world` ranks (this process is rank 0)."""
    from unittest import mock

    import slipstream.api
    from slipstream.api import LLM
    from slipstream.distributed.tensor_parallel import ShardedModel, TensorParallelModel, rank_device

    if world < 2:
        raise SlipstreamError("--tensor-parallel needs at least 2 ranks")
    if config.speculative:
        raise SlipstreamError("--tensor-parallel does not combine with --speculative yet")
    if config.runtime not in ("auto", "eager"):
        raise SlipstreamError(f"--tensor-parallel runs the sharded eager step; --runtime {config.runtime} "
                              "does not apply")
    config = replace(config, runtime="eager")
    backend, device = rank_device(world, 0)   # refuses too few GPUs before anything starts
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    threads = config.threads or _threads(world)   # per rank: --threads, else the cores shared among the ranks
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower, args=(r, world, init_method, model, threads, backend,
                                                 str(_device_of(device, r))),
                         daemon=True, name=f"slipstream-tp-{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    torch.set_num_threads(threads)
    comm = _init_group(backend, device, init_method, 0, world)
    built: list[TensorParallelModel] = []

    def build_sharded(cfg: Any, weights: dict[str, Any]) -> TensorParallelModel:
        """`LLM`'s `build_model`: this rank's shard cut from the loader's weights (never the whole model)."""
        built.append(TensorParallelModel(ShardedModel.from_weights(cfg, weights, comm, device)))
        if progress:
            progress(f"sharded over {world} ranks ({backend}, {device})")
        return built[0]

    try:
        # LLM loads the checkpoint and builds its engine as usual; only its model is this rank's shard
        # (api.LLM has no way to take a model built elsewhere yet)
        with mock.patch.object(slipstream.api, "build_model", build_sharded):
            llm = LLM(model, config=config, progress=progress)
        if not built or llm.model is not built[0]:
            raise SlipstreamError("internal: LLM did not build its model through slipstream.api.build_model")
        tp = built[0]
    except BaseException:
        for p in procs:
            p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return llm, TensorParallelGroup(tp, procs)


def _device_of(rank0: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device when rank 0 is on `rank0`: cuda:r beside cuda:0, the CPU beside the CPU."""
    return torch.device("cuda", rank) if rank0.type == "cuda" else rank0
