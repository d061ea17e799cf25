"""Command line: `slipstream generate|chat|serve [MODEL] ...`.

User errors (a missing model file, an unsupported architecture or quant type, a prompt longer than
the context, bad sampling parameters) print one line, `error: ...`, and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any, Sequence

from slipstream.errors import SlipstreamError
from slipstream.runtime import RUNTIMES

MODEL_HELP = "a .gguf file, a Hugging Face folder, a compiled artifact, or smollm2-135m (the default)"


# Sampling flags, keyed by their SamplingParams field (with --max-tokens, whose default is the command's)
SAMPLING_FLAGS: dict[str, dict] = {
    "temperature": dict(type=float, default=0.0, help="0 = greedy (default)"),
    "top_p": dict(type=float, default=1.0),
    "top_k": dict(type=int, default=0),
    "min_p": dict(type=float, default=0.0),
    "repetition_penalty": dict(type=float, default=1.0),
    "presence_penalty": dict(type=float, default=0.0),
    "frequency_penalty": dict(type=float, default=0.0),
    "seed": dict(type=int, default=None),
    "stop": dict(action="append", default=None, help="stop string (repeatable)"),
    "ignore_eos": dict(action="store_true", help="keep generating past end-of-sequence"),
}


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    _add_flags(p, SAMPLING_FLAGS)


# The engine options the CLI exposes, keyed by their EngineConfig field (the flag is the field's name,
# dashed): every model command takes ENGINE_FLAGS, serve also BATCH_FLAGS. `_engine_config` reads back
# whichever of them a command has; EngineConfig validates them, once.
ENGINE_FLAGS: dict[str, dict] = {
    "max_model_len": dict(type=int, default=None, help="context length (default: the model's)"),
    "runtime": dict(choices=list(RUNTIMES), default="auto",
                    help="decode step executor: eager (torch reference), native (CPU kernels), graph (CUDA "
                         "graphs), megakernel (one persistent kernel); auto: graph on a GPU, else native where "
                         "it applies"),
    "speculative": dict(default=None, metavar="METHOD",
                        help="speculative decoding: ngram (prompt lookup), mtp (the model's own MTP layers) or "
                             "draft:MODEL (a smaller model with the same tokenizer)"),
    "num_speculative_tokens": dict(type=int, default=4, metavar="K",
                                   help="guesses verified per step with --speculative (default 4)"),
    "exact": dict(action="store_true",
                  help="use the exact fp32-activation CPU kernels instead of the int8-activation fast path"),
    "threads": dict(type=int, default=None, metavar="N",
                    help="compute threads on the CPU, per rank with --tensor-parallel (default: one per core this "
                         "process may run on; SLIPSTREAM_THREADS sets that default)"),
    "kv_cache_dtype": dict(default="auto", metavar="{auto,fp32,fp16,int8}",   # EngineConfig refuses others in one line
                           help="KV-cache element type on the CPU: fp16 holds twice the tokens in the same memory "
                                "and halves what attention reads; auto: fp16 on the native fast path, fp32 with "
                                "--exact and on the eager CPU step (a GPU keeps the weights' dtype); int8: 8-bit codes "
                                "with a scale per row, about half of fp16's bytes (not with --exact)"),
}
BATCH_FLAGS: dict[str, dict] = {
    "max_batch": dict(type=int, default=32, help="most requests decoded together"),
    "max_waiting": dict(type=int, default=256, help="most requests queued for a batch slot; past it requests get 503"),
    "prefill_chunk": dict(type=int, default=512, help="prompt tokens per prefill step"),
    "prefill_budget": dict(type=int, default=64,
                           help="prompt tokens in a step that also decodes: bounds how long a running stream "
                                "waits behind a burst of new prompts (default 64; = --prefill-chunk for no bound); "
                                "with --prefill-pacing, its first guess"),
    "prefill_pacing": dict(type=lambda s: _factor_or_off(s), default=2.0,
                           metavar="FACTOR",
                           help="size the prompt tokens of a step that also decodes from measured step times, so "
                                "that it takes at most FACTOR decode-only steps' time: a running stream's "
                                "inter-token latency stays within FACTOR x its idle one while a burst of prompts "
                                "is prefilled (default 2; off: the fixed --prefill-budget)"),
    "kv_cache_tokens": dict(type=int, default=None, help="KV-cache size in tokens"),
}


# The HTTP server's limits, keyed by their ServerConfig field (flag: the field's name dashed, unless given)
SERVER_FLAGS: dict[str, dict] = {
    "max_body_bytes": dict(type=int, default=4 * 1024 * 1024, help="largest request body (413 past it)"),
    "max_prompt_chars": dict(type=int, default=None,
                             help="longest prompt or conversation in characters (default: 32 x the context length)"),
    "max_stop_chars": dict(type=int, default=256, help="longest stop string"),
    "max_choices": dict(type=int, default=128, help="most choices (n x prompts) in one request"),
    "max_json_depth": dict(type=int, default=32, help="deepest nesting of a JSON body"),
    "workers": dict(flag="--http-workers", metavar="HTTP_WORKERS", type=int, default=2,
                    help="threads that parse, template and tokenize requests off the event loop"),
    "max_queued_jobs": dict(type=int, default=512,
                            help="requests waiting for such a thread; past it requests get 503 with Retry-After"),
    "header_timeout": dict(type=float, default=10.0, help="seconds a client has to send its headers"),
    "body_timeout": dict(type=float, default=30.0, help="seconds a client has to send its body"),
    "idle_timeout": dict(type=float, default=5.0, help="seconds an idle keep-alive connection stays open"),
    "max_connections": dict(type=int, default=1024,
                            help="most open connections; past it new ones get 503 and are closed"),
}


def _factor_or_off(s: str) -> float | str | None:
    """A --prefill-pacing value: a number, or off (anything else is left for EngineConfig to refuse
    in one line)."""
    if s.lower() in ("off", "none", "0"):
        return None
    try:
        return float(s)
    except ValueError:
        return s


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _add_flags(p: Any, flags: dict[str, dict]) -> None:
    """Add one flag per entry of a table above (to a parser or an argument group)."""
    for field, kwargs in flags.items():
        opts = {k: v for k, v in kwargs.items() if k != "flag"}
        p.add_argument(kwargs.get("flag", _flag(field)), dest=field, **opts)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    _add_flags(p, ENGINE_FLAGS)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N processes with torch.distributed (gloo): heads, FFN features, "
                        "experts and the vocabulary divided between them; runs the eager step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Low-latency LLM inference.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text for one prompt")
    _engine_args(g)
    g.add_argument("-p", "--prompt", required=True, help="the prompt ('-' reads standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, prompt_tokens, ttft_s, decode_tok_s")
    _sampling_args(g, 128)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _engine_args(c)
    c.add_argument("--system", default=None, help="system message")
    _sampling_args(c, 512)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version; "
                        "the environment variable SLIPSTREAM_API_KEY sets it too (the flag wins). With neither the "
                        "API is open to whoever can reach the address; an empty key is an error")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL's)")
    _add_flags(s, BATCH_FLAGS)
    s.add_argument("--drain-timeout", type=float, default=None,
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish (default: no limit)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")
    h = s.add_argument_group("limits and security of the HTTP server")
    h.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME",
                   help="Host header names accepted besides the bound address (repeatable or comma-separated; "
                        "'*' accepts any). Guards against DNS rebinding")
    h.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="answer cross-origin requests from ORIGIN (repeatable; '*' for any). Default: no CORS")
    _add_flags(h, SERVER_FLAGS)

    d = s.add_argument_group("replicas on Ray Serve (pip install 'slipstream[distributed]')")
    d.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas as Ray Serve deployments behind this one endpoint")
    d.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join the Ray cluster at ADDRESS (e.g. ray://head:10001 or auto); default: start a local one")
    d.add_argument("--router", default="cache-aware", choices=["cache-aware", "round-robin", "least-loaded"],
                   help="how requests are spread over the replicas (default cache-aware: the replica holding the "
                        "prompt's prefix in its KV cache, unless it is much busier than the least loaded one)")
    d.add_argument("--router-load-threshold", type=int, default=4, metavar="K",
                   help="cache-aware: go to the least loaded replica when the prefix holder has more than K "
                        "requests in flight beyond it (default 4)")
    d.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="Ray CPUs per replica (fractions allowed; default: the machine's CPUs / N, at most 1)")
    d.add_argument("--replica-gpus", type=float, default=0.0, metavar="G", help="Ray GPUs per replica (default 0)")
    d.add_argument("--replica-threads", type=int, default=None, metavar="T",
                   help="compute threads per replica (SLIPSTREAM_THREADS; default: its CPUs, at least 1)")

    k = sub.add_parser("compile", help="write an ahead-of-time artifact that serve/generate/chat load directly")
    k.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    k.add_argument("--out", required=True, help="the artifact directory (created)")
    k.add_argument("--plan-context", type=int, default=None,
                   help="longest context the megakernel plans cover (default: the model's maximum)")
    k.add_argument("--tune", action="store_true", help="time the GPU kernels' tiles on this machine's GPU")

    i = sub.add_parser("inspect", help="what a model file holds and which runtime will run it, and why")
    i.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    i.add_argument("--json", action="store_true", help="one JSON object instead of text")

    from slipstream.bench.cli import add_parser as add_bench_parser  # argparse only: no heavy imports
    add_bench_parser(sub)
    return parser


def _params(args: argparse.Namespace):
    from slipstream.engine.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, **{f: getattr(args, f) for f in SAMPLING_FLAGS})
    except ValueError as e:
        raise SlipstreamError(str(e)) from None


def _engine_config(args: argparse.Namespace):
    """The engine configuration the flags ask for, validated, and the model argument checked, before
    anything imports torch (a typo is reported at once). A bad value is reported by its flag."""
    from slipstream.engine.config import EngineConfig, EngineConfigError
    from slipstream.weights import resolve_model

    try:
        config = EngineConfig(**{f: getattr(args, f) for f in {**ENGINE_FLAGS, **BATCH_FLAGS} if hasattr(args, f)})
    except EngineConfigError as e:
        raise SlipstreamError(f"{_flag(e.field)} {e.problem}") from None
    if getattr(args, "tensor_parallel", 1) < 1:
        raise SlipstreamError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    resolve_model(args.model)
    return config


def _progress(msg: str) -> None:
    """Loading stages on one terminal line, overwritten as they go (nothing when stderr is not a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[Kloading: {msg} ..." if msg else "\r\033[K")
        sys.stderr.flush()


_TP_GROUPS: list = []   # tensor-parallel follower groups started by this command (closed at exit)


def _build_llm(args: argparse.Namespace, config):
    """The LLM the flags ask for: one process, or rank 0 of a --tensor-parallel group."""
    from slipstream.api import LLM

    if getattr(args, "tensor_parallel", 1) == 1:
        return LLM(args.model, config=config, progress=_progress)
    from slipstream.distributed.tp_launch import tensor_parallel_llm

    llm, group = tensor_parallel_llm(args.model, config, args.tensor_parallel, progress=_progress)
    _TP_GROUPS.append(group)
    return llm


def _close_tp_groups() -> None:
    while _TP_GROUPS:
        _TP_GROUPS.pop().close()


def _load(args: argparse.Namespace, config=None):
    try:
        llm = _build_llm(args, config or _engine_config(args))
    finally:
        _progress("")
    _template_note(llm)
    return llm


def _kv_note(llm: Any) -> str:
    """', KV cache N tokens (dtype)' for the startup line: how much context the cache holds, in what element type."""
    kv = llm.engine.kv
    tokens, k = getattr(kv, "capacity_tokens", None), getattr(kv, "k", None)
    if tokens is None:
        return ""
    dtype = str(k.dtype).removeprefix("torch.").replace("float", "fp") if k is not None else ""
    return f", KV cache {tokens} tokens{' ' + dtype if dtype else ''}"


def _template_note(llm) -> None:
    """Say which chat format is used when the model file had none (a built-in family template)."""
    source = getattr(getattr(llm, "tokenizer", None), "chat_template_source", None) or ""
    if source.startswith("built-in"):
        print(f"note: chat prompts use the {source}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    config = _engine_config(args)
    params = _params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = _load(args, config)
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": prompt})
        source = msgs
    else:
        source = prompt
    last = None
    for chunk in llm.stream(source, params):
        if not args.json and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    req = last.request
    m = req.metrics
    if args.json:
        print(json.dumps({
            "text": req.text, "token_ids": req.output_ids, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids), "finish_reason": req.finish_reason,
            "ttft_s": m.ttft_s, "decode_tok_s": m.decode_tok_s, "model": llm.model_name,
            "runtime": llm.engine.runtime_name, "speculative": args.speculative,
            "accepted_tokens_per_step": llm.engine.spec.accepted_tokens_per_step if args.speculative else None},
            ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        tps = f"{m.decode_tok_s:.1f} tok/s" if m.decode_tok_s else "n/a"
        ttft = f"{m.ttft_s * 1000:.0f} ms" if m.ttft_s is not None else "n/a"
        print(f"[{len(req.prompt_ids)} prompt tokens, {len(req.output_ids)} generated, "
              f"TTFT {ttft}, decode {tps}, finish: {req.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    config = _engine_config(args)
    params = _params(args)
    t0 = time.perf_counter()
    llm = _load(args, config)
    print(f"{llm.model_name} loaded in {time.perf_counter() - t0:.1f} s ({llm.engine.runtime_name} runtime). "
          f"Type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            print("(conversation cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        reply, last = "", None
        try:
            for chunk in llm.stream(history, params):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                reply += chunk.text
                last = chunk
        except SlipstreamError as e:  # e.g. the conversation outgrew the context: say so, keep going
            history.pop()
            print(f"\nerror: {e} (try /reset)", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
        history.append({"role": "assistant", "content": reply})
        m = last.request.metrics if last else None
        speed = f"{m.decode_tok_s:.1f} tok/s" if m and m.decode_tok_s else "n/a"
        ttft = f"{m.ttft_s * 1000:.0f} ms" if m and m.ttft_s is not None else "n/a"
        print(f"\n[{len(last.request.output_ids) if last else 0} tokens, TTFT {ttft}, {speed}]", file=sys.stderr)


def _server_config(args: argparse.Namespace):
    """The HTTP server's settings from the flags (and SLIPSTREAM_API_KEY), validated before loading."""
    import os

    from slipstream.server.config import ServerConfig

    api_key = args.api_key if args.api_key is not None else os.environ.get("SLIPSTREAM_API_KEY")
    if api_key is not None and not api_key.strip():
        where = "--api-key" if args.api_key is not None else "SLIPSTREAM_API_KEY"
        raise SlipstreamError(f"{where} is empty: give a non-empty key, or unset it to serve an open API")

    def names(values: list[str] | None) -> tuple[str, ...]:
        return tuple(v.strip() for arg in values or [] for v in arg.split(",") if v.strip())

    return ServerConfig(api_key=api_key, served_model_name=args.served_model_name,
                        cors_origins=names(args.cors_origin), drain_timeout=args.drain_timeout,
                        **{f: getattr(args, f) for f in SERVER_FLAGS})


def _api_access_line(config, host: str, port: int) -> str:
    if config.api_key:
        return "API key required (Authorization: Bearer KEY)"
    return f"API OPEN: no API key, anyone who can reach {host}:{port} can use it (set --api-key or SLIPSTREAM_API_KEY)"


def cmd_serve(args: argparse.Namespace) -> int:
    import socket

    if not 0 <= args.port <= 65535:
        raise SlipstreamError(f"--port must be in 0..65535, got {args.port}")
    config = _engine_config(args)
    if args.drain_timeout is not None and args.drain_timeout < 0:
        raise SlipstreamError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    server_config = _server_config(args)
    replica_opts = _replica_options(args)
    if replica_opts is not None and args.tensor_parallel > 1:
        raise SlipstreamError("--tensor-parallel with --replicas is not supported yet: choose one")
    if replica_opts is not None and config.threads is not None:
        raise SlipstreamError("--threads sizes one engine; with --replicas use --replica-threads (threads per replica)")
    try:   # fail before loading the model if the address is taken
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((args.host, args.port))
    except OSError as e:
        raise SlipstreamError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    allowed = tuple(h.strip() for a in args.allowed_hosts or [] for h in a.split(",") if h.strip())
    if replica_opts is not None:
        from slipstream.distributed.ray_serve import run_replicas

        print(f"starting {replica_opts.replicas} replica(s) of {args.model or 'smollm2-135m'} on Ray Serve; "
              f"{_api_access_line(server_config, args.host, args.port)}", file=sys.stderr, flush=True)
        run_replicas(args.model, config, server_config, replica_opts, host=args.host, port=args.port,
                     log_level=args.log_level, access_log=not args.no_access_log, allowed_hosts=allowed,
                     say=lambda msg: print(msg, file=sys.stderr, flush=True))
        return 0
    try:
        from slipstream.server.app import run_server
    except ImportError as e:
        raise SlipstreamError(f"the server needs fastapi, uvicorn and prometheus-client ({e.name or e} is missing): "
                              f"pip install fastapi uvicorn prometheus-client") from None
    t0 = time.perf_counter()
    from slipstream.server.async_engine import build_off_main_thread

    try:
        llm = build_off_main_thread(lambda: _build_llm(args, config))
    finally:
        _progress("")
    _template_note(llm)
    print(f"{llm.model_name} loaded in {time.perf_counter() - t0:.1f} s ({llm.engine.runtime_name} runtime, "
          f"context {llm.max_model_len}{_kv_note(llm)}); serving as {args.served_model_name or llm.model_name!r}"
          f"; {_api_access_line(server_config, args.host, args.port)}", file=sys.stderr, flush=True)
    run_server(llm, server_config, host=args.host, port=args.port, log_level=args.log_level,
               access_log=not args.no_access_log, allowed_hosts=allowed)
    return 0


def _replica_options(args: argparse.Namespace):
    """The Ray Serve replica settings when --replicas (or --ray-address) is given, else None; Ray's
    presence is checked here, before anything loads."""
    if args.replicas is None and args.ray_address is None:
        return None
    from slipstream.distributed.ray_serve import ReplicaOptions, require_ray

    opts = ReplicaOptions(replicas=args.replicas or 1, ray_address=args.ray_address,
                          replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus,
                          threads=args.replica_threads, router=args.router,
                          load_threshold=args.router_load_threshold)
    require_ray()
    return opts


def cmd_compile(args: argparse.Namespace) -> int:
    from slipstream.compiler import compile_model

    m = compile_model(args.model, args.out, plan_context=args.plan_context, tune=args.tune)
    print(f"compiled {m['name']} ({m['config']['architecture']}, {m['config']['num_layers']} layers) into "
          f"{args.out} in {m['compile_s']:.1f} s; use it as the MODEL of generate, chat or serve", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from slipstream.model_info import inspect_model, render

    report = inspect_model(args.model)
    print(report.to_json() if args.json else render(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from slipstream import __version__
        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    # a user reads a warning, not the line of our source that raised it
    warnings.formatwarning = lambda message, category, *rest, **kw: f"warning: {message}\n"
    try:
        if args.command == "bench":
            from slipstream.bench.cli import run as run_bench
            return run_bench(args)
        return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                "compile": cmd_compile, "inspect": cmd_inspect}[args.command](args)
    except SlipstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `slipstream generate ... | head`
        return 0
    finally:
        _close_tp_groups()


if __name__ == "__main__":
    sys.exit(main())
