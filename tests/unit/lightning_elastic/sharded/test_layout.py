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
    Piece,
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


def member(rank: int, version: int, held: int | None = None, spare: int = NONE, layout: Layout = L4) -> Holding:
    """A member that was ``rank``: its own rows and the covered rank's at ``version`` (the
    held copy at ``held`` if given), and the covered rank's in its spare buffer at ``spare``."""
    covered = layout.covered(rank)
    pieces = [Piece("own", layout, rank, version, rest=True),
              Piece("held", layout, covered, version if held is None else held)]
    if spare != NONE:
        pieces.append(Piece("spare", layout, covered, spare))
    return Holding(tuple(p for p in pieces if p.version != NONE))


def survivors(*ranks: int, version: int = 5, layout: Layout = L4) -> list[Holding]:
    return [member(r, version, layout=layout) for r in ranks]


def test_nothing_committed_anywhere_is_a_fresh_start() -> None:
    assert choose_commit([Holding(), Holding()]) == Fresh()


def test_a_lost_rank_is_read_from_its_holder() -> None:
    choice = choose_commit(survivors(0, 2, 3))  # rank 1 lost; rank 2 holds its copy
    assert isinstance(choice, Restore) and choice.version == 5
    assert [(s.member, s.slot) for s in choice.sources] == [(0, "own"), (1, "held"), (1, "own"), (2, "own")]


def test_a_joiner_holds_nothing_and_changes_nothing() -> None:
    choice = choose_commit([*survivors(0, 1, 2, 3), Holding()])
    assert isinstance(choice, Restore) and all(s.slot == "own" for s in choice.sources)


def test_a_rank_and_its_holder_lost_together_is_lost_with_a_reason() -> None:
    choice = choose_commit(survivors(0, 3))  # 1 and 2: 1's copy was on 2
    assert isinstance(choice, Lost)
    assert "rank(s) 1" in choice.reason and "copy" in choice.reason


def test_a_copy_torn_by_a_loss_during_the_commit_leaves_the_previous_commit_whole() -> None:
    # Rank 1 died while sending commit 6: its holder's spare buffer never completed (not
    # reported); every survivor still has commit 5 whole, and the others' staged copies of 6.
    holdings = [Holding((Piece("own", L4, 0, 5, True), Piece("held", L4, 3, 5), Piece("spare", L4, 3, 6))),
                Holding((Piece("own", L4, 2, 5, True), Piece("held", L4, 1, 5))),
                Holding((Piece("own", L4, 3, 5, True), Piece("held", L4, 2, 5), Piece("spare", L4, 2, 6)))]
    choice = choose_commit(holdings)
    assert isinstance(choice, Restore) and choice.version == 5
    assert [(s.member, s.slot) for s in choice.sources] == [(0, "own"), (1, "held"), (1, "own"), (2, "own")]


def test_a_commit_promoted_on_some_members_only_restores_the_version_that_is_whole() -> None:
    # Rank 3 died after the agreement of commit 6 completed on it. Member 0 (rank 0) promoted
    # (own and held at 6, the previous copy of rank 3 in its spare); ranks 1 and 2 did not:
    # rank 2's rows of 6 exist only in its live state (its copy was on rank 3), so 6 is torn,
    # and 5 is whole: rank 0's rows of 5 from rank 1's held copy, rank 3's from rank 0's spare.
    holdings = [member(0, 6, spare=5), member(1, 5, spare=6), member(2, 5, spare=6)]
    choice = choose_commit(holdings)
    assert isinstance(choice, Restore) and choice.version == 5
    assert [(s.member, s.slot) for s in choice.sources] == [(1, "held"), (1, "own"), (2, "own"), (0, "spare")]
    # Had rank 2 promoted too, 6 would be whole, and newer.
    choice = choose_commit([member(0, 6, spare=5), member(1, 5, spare=6), member(2, 6, spare=5)])
    assert isinstance(choice, Restore) and choice.version == 6
    assert [(s.member, s.slot) for s in choice.sources] == [(0, "own"), (2, "held"), (2, "own"), (0, "held")]


