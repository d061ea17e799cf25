"""Scenario construction, the built-in text set, server start/stop."""
from __future__ import annotations

import sys

import pytest

from slipstream.bench.cli import build_parser, build_specs, main, scenario_names
from slipstream.bench.peers import BenchError, ManagedServer, free_port, llama_cpp_command, slipstream_command
from slipstream.bench.client import poisson_offsets
from slipstream.bench.workloads import documents, parse_list, vocabulary


def test_documents_are_about_800_chars_and_distinct():
    docs = documents(50)
    assert len(docs) == 50 and len(set(docs)) == 50
    for d in docs:
        assert 700 <= len(d) <= 1200 and d.endswith((".", "!", "?"))
    assert len(vocabulary()) > 300


def test_specs_for_all_scenarios():
    args = build_parser().parse_args(["--base-url", "http://x", "--scenario", "all"])
    specs = {s.name: s for s in build_specs(args)}
    assert list(specs) == ["short", "long", "batch-docs", "conversation", "serving"]
    assert specs["short"].mode == "sequential" and len(specs["short"].prompts) == 5
    assert "200-character" in specs["short"].prompts[0].messages[0]["content"]
    assert "3,000-character" in specs["long"].prompts[0].messages[0]["content"]
    assert specs["batch-docs"].mode == "batch" and len(specs["batch-docs"].prompts) == 50
    assert specs["conversation"].mode == "conversation" and len(specs["conversation"].prompts) == 10
    assert specs["serving"].points == [{"concurrency": 1}, {"concurrency": 4}, {"concurrency": 16}]
    assert not any(p.fixed_length for p in specs["short"].prompts)
    args = build_parser().parse_args(["--base-url", "http://x", "--scenario", "serving", "--dataset", "builtin",
                                      "--concurrency", "2", "--request-rate", "1.5,inf", "--num-prompts", "3"])
    (s,) = build_specs(args)
    assert s.points == [{"concurrency": 2}, {"request_rate": 1.5}, {"request_rate": float("inf")}]
    assert len(s.prompts) == 9 and all(p.fixed_length and p.max_tokens == 128 for p in s.prompts)


def test_parse_helpers():
    assert parse_list("1, 4,16") == [1, 4, 16]
    assert parse_list("0.5,inf", float) == [0.5, float("inf")]
    with pytest.raises(ValueError):
        parse_list("0")
    assert scenario_names("short,all") == ["short", "long", "batch-docs", "conversation", "serving"]
    with pytest.raises(BenchError):
        scenario_names("nope")


def test_poisson_offsets():
    assert poisson_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    a = poisson_offsets(2000, 4.0, 1)
    assert a == poisson_offsets(2000, 4.0, 1) and a != poisson_offsets(2000, 4.0, 2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert abs(a[-1] / 1999 - 0.25) < 0.02          # mean gap 1/rate


def test_bad_arguments_exit_2(capsys):
    assert main(["--scenario", "short"]) == 2                     # no target
    assert main(["--base-url", "http://x", "--server", "slipstream"]) == 2
    assert main(["--base-url", "http://x", "--slo", "ttft"]) == 2
    assert main(["--base-url", "http://x", "--scenario", "bogus"]) == 2
    assert main(["--base-url", "http://x", "--peer", "llama.cpp", "--peer-model", "/nonexistent.gguf"]) == 2
    assert capsys.readouterr().err.count("error:") == 5


def test_server_commands():
    cmd = llama_cpp_command("m.gguf", 1234, 2048, 2)
    assert cmd[1:3] == ["-m", "llama_cpp.server"]
    s = " ".join(cmd)
    assert "--model m.gguf" in s and "--port 1234" in s and "--n_ctx 2048" in s and "--n_threads 2" in s
    assert "--interrupt_requests False" in s and "--host 127.0.0.1" in s
    assert slipstream_command(None, 5, 8)[1:] == ["-m", "slipstream", "serve", "--host", "127.0.0.1", "--port", "5",
                                                  "--max-batch", "8"]


MINI_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == '/v1/models' else 404)
        self.send_header('content-type', 'application/json'); self.end_headers()
        self.wfile.write(b'{"data": [{"id": "mini"}]}')
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def test_managed_server_start_stop(tmp_path):
    import httpx

    port = free_port()
    srv = ManagedServer("mini", [sys.executable, "-c", MINI_SERVER, str(port)], port, str(tmp_path))
    with srv:
        t = srv.start(timeout_s=30)
        assert 0 < t < 30
        assert httpx.get(srv.base_url + "/v1/models", trust_env=False).json()["data"][0]["id"] == "mini"
        assert srv.cpu_seconds() is not None
    assert srv.proc.poll() is not None                          # stopped on exit


def test_managed_server_that_dies_is_a_bench_error(tmp_path):
    port = free_port()
    srv = ManagedServer("dies", [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], port, str(tmp_path))
    with pytest.raises(BenchError, match="exited with code 3") as e:
        srv.start(timeout_s=30)
    assert "bad flag" in str(e.value)


def test_plans_keep_their_own_models():
    from slipstream.bench.cli import plans_from_args

    gguf = __file__   # any existing file stands in for a GGUF
    args = build_parser().parse_args(["--server", "slipstream", "--peer", "llama.cpp", "--peer-model", gguf,
                                      "--max-batch", "4"])
    ours, peer = plans_from_args(args)
    assert ours["command"](1)[3:] == ["serve", "--host", "127.0.0.1", "--port", "1", "--max-batch", "4"]
    assert peer["command"](2)[4] == gguf and peer["label"] == "llama.cpp"
