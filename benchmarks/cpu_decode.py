"""Batch-1 CPU decode speed of Slipstream against llama.cpp and HF transformers, on one GGUF file.

What it measures
----------------
Every engine is given the same prompt as token ids (tokenized once, by Slipstream's tokenizer for
the GGUF, so every prefill has the same length) and decodes greedily for ``--max-tokens`` new tokens
with end-of-sequence ignored, at batch size 1, on ``--threads`` CPU threads. For each token the
harness takes a ``time.perf_counter()`` stamp as soon as the engine hands the token id to Python.
With ``t0`` taken just before the engine's generation call and ``t_1 .. t_n`` the token stamps:

* TTFT          = t_1 - t0           (prefill and the first sampled token included)
* decode tok/s  = (n - 1) / (t_n - t_1)   (prefill excluded)

The same definitions are used for all three engines, each through its fastest ordinary streaming
path:

* slipstream:   ``LLM(path).stream(prompt_ids, SamplingParams(temperature=0, ignore_eos=True))``
  (the engine's own ``RequestMetrics`` numbers are recorded next to ours in the JSON).
* llama.cpp:    ``llama_cpp.Llama.generate(prompt_ids, temp=0, ...)``, the token generator under
  ``create_completion``; it does not stop at EOS by itself, so it is stopped after n tokens.
  ``Llama.reset()`` is called before each run so the prompt is never served from the KV cache.
* transformers: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (the GGUF dequantized
  to float32), then a hand-written greedy loop, ``model(...)`` with a ``DynamicCache`` under
  ``torch.inference_mode()``, prefill computing only the last position's logits (as ``generate``
  does). This is ``generate``'s greedy path without its per-step logits-processor, stopping-criteria
  and streamer bookkeeping, so the peer is timed at its best, not handicapped by our harness.

Each engine runs in its own child process (this script with ``--engine NAME``), one after another,
never two at once, so threads and memory of one do not disturb the next. Each child does one
untimed warm-up run and then ``--runs`` timed runs; the parent reports the median (and min/max).

Greedy tokens are compared: Slipstream and transformers both compute in float32 on the same
dequantized weights, so their tokens should match; llama.cpp quantizes activations for its integer
dot products, so it drifts sooner and its agreement length is informative only.

Usage::

    python benchmarks/cpu_decode.py
    python benchmarks/cpu_decode.py --engines slipstream --runs 1 --max-tokens 16
    python benchmarks/cpu_decode.py --prompt-tokens 512 --json results.json
    python benchmarks/cpu_decode.py --engines slipstream --batch 8          # aggregate of 8 sequences
    python benchmarks/cpu_decode.py --engines slipstream,llama.cpp --neighbour   # beside a busy process, then
                                                  # quiet and on one thread: the fair share's bound
    python benchmarks/cpu_decode.py --march x86-64-v3 --llama-path DIR      # the AVX2 pair on an AVX-512 CPU

Engines: ``slipstream`` (the native runtime's default int8-activation path), ``slipstream-exact``
(``--exact``: fp32 activations), ``llama.cpp``, ``transformers``. After the table the script
measures a STREAM-style copy and triad bandwidth and reports each engine's weight bytes per token x
tok/s as a share of that limit.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

ENGINES = ("slipstream", "slipstream-exact", "llama.cpp", "transformers")
# The Python package each engine needs (checked before a child is started).
ENGINE_PACKAGES = {"slipstream": "slipstream", "slipstream-exact": "slipstream", "llama.cpp": "llama_cpp",
                   "transformers": "transformers"}
DEFAULT_QUESTION = "Explain in a few sentences why the sky is blue during the day."
# Filler for --prompt-tokens: repeated, then cut to the exact length wanted.
FILLER = ("The history of the river valley is long and varied. Farmers grew wheat and barley on "
          "its banks, traders carried salt and cloth along its roads, and every spring the water "
          "rose and covered the low fields with fresh soil. ")
CHILD_TIMEOUT_S = 1800
# A gap between two tokens this many times the run's median gap counts as a stall.
STALL_FACTOR = 4.0
# Warn when stalls took more than this share of a run's decode time.
STALL_WARN = 0.05
# Warn when other processes used more than this many cores just before an engine starts.
BUSY_WARN_CORES = 0.25


# -- results --------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One timed generation: its tokens and the time stamps they arrived at (seconds after t0)."""
    token_ids: list[int]
    stamps_s: list[float]
    engine_metrics: dict[str, float | None] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return self.stamps_s[0]

    @property
    def decode_tok_s(self) -> float | None:
        n = len(self.stamps_s)
        dt = self.stamps_s[-1] - self.stamps_s[0] if n else 0.0
        return (n - 1) / dt if n >= 2 and dt > 0 else None

    @property
    def itls_s(self) -> list[float]:
        """Inter-token latencies (gaps between consecutive token stamps)."""
        return [b - a for a, b in zip(self.stamps_s, self.stamps_s[1:])]

    @property
    def stall_fraction(self) -> float:
        """Share of the decode time spent in gaps over STALL_FACTOR x the median gap: a sign that
        something else took the CPU (the harness cannot tell which, it can only warn)."""
        itls = self.itls_s
        if not itls:
            return 0.0
        med = statistics.median(itls)
        return sum(g - med for g in itls if g > STALL_FACTOR * med) / sum(itls)


