"""How many prompt tokens a step that also decodes may carry: sized from measured step times.

A fixed token budget (`--prefill-budget 64`) bounds how long a stream waits behind a burst of prompts
in tokens, but what a user feels is time: 64 prompt tokens cost ~25 ms on one machine and 200 ms on
another (or on the same one with a busy neighbour). The pacer keeps the inter-token latency of the
running streams within `factor` times what a step without prompt work takes, by measuring both:

* `decode_s`: the median of the last `window` steps that only decoded (no prompt tokens), and
* `per_token_s`: what the prompt tokens added to the last `window` steps that carried some, per token:
  sum(step time - decode_s) / sum(tokens),

and hands out `(factor - 1) * decode_s / per_token_s` tokens (at least `floor`, at most `ceiling`).

Why windows and not running averages (measured in `serve` on the 2-core CPU, 31 prompts arriving beside
one stream): the decode-only steps right before a burst are slowed by the burst's own arrival (HTTP
parsing, admission: 13-17 ms against 8 ms), and a running average weighted to the newest took the
baseline from 8.1 to 11.9 ms, so every step of the burst was allowed 1.5x too much prompt work (a median
gap of 2.8x the idle one where the engine alone held 1.7x). A median ignores a few such steps. And a
per-step estimate (step - decode_s) / tokens divides one step's noise by its token count: one slow
one-token step read as 40 ms per token, one quick step as 1.5 ms, and the budget swung between the floor
and 6x it; sums over a window weigh each step by its tokens.

The cost of prompt tokens is not proportional to their number (the first one adds a sequence to the
step, with its own attention); the estimate is the average cost per token at the budgets actually
handed out, which is what the next step will carry, so the fixed point is still a step of `factor`
decode steps. Until the decode cost is measured the pacer hands out `initial`; once it is, and before
any prompt token was, `probe` (a first step of 64 prompt tokens beside a stream costs ~15-50 decode
steps). Prompt work never starves: every step that has a prompt waiting carries at least `floor`
tokens of it.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class PrefillPacer:
    factor: float = 2.5        # a decoding step with prompt work takes at most this many decode steps' time
    initial: int = 16          # tokens per step before anything was measured
    probe: int = 4             # tokens per step once the decode cost is known, before a prompt token's is
    floor: int = 1
    ceiling: int = 512
    window: int = 16           # steps of each kind the estimates are taken over
    _decode: deque[float] = field(default_factory=deque, repr=False)
    _mixed: deque[tuple[float, int]] = field(default_factory=deque, repr=False)   # (extra seconds, tokens)

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"the pacing factor must be > 1, got {self.factor}")
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor}, {self.ceiling}")
        if self.window < 1:
            raise ValueError(f"the window must be >= 1 step, got {self.window}")

    @property
    def decode_s(self) -> float | None:
        """What a step that only decodes takes now (median of the recent ones); None before one ran."""
        return statistics.median(self._decode) if self._decode else None

    @property
    def per_token_s(self) -> float | None:
        """What one prompt token adds to a decoding step (over the recent steps that carried some)."""
        tokens = sum(n for _, n in self._mixed)
        return max(sum(x for x, _ in self._mixed) / tokens, 1e-6) if tokens else None

    def budget(self) -> int:
        """Prompt tokens for the next step that also decodes."""
        decode_s, per_token_s = self.decode_s, self.per_token_s
        if decode_s is None:
            tokens = self.initial
        elif per_token_s is None:
            tokens = min(self.initial, self.probe)
        else:
            tokens = int((self.factor - 1) * decode_s / per_token_s + 1e-6)   # 9.99999 (rounding) is 10
        return max(self.floor, min(self.ceiling, tokens))

    def observe(self, decoded: bool, prompt_tokens: int, seconds: float) -> None:
        """One engine step: whether it decoded, how many prompt tokens it computed, how long it took."""
        if not decoded or seconds <= 0:
            return   # a prefill-only step says nothing about what a stream waits for
        if prompt_tokens == 0:
            self._push(self._decode, seconds)
        elif self._decode:
            self._push(self._mixed, (max(seconds - statistics.median(self._decode), 0.0), prompt_tokens))

    def _push(self, q: deque, item: object) -> None:
        q.append(item)
        if len(q) > self.window:
            q.popleft()