def test_rows_without_the_rest_of_their_commit_are_not_restored() -> None:
    # Commit 6's rows are all staged somewhere, but nobody promoted it: no member has its rest.
    copies = [Holding((Piece("held", L4, r, 6),)) for r in range(4)]
    assert isinstance(choose_commit([*copies, *survivors(0, 1, 2, 3)]), Restore)
    assert choose_commit([*copies, *survivors(0, 1, 2, 3)]).version == 5  # type: ignore[union-attr]


def test_the_lost_reason_names_the_commit_that_came_closest() -> None:
    # Ranks 0 and 1 lost mid-commit: commit 6 was staged on rank 2 only; 5 lacks rank 0 alone.
    holdings = [Holding((Piece("own", L4, 2, 5, True), Piece("held", L4, 1, 5), Piece("spare", L4, 1, 6))),
                Holding((Piece("own", L4, 3, 5, True), Piece("held", L4, 2, 5)))]
    choice = choose_commit(holdings)
    assert isinstance(choice, Lost) and "commit 5" in choice.reason and "rank(s) 0 " in choice.reason


def test_the_newest_whole_commit_wins() -> None:
    older = Layout(round=1, world=4, shift=1)
    assert choose_commit(survivors(0, 1, 2, 3, version=7, layout=older)).version == 7  # type: ignore[union-attr]


def test_the_old_layouts_commit_is_restored_while_the_first_in_the_new_one_is_torn() -> None:
    # 3 -> 4 (a joiner): the first commit in the new layout was staged on some members only.
    l3, new = Layout(round=1, world=3, shift=1), Layout(round=2, world=4, shift=1)
    old = [(Piece("old0", l3, r, 5, True), Piece("old1", l3, l3.covered(r), 5)) for r in range(3)]
    holdings = [Holding((*old[0], Piece("spare", new, 3, 6))), Holding(old[1]), Holding(old[2]),
                Holding((Piece("spare", new, 2, 6),))]
    choice = choose_commit(holdings[:1] + holdings[2:])  # new rank 1 lost
    assert isinstance(choice, Restore) and (choice.layout, choice.version) == (l3, 5)
    assert [(s.member, s.slot) for s in choice.sources] == [(0, "old0"), (1, "old1"), (1, "old0")]


def test_a_re_shard_interrupted_before_the_next_commit_restores_the_same_commit_again() -> None:
    # 4 -> 3 restored commit 5 of L4; no commit since; another member lost: the copies of
    # L4 still say where commit 5 lives.
    holdings = [*survivors(0, 2, 3), Holding()]
    del holdings[1]  # the member holding rank 2's own rows and rank 1's copy is lost too
    assert isinstance(choose_commit(holdings), Lost)
    assert isinstance(choose_commit(survivors(0, 2, 3)[:1] + survivors(2, 3)), Restore)


@pytest.mark.parametrize(("old_world", "new_world"), [(4, 3), (4, 2), (3, 4), (4, 4), (2, 5), (5, 1)])
@pytest.mark.parametrize("rows", [1, 5, 7, 64])
def test_transfers_cover_every_new_row_exactly_once_from_the_rank_that_had_it(old_world: int, new_world: int,
                                                                             rows: int) -> None:
    from lightning_elastic.sharded.layout import Source

    sources = [Source(member=r % new_world, slot="held" if r >= new_world else "own") for r in range(old_world)]
    transfers = plan_transfers(sources, old_world, new_world, [rows, 3])
    for entry, count in enumerate([rows, 3]):
        written: dict[int, int] = {}
        for t in (t for t in transfers if t.entry == entry):
            src_start = rows_of(t.old_rank, old_world, count)[0] + t.src_row
            dst_start = rows_of(t.dst, new_world, count)[0] + t.dst_row
            assert src_start == dst_start  # the same global rows
            assert t.src == sources[t.old_rank].member and t.slot == sources[t.old_rank].slot
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
