"""What every workload shares: the two models, their optimizers and data, one training step.

Imported by the workload scripts of this directory (which run as ``python
benchmarks/workloads/<script>.py``, so this directory is on ``sys.path``).

- ``small``: MLP 256 -> 1024 -> 10, batch 64 per worker, SGD lr 0.01 (274k parameters).
- ``100m``: six Linear(4096, 4096) layers with ReLU and a Linear(4096, 10) head (100.7M
  parameters, 403 MB), SGD lr 0.01 momentum 0.9 (parameters + momentum: 806 MB), batch 8
  per worker.

Data are random tensors generated once from a fixed seed; step ``s`` of rank ``r`` in a world
of ``W`` takes batch number ``s * W + r`` (cyclically): the same in every launcher, and
nothing to carry across an elastic reset but the step counter.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    in_dim: int
    hidden: int
    hidden_layers: int  # Linear(hidden, hidden) layers after the first Linear(in_dim, hidden)
    classes: int
    batch: int  # per worker
    momentum: float
    samples: int  # size of the random data set (a multiple of batch)
    lr: float = 0.01


SPECS = {
    "small": ModelSpec("small", in_dim=256, hidden=1024, hidden_layers=0, classes=10, batch=64, momentum=0.0,
                       samples=64 * 128),
    "100m": ModelSpec("100m", in_dim=4096, hidden=4096, hidden_layers=5, classes=10, batch=8, momentum=0.9,
                      samples=8 * 64),
}


def spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(SPECS)}") from None


def build_model(s: ModelSpec) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(s.in_dim, s.hidden), nn.ReLU()]
    for _ in range(s.hidden_layers):
        layers += [nn.Linear(s.hidden, s.hidden), nn.ReLU()]
    layers.append(nn.Linear(s.hidden, s.classes))
    return nn.Sequential(*layers)


def make_optimizer(model: nn.Module, s: ModelSpec, momentum: float | None = None) -> torch.optim.Optimizer:
    m = s.momentum if momentum is None else momentum
    return torch.optim.SGD(model.parameters(), lr=s.lr, momentum=m)


def random_data(s: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(s.samples, s.in_dim, generator=g), torch.randint(0, s.classes, (s.samples,), generator=g)


def batch_at(data: tuple[torch.Tensor, torch.Tensor], s: ModelSpec, step: int, rank: int, world: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    n = s.samples // s.batch
    start = ((step * world + rank) % n) * s.batch
    x, y = data
    return x[start:start + s.batch], y[start:start + s.batch]


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()
    optimizer.step()


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a commit holds: the model's state_dict and the optimizer's state."""
    found: list[torch.Tensor] = list(model.state_dict().values())
    for per_param in optimizer.state.values():
        found += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return found
