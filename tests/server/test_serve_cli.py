"""`slipstream serve` with bad arguments: one `error: ...` line and exit code 2, before serving."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _serve(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    env.pop("SLIPSTREAM_API_KEY", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "slipstream", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port"),
    (["--port", "0", "--max-batch", "0"], "--max-batch"),
    (["--port", "0", "--max-waiting", "0"], "--max-waiting"),
    (["/no/such/model.gguf", "--port", "0"], "no/such/model.gguf"),
    (["--port", "0", "--api-key", ""], "--api-key is empty"),
    (["--port", "0", "--max-body-bytes", "0"], "max-body-bytes"),
    (["--port", "0", "--header-timeout", "0"], "header-timeout"),
])
def test_bad_arguments(args, needle):
    proc = _serve(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_address_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _serve("--port", str(s.getsockname()[1]))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: cannot listen on 127.0.0.1:") and proc.stderr.count("\n") == 1, proc.stderr


def test_empty_api_key_in_the_environment_is_an_error():
    proc = _serve("--port", "0", env_extra={"SLIPSTREAM_API_KEY": ""})
    assert proc.returncode == 2 and "SLIPSTREAM_API_KEY is empty" in proc.stderr, proc.stderr


def test_startup_line_says_whether_the_api_is_open(server_process):
    assert "API OPEN: no API key" in server_process.log(100_000)
