"""`slipstream serve` with bad arguments: one `error: ...` line and exit code 2, before serving."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "slipstream", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("args,needle", [
    (["--port", "70000"], "--port"),
    (["--port", "0", "--max-batch", "0"], "--max-batch"),
    (["--port", "0", "--max-waiting", "0"], "--max-waiting"),
    (["/no/such/model.gguf", "--port", "0"], "no/such/model.gguf"),
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
