"""`slipstream bench`: measure an OpenAI-compatible endpoint (ours or any other), with peers side by side.

    slipstream bench --base-url http://127.0.0.1:8000 --scenario short --out results.json
    slipstream bench --server slipstream --peer llama.cpp --scenario all --out r.json --report DIR
    slipstream bench --base-url URL --scenario serving --concurrency 1,4,16 --input-len 256 --output-len 128
    slipstream bench --base-url URL --scenario serving --request-rate 1,2,inf --slo ttft:500,tpot:50

Targets run one after another, never two servers at once: first ours (``--base-url`` or a server
started with ``--server slipstream``), then the peer (``--peer llama.cpp`` started on the same GGUF, or
``--peer-base-url``). Usage errors print one ``error: ...`` line and exit with 2; a run whose peer
could not be measured exits with 1; failed requests are counted and reported, not fatal.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from slipstream.bench.metrics import parse_slo
from slipstream.bench.peers import PEERS, BenchError, LoadWatch, ManagedServer, default_model, free_port, \
    llama_cpp_command, slipstream_command
from slipstream.bench.workloads import DEFAULTS, SCENARIOS, ScenarioSpec, builtin_prompts, conversation_turns, \
    doc_prompts, long_prompts, parse_list, short_prompts

NOISY_CORES = 0.3     # other processes' CPU use (cores) above which a target's numbers are flagged

DESCRIPTION = ("Benchmark an OpenAI-compatible endpoint with the project's scenarios (short, long, batch-docs, "
               "conversation) and a serving sweep (vLLM bench-serve metrics), optionally against a peer.")


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("target (ours)")
    g.add_argument("--base-url", help="the endpoint to measure, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--server", choices=["slipstream"], default=None,
                   help="start `python -m slipstream serve` on a free loopback port instead of --base-url")
    g.add_argument("--server-model", default=None, help="model for --server (default: the embedded SmolLM2-135M)")
    g.add_argument("--max-batch", type=int, default=None, help="--max-batch passed to `slipstream serve`")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `slipstream serve` (repeatable)")
    g.add_argument("--model", default=None, help="model name sent in requests (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--label", default=None, help="name of the target in tables (default: slipstream with --server, else target)")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")

    g = p.add_argument_group("peer")
    g.add_argument("--peer", choices=list(PEERS), default=None,
                   help="start this peer server on the same model file and run the same workload against it")
    g.add_argument("--peer-model", default=None, help="GGUF for --peer (default: --server-model or the embedded model)")
    g.add_argument("--peer-n-ctx", type=int, default=2048, help="context length of the llama.cpp peer (default 2048)")
    g.add_argument("--peer-threads", type=int, default=None, help="threads of the llama.cpp peer (default: CPU count)")
    g.add_argument("--peer-base-url", default=None, help="compare against an already running endpoint instead")
    g.add_argument("--peer-model-name", default=None, help="model name sent to the peer")
    g.add_argument("--peer-api-key", default=None)
    g.add_argument("--peer-label", default=None, help="name of the peer in tables (default: llama.cpp or peer)")

    g = p.add_argument_group("workload")
    g.add_argument("--scenario", default="short",
                   help=f"comma-separated, from {', '.join(SCENARIOS)}, or all (default: short)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per scenario, and per sweep point for serving (defaults: short 5, long 2, "
                        "batch-docs 50, serving 32)")
    g.add_argument("--rounds", type=int, default=10, help="conversation rounds (default 10)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens of the short/long/batch-docs/conversation requests "
                        "(defaults: 128, 1024, 128, 128)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="scenarios other than serving: ask for exactly max_tokens tokens (serving always does)")
    g.add_argument("--concurrency", default=None, help="serving: closed-loop concurrency levels, e.g. 1,4,16")
    g.add_argument("--request-rate", default=None, help="serving: Poisson request rates in req/s, e.g. 1,2,inf")
    g.add_argument("--input-len", type=int, default=256, help="serving: prompt tokens (random dataset; default 256)")
    g.add_argument("--output-len", type=int, default=128, help="serving: output tokens per request (default 128)")
    g.add_argument("--dataset", choices=["random", "builtin"], default="random",
                   help="serving prompts: random words cut to --input-len tokens, or the built-in documents")
    g.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:500,tpot:50[,e2el:10000]")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts and Poisson arrivals")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests per target before its runs (default 1)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for a started server")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="write the results JSON here")
    g.add_argument("--report", default=None, metavar="DIR", help="write report.md and PNG plots into DIR")
    g.add_argument("--from-json", default=None, metavar="PATH",
                   help="no run: print the table (and --report) of a saved results JSON")
    g.add_argument("--log-dir", default=None, help="where started servers write their logs (default: a temp dir)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the main CLI's subparsers."""
    p = subparsers.add_parser("bench", help="measure an OpenAI-compatible endpoint, with peers side by side",
                              description=DESCRIPTION)
    return configure(p)


