"""Results out: ratios, the terminal table, the JSON file, and the markdown report with PNG plots.

Everything here works on the results dictionary (the JSON document), so a report can be rebuilt
from a saved JSON: ``python -m slipstream.bench --from-json results.json --report DIR``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from slipstream.bench.metrics import ratio

# (key, title, unit, getter from a point summary, higher is better)
Getter = Callable[[dict[str, Any]], Any]
METRICS: list[tuple[str, str, str, Getter, bool]] = [
    ("avg_output_speed_tok_s", "avg output speed per request", "tok/s", lambda s: s["output_speed_tok_s"]["mean"], True),
    ("output_throughput", "output throughput", "tok/s", lambda s: s["output_throughput"], True),
    ("request_throughput", "request throughput", "req/s", lambda s: s["request_throughput"], True),
    ("request_goodput", "goodput", "req/s", lambda s: s.get("request_goodput"), True),
    ("ttft_mean_ms", "TTFT mean", "ms", lambda s: s["ttft_ms"]["mean"], False),
    ("ttft_p50_ms", "TTFT p50", "ms", lambda s: s["ttft_ms"]["p50"], False),
    ("ttft_p90_ms", "TTFT p90", "ms", lambda s: s["ttft_ms"]["p90"], False),
    ("ttft_p99_ms", "TTFT p99", "ms", lambda s: s["ttft_ms"]["p99"], False),
    ("tpot_mean_ms", "TPOT mean", "ms", lambda s: s["tpot_ms"]["mean"], False),
    ("tpot_p50_ms", "TPOT p50", "ms", lambda s: s["tpot_ms"]["p50"], False),
    ("tpot_p90_ms", "TPOT p90", "ms", lambda s: s["tpot_ms"]["p90"], False),
    ("tpot_p99_ms", "TPOT p99", "ms", lambda s: s["tpot_ms"]["p99"], False),
    ("itl_mean_ms", "ITL mean", "ms", lambda s: s["itl_ms"]["mean"], False),
    ("itl_p50_ms", "ITL p50", "ms", lambda s: s["itl_ms"]["p50"], False),
    ("itl_p99_ms", "ITL p99", "ms", lambda s: s["itl_ms"]["p99"], False),
    ("e2el_mean_ms", "E2E latency mean", "ms", lambda s: s["e2el_ms"]["mean"], False),
    ("e2el_p99_ms", "E2E latency p99", "ms", lambda s: s["e2el_ms"]["p99"], False),
    ("total_time_s", "total time", "s", lambda s: s["duration_s"], False),
]


def _get(getter: Getter, summary: dict[str, Any]) -> Any:
    try:
        return getter(summary)
    except (KeyError, TypeError):
        return None


def compute_ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """{scenario: {point label: {metric: ours / peer}}} over the scenarios and points both ran.
    For throughputs and speeds > 1 means we are faster; for latencies and times < 1 does."""
    out: dict[str, Any] = {}
    for name, sc in ours.get("scenarios", {}).items():
        psc = peer.get("scenarios", {}).get(name)
        if not psc:
            continue
        ppoints = {p["label"]: p for p in psc["points"]}
        per: dict[str, Any] = {}
        for p in sc["points"]:
            q = ppoints.get(p["label"])
            if q is None:
                continue
            per[p["label"]] = {k: ratio(_get(g, p["summary"]), _get(g, q["summary"])) for k, _, _, g, _ in METRICS}
        out[name] = per
    return out


def write_json(path: str | Path, results: dict[str, Any]) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(results), indent=1, default=_json_default, allow_nan=False) + "\n")
    return path


def clean(o: Any) -> Any:
    """Strict JSON: inf -> "inf", nan -> None, tuples -> lists."""
    if isinstance(o, float):
        if math.isnan(o):
            return None
        if math.isinf(o):
            return "inf" if o > 0 else "-inf"
        return o
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    return str(o)


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.{digits}f}"
    return str(v)


def _r(v: Any) -> str:
    return "–" if v is None else f"{v:.2f}x"


# (metric, column title, digits); the titles are short so the table fits ~150 columns
TABLE_COLUMNS: list[tuple[str, str, int]] = [
    ("avg_output_speed_tok_s", "speed tok/s", 1),
    ("ttft_mean_ms", "TTFT ms", 1),
    ("ttft_p99_ms", "TTFT p99", 1),
    ("tpot_mean_ms", "TPOT ms", 2),
    ("tpot_p99_ms", "TPOT p99", 2),
    ("itl_p50_ms", "ITL p50", 2),
    ("e2el_mean_ms", "E2E ms", 0),
    ("total_time_s", "time s", 2),
    ("output_throughput", "out tok/s", 1),
    ("request_throughput", "req/s", 3),
]


def _metric(key: str) -> Getter:
    for k, _, _, g, _ in METRICS:
        if k == key:
            return g
    raise KeyError(key)


def table_rows(results: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """Per scenario: rows of [target, point, ok/failed, *TABLE_COLUMNS (+ goodput)], then ratio rows."""
    targets = results.get("targets", [])
    has_slo = bool(results.get("config", {}).get("slo"))
    out = []
    names: list[str] = []
    for t in targets:
        for n in t.get("scenarios", {}):
            if n not in names:
                names.append(n)
    for name in names:
        rows: list[list[str]] = []
        for t in targets:
            sc = t.get("scenarios", {}).get(name)
            if not sc:
                continue
            for p in sc["points"]:
                s = p["summary"]
                row = [t["label"], p["label"], f"{s['completed']}/{s['failed']}"]
                row += [_f(_get(_metric(k), s), d) for k, _, d in TABLE_COLUMNS]
                if has_slo:
                    row.append(_f(s.get("request_goodput"), 3))
                rows.append(row)
        ratios = results.get("ratios", {}).get(name, {})
        if ratios and len(targets) > 1:
            for label, rr in ratios.items():
                row = [f"{targets[0]['label']}/{targets[1]['label']}", label, ""]
                row += [_r(rr.get(k)) for k, _, _ in TABLE_COLUMNS]
                if has_slo:
                    row.append(_r(rr.get("request_goodput")))
                rows.append(row)
        out.append((name, rows))
    return out


def table_header(results: dict[str, Any]) -> list[str]:
    h = ["target", "run", "ok/fail"] + [t for _, t, _ in TABLE_COLUMNS]
    if results.get("config", {}).get("slo"):
        h.append("goodput req/s")
    return h


def print_table(results: dict[str, Any], file=None) -> None:
    """The end-of-run table (rich when installed, plain text otherwise), one table per scenario."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(results, file)
        return
    console = Console(file=file)
    if not console.is_terminal and console.width < 200:
        console = Console(file=file, width=200)
    console.print("speed = mean over requests of 1/TPOT (tok/s once the first token is out); times in ms "
                  "unless marked; ratios are first target / peer", style="dim")
    header = table_header(results)
    for name, rows in table_rows(results):
        t = Table(title=f"scenario: {name}", show_lines=False)
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i < 2 else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    for w in results.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}")


