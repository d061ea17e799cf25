"""Helpers for the server tests: a real `slipstream serve` subprocess, as a user runs it.
The fixtures built on them live in conftest.py:

    server          base URL ("http://127.0.0.1:PORT") of one server shared by the session
                    (the default model, default settings); its process is `server_process`
    client          a sync `openai.OpenAI` for it (no retries: a 503 must show up as one)
    start_server    start another server with extra CLI arguments (stopped at the end of the test)
    metrics(url)    GET /metrics parsed into {'name{labels}': value}

The server's output goes to a log file whose tail is shown when it fails to come up.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STARTUP_TIMEOUT = 240.0
REQUEST_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics as {'name' or 'name{labels}': value}."""
    import httpx

    from slipstream.server.metrics import parse_metrics

    r = httpx.get(f"{base_url}/metrics", timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


class ServerProcess:
    """`python -m slipstream serve --port P ARGS...`, waited for until /health answers 200."""

    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream", "serve", "--port", str(self.port), "--no-access-log", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < STARTUP_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not come up in {STARTUP_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self, tail: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()




class ThreadedServer:
    """An app over the fake engine (tests/server/fake_engine.py) served by uvicorn with the server's own
    connection protocol on 127.0.0.1, in a thread of this process: real sockets and HTTP, no model."""

    def __init__(self, config=None, engine=None, host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = ()):
        import threading
        from dataclasses import replace

        import uvicorn
        from fake_engine import FakeLLM

        from slipstream.server.app import build_app
        from slipstream.server.config import ServerConfig, default_allowed_hosts
        from slipstream.server.http import protocol_class

        config = config or ServerConfig()
        if config.allowed_hosts is None:
            config = replace(config, allowed_hosts=default_allowed_hosts(host, allowed_hosts))
        self.config = config
        self.llm = FakeLLM(engine)
        self.app = build_app(self.llm, config)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host=host, port=self.port, log_level="warning", access_log=False, lifespan="on",
            http=protocol_class(config), timeout_keep_alive=config.idle_timeout, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert time.monotonic() - t0 < 30, "the threaded server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