def build_parser() -> argparse.ArgumentParser:
    return configure(argparse.ArgumentParser(prog="slipstream bench", description=DESCRIPTION))


# --------------------------------------------------------------------------- helpers


def scenario_names(text: str) -> list[str]:
    names = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part == "all":
            names += [s for s in SCENARIOS if s not in names]
            continue
        if part not in SCENARIOS:
            raise BenchError(f"unknown scenario {part!r}; choose from {', '.join(SCENARIOS)} or all")
        if part not in names:
            names.append(part)
    if not names:
        raise BenchError("no scenario given")
    return names


def build_specs(args: argparse.Namespace) -> list[ScenarioSpec]:
    specs = []
    for name in scenario_names(args.scenario):
        d = DEFAULTS[name]
        n = args.num_prompts or d["num_prompts"]
        mt = args.max_tokens or d["max_tokens"]
        fixed = bool(args.ignore_eos)
        cfg: dict[str, Any] = {"num_prompts": n, "max_tokens": mt, "fixed_length": fixed}
        if name == "short":
            specs.append(ScenarioSpec(name, "sequential", short_prompts(n, mt, fixed), config=cfg))
        elif name == "long":
            specs.append(ScenarioSpec(name, "sequential", long_prompts(n, mt, fixed), config=cfg))
        elif name == "batch-docs":
            specs.append(ScenarioSpec(name, "batch", doc_prompts(n, mt, fixed, args.seed), config=cfg))
        elif name == "conversation":
            from slipstream.bench.client import Prompt
            turns = conversation_turns(args.rounds)
            cfg = {"rounds": args.rounds, "max_tokens": mt, "fixed_length": fixed}
            specs.append(ScenarioSpec(name, "conversation", [Prompt([{"role": "user", "content": t}], mt, fixed) for t in turns],
                                      config=cfg))
        else:
            conc = parse_list(args.concurrency, int)
            rates = parse_list(args.request_rate, float)
            if not conc and not rates:
                conc = [1, 4, 16]
            points = [{"concurrency": c} for c in conc] + [{"request_rate": r} for r in rates]
            if args.input_len < 1 or args.output_len < 1:
                raise BenchError("--input-len and --output-len must be >= 1")
            cfg = {"dataset": args.dataset, "num_prompts": n, "input_len": args.input_len if args.dataset == "random" else None,
                   "output_len": args.output_len, "concurrency": conc, "request_rate": rates, "fixed_length": True}
            prompts = builtin_prompts(n * len(points), args.output_len, args.seed) if args.dataset == "builtin" else []
            specs.append(ScenarioSpec(name, "serving", prompts, points=points, config=cfg))
    return specs


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    cpu = cpu_name()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) / 1024 ** 2
    except (OSError, ValueError):
        pass
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        gpu = ", ".join(x.strip() for x in out.stdout.splitlines() if x.strip()) or None
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {}
    for dist in ("slipstream", "httpx", "llama_cpp_python", "torch"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": cpu, "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_gib": mem, "gpu": gpu, "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions, "slipstream_commit": commit,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def command_line(args: argparse.Namespace) -> str:
    argv = getattr(args, "_argv", None)
    if argv is None:
        argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else sys.argv[1:]
    return "slipstream bench " + shlex.join(argv)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the run


def _measure(plan: dict[str, Any], specs: list[ScenarioSpec], opts, cache: dict[str, Any], args) -> dict[str, Any]:
    """Start the plan's server if it has one, run every scenario against it, stop it."""
    from slipstream.bench.client import Target
    from slipstream.bench.runner import run_target

    server = None
    info: dict[str, Any] = {"label": plan["label"], "role": plan["role"]}
    try:
        if plan.get("command"):
            port = free_port()
            cmd = plan["command"](port)
            server = ManagedServer(plan["label"], cmd, port, args.log_dir)
            _log(f"starting {plan['label']}: {shlex.join(cmd)}")
            startup = server.start(args.startup_timeout)
            _log(f"{plan['label']} ready after {startup:.1f} s (log: {server.log_path})")
            base_url = server.base_url
            info["server"] = {"command": cmd, "startup_s": startup, "log": str(server.log_path)}
        else:
            base_url = plan["base_url"]
            info["server"] = None
        target = Target(base_url, model=plan.get("model"), api_key=plan.get("api_key"), endpoint=args.endpoint,
                        label=plan["label"])
        watch = LoadWatch(server)
        res = asyncio.run(run_target(target, specs, opts, cache, log=_log))
        info["load"] = {"all": watch.result()}
        info["base_url"] = base_url
        info.update(res)
        return info
    finally:
        if server is not None:
            server.stop()


def plans_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    if bool(args.base_url) == bool(args.server):
        raise BenchError("give exactly one of --base-url URL or --server slipstream")
    if args.peer and args.peer_base_url:
        raise BenchError("give at most one of --peer and --peer-base-url")
    plans = []
    if args.server:
        plans.append({"label": args.label or "slipstream", "role": "target", "model": args.model, "api_key": args.api_key,
                      "command": lambda port, m=args.server_model: slipstream_command(m, port, args.max_batch,
                                                                                       args.server_arg)})
    else:
        plans.append({"label": args.label or "target", "role": "target", "base_url": args.base_url,
                      "model": args.model, "api_key": args.api_key})
    if args.peer == "llama.cpp":
        model = args.peer_model
        if model is None:
            sm = args.server_model if args.server else None
            model = sm if sm and str(sm).endswith(".gguf") else default_model()
        if not Path(model).is_file():
            raise BenchError(f"peer model {model!r} is not a file (llama.cpp needs a .gguf)")
        plans.append({"label": args.peer_label or "llama.cpp", "role": "peer", "model": args.peer_model_name,
                      "api_key": args.peer_api_key, "gguf": model,
                      "command": lambda port, m=model, n=args.peer_n_ctx, t=args.peer_threads:
                          llama_cpp_command(m, port, n, t)})
    elif args.peer_base_url:
        plans.append({"label": args.peer_label or "peer", "role": "peer", "base_url": args.peer_base_url,
                      "model": args.peer_model_name, "api_key": args.peer_api_key})
    if len(plans) == 2 and plans[0]["label"] == plans[1]["label"]:
        plans[1]["label"] += " (peer)"
    return plans


def _config(args: argparse.Namespace, specs: list[ScenarioSpec], slo: dict[str, float]) -> dict[str, Any]:
    return {"scenarios": [s.name for s in specs], "endpoint": args.endpoint, "temperature": args.temperature,
            "seed": args.seed, "warmup": args.warmup, "slo": slo or None, "timeout_s": args.timeout,
            "ignore_eos": args.ignore_eos, "peer": args.peer, "peer_n_ctx": args.peer_n_ctx if args.peer else None,
            "peer_threads": (args.peer_threads or os.cpu_count()) if args.peer else None,
            "server": args.server, "max_batch": args.max_batch}


def run(args: argparse.Namespace) -> int:
    from slipstream.bench import report
    from slipstream.bench.runner import RunOptions

    try:
        if args.from_json:
            results = json.loads(Path(args.from_json).read_text())
            report.print_table(results)
            if args.report:
                files = report.write_report(args.report, results)
                _log(f"report: {', '.join(str(f) for f in files)}")
            return 0
        try:
            slo = parse_slo(args.slo)
            specs = build_specs(args)
        except ValueError as e:
            raise BenchError(str(e)) from None
        plans = plans_from_args(args)
        opts = RunOptions(temperature=args.temperature, seed=args.seed, slo=slo, progress=not args.no_progress,
                          timeout_s=args.timeout, warmup=args.warmup)
        results: dict[str, Any] = {
            "tool": "slipstream bench", "format": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(args), "machine": machine_info(), "config": _config(args, specs, slo),
            "targets": [], "ratios": {}, "warnings": []}
        cache: dict[str, Any] = {}
        rc = 0
        for plan in plans:
            try:
                t = _measure(plan, specs, opts, cache, args)
            except BenchError as e:
                if plan["role"] == "target":
                    raise
                results["warnings"].append(f"peer {plan['label']} not measured: {e}")
                _log(f"error: peer {plan['label']} not measured: {e}")
                rc = 1
                continue
            if plan.get("gguf"):
                t["gguf"] = plan["gguf"]
            other = (t.get("load") or {}).get("all", {}).get("other_cores")
            if other is not None and other > NOISY_CORES:
                results["warnings"].append(f"{t['label']}: other processes kept {other:.2f} cores busy during its runs; "
                                           "its numbers are disturbed (measure on a quiet machine)")
            results["targets"].append(t)
            for sc in t["scenarios"].values():
                for p in sc["points"]:
                    results["warnings"] += p.get("warnings", [])
        if len(results["targets"]) == 2:
            results["ratios"] = report.compute_ratios(results["targets"][0], results["targets"][1])
        if args.out:
            report.write_json(args.out, results)
            _log(f"results: {args.out}")
        report.print_table(results)
        if args.report:
            files = report.write_report(args.report, results)
            _log(f"report: {', '.join(str(f) for f in files)}")
        return rc
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)
