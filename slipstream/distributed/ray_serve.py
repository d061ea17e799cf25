"""`slipstream serve MODEL --replicas N`: N engine replicas as Ray Serve deployments behind one
OpenAI-compatible endpoint.

    ray.init()                  a local Ray cluster (or `--ray-address` to join one)
    serve.start(Disabled)       Serve's controller; no Serve HTTP proxy: the endpoint is ours
    serve.run_many(N apps)      one application per replica (one `ReplicaServer` deployment each),
                                so the router can address a replica; Serve restarts a dead one
    uvicorn(Ingress)            the endpoint, behind the single server's request guard and
                                connection protocol (Host check, API key, body limits, timeouts)

On exit (SIGINT/SIGTERM: new requests get 503 while in-flight ones finish, for at most
`--drain-timeout` seconds) the applications are deleted and a cluster this command started is
shut down.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from slipstream.distributed.asgi_call import ForwardedRequest
from slipstream.distributed.ingress import Ingress, ReplicaFailed
from slipstream.distributed.prompt_key import prompt_key
from slipstream.distributed.router import POLICIES, Router
from slipstream.errors import SlipstreamError

log = logging.getLogger("slipstream.distributed")

READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 2
    ray_address: str | None = None       # None: start a local cluster (or join RAY_ADDRESS if set)
    replica_cpus: float | None = None    # Ray CPUs per replica (None: the machine's CPUs / replicas, at most 1)
    replica_gpus: float = 0.0
    threads: int | None = None           # compute threads per replica (None: its CPUs, at least 1)
    router: str = "cache-aware"
    load_threshold: int = 4              # cache-aware: requests in flight beyond the least loaded replica
    max_ongoing_requests: int = 1024     # per replica; the engine's own queue limit answers 503 before it

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise SlipstreamError(f"--replicas must be >= 1, got {self.replicas}")
        if self.router not in POLICIES:
            raise SlipstreamError(f"--router must be one of {', '.join(POLICIES)}, got {self.router!r}")
        if self.replica_cpus is not None and not self.replica_cpus > 0:
            raise SlipstreamError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.replica_gpus < 0:
            raise SlipstreamError(f"--replica-gpus must be >= 0, got {self.replica_gpus}")
        if self.threads is not None and self.threads < 1:
            raise SlipstreamError(f"--replica-threads must be >= 1, got {self.threads}")
        if self.load_threshold < 0:
            raise SlipstreamError(f"--router-load-threshold must be >= 0, got {self.load_threshold}")

    def cpus(self) -> float:
        if self.replica_cpus is not None:
            return self.replica_cpus
        return max(0.01, min(1.0, round((os.cpu_count() or 1) / self.replicas, 2)))

    def thread_count(self) -> int:
        return self.threads if self.threads is not None else max(1, int(self.cpus()))


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise SlipstreamError(f"--replicas needs Ray Serve ({e.name or e} is missing): "
                              "pip install 'slipstream[distributed]' (or 'ray[serve]')") from None


class ServeReplica:
    """A replica's Ray Serve deployment handle, as the ingress's `Replica`."""

    def __init__(self, handle: Any):
        self.handle = handle
        self._streaming = handle.options(stream=True)

    async def stream(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any] | bytes]:
        gen = self._streaming.handle_http.remote(request)
        done = False
        try:
            async for part in gen:
                yield part
            done = True
        except asyncio.CancelledError:
            raise
        except Exception as e:    # the actor died, is restarting, or its call failed
            raise ReplicaFailed(f"{type(e).__name__}: {str(e)[:300]}") from e
        finally:
            if not done:
                gen.cancel()

    async def info(self) -> dict[str, Any]:
        return await self.handle.info.remote()

    async def metrics(self) -> str:
        return await self.handle.metrics.remote()


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or start a local one. True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise SlipstreamError(f"cannot join the Ray cluster at {address}: {e}") from None
        return False
    joining = bool(os.environ.get("RAY_ADDRESS"))
    ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             object_store_memory=None if joining else 200 * 1024 * 1024)
    return not joining


def deploy(model: str | None, engine_config: Any, server_config: Any, opts: ReplicaOptions,
           app_prefix: str) -> list[Any]:
    """Deploys the replicas (one Serve application each) and returns their handles once every one
    has loaded its model."""
    from ray import serve
    from ray.serve.api import RunTarget

    from slipstream.distributed.replica import ReplicaServer

    _start_serve()
    threads = opts.thread_count()
    env = {"SLIPSTREAM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    make: Any = serve.deployment
    dep = make(ReplicaServer).options(
        name="replica", num_replicas=1, max_ongoing_requests=opts.max_ongoing_requests,
        ray_actor_options={"num_cpus": opts.cpus(), "num_gpus": opts.replica_gpus, "runtime_env": {"env_vars": env}},
        health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0)
    replica_config = replace(server_config, allowed_hosts=None)   # the ingress checks the Host header
    targets = [RunTarget(dep.bind(model, engine_config, replica_config, threads), name=f"{app_prefix}-{i}",
                         route_prefix=None) for i in range(opts.replicas)]
    try:
        return list(serve.run_many(targets))
    except RuntimeError as e:
        raise SlipstreamError(f"the replicas could not start: {e}") from None


def _start_serve(attempts: int = 10) -> None:
    """Start Serve's controller on the cluster, or connect to the one running there. Two commands
    joining one cluster at once may race to create it: the loser connects to the winner's."""
    import time

    from ray import serve
    from ray.exceptions import ActorAlreadyExistsError

    for attempt in range(attempts):
        try:
            serve.start(proxy_location="Disabled")
            return
        except ActorAlreadyExistsError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)


