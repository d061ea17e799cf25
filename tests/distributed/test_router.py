"""The router's choices, on prompt keys built as the ingress builds them (engine block hashes)."""
from __future__ import annotations

import pytest

from slipstream.distributed.prompt_key import key_of_tokens
from slipstream.distributed.router import Router
from slipstream.kv.prefix_cache import block_hash

BS = 16


def ready(router: Router) -> Router:
    for i in range(len(router.replicas)):
        router.set_ready(i, True, generation="g0")
    return router


def send(router: Router, ids: list[int]) -> int:
    key = key_of_tokens(ids, BS)
    d = router.choose(key)
    assert d is not None
    router.started(d, key)
    router.finished(d, key)
    return d.replica


def test_key_uses_the_engine_chained_block_hashes():
    ids = list(range(40))
    key = key_of_tokens(ids, BS)
    h0 = block_hash(None, ids[:16])
    assert key.blocks == (h0, block_hash(h0, ids[16:32]))
    assert key_of_tokens(ids, BS).whole == key.whole
    assert key_of_tokens(ids[:39], BS).whole != key.whole     # the partial block counts for identity


def test_a_conversation_stays_on_one_replica_and_new_ones_spread():
    r = ready(Router(3, "cache-aware"))
    conv_a, conv_b = list(range(100, 164)), list(range(500, 564))
    first_a = send(r, conv_a)
    first_b = send(r, conv_b)
    assert first_a != first_b                          # nothing cached anywhere: in turn
    for turn in range(3):                              # every later turn extends the history
        conv_a += list(range(1000 + 40 * turn, 1040 + 40 * turn))
        conv_b += list(range(3000 + 40 * turn, 3040 + 40 * turn))
        assert send(r, conv_a) == first_a
        assert send(r, conv_b) == first_b


def test_a_shared_system_prompt_alone_does_not_pull_new_conversations_together():
    r = ready(Router(2, "cache-aware"))
    system = list(range(16))                           # one block shared by every conversation
    homes = {send(r, system + list(range(1000 * c, 1000 * c + 96))) for c in range(1, 5)}
    assert homes == {0, 1}
    r = ready(Router(2, "cache-aware"))                # exactly a quarter of the blocks shared: still new
    homes = {send(r, system + list(range(1000 * c, 1000 * c + 48))) for c in range(1, 5)}
    assert homes == {0, 1}


def test_load_bound_falls_back_to_the_least_loaded():
    r = ready(Router(2, "cache-aware", load_threshold=2))
    conv = list(range(64))
    home = send(r, conv)
    keys = [key_of_tokens(conv + [900 + i] * 20, BS) for i in range(4)]
    decisions = []
    for k in keys:                                     # in flight together, all extending `conv`
        d = r.choose(k)
        assert d is not None
        r.started(d, k)
        decisions.append(d)
    assert [d.replica for d in decisions[:3]] == [home] * 3
    assert decisions[3].replica != home and decisions[3].reason == "load-bound"


def test_identical_requests_in_flight_share_a_replica_past_the_load_bound():
    r = ready(Router(2, "cache-aware", load_threshold=0))
    key = key_of_tokens(list(range(10)), BS)           # shorter than one block: only its identity
    first = r.choose(key)
    assert first is not None
    r.started(first, key)
    again = r.choose(key)
    assert again is not None and again.replica == first.replica and again.reason == "identical"


def test_round_robin_and_least_loaded():
    rr = ready(Router(3, "round-robin"))
    assert [send(rr, [1] * 40) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = ready(Router(2, "least-loaded"))
    key = key_of_tokens([5] * 40, BS)
    d = ll.choose(key)
    assert d is not None
    ll.started(d, key)
    d2 = ll.choose(key)
    assert d2 is not None and d2.replica != d.replica


def test_unready_replicas_are_skipped_and_a_restart_forgets_the_cache():
    r = ready(Router(2, "cache-aware"))
    conv = list(range(64))
    home = send(r, conv)
    r.set_ready(home, False)
    assert send(r, conv) != home
    assert r.choose(key_of_tokens(conv, BS), exclude=[1 - home]) is None   # nothing left
    r.set_ready(home, True, generation="g1")           # came back as a new process
    assert len(r.replicas[home].hashes) == 0
    r.set_ready(1 - home, False)
    assert send(r, conv) == home


def test_bad_settings():
    with pytest.raises(ValueError):
        Router(2, "random")
    with pytest.raises(ValueError):
        Router(0)
