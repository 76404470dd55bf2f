"""``DPBalancer``: least-loaded and prefix routing over data-parallel engines, and engine death."""

from __future__ import annotations

import collections
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.core.prefix_cache import update_block_hashes
from jaxpaged.engine_core.dp_balancer import DPBalancer, NoHealthyEngineError

BLOCK = 4


def _prompt(family: int, suffix: int, prefix_len: int = 2 * BLOCK) -> list[int]:
    return [family + 1] * prefix_len + [1000 + suffix, 7, 7]


def test_least_loaded_picks_the_engine_with_fewest_outstanding_requests():
    balancer = DPBalancer(3)
    assert [balancer.add_request(f"r{i}") for i in range(3)] == [0, 1, 2]
    balancer.finish_request("r1")
    assert balancer.num_outstanding == [1, 0, 1]
    assert balancer.add_request("r3") == 1
    balancer.add_request("r4")  # all tied at 2 after r3: round robin goes on after engine 1
    assert balancer.engine_of("r4") == 2
    balancer.check_invariants()


def test_ties_rotate_when_requests_finish_before_the_next_arrives():
    balancer = DPBalancer(3)
    engines = []
    for i in range(7):
        engines.append(balancer.add_request(f"r{i}"))
        balancer.finish_request(f"r{i}")
    assert engines == [0, 1, 2, 0, 1, 2, 0]
    assert balancer.num_routed == [3, 2, 2]


def test_prefix_routing_sends_a_shared_prefix_to_one_engine_and_spreads_families():
    balancer = DPBalancer(4, routing="prefix", block_size=BLOCK, prefix_blocks=2)
    by_family = collections.defaultdict(set)
    for family in range(40):
        for suffix in range(3):
            by_family[family].add(balancer.choose(_prompt(family, suffix)))
    assert all(len(engines) == 1 for engines in by_family.values())
    # 40 families over 4 engines by a uniform hash: every engine gets some.
    assert {next(iter(e)) for e in by_family.values()} == {0, 1, 2, 3}


def test_prefix_key_is_the_prefix_caches_block_hash():
    balancer = DPBalancer(2, routing="prefix", block_size=BLOCK, prefix_blocks=2)
    tokens = list(range(3 * BLOCK + 1))
    seq = types.SimpleNamespace(token_ids=tokens, block_hashes=[], block_hash_extra_keys=("lora",))
    hashes = update_block_hashes(seq, BLOCK)
    assert balancer.prefix_key(tokens, ("lora",)) == hashes[1]
    assert balancer.prefix_key(tokens[: BLOCK + 2], ("lora",)) == hashes[0]
    assert balancer.prefix_key(tokens[: BLOCK - 1]) is None


def test_prefix_routing_balances_prompts_without_a_full_block_by_load():
    balancer = DPBalancer(2, routing="prefix", block_size=BLOCK)
    assert balancer.add_request("a", [1, 2]) == 0
    assert balancer.add_request("b", [1, 2]) == 1


def test_balance_threshold_overrides_prefix_affinity_when_one_engine_is_swamped():
    balancer = DPBalancer(2, routing="prefix", block_size=BLOCK, balance_threshold=2)
    prompt = _prompt(0, 0)
    home = balancer.choose(prompt)
    engines = [balancer.add_request(f"r{i}", prompt) for i in range(5)]
    # Affinity holds until home has 3 more outstanding than the other engine.
    assert engines == [home, home, home, 1 - home, home]


def test_lora_name_separates_prefix_keys():
    balancer = DPBalancer(2, routing="prefix", block_size=BLOCK)
    prompt = _prompt(0, 0)
    assert balancer.prefix_key(prompt, ("a",)) != balancer.prefix_key(prompt)


def test_dead_engine_is_skipped_and_returns_its_requests():
    balancer = DPBalancer(3)
    for i in range(6):
        balancer.add_request(f"r{i}")
    assert balancer.mark_dead(1) == ["r1", "r4"]
    assert balancer.healthy == [True, False, True]
    assert balancer.engine_of("r1") is None
    assert balancer.finish_request("r1") is None  # failing it later is harmless
    assert {balancer.add_request(f"n{i}") for i in range(4)} == {0, 2}
    balancer.mark_alive(1)
    assert balancer.add_request("back") == 1  # it is the least loaded now
    balancer.check_invariants()


def test_all_engines_dead_is_a_clear_error():
    balancer = DPBalancer(2, routing="prefix", block_size=BLOCK)
    balancer.mark_dead(0)
    balancer.mark_dead(1)
    with pytest.raises(NoHealthyEngineError, match="all 2 data-parallel engines are dead"):
        balancer.add_request("r", _prompt(0, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_engines=0), "data_parallel_size must be at least 1, got 0"),
        (dict(num_engines=2, routing="random"), "dp_routing must be one of"),
        (dict(num_engines=2, block_size=0), "block_size must be at least 1, got 0"),
        (dict(num_engines=2, prefix_blocks=0), "prefix_blocks must be at least 1, got 0"),
        (dict(num_engines=2, balance_threshold=-1), "balance_threshold must be >= 0"),
    ],
)
def test_bad_arguments_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPBalancer(**kwargs)


def test_misuse_raises():
    balancer = DPBalancer(2)
    balancer.add_request("r")
    with pytest.raises(ValueError, match="'r' is already outstanding on engine 0"):
        balancer.add_request("r")
    with pytest.raises(ValueError, match=r"engine must be in \[0, 2\), got 5"):
        balancer.mark_dead(5)


@settings(max_examples=60, deadline=None)
@given(
    num_engines=st.integers(2, 6),
    keys=st.lists(st.integers(0, 10_000), min_size=1, max_size=40, unique=True),
    dead=st.integers(0, 5),
)
def test_a_dead_engine_moves_only_its_own_prefix_keys(num_engines, keys, dead):
    dead %= num_engines
    balancer = DPBalancer(num_engines, routing="prefix", block_size=BLOCK)
    prompts = [[key] * BLOCK for key in keys]
    before = [balancer.choose(p) for p in prompts]
    balancer.mark_dead(dead)
    during = [balancer.choose(p) for p in prompts]
    for old, new in zip(before, during, strict=True):
        assert new == old if old != dead else new != dead
    balancer.mark_alive(dead)
    assert [balancer.choose(p) for p in prompts] == before


@settings(max_examples=60, deadline=None)
@given(
    num_engines=st.integers(1, 4),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "finish", "dead", "alive"]), st.integers(0, 30)),
        max_size=60,
    ),
)
def test_least_loaded_invariants_under_any_sequence_of_events(num_engines, ops):
    balancer = DPBalancer(num_engines)
    for op, n in ops:
        if op == "add":
            if not any(balancer.healthy):
                with pytest.raises(NoHealthyEngineError):
                    balancer.choose()
                continue
            if balancer.engine_of(f"r{n}") is not None:
                continue
            load = balancer.num_outstanding
            fewest = min(load[i] for i in range(num_engines) if balancer.healthy[i])
            engine = balancer.add_request(f"r{n}")
            assert balancer.healthy[engine] and load[engine] == fewest
        elif op == "finish":
            balancer.finish_request(f"r{n}")
        elif op == "dead":
            balancer.mark_dead(n % num_engines)
        else:
            balancer.mark_alive(n % num_engines)
        balancer.check_invariants()
