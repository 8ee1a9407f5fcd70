"""Every single-rank loss (and every lost host, when copies live on other hosts) at every
phase of a sharded commit leaves a whole commit among the survivors.

Each rank's ``ShardedCommit`` is driven through its phases (``begin``, ``staged``,
``promote``, ``settle``) with the messages played by copying rows between the ranks'
objects. A loss freezes every rank at some phase; which combinations can happen follows
from the commit's messages and its two all-reduces (``_possible``). For each, the
survivors' holdings go through ``choose_commit``, and the rows it reads are checked, bit
for bit, against the commit it names.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from lightning_elastic.sharded.commit import ShardedCommit
from lightning_elastic.sharded.layout import Layout, Lost, Restore, choose_commit, covers_hosts, holder_shift, rows_of
from lightning_elastic.sharded.rows import Entry

ENTRIES = (
    Entry(("model", "w"), (5, 3), torch.float32),  # 5 rows: uneven at 2, 3 and 4 ranks
    Entry(("model", "b"), (2,), torch.float64),  # fewer rows than ranks: some hold none
    Entry(("optimizer", "w", "exp_avg"), (5, 3), torch.float32),
)

# A rank's progress in the commit under way: before it, its copy being staged, staged,
# promoted, settled.
BEFORE, BEGUN, STAGED, PROMOTED, SETTLED = range(5)


def live(rank: int, world: int, version: int) -> list[torch.Tensor]:
    """Rank ``rank``'s rows of every entry at commit ``version``: values that name the
    version, the entry and the global row."""
    out = []
    for index, entry in enumerate(ENTRIES):
        start, stop = rows_of(rank, world, entry.rows)
        rows = torch.arange(start, stop, dtype=torch.float64) + 100 * index + 1000 * version
        out.append(rows.reshape(-1, *[1] * (len(entry.shape) - 1)).expand(-1, *entry.shape[1:]).to(entry.dtype))
    return out


def commit_fully(commits: Sequence[ShardedCommit], layout: Layout, version: int) -> None:
    advance(commits, layout, [SETTLED] * layout.world)
    assert all(c.version == version for c in commits)


def advance(commits: Sequence[ShardedCommit], layout: Layout, levels: Sequence[int]) -> None:
    """Each rank of ``layout`` runs the next commit up to ``levels[rank]``."""
    world = layout.world
    version = max(c.version for c in commits) + 1
    stages = {}
    for rank, commit in enumerate(commits):
        if levels[rank] >= BEGUN:
            stages[rank] = commit.begin(ENTRIES, {"version": version}, layout, rank)
    for rank, commit in enumerate(commits):
        if levels[rank] >= STAGED and stages[rank] is not None:
            covered = layout.covered(rank)
            for index, tensor in enumerate(live(covered, world, version)):
                stages[rank].view(index).copy_(tensor)
            commit.staged()
    for rank, commit in enumerate(commits):
        if levels[rank] >= PROMOTED:
            commit.promote(ENTRIES, live(rank, world, version), layout, rank)
    for rank, commit in enumerate(commits):
        if levels[rank] >= SETTLED:
            commit.settle()


@dataclasses.dataclass(frozen=True)
class Death:
    """How far the lost rank got: its level, whether its copy went out whole, whether it
    took part in the all-reduce that ends its level (the agreement, or the settling one)."""

    level: int
    sent: bool
    voted: bool


DEATHS = (Death(BEFORE, False, False), Death(BEGUN, False, False), Death(BEGUN, True, False),
          Death(STAGED, True, False), Death(STAGED, True, True), Death(PROMOTED, True, False),
          Death(PROMOTED, True, True), Death(SETTLED, True, True))


def _possible(layout: Layout, deaths: dict[int, Death], levels: Sequence[int]) -> bool:
    """Whether the ranks can be at ``levels`` (the lost ones' included) when the ranks in
    ``deaths`` die so."""
    if any(levels[rank] != death.level for rank, death in deaths.items()):
        return False
    for rank, level in enumerate(levels):
        covered = layout.covered(rank)
        if level >= STAGED and (levels[covered] < BEGUN or (covered in deaths and not deaths[covered].sent)):
            return False  # a copy arrives whole only from a rank that sent all of it
    if any(level >= PROMOTED for level in levels) and (
            any(level < STAGED for level in levels)
            or not all(d.level >= PROMOTED or (d.level == STAGED and d.voted) for d in deaths.values())):
        return False  # the agreement completes only once every rank staged and joined it
    if any(level >= SETTLED for level in levels) and (
            any(level < PROMOTED for level in levels)
            or not all(d.level >= SETTLED or (d.level == PROMOTED and d.voted) for d in deaths.values())):
        return False
    return True


def moments(layout: Layout, lost_together: Sequence[tuple[int, ...]] = ()) -> Iterator[
        tuple[tuple[int, ...], tuple[Death, ...], tuple[int, ...]]]:
    """Every (lost ranks, how far each got, every rank's level) the commit's messages allow:
    any one rank lost, or the ranks of each tuple in ``lost_together`` (a host)."""
    for lost in [(r,) for r in range(layout.world)] + list(lost_together):
        for deaths in itertools.product(DEATHS, repeat=len(lost)):
            for levels in itertools.product(range(BEFORE, SETTLED + 1), repeat=layout.world):
                if _possible(layout, dict(zip(lost, deaths, strict=True)), levels):
                    yield lost, deaths, levels


def frozen(layout: Layout, setup: Callable[[], list[ShardedCommit]]) -> list[list[ShardedCommit]]:
    """``[rank][level]``: each rank's commit object stopped at each level of the next commit
    of ``layout`` (after ``setup()``). A rank's state depends on its own level alone: the
    rows it receives are its covered rank's, whatever that rank's level now."""
    by_level = []
    for level in range(BEFORE, SETTLED + 1):
        commits = setup()
        advance(commits, layout, [level] * layout.world)
        by_level.append(commits)
    return [[by_level[level][rank] for level in range(BEFORE, SETTLED + 1)] for rank in range(layout.world)]


def check_restorable(members: Sequence[ShardedCommit]) -> Restore | Lost:
    """``choose_commit`` over ``members``' holdings; a Restore's rows and rest checked bit for bit."""
    choice = choose_commit([m.holding() for m in members])
    if isinstance(choice, Lost):
        return choice
    assert isinstance(choice, Restore), choice
    world = choice.layout.world
    for rank, source in enumerate(choice.sources):
        buffer = members[source.member].buffers()[source.slot]
        assert (buffer.rows.rank, buffer.layout, buffer.version) == (rank, choice.layout, choice.version)
        for index, expected in enumerate(live(rank, world, choice.version)):
            assert torch.equal(buffer.rows.view(index), expected), (rank, index, choice)
    rests = [b.rest for b in members[choice.replicated_from].buffers().values()
             if b.rest is not None and (b.layout, b.version) == (choice.layout, choice.version)]
    assert rests == [{"version": choice.version}]
    return choice


HOSTS = [
    ["a", "a"], ["a", "b"],
    ["a", "a", "a"], ["a", "a", "b"], ["a", "b", "c"],
    ["a", "a", "a", "a"], ["a", "a", "b", "b"], ["a", "b", "c", "d"],
]


@pytest.mark.parametrize("hosts", HOSTS, ids=["".join(h) for h in HOSTS])
def test_any_one_rank_or_covered_host_lost_at_any_phase_of_a_commit_leaves_the_previous_or_the_new_commit_whole(
        hosts: list[str]) -> None:
    layout = Layout(round=1, world=len(hosts), shift=holder_shift(hosts))

    def two_commits() -> list[ShardedCommit]:
        commits = [ShardedCommit() for _ in hosts]
        commit_fully(commits, layout, 1)
        commit_fully(commits, layout, 2)  # the spare buffers exist from here on
        return commits

    hosts_lost = [tuple(r for r, h in enumerate(hosts) if h == host) for host in sorted(set(hosts))]
    states = frozen(layout, two_commits)
    checked = torn_by_a_host = 0
    for lost, death, levels in moments(layout, hosts_lost if covers_hosts(hosts, layout.shift) else ()):
        choice = check_restorable([states[r][level] for r, level in enumerate(levels) if r not in lost])
        left = {level for r, level in enumerate(levels) if r not in lost}
        if isinstance(choice, Lost) and len(lost) > 1 and STAGED in left and PROMOTED in left:
            # The one window a whole host can still tear: it is lost just as the agreement
            # completes on some survivors and not on others. Two ranks covered by that host,
            # one promoted and one not, then leave neither commit whole.
            torn_by_a_host += 1
            continue
        assert isinstance(choice, Restore), (lost, death, levels, choice)
        assert choice.version in (2, 3), (lost, death, levels, choice)
        if min(levels) == SETTLED:
            assert choice.version == 3
        checked += 1
    assert checked > 0 and (torn_by_a_host == 0 or len(set(hosts)) < len(hosts))


@pytest.mark.parametrize(("old_hosts", "new_hosts"), [
    (["a", "a"], ["a", "a", "b"]), (["a", "b"], ["a", "b", "b"]), (["a", "a", "a"], ["a", "a", "a", "a"]),
    (["a", "a", "b"], ["a", "a", "b", "b"]), (["a", "b", "c"], ["a", "b", "c", "d"]),
], ids=lambda h: "".join(h))
def test_the_first_commit_after_a_join_keeps_the_restored_commit_until_it_has_settled(
        old_hosts: list[str], new_hosts: list[str]) -> None:
    # The old members keep their ranks; the joiner is the last rank. Each old member keeps
    # what the restore read from (the restored commit), as ShardedCommit.restore does.
    old = Layout(round=1, world=len(old_hosts), shift=holder_shift(old_hosts))
    new = Layout(round=2, world=len(new_hosts), shift=holder_shift(new_hosts))

    def restored_and_joined() -> list[ShardedCommit]:
        commits = [ShardedCommit() for _ in old_hosts]
        commit_fully(commits, old, 1)
        commit_fully(commits, old, 2)
        for commit in commits:
            commit.keep_only(old, 2)
        joiner = ShardedCommit()
        joiner.version = 2
        return [*commits, joiner]

    states = frozen(new, restored_and_joined)
    for lost, death, levels in moments(new):
        choice = check_restorable([states[r][level] for r, level in enumerate(levels) if r not in lost])
        assert isinstance(choice, Restore), (lost, death, levels, choice)
        assert (choice.layout, choice.version) in ((old, 2), (new, 3)), (lost, death, levels, choice)
    # The old layout's buffers go once the first commit in the new one settled; the spare
    # buffer exists from the second: three shards per rank.
    commits = restored_and_joined()
    commit_fully(commits, new, 3)
    assert all(sorted(c.buffers()) == ["held", "own"] for c in commits)
    commit_fully(commits, new, 4)
    assert all(sorted(c.buffers()) == ["held", "own", "spare"] for c in commits)


@pytest.mark.parametrize("hosts", [["a", "a", "a", "a"], ["a", "a", "b", "b"]], ids=lambda h: "".join(h))
def test_after_a_loss_the_restored_commit_is_singly_held_until_the_first_commit_in_the_new_layout(
        hosts: list[str]) -> None:
    # Old rank x lost, the survivors restored commit 2 and keep it: x's rows live only on its
    # holder, and its covered rank's only on that rank (its copy was on x). Until the first
    # commit in the new layout settles, losing either of those two may lose everything; any
    # other loss does not.
    old = Layout(round=1, world=len(hosts), shift=holder_shift(hosts))
    x = 1
    rest_hosts = [h for r, h in enumerate(hosts) if r != x]
    new = Layout(round=2, world=len(rest_hosts), shift=holder_shift(rest_hosts))
    old_rank_of = [r for r in range(old.world) if r != x]  # by new rank
    singly_held = {old_rank_of.index(old.holder(x)), old_rank_of.index(old.covered(x))}
    lost_anyway = 0

    def restored() -> list[ShardedCommit]:
        everyone = [ShardedCommit() for _ in hosts]
        commit_fully(everyone, old, 1)
        commit_fully(everyone, old, 2)
        commits = [everyone[r] for r in old_rank_of]
        for commit in commits:
            commit.keep_only(old, 2)
        return commits

    states = frozen(new, restored)
    for lost, death, levels in moments(new):
        choice = check_restorable([states[r][level] for r, level in enumerate(levels) if r not in lost])
        if isinstance(choice, Lost):
            assert set(lost) & singly_held, (lost, death, levels, choice)
            lost_anyway += 1
        else:
            assert (choice.layout, choice.version) in ((old, 2), (new, 3))
    assert lost_anyway > 0  # the window is real: the docs say so


def test_one_rank_commits_without_copies_or_collectives() -> None:
    layout = Layout(round=1, world=1, shift=0)
    [commit] = commits = [ShardedCommit()]
    commit_fully(commits, layout, 1)
    commit_fully(commits, layout, 2)
    assert sorted(commit.buffers()) == ["own"] and check_restorable(commits).version == 2  # type: ignore[union-attr]