@dataclass
class EngineResult:
    engine: str
    ok: bool
    note: str = ""
    load_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    runs: list[RunResult] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineResult:
        runs = [RunResult(**r) for r in d.pop("runs", [])]
        return cls(**d, runs=runs)


def _median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _summary(res: EngineResult) -> dict[str, Any]:
    """Median/min/max of the timed runs' decode tok/s and TTFT."""
    tps = [r.decode_tok_s for r in res.runs if r.decode_tok_s is not None]
    ttft = [r.ttft_s for r in res.runs]
    itl = [statistics.median(r.itls_s) for r in res.runs if r.itls_s]
    out: dict[str, Any] = {"n_runs": len(res.runs), "n_tokens": [len(r.token_ids) for r in res.runs]}
    if tps:
        out["decode_tok_s"] = dict(zip(("median", "min", "max"), _median_min_max(tps)))
    if ttft:
        out["ttft_ms"] = dict(zip(("median", "min", "max"), (1e3 * v for v in _median_min_max(ttft))))
    if itl:  # each run's median inter-token gap, then the median over runs: robust to stalls
        out["itl_p50_ms"] = dict(zip(("median", "min", "max"), (1e3 * v for v in _median_min_max(itl))))
    out["stall_fraction"] = [round(r.stall_fraction, 4) for r in res.runs]
    out["deterministic"] = len({tuple(r.token_ids) for r in res.runs}) <= 1
    return out


# -- prompt ---------------------------------------------------------------------------------------
def _load_tokenizer(model: Path) -> Any:
    """Slipstream's tokenizer for the GGUF (the one `LLM(model).tokenizer` is), without the weights."""
    from slipstream.tokenizer import Tokenizer
    return Tokenizer.from_gguf(model)


