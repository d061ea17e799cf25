"""The whole client path against a live (fake) OpenAI-compatible streaming server.

The fake server (conftest.py) streams with known delays: the first content chunk 40 ms after the
request, then one chunk every 10 ms. The lead adds the same checks against `slipstream serve`.
"""
from __future__ import annotations

import asyncio
import json

from fake_openai import ITL_S, NATURAL_TOKENS, TTFT_S

from slipstream.bench.cli import main
from slipstream.bench.client import Prompt, Target, make_client, send_request
from slipstream.bench.runner import RunOptions, prepare, run_point
from slipstream.bench.workloads import ScenarioSpec

STAT_KEYS = {"n", "mean", "std", "min", "p50", "p90", "p99", "max"}
SUMMARY_KEYS = {"completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
                "output_speed_tok_s", "request_goodput", "good_requests", "slo_ms"}


def test_short_and_serving_sweep_with_peer(fake_server, tmp_path):
    base, _ = fake_server
    out, rep = tmp_path / "r.json", tmp_path / "report"
    rc = main(["--base-url", base + "/v1", "--label", "ours", "--peer-base-url", base + "/nousage", "--peer-label", "peer",
               "--scenario", "short,serving", "--num-prompts", "4", "--max-tokens", "8", "--concurrency", "1,2",
               "--input-len", "32", "--output-len", "6", "--slo", "ttft:1000,tpot:500",
               "--out", str(out), "--report", str(rep), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["machine"]["cores"] and res["date"] and res["command"].startswith("slipstream bench ")
    ours, peer = res["targets"]
    assert (ours["label"], peer["label"]) == ("ours", "peer")
    assert ours["model"] == "fake-model" and ours["tokenizer_endpoint"] == "vllm"
    assert peer["tokenizer_endpoint"] == "llama-cpp-python"
    for t in (ours, peer):
        assert set(t["scenarios"]) == {"short", "serving"}
        short = t["scenarios"]["short"]["points"][0]
        s = short["summary"]
        assert SUMMARY_KEYS <= set(s)
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_speed_tok_s"):
            assert set(s[k]) == STAT_KEYS and s[k]["n"] > 0
        assert s["completed"] == 4 and s["failed"] == 0
        # natural stop after NATURAL_TOKENS tokens; sane timings from the known delays
        assert s["total_output_tokens"] == 4 * NATURAL_TOKENS
        assert TTFT_S * 1e3 <= s["ttft_ms"]["min"] and s["ttft_ms"]["p50"] < TTFT_S * 1e3 + 400
        assert ITL_S * 1e3 * 0.9 <= s["tpot_ms"]["min"] and s["tpot_ms"]["p50"] < ITL_S * 1e3 + 100
        assert s["e2el_ms"]["min"] >= (TTFT_S + (NATURAL_TOKENS - 1) * ITL_S) * 1e3 * 0.95
        assert s["good_requests"] == 4
        for r in short["requests"]:
            assert r["text"].strip().startswith("w0") and r["finish_reason"] == "stop"
        serving = t["scenarios"]["serving"]
        assert [p["label"] for p in serving["points"]] == ["concurrency=1", "concurrency=2"]
        for p in serving["points"]:
            s = p["summary"]
            assert s["completed"] == 4 and s["total_output_tokens"] == 4 * 6      # fixed lengths honoured
            assert s["total_input_tokens"] == 4 * 32                             # prompts cut to --input-len
            assert s["output_throughput"] > 0 and s["request_throughput"] > 0
            assert p["warnings"] == []
    # where the tokens came from: ours sends usage; the peer does not (filled in after the run)
    srv_ours = ours["scenarios"]["serving"]["points"][0]["requests"]
    srv_peer = peer["scenarios"]["serving"]["points"][0]["requests"]
    assert {r["output_tokens_source"] for r in srv_ours} == {"usage"}
    assert {r["output_tokens_source"] for r in srv_peer} == {"max_tokens"}
    assert {r["prompt_tokens_source"] for r in srv_peer} == {"workload"}
    assert {r["output_tokens_source"] for r in peer["scenarios"]["short"]["points"][0]["requests"]} == {"retokenized"}
    assert {r["prompt_tokens_source"] for r in peer["scenarios"]["short"]["points"][0]["requests"]} == {"probe"}
    # the same prompts went to both
    assert ours["fixed_length_fields"] == ["ignore_eos", "min_tokens"]
    cfg = ours["scenarios"]["serving"]["config"]
    assert cfg["prompt_construction"]["method"] == "tokenizer"
    # ratios ours/peer for every point
    assert set(res["ratios"]) == {"short", "serving"}
    assert set(res["ratios"]["serving"]) == {"concurrency=1", "concurrency=2"}
    r = res["ratios"]["short"]["sequential"]
    assert 0.2 < r["ttft_mean_ms"] < 5 and 0.2 < r["output_throughput"] < 5
    md = (rep / "report.md").read_text()
    assert "ours / peer" in md and "concurrency=2" in md
    for png in ("short_latency.png", "serving_latency.png", "serving_concurrency.png", "scenarios_overview.png"):
        assert (rep / png).read_bytes()[:4] == b"\x89PNG"


def test_poisson_rates_completions_endpoint_builtin_dataset(fake_server, tmp_path):
    base, _ = fake_server
    out = tmp_path / "r.json"
    rc = main(["--base-url", base, "--endpoint", "completions", "--scenario", "serving", "--dataset", "builtin",
               "--request-rate", "inf,40", "--num-prompts", "3", "--output-len", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    pts = res["targets"][0]["scenarios"]["serving"]["points"]
    assert [p["request_rate"] for p in pts] == ["inf", 40.0]
    assert [p["label"] for p in pts] == ["rate=inf/s", "rate=40/s"]
    for p in pts:
        assert p["summary"]["completed"] == 3 and p["summary"]["total_output_tokens"] == 12
    # all three were sent at once at rate inf
    assert max(r["send_offset_s"] for r in pts[0]["requests"]) < 0.2


def test_failures_are_counted_not_fatal(fake_server):
    base, _ = fake_server

    async def go():
        target = Target(base, label="t")
        opts = RunOptions(progress=False)
        async with make_client() as c:
            sess = await prepare(c, target, opts)
            prompts = [Prompt([{"role": "user", "content": t}], 4, True) for t in ("ok", "FAIL please", "ok", "MIDFAIL")]
            spec = ScenarioSpec("batch-docs", "batch", prompts)
            return await run_point(c, sess, spec, {}, prompts, opts)

    rec = asyncio.run(go())
    s = rec["summary"]
    assert s["completed"] == 2 and s["failed"] == 2
    assert any("injected failure" in e for e in s["errors"]) and any("mid-stream" in e for e in s["errors"])
    assert [r["ok"] for r in rec["requests"]] == [True, False, True, False]


def test_usage_counts_tokens_not_chunks(fake_server):
    base, _ = fake_server

    async def go():
        async with make_client() as c:
            return await send_request(c, Target(base), Prompt([{"role": "user", "content": "PAIRS"}], 9, True))

    r = asyncio.run(go())
    assert r.ok and r.output_tokens == 9 and r.output_tokens_source == "usage"
    assert len(r.chunk_times) < 9


def test_unreachable_target_is_a_clean_error(tmp_path, capsys):
    from slipstream.bench.peers import free_port

    rc = main(["--base-url", f"http://127.0.0.1:{free_port()}", "--scenario", "short", "--no-progress",
               "--out", str(tmp_path / "x.json")])
    assert rc == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_unreachable_peer_is_reported(fake_server, tmp_path):
    from slipstream.bench.peers import free_port

    base, _ = fake_server
    out = tmp_path / "r.json"
    rc = main(["--base-url", base, "--peer-base-url", f"http://127.0.0.1:{free_port()}", "--scenario", "short",
               "--num-prompts", "1", "--max-tokens", "3", "--no-progress", "--out", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    assert len(res["targets"]) == 1 and any("not measured" in w for w in res["warnings"])


def test_strict_server_gets_only_the_fields_it_takes(fake_server):
    base, _ = fake_server

    async def go():
        async with make_client() as c:
            return await prepare(c, Target(base + "/strict", label="strict"), RunOptions(progress=False))

    sess = asyncio.run(go())
    assert sess.fixed_fields == ("ignore_eos",)
    assert "refused" in sess.notes[0] and "min_tokens" in sess.notes[0]


def test_long_batch_docs_and_conversation(fake_server, tmp_path):
    base, app = fake_server
    out = tmp_path / "r.json"
    rc = main(["--base-url", base, "--scenario", "long,batch-docs,conversation", "--num-prompts", "3", "--rounds", "3",
               "--max-tokens", "4", "--ignore-eos", "--out", str(out), "--no-progress"])
    assert rc == 0
    sc = json.loads(out.read_text())["targets"][0]["scenarios"]
    assert sc["long"]["points"][0]["summary"]["completed"] == 3
    docs = sc["batch-docs"]["points"][0]
    assert docs["summary"]["completed"] == 3 and docs["summary"]["total_output_tokens"] == 12
    assert max(r["send_offset_s"] for r in docs["requests"]) < 0.2          # submitted together
    conv = sc["conversation"]["points"][0]
    assert conv["label"] == "3 rounds" and conv["summary"]["completed"] == 3
    tokens = [r["prompt_tokens"] for r in conv["requests"]]
    assert tokens[0] < tokens[1] < tokens[2]                                 # the history grows
    last = [b for b in app.state.requests if "messages" in b and b.get("stream")][-1]
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert last["messages"][2]["content"] == conv["requests"][0]["text"]    # its own previous answer