def _print_plain(results: dict[str, Any], file=None) -> None:
    import sys

    out = file or sys.stdout
    header = table_header(results)
    for name, rows in table_rows(results):
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        print(f"scenario: {name}", file=out)
        for r in [header, *rows]:
            print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
                  file=out)
    for w in results.get("warnings", []):
        print(f"warning: {w}", file=out)


# --------------------------------------------------------------------------- markdown + plots


def write_report(out_dir: str | Path, results: dict[str, Any]) -> list[Path]:
    """report.md and PNG plots in `out_dir`; returns the files written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(d, results)
    md = d / "report.md"
    md.write_text(markdown(results, {p.name for p in pngs}))
    return [md, *pngs]


def markdown(results: dict[str, Any], pngs: set[str] | None = None) -> str:
    pngs = pngs or set()
    m = results.get("machine", {})
    cfg = results.get("config", {})
    targets = results.get("targets", [])
    L: list[str] = ["# `slipstream bench` report", ""]
    L.append(f"- **Date:** {results.get('date', '?')}")
    L.append(f"- **Machine:** {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
             f"{_f(m.get('memory_gib'))} GiB, {m.get('gpu') or 'no GPU'}; {m.get('platform', '')}, "
             f"Python {m.get('python', '')}; Slipstream commit {m.get('slipstream_commit') or '?'}")
    L.append(f"- **Command:** `{results.get('command', '')}`")
    L.append(f"- **Scenarios:** {', '.join(cfg.get('scenarios', []))}; temperature {cfg.get('temperature')}, "
             f"endpoint {cfg.get('endpoint')}, seed {cfg.get('seed')}"
             + (f"; SLO {cfg.get('slo')}" if cfg.get("slo") else ""))
    L += ["", "## Targets", ""]
    L += ["| label | role | endpoint | model | server | start-up s | machine busy, cores | other processes, cores |",
          "|---|---|---|---|---|---|---|---|"]
    for t in targets:
        srv = t.get("server") or {}
        cmd = f"`{' '.join(srv['command'])}`" if srv.get("command") else "(already running)"
        load = (t.get("load") or {}).get("all") or {}
        L.append(f"| {t['label']} | {t.get('role', '')} | {t.get('url', '')} | {t.get('model', '')} | {cmd} | "
                 f"{_f(srv.get('startup_s'), 1)} | {_f(load.get('machine_busy_cores'), 2)} | {_f(load.get('other_cores'), 2)} |")
    L += ["", "Machine busy = all CPU use during the target's runs (client and server included); other processes = "
          "that minus this client and the server (known only for servers the bench started). More than a few "
          "tenths of a core of other processes means the numbers are disturbed."]
    L.append("")
    for t in targets:
        for n in t.get("notes", []):
            L.append(f"- note ({t['label']}): {n}")
    # headline table
    names: list[str] = []
    for t in targets:
        for n in t.get("scenarios", {}):
            if n not in names:
                names.append(n)
    if len(targets) > 1:
        ours, peer = targets[0]["label"], targets[1]["label"]
        L += ["", "## Summary", "",
              f"Ratios are {ours} / {peer}: above 1 is better for speeds and throughputs, below 1 for latencies and times.", "",
              f"| scenario | run | avg output speed tok/s ({ours} / {peer}) | ratio | mean TTFT ms ({ours} / {peer}) | ratio | "
              f"total time s ({ours} / {peer}) | ratio | output tok/s ({ours} / {peer}) | ratio |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for name in names:
            a = targets[0].get("scenarios", {}).get(name)
            b = targets[1].get("scenarios", {}).get(name)
            if not a or not b:
                continue
            bp = {p["label"]: p for p in b["points"]}
            for p in a["points"]:
                q = bp.get(p["label"])
                if q is None:
                    continue
                cells = []
                for key, digits in (("avg_output_speed_tok_s", 1), ("ttft_mean_ms", 1), ("total_time_s", 2), ("output_throughput", 1)):
                    g = _metric(key)
                    x, y = _get(g, p["summary"]), _get(g, q["summary"])
                    cells += [f"{_f(x, digits)} / {_f(y, digits)}", f"**{_r(ratio(x, y))}**"]
                L.append(f"| {name} | {p['label']} | " + " | ".join(cells) + " |")
    else:
        L += ["", "## Summary", "", "| scenario | run | avg output speed tok/s | mean TTFT ms | total time s | output tok/s |",
              "|---|---|---|---|---|---|"]
        for name in names:
            sc = targets[0]["scenarios"][name] if targets else None
            for p in (sc or {}).get("points", []):
                s = p["summary"]
                L.append(f"| {name} | {p['label']} | {_f(s['output_speed_tok_s']['mean'])} | {_f(s['ttft_ms']['mean'])} | "
                         f"{_f(s['duration_s'], 2)} | {_f(s['output_throughput'])} |")
    if "scenarios_overview.png" in pngs:
        L += ["", "![average output speed and TTFT per scenario](scenarios_overview.png)"]
    # per scenario details
    for name in names:
        L += ["", f"## Scenario `{name}`", ""]
        first = next((t["scenarios"][name] for t in targets if name in t.get("scenarios", {})), None)
        if first:
            L.append("Configuration: " + ", ".join(f"{k}={json.dumps(v, default=_json_default)}" for k, v in first["config"].items()
                                                   if k != "prompt_construction"))
            if first["config"].get("prompt_construction"):
                L.append("")
                L.append("Prompt construction: " + json.dumps(first["config"]["prompt_construction"], default=_json_default))
        L.append("")
        labels: list[str] = []
        for t in targets:
            for p in t.get("scenarios", {}).get(name, {}).get("points", []):
                if p["label"] not in labels:
                    labels.append(p["label"])
        for label in labels:
            cols = []
            for t in targets:
                p = next((p for p in t.get("scenarios", {}).get(name, {}).get("points", []) if p["label"] == label), None)
                cols.append((t["label"], p))
            head = "| metric | " + " | ".join(c[0] for c in cols)
            sep = "|---|" + "---|" * len(cols)
            rr = results.get("ratios", {}).get(name, {}).get(label) if len(cols) > 1 else None
            if rr is not None:
                head += f" | {cols[0][0]} / {cols[1][0]}"
                sep += "---|"
            L += [f"**{label}**", "", head + " |", sep]
            first_s = next((p["summary"] for _, p in cols if p), None)
            L.append("| completed / failed | " + " | ".join(
                f"{p['summary']['completed']} / {p['summary']['failed']}" if p else "–" for _, p in cols) + (" | |" if rr is not None else " |"))
            L.append("| input / output tokens | " + " | ".join(
                f"{p['summary']['total_input_tokens']} / {p['summary']['total_output_tokens']}" if p else "–" for _, p in cols)
                + (" | |" if rr is not None else " |"))
            for key, title, unit, g, _ in METRICS:
                if key == "request_goodput" and (first_s is None or "request_goodput" not in first_s):
                    continue
                vals = [_f(_get(g, p["summary"]), 2) if p else "–" for _, p in cols]
                line = f"| {title} ({unit}) | " + " | ".join(vals)
                if rr is not None:
                    line += f" | {_r(rr.get(key))}"
                L.append(line + " |")
            L.append("")
            for tl, p in cols:
                for err, count in ((p or {}).get("summary", {}).get("errors") or {}).items():
                    L.append(f"- {tl}: {count} failed request(s): {err}")
        png = f"{_slug(name)}_latency.png"
        if png in pngs:
            L += [f"![TTFT and TPOT distributions, {name}]({png})", ""]
        if name == "serving":
            for png, what in (("serving_concurrency.png", "output tok/s and TPOT against concurrency"),
                              ("serving_rate.png", "output tok/s and TPOT against request rate")):
                if png in pngs:
                    L += [f"![{what}]({png})", ""]
    if results.get("warnings"):
        L += ["", "## Warnings", ""] + [f"- {w}" for w in results["warnings"]]
    L += ["", "## Definitions", "",
          "As vLLM's `bench serve`: TTFT = send to the first streamed chunk with content; E2E = send to the last content "
          "chunk; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between consecutive content chunks; output speed "
          "of a request = 1 / TPOT (the scenario tables' \"average output speed\" is its mean over requests); output "
          "throughput = all output tokens / wall time of the run; goodput = requests meeting every SLO / wall time. "
          "Token counts come from the server's `usage`; where a server sends none (llama-cpp-python) they are filled in "
          "after the run (see each request's `*_tokens_source` in the JSON). Percentiles: numpy's linear interpolation. "
          "Distributions are plotted as empirical CDFs.", ""]
    return "\n".join(L)


def _slug(name: str) -> str:
    return name.replace("-", "_").replace(" ", "_")


def _requests_values(p: dict[str, Any], key: str) -> list[float]:
    return sorted(r[key] for r in p.get("requests", []) if r.get("ok") and r.get(key) is not None)


def write_plots(d: Path, results: dict[str, Any]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = results.get("targets", [])
    written: list[Path] = []
    styles = ["-", "--", ":", "-."]
    names: list[str] = []
    for t in targets:
        for n in t.get("scenarios", {}):
            if n not in names:
                names.append(n)
    cmap = plt.get_cmap("tab10")

    # TTFT and TPOT distributions per scenario: one line per target and run
    for name in names:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        any_line = False
        for ti, t in enumerate(targets):
            points = t.get("scenarios", {}).get(name, {}).get("points", [])
            for pi, p in enumerate(points):
                color = cmap(ti) if len(points) == 1 else cmap(pi)
                lab = t["label"] if len(points) == 1 else f"{t['label']} {p['label']}"
                for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
                    xs = _requests_values(p, key)
                    if not xs:
                        continue
                    ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                    xs = [xs[0]] + xs
                    ax.step(xs, ys, where="post", color=color, linestyle=styles[ti % len(styles)], label=lab)
                    any_line = True
        if not any_line:
            plt.close(fig)
            continue
        for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.suptitle(f"{name}: TTFT and TPOT distributions (empirical CDF)")
        fig.tight_layout()
        path = d / f"{_slug(name)}_latency.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # serving sweeps: output tok/s and mean TPOT against concurrency / request rate
    for key, fname, xlabel in (("concurrency", "serving_concurrency.png", "concurrency (closed loop)"),
                               ("request_rate", "serving_rate.png", "request rate (req/s, Poisson)")):
        series = []
        for ti, t in enumerate(targets):
            pts = [p for p in t.get("scenarios", {}).get("serving", {}).get("points", []) if key in p]
            pts = [p for p in pts if isinstance(p[key], (int, float)) and math.isfinite(p[key])]
            if pts:
                series.append((ti, t["label"], pts))
        if not series:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ti, label, pts in series:
            xs = [p[key] for p in pts]
            axes[0].plot(xs, [p["summary"]["output_throughput"] or 0 for p in pts], marker="o",
                         color=cmap(ti), linestyle=styles[ti % len(styles)], label=label)
            axes[1].plot(xs, [p["summary"]["tpot_ms"]["mean"] or float("nan") for p in pts], marker="o",
                         color=cmap(ti), linestyle=styles[ti % len(styles)], label=label)
        for ax, yl in zip(axes, ("output tok/s (all requests)", "mean TPOT (ms)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(yl)
            if key == "concurrency":
                from matplotlib.ticker import NullFormatter, ScalarFormatter
                ax.set_xscale("log", base=2)
                ax.set_xticks(sorted({p[key] for _, _, pts in series for p in pts}))
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("serving: throughput and per-token latency")
        fig.tight_layout()
        path = d / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # overview of the four user scenarios: average output speed and mean TTFT, per target
    scen = [n for n in names if n != "serving"]
    if scen:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        width = 0.8 / max(1, len(targets))
        for ti, t in enumerate(targets):
            speed, ttft = [], []
            for n in scen:
                pts = t.get("scenarios", {}).get(n, {}).get("points", [])
                s = pts[0]["summary"] if pts else None
                speed.append((s and s["output_speed_tok_s"]["mean"]) or 0)
                ttft.append((s and s["ttft_ms"]["mean"]) or 0)
            xs = [i + (ti - (len(targets) - 1) / 2) * width for i in range(len(scen))]
            axes[0].bar(xs, speed, width, label=t["label"], color=cmap(ti))
            axes[1].bar(xs, ttft, width, label=t["label"], color=cmap(ti))
        for ax, yl in zip(axes, ("average output speed per request (tok/s)", "mean TTFT (ms)")):
            ax.set_xticks(range(len(scen)))
            ax.set_xticklabels(scen)
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        fig.suptitle("scenarios")
        fig.tight_layout()
        path = d / "scenarios_overview.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
