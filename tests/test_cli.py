"""The real command line, run as a user runs it: `python -m slipstream ...` in a subprocess.

Good runs are compared with the Python API on the same default model; bad input must end with exit
code 2 and exactly one line on stderr, `error: ...`, naming the problem (no traceback, no warnings).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import skip_unless_default_model

import slipstream
from slipstream import LLM, SamplingParams

TIMEOUT = 300
PROMPT = "The three primary colors are"
LONG_PROMPT = "word " * 100


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)  # warnings a user would see must show up here too
    return subprocess.run([sys.executable, "-m", "slipstream", *args], input=stdin, capture_output=True,
                          text=True, timeout=TIMEOUT, env=env)


@pytest.fixture(scope="module")
def llm() -> LLM:
    skip_unless_default_model()
    return LLM()


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {proc.stdout!r}"
    return json.loads(lines[0])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# -- good runs ------------------------------------------------------------------------------------

def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == slipstream.__version__
    assert proc.stderr == ""


def test_generate_json_matches_api(llm):
    out = _json(run_cli("generate", "-p", PROMPT, "--max-tokens", "16", "--ignore-eos", "--json"))
    for key in ("text", "token_ids", "prompt_tokens", "ttft_s", "decode_tok_s"):
        assert key in out
    assert isinstance(out["text"], str)
    assert len(out["token_ids"]) == 16 and all(isinstance(t, int) for t in out["token_ids"])
    assert out["prompt_tokens"] == len(llm.tokenizer.encode(PROMPT))
    assert out["ttft_s"] > 0 and out["decode_tok_s"] > 0
    ref = llm.generate(PROMPT, _greedy(16))[0]
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == ref.text
    assert out.get("finish_reason", "length") == "length"


def test_generate_with_ngram_speculation_reports_accepted_tokens(llm):
    echo = "Original: the cat sat on the mat.\nCopy: the cat sat on the mat.\nOriginal: the cat sat on the mat.\nCopy:"
    out = _json(run_cli("generate", "-p", echo, "--max-tokens", "24", "--ignore-eos", "--json",
                        "--speculative", "ngram", "--num-speculative-tokens", "3"))
    assert out["speculative"] == "ngram" and out["accepted_tokens_per_step"] > 1.5
    assert out["token_ids"] == llm.generate(echo, _greedy(24))[0].token_ids      # lossless
    bad = run_cli("generate", "-p", "hi", "--speculative", "medusa")
    assert bad.returncode == 2 and "unknown speculative method" in bad.stderr


def test_generate_chat_json_matches_api(llm):
    question = "What is the largest planet in the solar system?"
    out = _json(run_cli("generate", "--chat", "-p", question, "--max-tokens", "16", "--ignore-eos", "--json"))
    ref = llm.chat([{"role": "user", "content": question}], _greedy(16))[0]
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["prompt_tokens"] == len(ref.prompt_token_ids)


def test_generate_seeded_sampling_is_reproducible():
    args = ("generate", "-p", "Write a sentence about cats.", "--max-tokens", "24", "--ignore-eos",
            "--temperature", "0.8", "--seed", "42", "--json")
    a, b = _json(run_cli(*args)), _json(run_cli(*args))
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]


def test_generate_plain_text_to_stdout_stats_to_stderr(llm):
    proc = run_cli("generate", "-p", PROMPT, "--max-tokens", "16", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    ref = llm.generate(PROMPT, _greedy(16))[0]
    assert proc.stdout == ref.text + "\n"
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr  # the stats line, nothing else (no warnings)
    n_prompt = len(ref.prompt_token_ids)
    assert re.fullmatch(rf"\[{n_prompt} prompt tokens, 16 generated, TTFT \d+ ms, decode [\d.]+ tok/s, "
                        r"finish: length\]", err[0]), err[0]


def test_generate_prompt_from_stdin(llm):
    out = _json(run_cli("generate", "-p", "-", "--max-tokens", "8", "--ignore-eos", "--json", stdin=PROMPT))
    assert out["token_ids"] == llm.generate(PROMPT, _greedy(8))[0].token_ids


def test_chat_two_turns(llm):
    max_tokens = 32
    proc = run_cli("chat", "--max-tokens", str(max_tokens), stdin="Hello\nWhat is 2+2?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # what the conversation should be, turn by turn, with the first reply in the history
    history = [{"role": "user", "content": "Hello"}]
    first = llm.chat(history, SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is 2+2?"}]
    second = llm.chat(history, SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
    assert first.strip() and second.strip()
    assert first in proc.stdout and second in proc.stdout
    assert proc.stdout.index(first) < proc.stdout.index(second)
    speeds = re.findall(r"\[\d+ tokens, TTFT \d+ ms, [\d.]+ tok/s\]", proc.stderr)
    assert len(speeds) == 2, proc.stderr


def test_chat_end_of_input_exits_cleanly():
    proc = run_cli("chat", "--max-tokens", "8", stdin="Hello\n")
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_keeps_going_after_a_too_long_message():
    proc = run_cli("chat", "--max-model-len", "48", "--max-tokens", "8", stdin=LONG_PROMPT + "\nHi\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "48" in errors[0], proc.stderr
    assert re.search(r"\[\d+ tokens, TTFT \d+ ms, ([\d.]+ tok/s|n/a)\]", proc.stderr), proc.stderr


# -- bad input ----------------------------------------------------------------------------------------

def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    for name, (arr, raw_dtype) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_llama_tensors(quant_name: str | None = None) -> dict[str, tuple[np.ndarray, object]]:
    """A complete 1-layer llama (hidden 256, vocab 32) in F32; with `quant_name`, ffn_down is stored
    in that ggml type (zero bytes of the right size: the loader must refuse it before reading)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

    f32 = lambda *shape: (np.zeros(shape, np.float32), None)  # noqa: E731
    t = {"token_embd.weight": f32(32, 256), "output_norm.weight": f32(256), "output.weight": f32(32, 256)}
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        t[f"blk.0.{name}.weight"] = f32(256, 256)
    t["blk.0.attn_norm.weight"] = f32(256)
    t["blk.0.ffn_norm.weight"] = f32(256)
    if quant_name:
        qt = QT[quant_name]
        block, nbytes = GGML_QUANT_SIZES[qt]
        t["blk.0.ffn_down.weight"] = (np.zeros((256, 256 // block * nbytes), np.uint8), qt)
    return t


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, llm) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (CLI arguments, substrings the one-line error must contain)."""
    root = tmp_path_factory.mktemp("bad")
    cases: dict[str, tuple[list[str], list[str]]] = {}
    missing = root / "no-such-model.gguf"
    cases["missing_file"] = ([str(missing)], ["not found", str(missing)])
    embd = {"token_embd.weight": (np.zeros((32, 256), np.float32), None)}
    arch = _write_gguf(root / "gpt2.gguf", "gpt2", embd)
    cases["unsupported_arch"] = ([str(arch)], ["architecture", "gpt2"])
    for q in ("Q8_1", "Q8_K"):   # ggml's activation types: no file stores weights in them, no reader here
        f = _write_gguf(root / f"{q}.gguf", "llama", _tiny_llama_tensors(q))
        cases[f"unsupported_quant_{q}"] = ([str(f)], [q, "blk.0.ffn_down.weight"])
    text = root / "notes.gguf"
    text.write_text("this is not a GGUF file\n")
    cases["not_a_gguf"] = ([str(text)], ["not a readable GGUF", str(text)])
    whole = _write_gguf(root / "whole.gguf", "llama", _tiny_llama_tensors())
    cut = root / "truncated.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # an interrupted download
    cases["truncated_gguf"] = ([str(cut)], ["not a readable GGUF", str(cut)])
    folder = _hf_folder(root / "hf", llm)
    broken = root / "hf-missing-shard"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    (broken / shards[-1]).unlink()
    cases["missing_shard"] = ([str(broken)], [shards[-1]])
    n = len(llm.tokenizer.encode(LONG_PROMPT))
    cases["prompt_too_long"] = (["--max-model-len", "32", "-p", LONG_PROMPT], [str(n), "32"])
    cases["bad_temperature"] = (["--temperature", "-1"], ["temperature", "-1"])
    cases["bad_top_p"] = (["--top-p", "1.5"], ["top_p"])
    return cases


def _hf_folder(folder: Path, llm: LLM) -> Path:
    """A tiny random llama in sharded safetensors with SmolLM2's tokenizer (tokenizer.json as built
    from the GGUF, plus the chat template and special tokens)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=llm.tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="1MB")
    llm.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": llm.tokenizer.bos_token, "eos_token": llm.tokenizer.eos_token,
        "chat_template": llm.tokenizer.chat_template}))
    return folder


