"""One engine replica as a Ray Serve deployment: the model, its engine and the single server's app
(`server.app.build_app`), driven in process through `asgi_call`. Every route, its validation, its
errors, its streaming and its metrics are the single server's; the ingress only forwards.

Ray Serve owns its life: it starts it on a node with the CPUs (and GPUs) asked for, checks its
health (`check_health`) and starts a new one when its process dies.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from typing import Any, AsyncIterator

from slipstream.distributed.asgi_call import ForwardedRequest, call_asgi


class ReplicaServer:
    """The deployment's class (wrapped by `serve.deployment` in `ray_serve.py`)."""

    def __init__(self, model: str | None, engine_config: Any, server_config: Any, threads: int | None = None):
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from slipstream.api import LLM
        from slipstream.server.app import build_app
        from slipstream.server.async_engine import build_off_main_thread

        self.llm = build_off_main_thread(lambda: LLM(model, config=engine_config))
        self.app = build_app(self.llm, server_config)
        self.generation = uuid.uuid4().hex    # a restarted replica is a new generation: an empty cache
        self._lifespan: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None

    async def _started(self) -> None:
        """Enter the app's lifespan (which starts the engine thread) on the first call, on the event
        loop the calls run on."""
        if self._lifespan is not None:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._lifespan is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.app.router.lifespan_context(self.app))
                self._lifespan = stack

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        """The app's response to `request`: its head, then its body chunks (a streaming call)."""
        await self._started()
        async for part in call_asgi(self.app, request):
            yield part

    async def info(self) -> dict[str, Any]:
        await self._started()
        S = self.app.state.server
        return {"generation": self.generation, "pid": os.getpid(), "node": socket.gethostname(),
                "ready": bool(S.engine.is_running and S.engine.accepting and not S.draining),
                "inflight": S.engine.num_inflight, "model": S.model_id,
                "runtime": self.llm.engine.runtime_name}

    async def metrics(self) -> str:
        await self._started()
        return self.app.state.server.metrics.render().decode()

    async def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine thread died is replaced."""
        if self._lifespan is not None and not self.app.state.server.engine.is_running:
            raise RuntimeError("the engine thread is not running")

    async def shutdown(self) -> None:
        if self._lifespan is not None:
            stack, self._lifespan = self._lifespan, None
            await stack.aclose()
