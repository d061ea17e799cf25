"""The megakernel's scheduling protocol under adversarial interleavings, on the real plan tables.

The interpreter runs programs one after another, so the kernel's tests never see two programs
interleave. Here a step-by-step model of `_megakernel`'s loop (ticket = atomic_add on the queue
counter minus the epoch's base, the next one drawn as a task begins, before its wait; acquire-poll
the wait event against count x epoch with a spin bound;
run; release-signal, or for an attention split an acq_rel count whose result elects the group's last
split, which then merges the group and signals the row's AUX event; the error word: first failure wins,
the others drain) is driven by a seeded
random scheduler: any runnable program may take the next atomic, programs start late, and a task
may take a random time. Checked on plans from `compile_plan` at real and small shapes: no hang,
every task exactly once per step, every producer finished before its consumer started; a dropped
signal ends in the error word with the first waiting task named, and a relaunch after `reset`
(zeroed counters, epoch 1) completes the step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from slipstream.models.random_init import shape_config
from slipstream.runtime.megakernel import default_tiles, epoch_limit
from slipstream.runtime.plan import AUX, OP, SIG_EV, WAIT_COUNT, WAIT_EV, Op, TileConfig, WeightLayout, compile_plan


@dataclass
class _Program:
    pid: int
    state: str = "ticket"     # ticket -> take -> ahead -> wait -> run -> signal [-> merge -> merged] -> take
                              # ... -> done
    task: int = -1
    pending: int = -1         # the ticket drawn ahead (`TICKET_AHEAD`): the program's next task
    spins: int = 0
    work_left: int = 0
    started: int = 0          # the global step at which it starts at all (a late program)


@dataclass
class _Device:
    """The sync buffer of `_megakernel`: event counters, the ticket counter, the error word."""
    num_events: int
    events: list[int] = field(default_factory=list)
    queue: int = 0
    error: int = 0

    def __post_init__(self) -> None:
        self.events = [0] * self.num_events

    def reset(self) -> None:
        self.events = [0] * self.num_events
        self.queue = 0
        self.error = 0


def run_step(rows: list[list[int]], dev: _Device, epoch: int, programs: int, rng: random.Random,
             max_spins: int = 10_000, drop_signal_of: int | None = None) -> dict:
    """One launch: interleaves the programs' atomic steps at random until all have exited.
    Returns the execution order, start and end clock of every task, the merges (split task -> start
    and end clock) and the error word."""
    n = len(rows)
    signallers: dict[int, int] = {}
    for r in rows:
        signallers[r[SIG_EV]] = signallers.get(r[SIG_EV], 0) + 1
    merges: dict[int, tuple[int, int]] = {}
    base = (epoch - 1) * (n + programs)
    progs = [_Program(p, started=rng.randrange(0, 50)) for p in range(programs)]
    clock = 0
    runs: list[int] = []
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    while any(p.state != "done" for p in progs):
        clock += 1
        assert clock < 50 * (n + programs) * (max_spins + 10), "the step hangs"
        live = [p for p in progs if p.state != "done" and p.started <= clock]
        if not live:
            continue
        p = rng.choice(live)          # any program may take the next atomic: arbitrary interleaving
        if p.state == "ticket":       # the program's first ticket
            p.pending = dev.queue - base
            dev.queue += 1
            p.state = "take"
        elif p.state == "take":
            i = p.pending
            if i < 0:
                dev.error = dev.error or -1
                p.state = "done"
            elif i >= n:
                p.state = "done"
            else:
                p.task, p.spins, p.state = i, 0, "ahead"
        elif p.state == "ahead":      # the next ticket, drawn before this task waits or runs
            p.pending = dev.queue - base
            dev.queue += 1
            i = p.task
            p.state = "wait" if rows[i][WAIT_EV] >= 0 else "run"
            if p.state == "run":
                start[i] = clock
                p.work_left = rng.randrange(1, 4)
        elif p.state == "wait":
            r = rows[p.task]
            if dev.events[r[WAIT_EV]] >= r[WAIT_COUNT] * epoch:
                start[p.task] = clock
                p.state, p.work_left = "run", rng.randrange(1, 4)
            else:
                p.spins += 1
                if dev.error or p.spins >= max_spins:   # gives up: records the first failure only
                    if not dev.error and p.spins >= max_spins:
                        dev.error = p.task + 1
                    p.state = "done"
        elif p.state == "run":
            p.work_left -= 1
            if p.work_left <= 0:
                p.state = "signal"
        elif p.state == "signal":
            i = p.task
            runs.append(i)
            end[i] = clock
            p.state = "take"
            if i != drop_signal_of:
                old = dev.events[rows[i][SIG_EV]]
                dev.events[rows[i][SIG_EV]] += 1
                # a split's count returns the old value: the one that completes it merges the group
                if rows[i][OP] == Op.ATTN_SPLIT and old == signallers[rows[i][SIG_EV]] * epoch - 1:
                    merges[i] = (clock, clock)
                    p.state, p.work_left = "merge", rng.randrange(1, 4)
        elif p.state == "merge":
            p.work_left -= 1
            if p.work_left <= 0:
                p.state = "merged"
        elif p.state == "merged":
            merges[p.task] = (merges[p.task][0], clock)
            dev.events[rows[p.task][AUX]] += 1
            p.state = "take"
    return {"runs": runs, "start": start, "end": end, "merges": merges, "error": dev.error}


def _check_order(rows: list[list[int]], res: dict) -> None:
    """Every task once; every split group merged once, by one of its splits, after all of them ended;
    every task waiting on an event started after all its producers (tasks or merges) ended."""
    assert sorted(res["runs"]) == list(range(len(rows)))
    producers: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        producers.setdefault(r[SIG_EV], []).append(i)
    ends = {e: [res["end"][j] for j in js] for e, js in producers.items()}
    groups = {r[SIG_EV] for r in rows if r[OP] == Op.ATTN_SPLIT}
    assert sorted(rows[i][SIG_EV] for i in res["merges"]) == sorted(groups), "a group merged twice or never"
    for i, (t_start, t_end) in res["merges"].items():
        assert t_start >= max(ends[rows[i][SIG_EV]]), f"split {i} merged before its group's splits ended"
        ends.setdefault(rows[i][AUX], []).append(t_end)
    for i, r in enumerate(rows):
        if r[WAIT_EV] >= 0:
            assert res["start"][i] > max(ends[r[WAIT_EV]]), f"task {i} started before its producer finished"


def _rows(name: str, batch: int, context: int, tiles: TileConfig | None = None) -> list[list[int]]:
    cfg = shape_config(name)
    layout = WeightLayout.for_config(cfg, cfg.tie_word_embeddings)
    tiles = tiles or default_tiles(cfg, context, 132)
    return compile_plan(cfg, batch, context, 16, layout, tiles).tasks.tolist()


@pytest.mark.parametrize("name,batch,context,programs,seed", [
    ("tiny", 2, 64, 3, 0), ("tiny", 4, 64, 7, 1), ("tiny", 1, 64, 64, 2), ("dense-1B", 1, 512, 132, 3),
])
def test_random_interleavings_run_every_task_once_in_order(name, batch, context, programs, seed):
    rng = random.Random(seed)
    tiles = TileConfig(embed=48, o=24, gate_up=48, down=16, lm_head=96, partition=8) if name == "tiny" else None
    rows = _rows(name, batch, context, tiles)
    dev = _Device(max(r[SIG_EV] for r in rows) + 1)
    for epoch in (1, 2, 3):                    # counters carry over: epoch-numbered waits
        res = run_step(rows, dev, epoch, programs, rng)
        assert res["error"] == 0
        _check_order(rows, res)
    counts: dict[int, int] = {}
    for r in rows:
        counts[r[SIG_EV]] = counts.get(r[SIG_EV], 0) + 1
    for e in {(r[SIG_EV], r[AUX]) for r in rows if r[OP] == Op.ATTN_SPLIT}:   # one merge per split group
        counts[e[1]] = counts.get(e[1], 0) + 1
    assert dev.events == [3 * counts.get(e, 0) for e in range(dev.num_events)]
    assert epoch_limit  # the kernel re-zeroes before (tasks + programs) * epoch leaves int32


def test_a_lost_signal_is_reported_and_a_relaunch_recovers():
    rng = random.Random(7)
    rows = _rows("tiny", 2, 64, TileConfig(embed=48, o=24, gate_up=48, down=16, lm_head=96, partition=8))
    dev = _Device(max(r[SIG_EV] for r in rows) + 1)
    victim = next(i for i, r in enumerate(rows) if any(s[WAIT_EV] == r[SIG_EV] for s in rows[i + 1:]))
    res = run_step(rows, dev, 1, 5, rng, max_spins=200, drop_signal_of=victim)
    assert res["error"] > 0
    failed = res["error"] - 1
    assert rows[failed][WAIT_EV] == rows[victim][SIG_EV]          # a consumer of the lost signal
    assert failed not in res["runs"]                              # it did not run on stale data
    # the host's `check` resets the counters; the relaunch is epoch 1 and completes
    dev.reset()
    res = run_step(rows, dev, 1, 5, rng)
    assert res["error"] == 0
    _check_order(rows, res)


def test_a_counter_behind_its_epoch_stops_every_program():
    """A step launched without `check` after a failed one: tickets below the epoch's base."""
    rows = _rows("tiny", 1, 64, TileConfig(embed=48, o=24, gate_up=48, down=16, lm_head=96, partition=8))
    dev = _Device(max(r[SIG_EV] for r in rows) + 1)
    res = run_step(rows, dev, 2, 4, random.Random(3))
    assert res["error"] == -1 and res["runs"] == []
