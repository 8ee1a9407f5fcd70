"""lightning_elastic/training/sampler.py: ElasticSampler covers each sample once per epoch, across resets."""

from __future__ import annotations

import pytest
import torch

from lightning_elastic.protocol import Assignment
from lightning_elastic.training.sampler import ElasticSampler, epoch_batches_done


class FixedWorld:
    """Stands in for an ElasticWorker: the sampler only reads ``worker.assignment``.

    A real ElasticWorker gets its assignment from a launcher's rendezvous (or is a world of
    one), so a multi-rank world cannot be built in one process without this stand-in.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.assignment = Assignment(1, rank, size, rank, size, 0, 1, "localhost", "127.0.0.1", 0, 0)


def samplers(n: int, world: int, **kwargs) -> list[ElasticSampler]:
    return [ElasticSampler(range(n), worker=FixedWorld(r, world), **kwargs) for r in range(world)]


def real_items(sampler: ElasticSampler, share: list[int]) -> list[int]:
    """The share without its padding repeat (real_in_batch of one batch holding the whole share)."""
    return share[: sampler.real_in_batch(0, max(len(share), 1))]


def run_pass(group: list[ElasticSampler]) -> list[list[int]]:
    return [list(iter(s)) for s in group]


SIZES = [1, 2, 7, 10, 23, 64]
WORLDS = [1, 2, 3, 4, 8]


# ----- one epoch -----------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("shuffle", [True, False])
def test_one_epoch_covers_every_index_exactly_once(n, world, shuffle):
    group = samplers(n, world, shuffle=shuffle, seed=11)
    shares = run_pass(group)
    real = [i for s, share in zip(group, shares) for i in real_items(s, share)]
    assert sorted(real) == list(range(n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_the_same_number_of_samples_with_at_most_one_repeat(n, world):
    group = samplers(n, world)
    shares = run_pass(group)
    per_rank = -(-n // world)
    assert [len(share) for share in shares] == [per_rank] * world
    assert [len(s) for s in group] == [per_rank] * world
    repeats = sum(len(share) - len(real_items(s, share)) for s, share in zip(group, shares))
    assert repeats == per_rank * world - n
    assert repeats <= world - 1
    for share in shares:
        assert set(share) <= set(range(n))


def test_short_ranks_repeat_a_sample_of_the_epoch_and_real_in_batch_excludes_it():
    group = samplers(10, 4, shuffle=False)
    shares = run_pass(group)
    assert [share[:2] for share in shares] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [share[2] for share in shares[:2]] == [8, 9]  # the real final step
    for share in shares[2:]:
        assert share[2] in range(10)  # a repeat, so every rank runs 3 steps
    assert [s.real_in_batch(2, 1) for s in group] == [1, 1, 0, 0]


def test_shuffle_false_gives_strided_natural_order():
    group = samplers(9, 3, shuffle=False)
    assert run_pass(group) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_without_a_worker_or_launcher_it_is_a_world_of_one():
    sampler = ElasticSampler(range(5), shuffle=False)
    assert list(sampler) == [0, 1, 2, 3, 4]
    assert len(sampler) == 5


def test_empty_dataset_yields_nothing():
    sampler = ElasticSampler([], worker=FixedWorld(0, 2))
    assert list(sampler) == [] and len(sampler) == 0


def test_real_in_batch_counts_batches_of_the_share():
    sampler = ElasticSampler(range(10), shuffle=False, worker=FixedWorld(3, 4))
    share = list(sampler)  # 3 positions, the last a repeat
    assert len(share) == 3
    assert [sampler.real_in_batch(b, 2) for b in range(3)] == [2, 0, 0]


# ----- shuffling -----------------------------------------------------------------------


def test_same_seed_and_epoch_give_the_same_order():
    a, b = ElasticSampler(range(50), seed=5), ElasticSampler(range(50), seed=5)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)


def test_order_is_a_permutation_that_differs_from_natural_order():
    order = list(ElasticSampler(range(50), seed=0))
    assert sorted(order) == list(range(50)) and order != list(range(50))


def test_set_epoch_reshuffles():
    sampler = ElasticSampler(range(50), seed=5)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(second) == list(range(50)) and second != first


def test_different_seeds_give_different_orders():
    assert list(ElasticSampler(range(50), seed=1)) != list(ElasticSampler(range(50), seed=2))


def test_order_is_the_documented_permutation_of_seed_plus_epoch():
    sampler = ElasticSampler(range(20), seed=7)
    sampler.set_epoch(2)
    g = torch.Generator()
    g.manual_seed(9)
    assert list(sampler) == torch.randperm(20, generator=g).tolist()


def test_set_epoch_to_the_same_epoch_keeps_progress():
    sampler = ElasticSampler(range(10), shuffle=False)
    list(sampler)
    sampler.record_batch(1, 2)
    sampler.set_epoch(0)
    assert sampler.consumed_total() == 4
    sampler.set_epoch(1)
    assert sampler.consumed_total() == 0 and sampler.epoch == 1


# ----- progress and state --------------------------------------------------------------


def test_record_batch_counts_positions_over_the_whole_world():
    group = samplers(40, 4, seed=3)
    shares = run_pass(group)
    for s in group:
        s.record_batch(2, 3)  # batches 0..2 of 3 samples: 9 per rank
    assert {s.consumed_total() for s in group} == {36}
    consumed = {i for share in shares for i in share[:9]}
    assert consumed == set(group[0]._order()[:36])
    assert group[0].remaining() == group[0]._order()[36:]


def test_consumed_total_never_exceeds_the_dataset():
    group = samplers(10, 4)
    run_pass(group)
    for s in group:
        s.record_batch(0, 3)  # the whole padded pass
    assert group[0].consumed_total() == 10 and group[0].remaining() == []


def test_state_dict_round_trip():
    source = ElasticSampler(range(30), seed=4, worker=FixedWorld(0, 2))
    source.set_epoch(2)
    list(source)
    source.record_batch(3, 2)
    state = source.state_dict()
    assert state == {"epoch": 2, "consumed": 16}
    target = ElasticSampler(range(30), seed=4, worker=FixedWorld(0, 2))
    target.load_state_dict(state)
    assert target.state_dict() == state
    assert target.remaining() == source.remaining()


def test_load_state_dict_discards_progress_not_in_the_state():
    sampler = ElasticSampler(range(30), shuffle=False)
    list(sampler)
    sampler.record_batch(4, 2)
    sampler.load_state_dict({"epoch": 0, "consumed": 4})  # restore an older commit
    assert sampler.consumed_total() == 4
    assert list(sampler) == list(range(4, 30))


def test_len_matches_the_next_pass_after_loading_state():
    sampler = ElasticSampler(range(23), worker=FixedWorld(1, 3))
    sampler.load_state_dict({"epoch": 0, "consumed": 8})
    assert len(sampler) == len(list(sampler)) == 5


def test_fully_consumed_epoch_yields_nothing_until_the_next_epoch():
    sampler = ElasticSampler(range(6), shuffle=False)
    list(sampler)
    sampler.record_batch(2, 2)
    assert list(sampler) == [] and len(sampler) == 0
    sampler.set_epoch(1)
    assert len(list(sampler)) == 6


# ----- world size changes mid-epoch ----------------------------------------------------


@pytest.mark.parametrize("n", [7, 23, 64])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 5), (4, 1), (1, 4), (3, 3)])
@pytest.mark.parametrize(("batch_size", "batches"), [(1, 1), (2, 1), (1, 2), (3, 0)])
def test_world_change_mid_epoch_covers_the_rest_exactly_once(n, before, after, batch_size, batches):
    old = samplers(n, before, seed=21)
    shares = run_pass(old)
    batches = min(batches, len(shares[0]) // batch_size - 1) if len(shares[0]) > batch_size else 0
    done = []
    for s, share in zip(old, shares):
        if batches:
            s.record_batch(batches - 1, batch_size)
        done += share[: batches * batch_size]
    state = old[0].state_dict()  # rank 0's state is synced to every rank of the new world
    assert all(s.state_dict() == state for s in old)

    new = samplers(n, after, seed=21)
    for s in new:
        s.load_state_dict(state)
    rest = [i for s, share in zip(new, run_pass(new)) for i in real_items(s, share)]
    assert sorted(done + rest) == list(range(n))
    assert len(set(done)) == len(done) == state["consumed"]


def test_surviving_sampler_keeps_its_progress_when_the_world_shrinks():
    # Live state (host-change interrupt): the same objects, a smaller world at the next pass.
    n = 30
    worlds = [FixedWorld(r, 3) for r in range(3)]
    group = [ElasticSampler(range(n), seed=8, worker=wk) for wk in worlds]
    shares = run_pass(group)
    for s in group:
        s.record_batch(1, 2)  # 4 samples per rank: positions 0..11
    done = [i for share in shares for i in share[:4]]
    survivors = group[:2]
    for rank, wk in enumerate(worlds[:2]):
        wk.assignment = FixedWorld(rank, 2).assignment  # the worker's new round
    rest_shares = run_pass(survivors)
    rest = [i for s, share in zip(survivors, rest_shares) for i in real_items(s, share)]
    assert sorted(done + rest) == list(range(n))
    # progress of the new pass is counted in the new world
    for s in survivors:
        s.record_batch(0, 3)
    assert survivors[0].consumed_total() == 12 + 6


def test_two_world_changes_in_one_epoch_still_cover_everything_once():
    n = 50
    seen: list[int] = []
    state = {"epoch": 0, "consumed": 0}
    for world, steps in [(4, 3), (2, 5), (3, None)]:
        group = samplers(n, world, seed=2)
        for s in group:
            s.load_state_dict(state)
        shares = run_pass(group)
        if steps is None:  # the last world finishes the epoch
            seen += [i for s, share in zip(group, shares) for i in real_items(s, share)]
            break
        for s, share in zip(group, shares):
            s.record_batch(steps - 1, 1)
            seen += share[:steps]
        state = group[0].state_dict()
    assert state["consumed"] == 4 * 3 + 2 * 5
    assert sorted(seen) == list(range(n))


# ----- epoch length in batches (batch_size given) --------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def test_batches_before_pass_needs_a_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(range(10)).batches_before_pass()


@pytest.mark.parametrize("n", [1, 10, 23])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_with_batch_size_a_fresh_epoch_has_no_batches_behind_it(n, world):
    sampler = ElasticSampler(range(n), worker=FixedWorld(0, world), batch_size=2)
    assert sampler.batches_before_pass() == 0
    assert len(sampler) == len(list(sampler)) == ceil_div(n, world)


@pytest.mark.parametrize(("n", "consumed"), [(23, 6), (23, 12), (64, 40), (10, 9)])
@pytest.mark.parametrize(("world", "batch_size"), [(1, 4), (2, 3), (5, 2)])
def test_epoch_keeps_its_length_in_batches_after_a_world_change(n, consumed, world, batch_size):
    sampler = ElasticSampler(range(n), seed=1, worker=FixedWorld(0, world), batch_size=batch_size)
    sampler.load_state_dict({"epoch": 0, "consumed": consumed})
    share = list(sampler)
    before = sampler.batches_before_pass()
    assert before + ceil_div(len(share), batch_size) == ceil_div(n, world * batch_size)
    assert len(sampler) == before * batch_size + len(share)


@pytest.mark.parametrize("n", [1, 7, 23, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_epoch_batches_done_plus_batches_left_is_the_epoch_length(n, world, batch_size):
    full = ceil_div(n, world * batch_size)
    done = [epoch_batches_done(n, c, world, batch_size) for c in range(n + 1)]
    assert done[0] == 0 and done[-1] == full
    assert done == sorted(done)  # never goes back as more is consumed
    for consumed, d in enumerate(done):
        assert d + ceil_div(ceil_div(n - consumed, world), batch_size) == full
