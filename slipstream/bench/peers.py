"""Starting and stopping the servers the benchmark measures: a peer (llama.cpp) or Slipstream itself.

Each server runs as a child process on a free loopback port, its output in a log file; it is ready
when ``GET /v1/models`` answers 200, and it is stopped (SIGTERM, then SIGKILL after 10 s) when its
workload is done, so two servers never run at the same time.

llama.cpp is measured through llama-cpp-python's OpenAI-compatible server::

    python -m llama_cpp.server --model GGUF --host 127.0.0.1 --port PORT --n_ctx 2048
        --n_threads N --n_threads_batch N

        --interrupt_requests False

(``N`` = the machine's CPU count unless ``--peer-threads`` says otherwise). That server runs one
sequence at a time: concurrent requests wait for each other (no batching), which is how it is
deployed by default, except that its default ``interrupt_requests=True`` makes a new request abort
the stream in progress; we turn that off so concurrent requests queue instead of failing. It accepts ``min_tokens`` (used for fixed output lengths; it ignores
``ignore_eos``) and sends no ``usage`` in streams, so its token counts are filled in after the run
(see ``client.fill_token_counts``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

from slipstream import peer_environ
from slipstream.errors import SlipstreamError

PEERS = ("llama.cpp",)


class BenchError(SlipstreamError):
    """A problem that stops the benchmark (printed as one `error: ...` line)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_model() -> str:
    from slipstream.weights import default_model_path

    try:
        return str(default_model_path())
    except Exception as e:  # ModelLoadError: the embedded model is not installed
        raise BenchError(str(e)) from None


def llama_cpp_command(model: str, port: int, n_ctx: int = 2048, threads: int | None = None) -> list[str]:
    threads = threads or os.cpu_count() or 1
    return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--interrupt_requests", "False"]


def slipstream_command(model: str | None, port: int, max_batch: int | None = None,
                       extra: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "slipstream", "serve"]
    if model:
        cmd.append(model)
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if max_batch:
        cmd += ["--max-batch", str(max_batch)]
    return cmd + list(extra)


class ManagedServer:
    """A server process started and stopped by the benchmark."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = env
        d = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="slipstream-bench-"))
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / f"{name.replace('/', '_').replace('.', '_')}-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Start the process and wait until it answers; returns the start-up time in seconds."""
        t0 = time.perf_counter()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**peer_environ(), **(self.env or {})}, start_new_session=True)
        except OSError as e:
            log.close()
            raise BenchError(f"could not start {self.name}: {e}") from None
        log.close()
        with httpx.Client(timeout=5.0, trust_env=False) as c:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise BenchError(f"{self.name} exited with code {rc} before it was ready; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    if c.get(self.base_url + "/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    self.stop()
                    raise BenchError(f"{self.name} was not ready after {timeout_s:.0f} s; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
                time.sleep(0.2)
        self.startup_s = time.perf_counter() - t0
        return self.startup_s

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server process so far (Linux /proc), or None."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ManagedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- machine load


def _cpu_busy_total() -> tuple[int, int] | None:
    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return sum(f) - idle, sum(f)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class LoadWatch:
    """How many cores other processes kept busy while a target ran: the machine's busy time minus
    this client's and (when we started it) the server's, over the wall time. A quiet machine shows
    ~0; more than a few tenths of a core means the numbers are disturbed."""

    def __init__(self, server: ManagedServer | None = None) -> None:
        self.server = server
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu_busy_total()
        self.own0 = _own_cpu_s()
        self.srv0 = server.cpu_seconds() if server else None
        self.load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def result(self) -> dict[str, float | None]:
        wall = time.perf_counter() - self.t0
        cpu1 = _cpu_busy_total()
        out: dict[str, float | None] = {"loadavg_1m_start": self.load0,
                                        "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                                        "machine_busy_cores": None, "client_cores": None, "server_cores": None,
                                        "other_cores": None}
        if self.cpu0 is None or cpu1 is None or wall <= 0:
            return out
        busy = (cpu1[0] - self.cpu0[0]) / os.sysconf("SC_CLK_TCK") / wall
        own = (_own_cpu_s() - self.own0) / wall
        out.update(machine_busy_cores=busy, client_cores=own)
        srv1 = self.server.cpu_seconds() if self.server else None
        if srv1 is not None and self.srv0 is not None:
            out["server_cores"] = (srv1 - self.srv0) / wall
            out["other_cores"] = max(0.0, busy - own - out["server_cores"])
        return out
