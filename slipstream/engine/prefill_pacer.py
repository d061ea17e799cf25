"""How many prompt tokens a step that also decodes may carry: sized from measured step times.

A fixed token budget (`--prefill-budget 64`) bounds how long a stream waits behind a burst of prompts
in tokens, but what a user feels is time: 64 prompt tokens cost ~25 ms on one machine and 200 ms on
another (or on the same one with a busy neighbour). The pacer keeps the inter-token latency of the
running streams within `factor` times what a step without prompt work takes, by measuring both:

* `decode_s`: an average of recent steps that only decoded (no prompt tokens), and
* `per_token_s`: an average of what each prompt token added to the steps that carried some,
  (step time - decode_s) / tokens,

and hands out `(factor - 1) * decode_s / per_token_s` tokens (at least `floor`, at most `ceiling`).
Until both have been measured it hands out `initial`. Prompt work never starves: every step that has
a prompt waiting carries at least `floor` tokens of it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillPacer:
    factor: float = 2.5        # a decoding step with prompt work takes at most this many decode steps' time
    initial: int = 16          # tokens per step before anything was measured
    floor: int = 1
    ceiling: int = 512
    smoothing: float = 0.25    # weight of the newest observation in the running averages
    decode_s: float | None = None
    per_token_s: float | None = None

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"the pacing factor must be > 1, got {self.factor}")
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor}, {self.ceiling}")

    def budget(self) -> int:
        """Prompt tokens for the next step that also decodes."""
        if self.decode_s is None or self.per_token_s is None:
            return max(self.floor, min(self.ceiling, self.initial))
        tokens = int((self.factor - 1) * self.decode_s / max(self.per_token_s, 1e-9))
        return max(self.floor, min(self.ceiling, tokens))

    def observe(self, decoded: bool, prompt_tokens: int, seconds: float) -> None:
        """One engine step: whether it decoded, how many prompt tokens it computed, how long it took."""
        if not decoded or seconds <= 0:
            return   # a prefill-only step says nothing about what a stream waits for
        if prompt_tokens == 0:
            self.decode_s = self._mix(self.decode_s, seconds)
        elif self.decode_s is not None:
            extra = max(seconds - self.decode_s, 0.0) / prompt_tokens
            self.per_token_s = self._mix(self.per_token_s, max(extra, 1e-6))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
