"""Fixtures for the server tests: a real `slipstream serve` subprocess (see server_support.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from server_support import REQUEST_TIMEOUT, ServerProcess
from support import skip_unless_default_model


@pytest.fixture(scope="session")
def server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    skip_unless_default_model()
    pytest.importorskip("fastapi")
    # the exact CPU path: tests compare the server's greedy answers with an in-process LLM's, and a
    # conversation's prefix-cached turn (decoded) must round like the reference's prefill
    srv = ServerProcess("--exact", log_path=tmp_path_factory.mktemp("server") / "serve.log")
    try:
        yield srv
    finally:
        srv.terminate()
        srv.kill()


@pytest.fixture(scope="session")
def server(server_process: ServerProcess) -> str:
    return server_process.base_url


@pytest.fixture
def client(server: str):
    import openai

    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT) as c:
        yield c


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start a separate server with extra arguments; it is killed at the end of the test."""
    skip_unless_default_model()
    pytest.importorskip("fastapi")
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(*args, log_path=tmp_path / f"serve-{len(started)}.log", env=env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.kill()
