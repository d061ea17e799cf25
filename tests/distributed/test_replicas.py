"""`slipstream serve --replicas 2` on Ray Serve, driven as a user drives it: the real CLI in a
subprocess (joining one Ray cluster this module starts), the real `openai` client on 127.0.0.1.

Two servers share the cluster: one routes cache-aware, one round-robin (both on the exact CPU path,
so greedy answers can be compared with an in-process engine's).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'slipstream[distributed]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from support import skip_unless_default_model  # noqa: E402

from slipstream.server.metrics import parse_metrics  # noqa: E402

STARTUP_TIMEOUT = 300.0
TIMEOUT = 150.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReplicaServer:
    """`python -m slipstream serve --replicas 2 --ray-address ADDR ARGS...` until /health says 2/2."""

    def __init__(self, address: str, log_path: Path, *args: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream", "serve", "--replicas", "2", "--ray-address", address,
             "--port", str(self.port), "--no-access-log", "--exact", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_ready(self) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < STARTUP_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=5)
                if r.status_code == 200 and r.json()["replicas_ready"] == 2:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the replicas did not come up in {STARTUP_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        r = httpx.get(f"{self.base_url}/metrics", timeout=30)
        r.raise_for_status()
        return parse_metrics(r.text)

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    skip_unless_default_model()
    ctx = ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
                   log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def servers(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ReplicaServer]]:
    logs = tmp_path_factory.mktemp("replicas")
    started = {name: ReplicaServer(ray_address, logs / f"{name}.log", "--router", name)
               for name in ("cache-aware", "round-robin")}
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def reference() -> Any:
    from slipstream import LLM

    return LLM(exact=True)


CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The capital of France is"


def test_answers_equal_a_single_engine(servers: dict[str, ReplicaServer], reference: Any):
    from slipstream import SamplingParams

    want_chat = reference.chat(CHAT, SamplingParams(max_tokens=24, temperature=0))[0].text
    want_text = reference.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0))[0].text
    c = servers["cache-aware"].client()
    for _ in range(2):   # the second time from the prefix cache (or the other replica)
        r = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want_chat
        chunks = c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat
        t = c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0)
        assert t.choices[0].text == want_text
        chunks = c.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want_text
    assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
    with pytest.raises(openai.BadRequestError) as e:   # the replica's own validation, passed through
        c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=24, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["code"]


LONG = ("Explain, in a few careful sentences, how a paged key-value cache lets an inference server reuse the "
        "computation of a shared prompt prefix across requests, and what happens when blocks run out. ")


def _conversation(c: Any, topic: int, turns: int) -> None:
    msgs: list[dict[str, str]] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Topic {topic}, question {t}. {LONG}"})
        r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})


def _per_replica(m: dict[str, float], name: str) -> list[float]:
    return [sum(v for k, v in m.items() if k.startswith(name + "{") and f'replica="{i}"' in k) for i in (0, 1)]


def _hit_rate(before: dict[str, float], after: dict[str, float]) -> float:
    q = after["slipstream_prefix_cache_queries_total"] - before["slipstream_prefix_cache_queries_total"]
    h = after["slipstream_prefix_cache_hits_total"] - before["slipstream_prefix_cache_hits_total"]
    return h / q


def test_cache_aware_keeps_a_conversation_on_one_replica_and_hits_more(servers: dict[str, ReplicaServer]):
    rates = {}
    for name, srv in servers.items():
        c = srv.client()
        first = srv.metrics()
        for topic in range(2):
            before = srv.metrics()
            _conversation(c, topic, 3)
            after = srv.metrics()
            done = [b - a for a, b in zip(_per_replica(before, "slipstream_request_success_total"),
                                          _per_replica(after, "slipstream_request_success_total"))]
            if name == "cache-aware":
                assert sorted(done) == [0, 3], f"conversation {topic}'s turns went to replicas {done}"
            else:
                assert sorted(done) == [1, 2]
        rates[name] = _hit_rate(first, srv.metrics())
    assert rates["cache-aware"] > rates["round-robin"], rates


def test_a_client_that_leaves_aborts_its_request_in_the_replica(servers: dict[str, ReplicaServer]):
    srv = servers["cache-aware"]
    key = 'slipstream_request_success_total{finished_reason="abort"}'
    before = srv.metrics()[key]
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                break                     # the first token is out: leave
    deadline = time.monotonic() + 60
    while srv.metrics()[key] == before:
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.5)
    assert sum(r["inflight"] for r in srv.health()["replicas"]) == 0


def test_bench_conversation_against_the_replicas(servers: dict[str, ReplicaServer], tmp_path: Path):
    """`slipstream bench --scenario conversation` runs against the replicas and reports their prefix-cache
    hit rate (summed over the replicas)."""
    import json

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "bench", "--base-url", servers["cache-aware"].base_url,
                           "--scenario", "conversation", "--rounds", "3", "--max-tokens", "8", "--warmup", "0",
                           "--no-progress", "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    point = json.loads(out.read_text())["targets"][0]["scenarios"]["conversation"]["points"][0]
    assert point["headline"]["completed"] == 3 and point["headline"]["failed"] == 0
    pc = point["summary"]["prefix_cache"]
    assert pc["queried_tokens"] > 0 and 0 < pc["hit_rate"] <= 1, pc


def test_killing_a_replica_during_load(servers: dict[str, ReplicaServer]):
    srv = servers["cache-aware"]
    outcomes: dict[int, str] = {}
    first_token = threading.Event()

    # answers long enough that the victim still has work in flight when the kill lands (at 64 tokens a fast
    # CPU, the Zen 5 EPYC, once had them all finished between the health read and the kill)
    tokens = 384

    def work(i: int) -> None:
        c = srv.client()
        msgs = [{"role": "user", "content": f"Request {i}: write a long story about a lighthouse keeper."}]
        try:
            if i % 2:
                reason = None
                for ch in c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    first_token.set()
                    if ch.choices and ch.choices[0].finish_reason:
                        reason = ch.choices[0].finish_reason
                outcomes[i] = f"ok:{reason}" if reason else "no-finish"
            else:
                r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=tokens, temperature=0,
                                              extra_body={"ignore_eos": True})
                outcomes[i] = f"ok:{r.choices[0].finish_reason}"
        except openai.APIError as e:   # an error answer or an SSE error event
            outcomes[i] = f"error:{type(e).__name__}"

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    assert first_token.wait(TIMEOUT), "no stream started"
    victim = max(srv.health()["replicas"], key=lambda r: r["inflight"])
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"requests hung: {outcomes}"
    assert len(outcomes) == 6 and all(o in ("ok:length", "error:APIError") or o.startswith("error:")
                                      for o in outcomes.values()), outcomes
    assert "no-finish" not in outcomes.values()
    m = srv.metrics()   # the kill hit work in flight: retried elsewhere (not yet answered) or cut mid-stream
    assert victim["inflight"] >= 1
    assert m["slipstream_router_retries_total"] + m["slipstream_router_streams_cut_total"] >= 1, outcomes
    cut = int(m["slipstream_router_streams_cut_total"])
    assert sum(o.startswith("error:") for o in outcomes.values()) >= cut
    t0 = time.monotonic()
    while time.monotonic() - t0 < STARTUP_TIMEOUT:   # Ray Serve starts a new replica in its place
        reps = srv.health()["replicas"]
        back = reps[victim["replica"]]
        if back["ready"] and back["pid"] != victim["pid"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"replica {victim['replica']} did not come back: {srv.health()}")
    assert srv.health()["replicas_ready"] == 2
    r = srv.client().chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
