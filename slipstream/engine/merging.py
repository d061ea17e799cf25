"""Request merging: identical deterministic requests in flight share one computation.

Two requests with the same prompt tokens and the same sampling parameters, where sampling is
deterministic (greedy, or seeded), would produce the same tokens. The second one becomes a
*follower* of the first: it is never scheduled, and every event of the first is copied to it
(output.emit). If the first one's caller leaves, the computation goes on for the others.
"""
from __future__ import annotations

from slipstream.engine.output import StepEvent, mirror
from slipstream.engine.request import Request
from slipstream.engine.scheduler import Scheduler


def merge_key(r: Request) -> tuple | None:
    """What identifies identical requests; None when the request cannot be shared (random sampling)."""
    p = r.params
    if not (p.greedy or p.seed is not None):
        return None
    return (tuple(r.prompt_ids), repr(p))


class Merger:
    def __init__(self, scheduler: Scheduler, enabled: bool):
        self.scheduler = scheduler
        self.enabled = enabled
        self.index: dict[tuple, Request] = {}
        self.num_merged = 0

    def primary_for(self, r: Request) -> Request | None:
        """An unfinished request in flight that `r` can follow, if any."""
        key = merge_key(r) if self.enabled else None
        primary = self.index.get(key) if key is not None else None
        return primary if primary is not None and not primary.finished else None

    def add(self, r: Request) -> None:
        """`r` is computed: later identical requests follow it."""
        key = merge_key(r) if self.enabled else None
        if key is not None:
            self.index[key] = r

    def remove(self, r: Request) -> None:
        key = merge_key(r)
        if key is not None and self.index.get(key) is r:
            del self.index[key]

    def follow(self, r: Request, primary: Request) -> StepEvent | None:
        """Merge `r` into `primary`; the event that catches it up with what `primary` has produced so far."""
        r.merged_into = primary
        primary.followers.append(r)
        self.num_merged += 1
        if r.priority < primary.priority:     # the shared computation runs at its best caller's priority
            self.scheduler.reprioritize(primary, r.priority)
        if primary.metrics.scheduled is not None:
            r.metrics.scheduled = max(primary.metrics.scheduled, r.metrics.arrival)
        if not primary.output_ids:
            return None
        mirror(primary, r)
        return StepEvent(r, primary.text[:primary.emitted], list(primary.output_ids),
                         list(primary.logprobs) if primary.params.logprobs is not None else [])

    def leave(self, r: Request) -> Request | None:
        """`r`'s caller left (its finish reason is already set). Returns the request whose computation
        nobody waits for any more, to drop, or None (it goes on for the others)."""
        primary = r.merged_into
        if primary is not None:
            primary.followers.remove(r)
            if primary.detached and not primary.followers:
                return primary
            self.settle_priority(primary)
            return None
        if r.followers:
            r.finish_reason = None          # keeps computing for the followers
            r.detached = True
            self.settle_priority(r)
            return None
        return r

    def settle_priority(self, primary: Request) -> None:
        """A shared computation runs at the best priority among the callers still waiting for it."""
        callers = [f.priority for f in primary.followers] + ([] if primary.detached else [primary.own_priority])
        best = min(callers, default=primary.own_priority)
        if best != primary.priority:
            self.scheduler.reprioritize(primary, best)
