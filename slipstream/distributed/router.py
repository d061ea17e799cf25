"""Which replica serves a request.

    round-robin    replicas in turn
    least-loaded   the replica with the fewest requests in flight (ties in turn)
    cache-aware    the replica most likely to hold the prompt's prefix in its KV cache, with a load bound

Cache-aware routing keeps, per replica, the chained hashes of the KV blocks of every prompt routed
to it (an LRU set: the same hashes `kv.prefix_cache` registers, so a hash names a whole prefix). A
request's prompt is walked block by block; the replica holding the longest run of leading blocks
wins. When the best match covers at most `min_match` of the prompt's blocks (a new conversation
that shares only a system prompt with others), or when the winner has more than `load_threshold`
requests in flight beyond the least loaded replica, it goes to the least loaded one instead (in
turn among equals, so new conversations spread over the replicas).
Identical prompts in flight go to the replica already running one, even past the load bound, so
the engine's request merging still computes them once. A replica that restarts (a new generation)
has its hashes forgotten: its cache is empty.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

POLICIES = ("cache-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the router sees it: the chained hashes of its full KV blocks, and one hash of the
    whole prompt (its partial last block included) for recognising identical requests."""
    blocks: tuple[int, ...]
    whole: int


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str              # "prefix", "identical", "no-prefix", "load-bound", "round-robin", "least-loaded"
    matched_blocks: int = 0


@dataclass
class ReplicaState:
    index: int
    ready: bool = False
    generation: str | None = None     # changes when the replica restarts
    inflight: int = 0
    routed: int = 0
    hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)


class Router:
    def __init__(self, num_replicas: int, policy: str = "cache-aware", load_threshold: int = 4,
                 min_match: float = 0.25, max_hashes: int = 1 << 16):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(POLICIES)})")
        if num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        if load_threshold < 0:
            raise ValueError("the load threshold must be >= 0")
        self.policy = policy
        self.load_threshold = load_threshold
        self.min_match = min_match
        self.max_hashes = max_hashes
        self.replicas = [ReplicaState(i) for i in range(num_replicas)]
        self._turn = 0
        self._identical: dict[int, tuple[int, int]] = {}   # whole-prompt hash -> (replica, requests in flight)

    # -- replica health ----------------------------------------------------------------------------
    def set_ready(self, index: int, ready: bool, generation: str | None = None) -> None:
        r = self.replicas[index]
        if generation is not None and generation != r.generation:
            if r.generation is not None:      # restarted: whatever it had cached is gone
                r.hashes.clear()
            r.generation = generation
        r.ready = ready

    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas)

    # -- choosing -------------------------------------------------------------------------------
    def choose(self, key: PromptKey | None, exclude: Sequence[int] = ()) -> Decision | None:
        """The replica for a request (None: no ready replica outside `exclude`). Call `started` with
        the decision once the request is sent, and `finished` when it is over."""
        cands = [r for r in self.replicas if r.ready and r.index not in exclude]
        if not cands:
            return None
        if self.policy == "round-robin":
            return Decision(self._in_turn(cands).index, "round-robin")
        least = self._least_loaded(cands)
        if self.policy == "least-loaded" or key is None:
            return Decision(least.index, "least-loaded")
        same = self._identical.get(key.whole)
        if same is not None and any(r.index == same[0] for r in cands):
            return Decision(same[0], "identical", len(key.blocks))
        best, matched = least, 0
        for r in cands:
            m = self._matched(r, key.blocks)
            if m > matched or (m == matched and m > 0 and r.inflight < best.inflight):
                best, matched = r, m
        if matched == 0 or matched <= self.min_match * len(key.blocks):
            return Decision(least.index, "no-prefix", matched)
        if best.inflight - least.inflight > self.load_threshold:
            return Decision(least.index, "load-bound", matched)
        return Decision(best.index, "prefix", matched)

    def started(self, decision: Decision, key: PromptKey | None) -> None:
        r = self.replicas[decision.replica]
        r.inflight += 1
        r.routed += 1
        if key is None or self.policy != "cache-aware":
            return
        for h in key.blocks:          # what this replica will hold once the prompt is prefilled
            r.hashes[h] = None
            r.hashes.move_to_end(h)
        while len(r.hashes) > self.max_hashes:
            r.hashes.popitem(last=False)
        replica, n = self._identical.get(key.whole, (decision.replica, 0))
        if replica == decision.replica:
            self._identical[key.whole] = (replica, n + 1)

    def finished(self, decision: Decision, key: PromptKey | None) -> None:
        r = self.replicas[decision.replica]
        r.inflight = max(0, r.inflight - 1)
        if key is not None and key.whole in self._identical:
            replica, n = self._identical[key.whole]
            if replica == decision.replica:
                if n <= 1:
                    del self._identical[key.whole]
                else:
                    self._identical[key.whole] = (replica, n - 1)

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _matched(r: ReplicaState, blocks: Sequence[int]) -> int:
        n = 0
        for h in blocks:
            if h not in r.hashes:
                break
            n += 1
        return n

    def _in_turn(self, cands: list[ReplicaState]) -> ReplicaState:
        """The first candidate at or after the turn pointer, which then moves past it."""
        n = len(self.replicas)
        order = sorted(cands, key=lambda r: (r.index - self._turn) % n)
        self._turn = (order[0].index + 1) % n
        return order[0]

    def _least_loaded(self, cands: list[ReplicaState]) -> ReplicaState:
        low = min(r.inflight for r in cands)
        return self._in_turn([r for r in cands if r.inflight == low])
