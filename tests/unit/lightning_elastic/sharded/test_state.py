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
