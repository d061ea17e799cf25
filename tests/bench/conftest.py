"""Fixtures of the bench tests: the fake OpenAI-compatible server of fake_openai.py, live on a free port."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from fake_openai import make_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def fake_server():
    """(base_url, app) of a running fake server."""
    import uvicorn

    app = make_app()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 20:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    th.join(5)