def _assert_one_line_error(proc: subprocess.CompletedProcess, expected: list[str]) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}; stderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr must be one line, got:\n{proc.stderr}"
    assert lines[0].startswith("error:"), lines[0]
    for s in expected:
        assert s in lines[0], f"{s!r} not named in {lines[0]!r}"
    assert proc.stdout.strip() == ""


BAD = ["missing_file", "not_a_gguf", "truncated_gguf", "unsupported_arch",
       "unsupported_quant_Q8_1", "unsupported_quant_Q8_K",
       "missing_shard", "prompt_too_long", "bad_temperature", "bad_top_p"]


@pytest.mark.parametrize("case", BAD)
def test_generate_bad_input(case, bad_inputs):
    args, expected = bad_inputs[case]
    if "-p" not in args:
        args = [*args, "-p", "Hello"]
    _assert_one_line_error(run_cli("generate", *args, "--max-tokens", "4"), expected)


@pytest.mark.parametrize("case", ["missing_file", "unsupported_quant_Q8_K", "bad_temperature"])
def test_chat_bad_input(case, bad_inputs):
    args, expected = bad_inputs[case]
    _assert_one_line_error(run_cli("chat", *args, stdin="Hello\n/exit\n"), expected)


def test_a_file_of_lattice_and_ternary_types_runs_without_a_warning(tmp_path):
    """IQ2_XXS and TQ1_0 weights are read natively (re-encoded at load into the IQ4 kernels' planes; they were
    re-encoded as Q8_0, with a warning, before the native decoders existed): the CLI says nothing on stderr."""
    gguf = pytest.importorskip("gguf")
    from support import tiny_llama_gguf
    qt = gguf.GGMLQuantizationType
    tiny_llama_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up": qt.IQ2_XXS, "blk.0.ffn_down": qt.TQ1_0}, size=0.1)
    proc = run_cli("generate", str(tmp_path / "iq.gguf"), "-p", "Hello", "--max-tokens", "4", "--ignore-eos", "--json")
    assert len(_json(proc)["token_ids"]) == 4
    assert not proc.stderr.strip(), proc.stderr


