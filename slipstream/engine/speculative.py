"""Speculative decoding: propose a few tokens cheaply, verify them all in one target step.

A *proposer* guesses up to K next tokens per sequence. The engine runs the target model once over
the last sampled token and the K guesses (K + 1 rows of the same decode step, each row attending to
its own prefix, so the numbers are exactly those of K + 1 ordinary decode steps) and walks the rows:

* greedy requests keep a guess while it equals the target's own choice at that row (penalties
  applied with the history so far); the first disagreement is replaced by the target's token, and
  when every guess passes the last row gives one bonus token. The output is token-for-token the
  output without speculation.
* sampled requests use rejection sampling: a guess d drawn from q is kept with probability
  min(1, p(d) / q(d)), otherwise a token is drawn from the normalised max(0, p - q); a proposer
  that has no distribution (n-gram lookup) is a point mass, q(d) = 1. The output distribution is
  exactly the target's p (Leviathan et al., 2023; Chen et al., 2023).

Rejected guesses leave KV entries past the sequence's length; they are overwritten later and
never registered in the prefix cache (only full blocks of accepted tokens are).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from slipstream.engine.sampling import SamplingParams, apply_penalties, draw, sampling_distribution


class Proposer(Protocol):
    name: str
    k: int

    def propose_batch(self, reqs: list, ks: list[int]) -> tuple[list[list[int]], list[list | None]]:
        """Up to ks[i] guesses for each request, and for each either None (guesses are point
        masses, or the request is greedy) or the distribution [V] each guess was drawn from."""
        ...

    def verified(self, r) -> None:
        """Called after the target has checked r's guesses (r.num_tokens - 1 tokens are in its KV)."""
        ...

    def release(self, request_id: str) -> None:
        """The request is gone: drop whatever the proposer keeps for it."""
        ...


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from n_max down to n_min) and propose what followed it. No weights, no extra compute; it
    pays off whenever the output repeats its input (code edits, summaries, tool-call loops)."""

    name = "ngram"

    def __init__(self, k: int, n_max: int = 4, n_min: int = 1, window: int = 4096):
        if k < 1 or not 1 <= n_min <= n_max:
            raise ValueError("ngram speculation needs k >= 1 and 1 <= n_min <= n_max")
        self.k, self.n_max, self.n_min, self.window = k, n_max, n_min, window

    def propose_batch(self, reqs: list, ks: list[int]) -> tuple[list[list[int]], list[list | None]]:
        return [self.propose(r.all_token_ids, k) if k > 0 else [] for r, k in zip(reqs, ks)], [None] * len(reqs)

    def verified(self, r) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        toks = list(token_ids[-self.window:])
        n_tok = len(toks)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            pattern = toks[n_tok - n:]
            first = pattern[0]
            # latest start i < n_tok - n with toks[i:i+n] == pattern, scanning backwards
            i = n_tok - n - 1
            while i >= 0:
                if toks[i] == first and toks[i:i + n] == pattern:
                    return toks[i + n:i + n + k]
                i -= 1
        return []


@dataclass
class SpecStats:
    """Counters of what speculation drafted and what the target kept."""
    k: int
    drafted: int = 0            # guesses verified
    accepted: int = 0           # guesses kept
    verifications: int = 0      # sequence-steps that carried guesses
    emitted: int = 0            # tokens produced by those sequence-steps (accepted + 1 each, less at a stop)
    accepted_at: list[int] = field(default_factory=list)   # [i]: times the guess at position i was kept

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.k

    @property
    def accepted_tokens_per_step(self) -> float:
        return self.emitted / self.verifications if self.verifications else 0.0


def rejection_sample(p: torch.Tensor, draft: int, q: torch.Tensor | None,
                     gen: torch.Generator | None) -> tuple[int, bool]:
    """Keep `draft` (drawn from q; None = a point mass on it) or replace it, so that the result
    is distributed as p. Returns (token, kept)."""
    pd = float(p[draft])
    qd = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if qd > 0 and u < min(1.0, pd / qd):
        return draft, True
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:     # p == q (up to rounding): any draw from p is right
        residual = p
    return draw(residual, gen), False


def verify_row(row: torch.Tensor, sp: SamplingParams, prompt_ids: list[int], output_ids: list[int],
               gen: torch.Generator | None, draft: int | None,
               q: torch.Tensor | None = None) -> tuple[int, bool, torch.Tensor]:
    """One row of a verification step: (token, draft kept, the penalised logits row).

    With draft None this is an ordinary sample (the bonus row)."""
    row = row.float().clone()
    if sp.has_penalties:
        apply_penalties(row, sp, prompt_ids, output_ids)
    if sp.greedy:
        tok = int(row.argmax())
        return tok, draft is not None and tok == draft, row
    p = sampling_distribution(row, sp)
    if draft is None:
        return draw(p, gen), False, row
    tok, kept = rejection_sample(p, draft, q, gen)
    return tok, kept, row


def make_proposer(spec: str | None, k: int, target=None, tokenizer=None) -> Proposer | None:
    """`ngram`, `draft:MODEL` (a model path or name with the target's vocabulary), or None."""
    if spec is None or spec in ("", "none", "off"):
        return None
    if spec == "ngram":
        return NgramProposer(k)
    if spec == "mtp":
        from slipstream.engine.mtp import MTPProposer

        return MTPProposer(target, k)
    if spec.startswith("draft:"):
        from slipstream.engine.draft import DraftModelProposer
        from slipstream.models import build_model
        from slipstream.weights import load_model

        loaded = load_model(spec[len("draft:"):])
        if target is not None and loaded.config.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size} tokens) differs from the "
                             f"target's ({target.cfg.vocab_size}); a draft must share the tokenizer")
        if tokenizer is not None and set(loaded.tokenizer.eos_token_ids) != set(tokenizer.eos_token_ids):
            raise ValueError("the draft model's end-of-sequence tokens differ from the target's; "
                             "a draft must share the tokenizer")
        return DraftModelProposer(build_model(loaded.config, loaded.weights), k)
    raise ValueError(f"unknown speculative method {spec!r} (ngram, mtp, draft:MODEL)")
