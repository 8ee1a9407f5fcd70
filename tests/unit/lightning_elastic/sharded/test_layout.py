"""The pure decisions of a sharded reset: rows, copies' placement, the commit chosen, transfers."""

from __future__ import annotations

import itertools

import pytest

from lightning_elastic.sharded.layout import (
    NONE,
    Fresh,
    Holding,
    Layout,
    Lost,
    Restore,
    choose_commit,
    covers_hosts,
    describe_coverage,
    holder_shift,
    plan_transfers,
    rows_of,
)


@pytest.mark.parametrize(("rows", "world", "expected"), [
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # torch.chunk: 2, 2, 1, 0
    (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]),
    (8, 3, [(0, 3), (3, 6), (6, 8)]),
    (0, 2, [(0, 0), (0, 0)]),
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
])
def test_rows_follow_torch_chunk(rows: int, world: int, expected: list[tuple[int, int]]) -> None:
    assert [rows_of(r, world, rows) for r in range(world)] == expected


def test_rows_match_torch_chunk_for_many_sizes() -> None:
    import torch

    for rows, world in itertools.product(range(0, 20), range(1, 7)):
        chunks = torch.arange(rows).chunk(world) if rows else ()
        sizes = [len(c) for c in chunks] + [0] * (world - len(chunks))
        assert [b - a for a, b in (rows_of(r, world, rows) for r in range(world))] == sizes, (rows, world)


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 4 of a world of 4"):
        rows_of(4, 4, 10)


@pytest.mark.parametrize(("hosts", "shift", "covers"), [
    (["a", "a", "b", "b"], 2, True),
    (["a", "b", "c", "d"], 1, True),
    (["a", "a", "a", "b", "b", "b"], 3, True),
    (["a", "a", "a", "a"], 1, False),  # one host: copies on the next rank
    (["a", "b", "b"], 1, False),  # b holds more than half: no placement covers it
    (["a"], 0, False),
])
def test_copies_go_to_another_host_when_any_placement_allows(hosts: list[str], shift: int, covers: bool) -> None:
    assert holder_shift(hosts) == shift
    assert covers_hosts(hosts, shift) is covers


def test_layout_names_holder_and_covered_rank() -> None:
    layout = Layout(round=1, world=4, shift=2)
    assert [layout.holder(r) for r in range(4)] == [2, 3, 0, 1]
    assert [layout.covered(r) for r in range(4)] == [2, 3, 0, 1]
    assert Layout(1, 1, 0).holder(0) == NONE


L4 = Layout(round=1, world=4, shift=1)


def survivors(*ranks: int, version: int = 5, layout: Layout = L4) -> list[Holding]:
    return [Holding(layout, own_rank=r, own_version=version, held_rank=layout.covered(r), held_version=version)
            for r in ranks]


def test_nothing_committed_anywhere_is_a_fresh_start() -> None:
    assert choose_commit([Holding(None), Holding(None)]) == Fresh()


def test_a_lost_rank_is_read_from_its_holder() -> None:
    choice = choose_commit(survivors(0, 2, 3))  # rank 1 lost; rank 2 holds its copy
    assert isinstance(choice, Restore) and choice.version == 5
    assert [(s.member, s.held) for s in choice.sources] == [(0, False), (1, True), (1, False), (2, False)]


def test_a_joiner_holds_nothing_and_changes_nothing() -> None:
    choice = choose_commit([*survivors(0, 1, 2, 3), Holding(None)])
    assert isinstance(choice, Restore) and all(not s.held for s in choice.sources)


def test_a_rank_and_its_holder_lost_together_is_lost_with_a_reason() -> None:
    choice = choose_commit(survivors(0, 3))  # 1 and 2: 1's copy was on 2
    assert isinstance(choice, Lost)
    assert "rank(s) 1" in choice.reason and "copy" in choice.reason


def test_a_copy_torn_by_a_loss_during_the_commit_is_not_used() -> None:
    # Rank 1 died while sending commit 6: survivors' own rows are at 6, rank 2's copy of
    # rank 1 never completed (NONE), the older commit 5 is gone: nothing whole is left.
    holdings = [Holding(L4, 0, 6, 3, 6), Holding(L4, 2, 6, 1, NONE), Holding(L4, 3, 6, 2, 6)]
    assert isinstance(choose_commit(holdings), Lost)


def test_the_newest_whole_commit_wins() -> None:
    older = Layout(round=1, world=4, shift=1)
    holdings = [Holding(older, 0, 7, 3, 7), Holding(older, 1, 7, 0, 7), Holding(older, 2, 7, 1, 7),
                Holding(older, 3, 7, 2, 7)]
    assert choose_commit(holdings).version == 7  # type: ignore[union-attr]


def test_a_re_shard_interrupted_before_the_next_commit_restores_the_same_commit_again() -> None:
    # 4 -> 3 restored commit 5 of L4; no commit since; another member lost: the copies of
    # L4 still say where commit 5 lives.
    holdings = [*survivors(0, 2, 3), Holding(None)]
    del holdings[1]  # the member holding rank 2's own rows and rank 1's copy is lost too
    assert isinstance(choose_commit(holdings), Lost)
    assert isinstance(choose_commit(survivors(0, 2, 3)[:1] + survivors(2, 3)), Restore)


@pytest.mark.parametrize(("old_world", "new_world"), [(4, 3), (4, 2), (3, 4), (4, 4), (2, 5), (5, 1)])
@pytest.mark.parametrize("rows", [1, 5, 7, 64])
def test_transfers_cover_every_new_row_exactly_once_from_the_rank_that_had_it(old_world: int, new_world: int,
                                                                             rows: int) -> None:
    from lightning_elastic.sharded.layout import Source

    sources = [Source(member=r % new_world, held=r >= new_world) for r in range(old_world)]
    transfers = plan_transfers(sources, old_world, new_world, [rows, 3])
    for entry, count in enumerate([rows, 3]):
        written: dict[int, int] = {}
        for t in (t for t in transfers if t.entry == entry):
            src_start = rows_of(t.old_rank, old_world, count)[0] + t.src_row
            dst_start = rows_of(t.dst, new_world, count)[0] + t.dst_row
            assert src_start == dst_start  # the same global rows
            assert t.src == sources[t.old_rank].member and t.held == sources[t.old_rank].held
            for row in range(dst_start, dst_start + t.rows):
                written[row] = written.get(row, 0) + 1
        assert written == {row: 1 for row in range(count)}


# ----- the log line that says what a lost rank or host costs ---------------------------


@pytest.mark.parametrize(
    ("hosts", "said"),
    [
        (["a"], "Sharded state: one rank, no copy of its commit held elsewhere."),
        (["a", "a", "b", "b"], "Sharded state: 4 ranks on 2 hosts; each commit's rows are copied to rank + 2, on "
                               "another host: one lost host loses nothing."),
        (["a", "a", "a"], "Sharded state: 3 ranks on one host; each commit's rows are copied to the next rank: one "
                          "lost rank loses nothing (the host lost needs --snapshot-dir)."),
        # 4 -> 3 after a loss on the first host: the second holds two of three ranks.
        (["a", "b", "b"], "Sharded state: 3 ranks on 2 hosts; each commit's rows are copied to the next rank: one "
                          "lost rank loses nothing; b holds more than half of the ranks, so losing it needs "
                          "--snapshot-dir."),
    ],
)
def test_the_coverage_said_for_each_layout(hosts, said):
    assert describe_coverage(hosts, holder_shift(hosts)) == said