def build_prompt_ids(model: Path, prompt_tokens: int | None) -> list[int]:
    """The chat-templated question as ids; with `prompt_tokens`, the user message is filled or cut
    so that the whole templated prompt is exactly that many tokens long."""
    tok = _load_tokenizer(model)
    if prompt_tokens is None:
        text = tok.apply_chat_template([{"role": "user", "content": DEFAULT_QUESTION}],
                                       add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    marker = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True)
    head, tail = text.split(marker)
    head_ids = tok.encode(head, add_special_tokens=False)
    tail_ids = tok.encode(tail, add_special_tokens=False)
    room = prompt_tokens - len(head_ids) - len(tail_ids)
    if room <= 0:  # shorter than the template itself: keep its start
        return (head_ids + tail_ids)[:prompt_tokens]
    question = tok.encode(" " + DEFAULT_QUESTION, add_special_tokens=False)
    filler = tok.encode(FILLER, add_special_tokens=False)
    body = filler * (room // len(filler) + 1)
    body = body[: max(0, room - len(question))] + question[-room:]
    return head_ids + body + tail_ids


# -- timing ---------------------------------------------------------------------------------------
def time_stream(start: Callable[[], Generator[Sequence[int], None, None]], max_tokens: int) -> RunResult:
    """Run one generation; `start()` returns an iterator of token-id groups as they are produced.

    t0 is taken just before `start()`; a token's stamp is when its group reaches us."""
    ids: list[int] = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    gen = start()
    try:
        for group in gen:
            now = time.perf_counter() - t0
            for t in group:
                ids.append(int(t))
                stamps.append(now)
            if len(ids) >= max_tokens:
                break
    finally:
        gen.close()  # let the engine release what the run holds (slipstream frees its KV blocks)
    return RunResult(ids[:max_tokens], stamps[:max_tokens])


def _bench(gen: Callable[[], RunResult], runs: int) -> list[RunResult]:
    gen()  # warm-up, not counted
    return [gen() for _ in range(runs)]


# -- engines (run inside the child process) -------------------------------------------------------
def run_slipstream(model: Path, ids: list[int], max_tokens: int, runs: int, threads: int,
                   exact: bool = False, batch: int = 1, kv_cache_dtype: str = "auto") -> EngineResult:
    import torch
    torch.set_num_threads(threads)
    os.environ.setdefault("SLIPSTREAM_THREADS", str(threads))
    import slipstream
    from slipstream import LLM, SamplingParams

    t = time.perf_counter()
    # no prefix cache: every timed run must prefill its whole prompt (the runs repeat one prompt)
    llm = LLM(str(model), exact=exact, enable_prefix_cache=False, kv_cache_dtype=kv_cache_dtype)
    load_s = time.perf_counter() - t
    if batch > 1:
        return _slipstream_batch(llm, ids, max_tokens, runs, batch, load_s, exact)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    last_req: list[Any] = []

    def groups() -> Generator[list[int], None, None]:
        for chunk in llm.stream(ids, params):
            last_req[:] = [chunk.request]
            yield chunk.token_ids

    def one() -> RunResult:
        r = time_stream(groups, max_tokens)
        m = last_req[0].metrics
        r.engine_metrics = {"ttft_s": m.ttft_s, "decode_tok_s": m.decode_tok_s}
        return r

    info = {"version": slipstream.__version__, "runtime": llm.engine.runtime_name, "exact": exact,
            "isa": _native_isa(), "weight_bytes_per_token": _slipstream_weight_bytes(llm),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    return EngineResult("slipstream-exact" if exact else "slipstream", True, load_s=load_s, info=info,
                        runs=_bench(one, runs))


def _native_isa() -> str | None:
    from slipstream.kernels.cpu import load_library
    lib = load_library()
    return None if lib is None else lib.ss_isa().decode()


def _slipstream_weight_bytes(llm: Any) -> int:
    """Bytes of weights one decode step reads: every layer's products and norms, the final norm and
    the LM head (one embedding row is negligible)."""
    m = llm.model
    total = m.lm_head.nbytes + m.norm.numel() * 4
    for L in m.layers:
        total += sum(w.nbytes for w in (L.qkv, L.o, L.gate_up, L.down))
        total += sum(v.numel() * 4 for v in (L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm) if v is not None)
    return int(total)


def _slipstream_batch(llm: Any, ids: list[int], max_tokens: int, runs: int, batch: int, load_s: float,
                      exact: bool) -> EngineResult:
    """Aggregate decode speed of `batch` sequences decoded together: every request is prefilled
    first, then the decode steps are timed (tokens produced / time). The prompts differ in their last
    token, so request merging cannot fold them into one."""
    from slipstream import SamplingParams
    from slipstream.engine.request import Request

    engine = llm.engine
    vocab = llm.model.cfg.vocab_size

    def one() -> RunResult:
        reqs = [Request(ids[:-1] + [(ids[-1] + i) % vocab],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for i in range(batch)]
        for r in reqs:
            engine.add_request(r)
        while any(len(r.output_ids) == 0 for r in reqs):
            engine.step()
        start_tokens = sum(len(r.output_ids) for r in reqs)
        t0 = time.perf_counter()
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append((time.perf_counter() - t0, sum(len(r.output_ids) for r in reqs) - start_tokens))
        # one stamp per token produced by the timed steps after a stamp at 0: decode tok/s is then
        # the aggregate tokens / decode time (token ids are not compared for batches)
        times = [0.0]
        for t, n in stamps:
            times += [t] * (n + 1 - len(times))
        return RunResult(token_ids=[0] * len(times), stamps_s=times)

    info = {"runtime": engine.runtime_name, "exact": exact, "batch": batch, "isa": _native_isa()}
    return EngineResult(f"slipstream-b{batch}", True, load_s=load_s, info=info, runs=_bench(one, runs))


def run_llama_cpp(model: Path, ids: list[int], max_tokens: int, runs: int, threads: int,
                  n_batch: int = 512) -> EngineResult:
    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(str(model), n_ctx=len(ids) + max_tokens + 16, n_threads=threads,
                          n_threads_batch=threads, n_batch=n_batch, n_ubatch=n_batch, verbose=False)
    load_s = time.perf_counter() - t

    def groups() -> Generator[list[int], None, None]:
        llm.reset()  # never reuse the previous run's KV cache for the prompt
        # generate() yields tokens until the caller stops; EOS is not special here (ignore_eos)
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            yield [tok]

    info = {"version": llama_cpp.__version__, "n_threads": threads, "n_batch": n_batch,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    return EngineResult("llama.cpp", True, load_s=load_s, info=info,
                        runs=_bench(lambda: time_stream(groups, max_tokens), runs))


def run_transformers(model: Path, ids: list[int], max_tokens: int, runs: int, threads: int) -> EngineResult:
    import torch
    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, dtype=torch.float32)
    hf.eval()
    load_s = time.perf_counter() - t

    def groups() -> Generator[list[int], None, None]:
        with torch.inference_mode():
            cache = DynamicCache(config=hf.config)
            x = torch.tensor([ids])
            out = hf(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            while True:
                nxt = int(out.logits[0, -1].argmax())
                yield [nxt]
                out = hf(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)

    info = {"version": transformers.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "attn": hf.config._attn_implementation}
    return EngineResult("transformers", True, load_s=load_s, info=info,
                        runs=_bench(lambda: time_stream(groups, max_tokens), runs))


RUNNERS: dict[str, Callable[..., EngineResult]] = {
    "slipstream": run_slipstream, "slipstream-exact": lambda *a, **k: run_slipstream(*a, exact=True, **k),
    "llama.cpp": run_llama_cpp, "transformers": run_transformers,
}


def child_main(args: argparse.Namespace) -> int:
    ids = json.loads(Path(args.prompt_ids_file).read_text())
    extra: dict[str, int | str] = {"batch": args.batch} if args.engine.startswith("slipstream") and args.batch > 1 else {}
    if args.engine.startswith("slipstream"):
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.engine == "llama.cpp":
        extra["n_batch"] = args.llama_batch
    res = RUNNERS[args.engine](Path(args.model), ids, args.max_tokens, args.runs, args.threads, **extra)
    Path(args.json).write_text(json.dumps(asdict(res)))
    return 0


# -- parent ---------------------------------------------------------------------------------------
def package_missing(engine: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(ENGINE_PACKAGES[engine]) is None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat, or None where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def other_cpu_load(seconds: float = 1.0) -> float | None:
    """How many cores' worth of CPU other processes used over `seconds` (this one sleeps)."""
    a = _cpu_times()
    time.sleep(seconds)
    b = _cpu_times()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


class LoadWatch:
    """CPU used by processes other than this one and its children, from its creation to a call."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu_times()
        self.own0 = self._own_cpu_s()

    @staticmethod
    def _own_cpu_s() -> float:
        import resource
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def other_cores(self) -> float | None:
        """Mean number of cores the rest of the machine kept busy (counted after a child exits)."""
        cpu1, wall = _cpu_times(), time.perf_counter() - self.t0
        if self.cpu0 is None or cpu1 is None or wall <= 0:
            return None
        busy_s = (cpu1[0] - self.cpu0[0]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, (busy_s - (self._own_cpu_s() - self.own0)) / wall)


def run_child(engine: str, args: argparse.Namespace, ids_file: Path) -> EngineResult:
    """Run one engine in a fresh interpreter and read back its results."""
    if package_missing(engine):
        return EngineResult(engine, False, note=f"skipped: package {ENGINE_PACKAGES[engine]!r} is not installed")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--engine", engine, "--json", str(out),
               "--model", str(args.model), "--prompt-ids-file", str(ids_file),
               "--runs", str(args.runs), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
               "--batch", str(args.batch), "--llama-batch", str(args.llama_batch),
               "--kv-cache-dtype", args.kv_cache_dtype]
        from slipstream import peer_environ  # llama.cpp gets the user's OpenMP wait policy, not ours
        env = dict(os.environ if engine.startswith("slipstream") else peer_environ(), OMP_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1")
        if args.march and engine.startswith("slipstream"):
            env["SLIPSTREAM_MARCH"] = args.march     # e.g. x86-64-v3: the AVX2 build on an AVX-512 machine
        if args.llama_path and engine == "llama.cpp":
            env["PYTHONPATH"] = os.pathsep.join([args.llama_path, env.get("PYTHONPATH", "")])
        watch = LoadWatch()
        neighbour = start_neighbour() if args.neighbour else None
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return EngineResult(engine, False, note=f"failed: timed out after {CHILD_TIMEOUT_S} s")
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        other = watch.other_cores()
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return EngineResult(engine, False, note="failed (rc %d): %s" % (proc.returncode, " | ".join(tail)))
        res = EngineResult.from_dict(json.loads(out.read_text()))
        res.info["other_cpu_load_during"] = other
        return res


NEIGHBOUR = ("import torch, time\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\n"
             "while True:\n    a = torch.tanh(a @ a)\n")


def start_neighbour() -> subprocess.Popen:
    """A busy neighbour process: a 2-thread matrix multiply loop, for as long as an engine runs."""
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)   # let it start burning before the engine does
    return proc


def measure_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """STREAM-style copy and triad over arrays far larger than any cache, on `threads` threads:
    best GB/s of `repeats`, counting bytes read + written (copy: 2 arrays, triad: 3)."""
    import torch
    torch.set_num_threads(threads)
    n = mib * 1024 * 1024 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    best = {"copy_gb_s": 0.0, "triad_gb_s": 0.0}
    for _ in range(repeats):
        t = time.perf_counter()
        a.copy_(b)
        best["copy_gb_s"] = max(best["copy_gb_s"], 2 * 4 * n / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        torch.add(b, c, alpha=2.0, out=a)
        best["triad_gb_s"] = max(best["triad_gb_s"], 3 * 4 * n / (time.perf_counter() - t) / 1e9)
    return best


def gguf_weight_bytes(model: Path) -> int:
    """Bytes of the GGUF's tensors one decode step reads (the embedding table only when it is also
    the output matrix, i.e. there is no output.weight)."""
    import gguf
    r = gguf.GGUFReader(str(model))
    names = {t.name for t in r.tensors}
    return int(sum(t.n_bytes for t in r.tensors
                   if t.name != "token_embd.weight" or "output.weight" not in names))


def print_limits(results: list[EngineResult], summaries: dict[str, dict[str, Any]], bw: dict[str, float],
                 gguf_bytes: int) -> dict[str, Any]:
    """Each engine's decode speed as a share of the memory-bandwidth limit."""
    out: dict[str, Any] = {"bandwidth": bw, "gguf_weight_bytes": gguf_bytes}
    print(f"\nmemory limit: copy {bw['copy_gb_s']:.1f} GB/s, triad {bw['triad_gb_s']:.1f} GB/s (read + written)")
    for res in results:
        if not res.ok or res.engine not in summaries or "-b" in res.engine:
            continue
        tps = summaries[res.engine].get("decode_tok_s", {}).get("median")
        wb = res.info.get("weight_bytes_per_token") or gguf_bytes
        if not tps:
            continue
        limit = bw["triad_gb_s"] * 1e9 / wb
        share = tps / limit
        out[res.engine] = {"weight_bytes_per_token": wb, "limit_tok_s": limit, "share_of_limit": share}
        print(f"  {res.engine:<18} {wb / 1e6:6.1f} MB/token x {tps:6.1f} tok/s = {wb * tps / 1e9:5.2f} GB/s: "
              f"{share * 100:4.0f}% of the triad limit ({limit:.0f} tok/s)")
    return out


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def machine_info() -> dict[str, Any]:
    from slipstream.bench.cli import cpu_name

    cpu = cpu_name()
    versions = {}
    for dist in ("torch", "llama_cpp_python", "transformers", "slipstream", "gguf"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((ln.split(":", 1)[1] for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith(("flags", "Features"))), "")
    vector = sorted(f for f in flags.split() if f.startswith(("avx", "amx", "fma", "asimd", "sve")) or f == "f16c")
    return {"cpu": cpu, "cores": os.cpu_count(), "vector_extensions": vector,
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": platform.platform(), "python": platform.python_version(), "versions": versions,
            "slipstream_commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _fmt_range(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_table(results: list[EngineResult], summaries: dict[str, dict[str, Any]]) -> None:
    ref = summaries.get("slipstream", {})
    ref_tps = ref.get("decode_tok_s", {}).get("median")
    ref_ttft = ref.get("ttft_ms", {}).get("median")
    print(f"{'engine':<14}{'decode tok/s (median [min-max])':<34}{'TTFT ms (median [min-max])':<30}"
          f"{'ITL p50 ms':<12}{'slipstream ratio':<18}{'TTFT ratio':<10}")
    for res in results:
        if not res.ok:
            print(f"{res.engine:<14}{res.note}")
            continue
        s = summaries[res.engine]
        tps, ttft, itl = s.get("decode_tok_s"), s.get("ttft_ms"), s.get("itl_p50_ms")
        ratio = tratio = ""
        if res.engine != "slipstream" and ref_tps and tps:
            ratio = f"{ref_tps / tps['median']:.2f} x"
        if res.engine != "slipstream" and ref_ttft and ttft:
            tratio = f"{ttft['median'] / ref_ttft:.2f} x"
        itl_s = f"{itl['median']:.1f}" if itl else "-"
        print(f"{res.engine:<14}{_fmt_range(tps):<34}{_fmt_range(ttft):<30}{itl_s:<12}{ratio:<18}{tratio:<10}")
    print("slipstream ratio = slipstream decode tok/s / peer's; TTFT ratio = peer's TTFT / slipstream's "
          "(both > 1 when slipstream is faster); ITL p50 = median gap between tokens (median over runs)")
    for name, s in summaries.items():
        if "-b" in name:   # a batch's aggregate stamps are not a stream: no stall check
            continue
        worst = max(s["stall_fraction"], default=0.0)
        if worst > STALL_WARN:
            print(f"warning: {name}: stalls (gaps > {STALL_FACTOR:g}x the median) took up to {100 * worst:.0f}% "
                  f"of a run's decode time; another process probably competed for the CPU, so its "
                  f"decode tok/s and TTFT are unreliable (ITL p50 is less affected by short stalls): "
                  f"rerun on a quiet machine")


def print_agreement(results: list[EngineResult], summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Compare the last timed run's greedy tokens with Slipstream's."""
    toks = {r.engine: r.runs[-1].token_ids for r in results if r.ok and r.runs}
    report: dict[str, Any] = {}
    for name, s in summaries.items():
        if not s["deterministic"]:
            print(f"note: {name} produced different tokens in different runs")
    for ours in ("slipstream", "slipstream-exact"):
        ref = toks.get(ours)
        if ref is None:
            continue
        for name in ("transformers", "llama.cpp"):
            if name not in toks:
                continue
            n = agreement(ref, toks[name])
            same = ref == toks[name]
            key = name if ours == "slipstream" else f"{name} (exact)"
            report[key] = {"identical": same, "agree_prefix": n, "length": len(ref)}
            verdict = "identical" if same else f"agree on the first {n} of {len(ref)} tokens"
            suffix = " (informative only: llama.cpp quantizes activations)" if name == "llama.cpp" else ""
            print(f"greedy tokens, {ours} vs {name}: {verdict}{suffix}")
    return report


def parent_main(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        print(f"unknown engine(s): {', '.join(unknown)} (choose from {', '.join(ENGINES)})", file=sys.stderr)
        return 2
    ids = build_prompt_ids(args.model, args.prompt_tokens)
    info = machine_info()
    print(f"model: {args.model}")
    print(f"machine: {info['cpu']}, {info['cores']} cores; threads={args.threads}; "
          f"prompt {len(ids)} tokens; {args.max_tokens} new tokens; {args.runs} timed runs + 1 warm-up"
          f"{'; batch %d' % args.batch if args.batch > 1 else ''}{'; busy neighbour' if args.neighbour else ''}"
          f"{'; slipstream -march=' + args.march if args.march else ''}")
    print(f"vector extensions: {' '.join(info['vector_extensions']) or 'none reported'}")
    results: list[EngineResult] = []
    with tempfile.TemporaryDirectory() as d:
        ids_file = Path(d) / "prompt_ids.json"
        ids_file.write_text(json.dumps(ids))
        for engine in engines:
            if package_missing(engine):
                results.append(EngineResult(engine, False, note=f"skipped: package "
                                            f"{ENGINE_PACKAGES[engine]!r} is not installed"))
                print(f"{engine}: {results[-1].note}")
                continue
            busy = other_cpu_load()
            busy_s = "" if busy is None else f" (CPU busy before start: {busy:.2f} cores)"
            print(f"running {engine} ...{busy_s}", flush=True)
            if busy is not None and busy > BUSY_WARN_CORES:
                print(f"  warning: other processes are using the CPU; {engine}'s numbers will be low")
            res = run_child(engine, args, ids_file)
            res.info["other_cpu_load_before"] = busy
            results.append(res)
            if not res.ok:
                print(f"  {res.note}")
                continue
            other = res.info.get("other_cpu_load_during")
            other_s = "" if other is None else f"; other processes used {other:.2f} cores meanwhile"
            print(f"  loaded in {res.load_s:.1f} s; tokens per run: {[len(r.token_ids) for r in res.runs]}{other_s}")
            if other is not None and other > BUSY_WARN_CORES:
                print(f"  warning: {engine} shared the CPU with other processes; its numbers are unreliable")
        quiet = quiet_speeds([r.engine for r in results if r.ok and r.runs], args, ids_file) if args.neighbour else {}
    summaries = {r.engine: _summary(r) for r in results if r.ok and r.runs}
    print()
    print_table(results, summaries)
    agree = print_agreement(results, summaries)
    bounds = print_neighbour_bounds(summaries, quiet, args.threads) if args.neighbour else None
    limits = None
    if not args.no_bandwidth:
        limits = print_limits(results, summaries, measure_bandwidth(args.threads), gguf_weight_bytes(args.model))
    short = [r.engine for r in results if r.ok and any(len(x.token_ids) < args.max_tokens for x in r.runs)]
    if short:
        print(f"note: fewer than {args.max_tokens} tokens from: {', '.join(short)}")
    if args.json:
        payload = {"machine": info, "model": str(args.model), "prompt_ids": ids,
                   "settings": {"runs": args.runs, "max_tokens": args.max_tokens, "threads": args.threads,
                                "prompt_tokens": len(ids), "batch": args.batch, "neighbour": args.neighbour,
                                "march": args.march, "llama_path": args.llama_path,
                                "kv_cache_dtype": args.kv_cache_dtype},
                   "summary": summaries, "agreement": agree, "limits": limits, "neighbour_bounds": bounds,
                   "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"raw numbers written to {args.json}")
    return 0 if all(r.ok or r.note.startswith("skipped") for r in results) else 1


def quiet_speeds(engines: list[str], args: argparse.Namespace, ids_file: Path) -> dict[str, dict[int, float | None]]:
    """With --neighbour: each engine's median decode tok/s without the neighbour, on --threads threads and on
    one thread (run right after the neighbour runs, in the same conditions otherwise)."""
    out: dict[str, dict[int, float | None]] = {}
    for engine in engines:
        out[engine] = {}
        for threads in dict.fromkeys([args.threads, 1]):
            print(f"running {engine} without the neighbour on {threads} thread(s) ...", flush=True)
            res = run_child(engine, argparse.Namespace(**{**vars(args), "neighbour": False, "threads": threads}),
                            ids_file)
            tps = _summary(res).get("decode_tok_s") if res.ok and res.runs else None
            out[engine][threads] = tps["median"] if tps else None
    return out


def print_neighbour_bounds(summaries: dict[str, dict[str, Any]], quiet: dict[str, dict[int, float | None]],
                           threads: int) -> dict[str, Any]:
    """Beside a neighbour that keeps every core busy, the scheduler's fair share leaves an engine about one
    core: its one-thread quiet speed bounds what it can keep, whatever it does."""
    report: dict[str, Any] = {}
    for engine, q in quiet.items():
        tps = summaries.get(engine, {}).get("decode_tok_s")
        full, one = q.get(threads), q.get(1)
        if not tps or not full or not one:
            continue
        busy = tps["median"]
        report[engine] = {"beside": busy, "quiet": full, "quiet_one_thread": one,
                          "of_quiet": busy / full, "bound_of_quiet": one / full, "of_bound": busy / one}
        print(f"{engine} beside the neighbour: {busy:.1f} tok/s = {busy / full:.2f}x its quiet {full:.1f} on "
              f"{threads} thread(s); one core alone (quiet, 1 thread, the fair share's bound) {one:.1f} = "
              f"{one / full:.2f}x quiet, so beside the neighbour it keeps {busy / one:.2f}x of that bound")
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine, after one warm-up")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per run (EOS ignored)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="fill/cut the templated prompt to exactly this many tokens")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine")
    p.add_argument("--json", default=None, help="write all raw numbers and machine info to this file")
    p.add_argument("--batch", type=int, default=1,
                   help="slipstream engines: aggregate decode speed of this many sequences decoded together")
    p.add_argument("--neighbour", action="store_true",
                   help="run a busy neighbour (a 2-thread matrix multiply) beside every engine, then each engine "
                        "again without it, on --threads and on one thread (the fair share's bound)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "fp16", "int8"],
                   help="slipstream engines: the KV cache's element type (EngineConfig.kv_cache_dtype)")
    p.add_argument("--march", default=None,
                   help="build slipstream's kernels for this -march (e.g. x86-64-v3 for AVX2 on an AVX-512 machine)")
    p.add_argument("--llama-path", default=None,
                   help="directory holding another llama-cpp-python build (pip install --target), e.g. an AVX2 one")
    p.add_argument("--llama-batch", type=int, default=512,
                   help="llama.cpp's n_batch (prompt tokens per evaluation); 1 feeds the prompt one token at a "
                        "time, for a build whose batched product crashes (ggml's AMX path on our Xeons)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    p.add_argument("--engine", choices=ENGINES, default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--prompt-ids-file", default=None, help=argparse.SUPPRESS)          # child mode
    args = p.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2 or args.threads < 1:
        p.error("--runs and --threads must be >= 1 and --max-tokens >= 2")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        p.error("--prompt-tokens must be >= 1")
    if args.engine and not (args.json and args.prompt_ids_file):
        p.error("--engine (child mode) needs --json and --prompt-ids-file")
    if args.model is None:
        from slipstream.weights import default_model_path
        args.model = default_model_path()
    args.model = Path(args.model).expanduser().resolve()
    if not args.model.is_file() or args.model.suffix != ".gguf":
        p.error(f"{args.model}: not a .gguf file")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return child_main(args) if args.engine else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
