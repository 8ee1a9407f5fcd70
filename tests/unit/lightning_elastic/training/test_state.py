"""lightning_elastic/training/state.py: commit, restore and sync of ObjectState and TorchState; to_host.

Most tests run in a world of one (no process group: broadcasts are no-ops there). The sync
tests run real gloo ranks through ``fakes.run_ranks``; the functions those ranks run are
module-level so that spawned processes can import them.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import pytest
import torch

from lightning_elastic.errors import HostsUpdatedInterrupt
from lightning_elastic.training.sampler import ElasticSampler
from lightning_elastic.training.state import ObjectState, TorchState, broadcast_object, to_host
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(60)


def make_training(seed: int, lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with parameters and buffers, and an optimizer with per-parameter state after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 3)).pow(2).sum().backward()
    optimizer.step()


def tensors_of(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state_dict.items()}


def momentum(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s["momentum_buffer"].clone() for s in optimizer.state_dict()["state"].values()]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def sampler_at(consumed: int, epoch: int = 0, worker: FakeWorker | None = None) -> ElasticSampler:
    sampler = ElasticSampler(range(20), seed=3, worker=worker or FakeWorker(), batch_size=2)
    sampler.load_state_dict({"epoch": epoch, "consumed": consumed})
    return sampler


# ----- ObjectState in a world of one ------------------------------------------------------


def test_object_state_restore_after_mutation_returns_the_committed_values():
    state = ObjectState(FakeWorker(), epoch=0, history=[1, 2])
    state.epoch = 3
    state.history.append(3)
    state.commit()
    state.epoch = 9
    state.history.append(4)
    state.restore()
    assert state.epoch == 3
    assert state.history == [1, 2, 3]


def test_object_state_restore_without_a_commit_returns_the_constructor_values():
    state = ObjectState(FakeWorker(), epoch=0, history=[1])
    state.epoch = 5
    state.history.append(2)
    state.restore()
    assert (state.epoch, state.history) == (0, [1])


def test_restore_hands_out_a_copy_so_the_commit_survives_mutation_after_restore():
    state = ObjectState(FakeWorker(), history=[1])
    state.restore()
    state.history.append(2)
    state.restore()
    assert state.history == [1]


def test_attributes_added_after_construction_are_saved_and_restored():
    state = ObjectState(FakeWorker(), epoch=0)
    state.batch = 5
    state.commit()
    state.batch = 7
    state.restore()
    assert state.batch == 5
    assert state._names == ["epoch", "batch"]


def test_private_attributes_are_not_tracked():
    state = ObjectState(FakeWorker(), epoch=0)
    state._scratch = 1
    state.commit()
    state._scratch = 2
    state.restore()
    assert state._scratch == 2
    assert state._names == ["epoch"]


def test_commit_saves_then_checks_for_host_updates():
    worker = FakeWorker()
    state = ObjectState(worker, epoch=0)
    state.epoch = 1
    state.commit()
    assert worker.checks == 1
    state.epoch = 2
    state.restore()
    assert state.epoch == 1


def test_an_interrupted_commit_has_still_saved():
    worker = FakeWorker()
    state = ObjectState(worker, epoch=0)
    state.epoch = 1
    state.commit()
    worker.interrupt_next()
    state.epoch = 4
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert worker.checks == 2
    state.epoch = 99
    state.restore()
    assert state.epoch == 4


def test_reset_callbacks_run_in_registration_order_on_every_reset():
    calls: list[str] = []
    state = ObjectState(FakeWorker(), epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.register_reset_callbacks([lambda: calls.append("c")])
    state.on_reset()
    assert calls == ["a", "b", "c"]
    state.on_reset()
    assert calls == ["a", "b", "c", "a", "b", "c"]


def test_the_explicit_worker_is_used():
    worker = FakeWorker()
    assert ObjectState(worker).worker is worker


# ----- TorchState in a world of one -------------------------------------------------------


def test_torch_state_restore_after_training_returns_the_committed_model_optimizer_and_values():
    model, optimizer = make_training(seed=0)
    sampler = sampler_at(consumed=6, epoch=1)
    state = TorchState(model, optimizer, worker=FakeWorker(), epoch=1, sampler=sampler, losses=[0.5])
    state.commit()
    weights, buffers = tensors_of(model.state_dict()), momentum(optimizer)

    train_step(model, optimizer)
    sampler.load_state_dict({"epoch": 2, "consumed": 14})
    state.epoch = 2
    state.losses.append(0.4)
    assert not torch.equal(model.state_dict()["0.weight"], weights["0.weight"])  # training changed it

    state.restore()
    assert_same_tensors(tensors_of(model.state_dict()), weights)
    assert [torch.equal(a, b) for a, b in zip(momentum(optimizer), buffers)] == [True] * 4
    assert sampler.state_dict() == {"epoch": 1, "consumed": 6}
    assert (state.epoch, state.losses) == (1, [0.5])
    assert state.model is model and state.optimizer is optimizer and state.sampler is sampler


def test_stateful_objects_are_restored_through_load_state_dict_not_replaced():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker())
    state.commit()
    state.restore()
    assert state.model is model
    assert state.optimizer is optimizer


def test_a_stateful_attribute_added_after_construction_is_committed():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, worker=FakeWorker())
    state.sampler = sampler_at(consumed=4)
    state.commit()
    state.sampler.load_state_dict({"epoch": 0, "consumed": 10})
    state.restore()
    assert state.sampler.state_dict() == {"epoch": 0, "consumed": 4}


def test_the_commit_is_a_copy_not_the_live_tensors():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker())
    state.commit()
    weights = tensors_of(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.restore()
    assert_same_tensors(tensors_of(model.state_dict()), weights)


def test_an_interrupted_torch_state_commit_has_saved_the_model():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker(interrupt_at=[1]))
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    weights = tensors_of(model.state_dict())
    train_step(model, optimizer)
    state.restore()
    assert_same_tensors(tensors_of(model.state_dict()), weights)


def test_a_second_restore_after_more_training_still_returns_the_commit():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker())
    state.commit()
    buffers = momentum(optimizer)
    train_step(model, optimizer)
    state.restore()
    train_step(model, optimizer)
    state.restore()
    assert [torch.equal(a, b) for a, b in zip(momentum(optimizer), buffers)] == [True] * 4


def test_sync_in_a_world_of_one_keeps_everything():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker(), epoch=3)
    weights, buffers = tensors_of(model.state_dict()), momentum(optimizer)
    state.sync()
    assert_same_tensors(tensors_of(model.state_dict()), weights)
    assert [torch.equal(a, b) for a, b in zip(momentum(optimizer), buffers)] == [True] * 4
    assert state.epoch == 3


# ----- to_host, broadcasts in a world of one ----------------------------------------------


class Point(NamedTuple):
    x: torch.Tensor
    tags: list[str]


def test_to_host_copies_a_tensor_detached_on_the_cpu():
    original = torch.ones(3, requires_grad=True)
    copy = to_host(original)
    assert copy.device == torch.device("cpu")
    assert not copy.requires_grad
    assert copy.data_ptr() != original.data_ptr()
    with torch.no_grad():
        original.add_(1.0)
    assert copy.tolist() == [1.0, 1.0, 1.0]


def test_to_host_deep_copies_containers_and_keeps_their_types():
    inner = [1, 2]
    original = collections.OrderedDict(t=torch.zeros(2), seq=(torch.ones(1), inner), names=["a"])
    copy = to_host(original)
    assert type(copy) is collections.OrderedDict
    assert list(copy) == ["t", "seq", "names"]
    assert type(copy["seq"]) is tuple and type(copy["names"]) is list
    original["t"].add_(5.0)
    original["seq"][0].add_(5.0)
    inner.append(3)
    original["names"].append("b")
    assert copy["t"].tolist() == [0.0, 0.0]
    assert copy["seq"][0].tolist() == [1.0]
    assert copy["seq"][1] == [1, 2]
    assert copy["names"] == ["a"]


def test_to_host_keeps_a_namedtuple_as_an_object_and_deep_copies_it():
    original = Point(torch.zeros(2), ["a"])
    copy = to_host(original)
    assert type(copy) is Point
    assert copy is not original
    original.x.add_(1.0)
    original.tags.append("b")
    assert copy.x.tolist() == [0.0, 0.0]
    assert copy.tags == ["a"]


def test_to_host_deep_copies_plain_objects():
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    original = Box()
    copy = to_host(original)
    original.items.append(2)
    assert type(copy) is Box
    assert copy.items == [1]


def test_to_host_copies_a_defaultdict():
    original = collections.defaultdict(int, {"seen": 2})
    copy = to_host(original)
    assert copy == {"seen": 2}
    assert copy["new"] == 0


def test_broadcast_object_in_a_world_of_one_returns_the_value_itself():
    value = {"a": [1]}
    assert broadcast_object(value, FakeWorker()) is value


def test_commits_reuse_two_sets_of_host_buffers():
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker())
    pointers = []
    for _ in range(4):
        train_step(model, optimizer)
        state.save()
        pointers.append(tuple(t.data_ptr() for t in state._snapshot.committed().tensors))
    assert pointers[0] != pointers[1]  # the spare set is written while the last commit stays
    assert (pointers[2], pointers[3]) == (pointers[0], pointers[1])
    assert state.committed_bytes == sum(
        t.numel() * t.element_size() for t in list(model.state_dict().values()) + momentum(optimizer)
    )


def test_a_commit_that_fails_part_way_leaves_the_previous_commit_whole(monkeypatch):
    model, optimizer = make_training(seed=0)
    state = TorchState(model, optimizer, worker=FakeWorker(), epoch=1)
    state.save()
    weights, buffers = tensors_of(model.state_dict()), momentum(optimizer)
    train_step(model, optimizer)
    state.epoch = 2
    copies = 0
    real_copy = torch.Tensor.copy_

    def copy_then_fail(self: torch.Tensor, source: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal copies
        copies += 1
        if copies == 3:
            raise RuntimeError("injected: the copy failed part-way")
        return real_copy(self, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_then_fail)
    with pytest.raises(RuntimeError, match="part-way"):
        state.save()
    monkeypatch.undo()
    state.restore()
    assert_same_tensors(tensors_of(model.state_dict()), weights)
    assert [torch.equal(a, b) for a, b in zip(momentum(optimizer), buffers)] == [True] * 4
    assert state.epoch == 1
    train_step(model, optimizer)
    state.save()  # the half-written buffers are reused and the commit is whole again
    weights = tensors_of(model.state_dict())
    train_step(model, optimizer)
    state.restore()
    assert_same_tensors(tensors_of(model.state_dict()), weights)


# ----- sync across real ranks -------------------------------------------------------------


def object_state_sync(rank: int, worker: FakeWorker) -> dict[str, Any]:
    state = ObjectState(worker, epoch=rank * 10, history=[rank])
    state.note = f"rank {rank}"  # added after construction
    state.sync()
    return {
        "epoch": state.epoch,
        "history": state.history,
        "note": state.note,
        "from_rank_1": broadcast_object(f"object of rank {rank}", worker, src=1),
    }


def test_object_state_sync_gives_every_rank_the_values_of_rank_0():
    results = run_ranks(2, object_state_sync)
    expected = {"epoch": 0, "history": [0], "note": "rank 0", "from_rank_1": "object of rank 1"}
    assert results == [expected, expected]


class RunningMean:
    """A stateful object with tensor state that is not a module: synced through broadcast_object.

    The ranks use it instead of a torch.optim optimizer, whose first construction imports
    torch._dynamo (some 2.5 s in every spawned rank).
    """

    def __init__(self, value: torch.Tensor) -> None:
        self.mean = value
        self.count = 1

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.count = state["mean"], state["count"]


def torch_state_snapshot(state: TorchState) -> dict[str, Any]:
    return {
        "model": {k: v.tolist() for k, v in state.model.state_dict().items()},
        "mean": (state.stats.mean.tolist(), state.stats.count),
        "sampler": state.sampler.state_dict(),
        "epoch": state.epoch,
    }


def torch_state_sync(rank: int, worker: FakeWorker) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model(torch.randn(4, 3))  # BatchNorm's running statistics (buffers) differ per rank too
    stats = RunningMean(torch.full((2,), float(rank)))
    stats.count = rank + 1
    state = TorchState(model, worker=worker, epoch=rank, stats=stats, sampler=sampler_at(2 * rank, rank, worker))
    before = torch_state_snapshot(state)
    state.sync()
    after = torch_state_snapshot(state)
    # The sync is every rank's commit too: training on, then restoring, comes back to it.
    with torch.no_grad():
        model[0].weight.add_(1.0)
    stats.mean.add_(5.0)  # in place: the restored value must not share memory with the commit
    state.epoch = 99
    state.restore()
    return before, after, torch_state_snapshot(state)


def test_torch_state_sync_gives_every_rank_the_parameters_and_state_of_rank_0_and_commits_it():
    results = run_ranks(2, torch_state_sync)
    befores = [before for before, _, _ in results]
    assert befores[1]["model"] != befores[0]["model"]  # the ranks really started apart
    assert befores[0]["mean"] == ([0.0, 0.0], 1) and befores[1]["mean"] == ([1.0, 1.0], 2)
    assert befores[0]["sampler"] == {"epoch": 0, "consumed": 0}
    for _, after, restored in results:
        assert after == befores[0]
        assert restored == befores[0]


class FreshOptimizerState:
    """Like an optimizer before its first step on a joiner: no tensor state at all yet."""

    def __init__(self, rank: int) -> None:
        self.state: dict[str, Any] = {"momentum": torch.full((1000,), 3.0)} if rank == 0 else {}

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state["state"]


def joiner_sync(rank: int, worker: FakeWorker) -> tuple[list[float], int]:
    optimizer = FreshOptimizerState(rank)
    state = TorchState(optimizer=optimizer, worker=worker)
    state.sync()
    optimizer.state["momentum"].add_(1.0)  # an optimizer step: the commit must not change
    state.restore()
    return optimizer.state["momentum"][:3].tolist(), state.committed_bytes


def test_a_joiner_without_tensor_state_receives_rank_0s_state_and_commit():
    results = run_ranks(2, joiner_sync)
    assert results == [([3.0, 3.0, 3.0], 4000)] * 2


# ----- a snapshot's step: the commits in the state's history (issue 37, item 9) ----------------


def _snapshotting_worker(directory) -> FakeWorker:
    from lightning_elastic.durable.files import SnapshotSettings
    from lightning_elastic.durable.store import SnapshotWriter

    clock = iter(range(0, 10**6, 100))  # every commit's offer is due
    worker = FakeWorker()
    worker.snapshot_writer = SnapshotWriter(SnapshotSettings(directory, every=1.0), "job", clock=lambda: next(clock))
    return worker


def _commit(state: ObjectState, times: int) -> None:
    for _ in range(times):
        state.value += 1
        state.commit()
        assert state.worker.snapshot_writer.wait(10)


def _steps(directory) -> list[int]:
    import json

    return sorted(json.loads(path.read_text())["step"] for path in directory.glob("snapshot-*.json"))


def test_a_resumed_jobs_snapshots_go_on_from_the_resumed_step_not_from_one(tmp_path):
    from lightning_elastic.durable.store import ResumePlan

    first = ObjectState(_snapshotting_worker(tmp_path), value=0)  # no "step" value: commits count
    _commit(first, 3)
    assert _steps(tmp_path) == [2, 3]  # the last two kept
    # A new launch of the job: its rank 0 resumes from snapshot step 3, then commits twice.
    worker = _snapshotting_worker(tmp_path)
    worker.resume_from = ResumePlan(None, tmp_path)
    again = ObjectState(worker, value=0)
    assert again.resume_from_snapshot() == "snapshot-3-step-3.pt"
    again.sync()
    assert again.value == 3
    _commit(again, 2)
    assert _steps(tmp_path) == [4, 5]  # was [1, 2]: the next snapshot logged as step 1


def test_the_commit_count_goes_back_with_the_state_it_counts(tmp_path):
    state = ObjectState(_snapshotting_worker(tmp_path), value=0)
    _commit(state, 2)
    state.value += 1
    state.commit()  # the third commit ...
    assert state.worker.snapshot_writer.wait(10)
    state.value += 1  # ... and work after it, lost to a peer's failure
    state.restore()
    assert state.value == 3
    _commit(state, 1)
    assert _steps(tmp_path) == [3, 4]
