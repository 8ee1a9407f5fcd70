"""lightning_elastic/training/ddp.py: torch's DDP that follows the job's process group across resets."""

from __future__ import annotations

import datetime
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_elastic.training.ddp import DistributedDataParallel
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(60)


def model_for(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # ranks start different: the first forward broadcasts rank 0's
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def step(ddp: DistributedDataParallel, rank: int) -> list[list[float]]:
    ddp.module.zero_grad()
    x = torch.full((2, 4), float(rank + 1))
    ddp(x).sum().backward()
    return [p.grad.flatten().tolist() for p in ddp.module.parameters()]


def new_group(rank: int, size: int) -> None:
    """What a reset does to the group: destroyed, and a new one formed (another store)."""
    box = [tempfile.mktemp(prefix="le-ddp-store-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(box[0], size), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=30))


def train_across_a_new_group(rank: int, worker: FakeWorker) -> dict[str, Any]:
    ddp = DistributedDataParallel(model_for(rank))
    first_wrapped = ddp.wrapped
    before = step(ddp, rank)
    weights_before = [p.detach().flatten().tolist() for p in ddp.module.parameters()]
    new_group(rank, worker.assignment.size)
    after = step(ddp, rank)  # torch's DDP built once would all-reduce on the destroyed group here
    return {
        "before": before, "after": after, "weights": weights_before,
        "rebuilt": ddp.wrapped is not first_wrapped,
        "keys": list(ddp.state_dict()), "params": len(list(ddp.parameters())),
        "module_params": len(list(ddp.module.parameters())),
    }


def test_gradients_are_averaged_before_and_after_the_group_is_formed_again():
    results = run_ranks(2, train_across_a_new_group)
    for r in results:
        assert r["rebuilt"]
        assert r["params"] == r["module_params"]  # the inner torch DDP is not a submodule
        assert r["keys"] == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
    assert results[0]["weights"] == results[1]["weights"]  # rank 0's parameters everywhere
    for phase in ("before", "after"):
        assert results[0][phase] == results[1][phase], f"{phase}: gradients differ between ranks"
    # Averaged, not local: rank 0's own gradient (input all ones) differs from the mean.
    model = model_for(0)
    model(torch.full((2, 4), 1.0)).sum().backward()
    local = [p.grad.flatten().tolist() for p in model.parameters()]
    assert results[0]["before"] != local


def test_process_group_is_refused_with_a_one_line_error():
    with pytest.raises(ValueError, match="le.DistributedDataParallel: process_group is not accepted"):
        DistributedDataParallel(torch.nn.Linear(2, 2), process_group=None)


def test_without_a_group_the_error_says_to_call_init():
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"no process group; call le.init\(\) first"):
        ddp(torch.zeros(1, 2))
