"""``le.ShardedState`` in a real gloo group of one (``fakes.run_ranks``): what a rebuild leaves behind.

The functions the ranks run are module-level (they are pickled to the rank processes).
"""

from __future__ import annotations

import weakref

import torch

from tests.unit.fakes import FakeWorker, run_ranks


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _shard(model: _Blocks, mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def tensors_alive_at_rebuild(rank: int, worker: FakeWorker) -> tuple[list[int], int]:
    from lightning_elastic.sharded.state import ShardedState

    dropped: list[weakref.ref] = []  # the optimizer's moments and the gradients of each round's model
    alive: list[int] = []  # at each model() call: how many of them still exist

    def make() -> _Blocks:
        alive.append(sum(ref() is not None for ref in dropped))
        return _Blocks()

    state = ShardedState(make, _shard, lambda params: torch.optim.AdamW(params, lr=1e-3), worker=worker, step=0)
    state.sync()  # the first build
    for _ in range(2):
        state.optimizer.zero_grad()
        state.model(torch.randn(4, 8)).sum().backward()
        state.optimizer.step()
        dropped.extend(weakref.ref(v) for per_param in state.optimizer.state.values() for v in per_param.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
        dropped.extend(weakref.ref(p.grad) for p in state.model.parameters() if p.grad is not None)
        state.save()
        state.restore()  # a lost peer: the live model goes...
        state.sync()  # ...and the commit is restored into a new one
    return alive, len(dropped)


def test_a_rebuild_frees_the_dropped_models_moments_and_gradients_before_it_builds_the_next() -> None:
    # FSDP2's modules reference themselves through their hooks: the dropped model object
    # itself waits for the cyclic garbage collector, but its large tensors must not (they
    # would hold their memory while the next model is allocated, and long after).
    [(alive, dropped)] = run_ranks(1, tensors_alive_at_rebuild, timeout=60)
    assert dropped > 0
    assert alive == [0, 0, 0]


def commits_in_a_gloo_group(rank: int, worker: FakeWorker) -> dict[str, tuple[int, int, bool]]:
    """Two commits of uneven rows over gloo; each buffer: (rank of its rows, version, rows right)."""
    from lightning_elastic.sharded.commit import ShardedCommit
    from lightning_elastic.sharded.layout import Layout
    from tests.unit.lightning_elastic.sharded.test_commit_phases import ENTRIES, live

    world = worker.assignment.size
    layout = Layout(round=1, world=world, shift=1)
    commit = ShardedCommit()
    for version in (1, 2):
        commit.save(ENTRIES, live(rank, world, version), {"version": version}, layout, rank, worker.device,
                    worker.wait_collective)
    out = {}
    for slot, buffer in commit.buffers().items():
        expected = live(buffer.rows.rank, world, buffer.version if buffer.version > 0 else 1)
        right = all(torch.equal(buffer.rows.view(i), t) for i, t in enumerate(expected))
        out[slot] = (buffer.rows.rank, buffer.version, right)
    return out


def test_a_commit_over_gloo_sends_each_rank_its_covered_ranks_rows_entry_by_entry() -> None:
    # 5 rows at 3 ranks: 2, 2, 1; 2 rows: 1, 1, 0 (rank 2 sends none of that entry).
    results = run_ranks(3, commits_in_a_gloo_group, timeout=60)
    for rank, buffers in enumerate(results):
        covered = (rank - 1) % 3
        # Commit 2 whole in own and held; the spare holds commit 1's copy, retired (no version).
        assert buffers == {"own": (rank, 2, True), "held": (covered, 2, True), "spare": (covered, -1, True)}