def test_hf_folder_control(bad_inputs):
    """The intact folder the missing-shard case was made from does run (so the error is the shard)."""
    folder = Path(bad_inputs["missing_shard"][0][0]).parent / "hf"
    out = _json(run_cli("generate", str(folder), "-p", "Hello", "--max-tokens", "4", "--ignore-eos", "--json"))
    assert len(out["token_ids"]) == 4


def test_native_runtime_on_dense_weights(bad_inputs):
    """A Hugging Face folder's dense (fp32) weights run on the native runtime too; its exact path
    gives the eager step's greedy tokens."""
    folder = Path(bad_inputs["missing_shard"][0][0]).parent / "hf"
    args = ("generate", str(folder), "-p", "Hello", "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--json")
    native = _json(run_cli(*args, "--runtime", "native", "--exact"))
    eager = _json(run_cli(*args, "--runtime", "eager"))
    assert native["token_ids"] == eager["token_ids"] and len(native["token_ids"]) == 6


def test_generate_max_tokens_zero_json():
    out = _json(run_cli("generate", "-p", PROMPT, "--max-tokens", "0", "--json"))
    assert out["text"] == "" and out["token_ids"] == []


def test_generate_max_tokens_zero_plain():
    proc = run_cli("generate", "-p", PROMPT, "--max-tokens", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "\n" and "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["0", "-5"])
def test_bad_max_model_len(value):
    _assert_one_line_error(run_cli("generate", "--max-model-len", value, "-p", "Hello", "--max-tokens", "4"),
                           ["max"])


@pytest.mark.parametrize("value,words", [("1", ["pacing", "> 1"]), ("fast", ["pacing", "number > 1 (or off)", "fast"])])
def test_bad_prefill_pacing(value, words):
    _assert_one_line_error(run_cli("serve", "--prefill-pacing", value, "--port", "1"), words)


def test_kv_cache_dtype_flag():
    """--kv-cache-dtype reaches the engine: the exact path and the eager step over an fp16 cache give the
    fp32 cache's greedy tokens (the cache's rounding is ~4e-4 of the logits; tests/runtime/test_cpu_kv_fp16.py
    checks the dtype each setting picks)."""
    skip_unless_default_model()
    args = ("generate", "-p", PROMPT, "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--json")
    fp32 = _json(run_cli(*args, "--exact", "--kv-cache-dtype", "fp32"))
    fp16 = _json(run_cli(*args, "--exact", "--kv-cache-dtype", "fp16"))
    eager16 = _json(run_cli(*args, "--runtime", "eager", "--kv-cache-dtype", "fp16"))
    assert fp16["token_ids"] == fp32["token_ids"] == eager16["token_ids"]
    _assert_one_line_error(run_cli("generate", "--kv-cache-dtype", "fp8", "-p", "Hello", "--max-tokens", "4"),
                           ["kv-cache-dtype", "fp8"])
    _assert_one_line_error(run_cli(*args, "--exact", "--kv-cache-dtype", "int8"), ["int8", "exact"])
    int8 = _json(run_cli(*args, "--kv-cache-dtype", "int8"))   # the fast path over 8-bit K and V: runs, 12 tokens
    assert len(int8["token_ids"]) == 12 and int8["token_ids"][0] == fp32["token_ids"][0]


def test_threads_flag():
    """--threads sizes the native step's team and torch's pool; the tokens do not depend on it (any number of
    threads completes the same task table), and a count below 1 is one error line; with --replicas it is refused
    for --replica-threads."""
    skip_unless_default_model()
    from slipstream.kernels.cpu import native_available
    if not native_available():
        pytest.skip("native CPU kernels unavailable")
    args = ("generate", "-p", PROMPT, "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--json")
    one = _json(run_cli(*args, "--threads", "1"))
    two = _json(run_cli(*args, "--threads", "2"))
    assert one["token_ids"] == two["token_ids"] and len(one["token_ids"]) == 12
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from slipstream import LLM; llm = LLM(threads=1, max_model_len=256); "
         "print(llm.engine.runtime_name, llm.engine.runtime.threads, torch.get_num_threads())"],
        capture_output=True, text=True, timeout=TIMEOUT)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == ["native", "1", "1"]
    for bad in ("0", "-2", "257"):
        _assert_one_line_error(run_cli("generate", "--threads", bad, "-p", "Hello", "--max-tokens", "4"), ["threads"])
    _assert_one_line_error(run_cli("serve", "--threads", "2", "--replicas", "2", "--port", "1"),
                           ["--threads", "--replica-threads"])
