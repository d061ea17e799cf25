"""Output processing: what a sampled token does to its request, and the events callers stream.

For each new token `OutputProcessor.append` records it (and its logprobs), advances the grammar,
decides whether the request stops (end of sequence, a stop token, a stop string, a complete
grammar, `max_tokens`, the context), detokenizes it, and returns the text that became final: stop
strings are never part of the text, and a tail that could still become one is held back until it
cannot. Each event goes to the request itself (unless its caller left) and a copy to every request
merged into it (see merging.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from slipstream.engine.request import Request
from slipstream.engine.sampling import TokenLogprobs


@dataclass
class StepEvent:
    request: Request
    text: str              # newly final text (stop strings are never part of it)
    token_ids: list[int]   # tokens added to the output by this event
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when asked for


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, r: Request, tok: int, lp: TokenLogprobs | None, now: float) -> list[StepEvent]:
        """Add one sampled token to `r`; the events it produces."""
        p = r.params
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        r.output_ids.append(tok)
        r.metrics.num_output_tokens += 1
        if lp is not None:
            r.logprobs.append(lp)
        if r.matcher is not None:
            r.matcher.accept(tok)
        if ((tok in self.tokenizer.eos_token_ids and (not p.ignore_eos or r.matcher is not None))
                or tok in (p.stop_token_ids or ())):
            r.finish_reason = "stop"
        else:
            before = len(r.text)
            r.text += r.detok.add(tok)
            check_stop_strings(r, before)
            if r.finish_reason is None and r.matcher is not None and r.matcher.finished:
                r.finish_reason = "stop"   # the grammar is complete and allows nothing more
        if r.finish_reason is None and (len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len):
            r.finish_reason = "length"
        return emit(r, final_text(r, now), [tok], [lp] if lp is not None else [])

    @staticmethod
    def finish(r: Request, reason: str, now: float) -> list[StepEvent]:
        """End `r` without a new token (e.g. it has filled the whole KV cache): its last text."""
        r.finish_reason = reason
        return emit(r, final_text(r, now), [], [])


def final_text(r: Request, now: float) -> str:
    """Text that became final with this event (flushes the detokenizer when the request ends)."""
    if r.finished:
        if r.finish_reason == "length":
            before = len(r.text)
            r.text += r.detok.flush()
            check_stop_strings(r, before)
        r.metrics.finished = now
    end = len(r.text) if r.finished else len(r.text) - held_back(r)
    delta = r.text[r.emitted:end] if end > r.emitted else ""
    r.emitted = max(r.emitted, end)
    return delta


def emit(r: Request, text: str, toks: list[int], lps: list[TokenLogprobs]) -> list[StepEvent]:
    """The event for the request itself (unless its caller left) and a copy for each follower."""
    out = [] if r.detached else [StepEvent(r, text, toks, lps)]
    for f in r.followers:
        mirror(r, f)
        out.append(StepEvent(f, text, list(toks), list(lps)))
    return out


def mirror(r: Request, f: Request) -> None:
    """Give follower `f` the output of the request it is merged into."""
    f.output_ids, f.logprobs = r.output_ids, r.logprobs   # shared: the same tokens
    f.text, f.emitted, f.finish_reason = r.text, r.emitted, r.finish_reason
    # a follower that joined late got its first tokens when it joined, not before it arrived
    now = time.perf_counter()
    if f.metrics.first_token is None and r.metrics.first_token is not None:
        f.metrics.first_token = max(r.metrics.first_token, f.metrics.arrival)
    if f.metrics.scheduled is None:
        f.metrics.scheduled = min(now, max(r.metrics.scheduled or now, f.metrics.arrival))
    if r.metrics.finished is not None:
        f.metrics.finished = max(r.metrics.finished, f.metrics.arrival)
    f.metrics.num_output_tokens = r.metrics.num_output_tokens


def check_stop_strings(r: Request, before: int) -> None:
    """Cut `r.text` at the first stop string that ends after `before` (the text before it was checked)."""
    for s in r.params.stop or ():
        i = r.text.find(s, max(0, before - len(s) + 1))
        if i >= 0:
            r.text = r.text[:i]
            r.finish_reason = "stop"
            before = min(before, i)


def held_back(r: Request) -> int:
    """Length of the text's tail that could still become a stop string: not streamed yet."""
    held = 0
    for s in r.params.stop or ():
        for k in range(min(len(s) - 1, len(r.text)), held, -1):
            if r.text.endswith(s[:k]):
                held = k
                break
    return held