def load_tokenizer(model: str | None) -> Any:
    """The model's tokenizer alone (the ingress tokenizes prompts to route them)."""
    from slipstream.tokenizer import Tokenizer
    from slipstream.weights import resolve_model
    from slipstream.weights.artifact import is_artifact, load_artifact

    path = resolve_model(model)
    if is_artifact(path):
        return load_artifact(path).tokenizer
    if path.is_file():
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_hf_dir(path)


def build_ingress(handles: list[Any], tokenizer: Any, engine_config: Any, server_config: Any,
                  opts: ReplicaOptions) -> Ingress:
    router = Router(len(handles), opts.router, opts.load_threshold)
    block = engine_config.block_size
    max_chars = server_config.max_prompt_chars or (1 << 22)

    def key_of(path: str, body: bytes) -> Any:
        return prompt_key(path, body, tokenizer, block, max_chars)

    return Ingress([ServeReplica(h) for h in handles], router, key_of, retry_after_s=server_config.retry_after_s)


def run_replicas(model: str | None, engine_config: Any, server_config: Any, opts: ReplicaOptions, *,
                 host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", access_log: bool = True,
                 allowed_hosts: tuple[str, ...] = (), say: Any = print) -> None:
    """Start (or join) Ray, deploy the replicas, serve the endpoint until a signal, clean up."""
    require_ray()
    import ray
    from ray import serve

    started = connect(opts.ray_address)
    prefix = f"slipstream-{uuid.uuid4().hex[:8]}"
    try:
        handles = deploy(model, engine_config, server_config, opts, prefix)
        ingress = build_ingress(handles, load_tokenizer(model), engine_config, server_config, opts)
        say(f"{opts.replicas} replica(s) ready ({opts.cpus():g} CPU and {opts.thread_count()} thread(s) each, "
            f"router {opts.router}); Ray cluster {'started here' if started else 'joined'}")
        _serve_ingress(ingress, server_config, host, port, log_level, access_log, allowed_hosts)
    finally:
        if started:    # the whole cluster goes: Serve's controller and replicas with it
            try:
                serve.shutdown()
            except Exception as e:
                log.warning("Serve did not shut down cleanly: %s", e)
            ray.shutdown()
        else:          # a cluster we joined keeps running: remove only our applications
            for i in range(opts.replicas):
                try:
                    serve.delete(f"{prefix}-{i}", _blocking=False)
                except Exception as e:
                    log.warning("could not delete the Serve application %s-%d: %s", prefix, i, e)


def _serve_ingress(ingress: Ingress, config: Any, host: str, port: int, log_level: str, access_log: bool,
                   allowed_hosts: tuple[str, ...]) -> None:
    import signal
    import threading

    import uvicorn

    from slipstream.server.config import default_allowed_hosts
    from slipstream.server.http import RequestGuard, protocol_class

    if config.allowed_hosts is None:
        config = replace(config, allowed_hosts=default_allowed_hosts(host, allowed_hosts))
    app = RequestGuard(ingress, config)
    drain_timeout = config.drain_timeout

    class _Server(uvicorn.Server):
        drain_requested = False
        drain_started = 0.0

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.drain_requested:        # the first signal: drain
                self.drain_requested = True
                ingress.draining = True
            else:                               # the second: stop now
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested:
                loop = asyncio.get_running_loop()
                if not self.drain_started:
                    self.drain_started = loop.time()
                waited = loop.time() - self.drain_started
                if ingress.inflight == 0:
                    return True
                if drain_timeout is not None and waited > drain_timeout:
                    ingress.cut_all()          # streams end with an error event and [DONE]
                    if waited > drain_timeout + 5.0:
                        return True
            return await super().on_tick(counter)

    uconfig = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                             http=protocol_class(config), timeout_keep_alive=config.idle_timeout,
                             timeout_graceful_shutdown=5, server_header=False)
    server = _Server(uconfig)
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig in handled:
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except SystemExit:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SlipstreamError(f"could not start the endpoint on {host}:{port} (see the log above)")
