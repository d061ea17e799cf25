"""The replicas' Prometheus texts as one: every sample once per replica (with a `replica` label)
and once summed over the replicas (without it), so the single server's dashboards and queries keep
working and a replica can still be told apart. Gauges that are fractions (`*_perc`) are averaged
instead of summed. Parsed with prometheus_client's own text parser.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _value(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if v == float("-inf"):
        return "-Inf"
    return repr(float(v))


def aggregate(texts: dict[int, str], extra: str = "") -> str:
    """`texts`: replica index -> its /metrics text (missing replicas are simply absent).
    `extra`: more exposition text (the router's own metrics) appended as it is."""
    docs: OrderedDict[str, tuple[str, str]] = OrderedDict()     # family -> (type, help)
    per: OrderedDict[str, list[str]] = OrderedDict()            # family -> per-replica sample lines
    totals: OrderedDict[str, OrderedDict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = OrderedDict()
    for index in sorted(texts):
        for fam in text_string_to_metric_families(texts[index]):
            docs.setdefault(fam.name, (fam.type, fam.documentation))
            lines = per.setdefault(fam.name, [])
            sums = totals.setdefault(fam.name, OrderedDict())
            for s in fam.samples:
                labels = tuple(sorted(s.labels.items()))
                lines.append(f"{s.name}{_labels(labels + (('replica', str(index)),))} {_value(s.value)}")
                sums.setdefault((s.name, labels), []).append(s.value)
    out: list[str] = []
    for name, (typ, doc) in docs.items():
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {typ}")
        for (sample, labels), values in totals[name].items():
            if name.endswith("_created"):   # creation times: per replica only
                break
            v = sum(values) / len(values) if name.endswith("_perc") else sum(values)
            out.append(f"{sample}{_labels(labels)} {_value(v)}")
        out.extend(per[name])
    text = "\n".join(out) + ("\n" if out else "")
    return text + extra
