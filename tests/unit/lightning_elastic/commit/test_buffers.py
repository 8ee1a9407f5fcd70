"""lightning_elastic/commit/buffers.py: split/join of state trees, reused buffers, commits never torn.

The CUDA copier cannot run here (no GPU): its decisions (promote a commit only when its copy
completed, keep the previous one when the copy failed) are tested through a scripted copier
that behaves like a side stream's event.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import pytest
import torch

from lightning_elastic.commit.buffers import HostCopier, HostSnapshot, TensorSlot, TensorSpec, join, split

pytestmark = pytest.mark.timeout(30)


class Pair(NamedTuple):
    left: Any
    right: Any


def test_split_takes_the_tensors_out_in_order_and_join_puts_them_back():
    a, b = torch.arange(3.0), torch.ones(2, 2, dtype=torch.int64)
    tree = {"x": [a, 1, "s"], "y": (b, None), "z": Pair(a, 2.5)}
    skeleton, tensors = split(tree)
    assert skeleton == {"x": [TensorSlot(0), 1, "s"], "y": (TensorSlot(1), None), "z": Pair(TensorSlot(2), 2.5)}
    assert [t.data_ptr() for t in tensors] == [a.data_ptr(), b.data_ptr(), a.data_ptr()]
    back = join(skeleton, tensors, clone=True)
    assert type(back["z"]) is Pair and torch.equal(back["x"][0], a) and torch.equal(back["y"][0], b)
    assert back["x"][0].data_ptr() != a.data_ptr()
    assert join(skeleton, tensors, clone=False)["x"][0] is tensors[0]


def test_split_keeps_container_types_and_copies_mutable_leaves():
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    ordered = collections.OrderedDict(a=torch.zeros(1))
    counts = collections.defaultdict(int, seen=1)
    box = Box()
    skeleton, _ = split({"ordered": ordered, "counts": counts, "box": box})
    assert type(skeleton["ordered"]) is collections.OrderedDict
    assert skeleton["counts"]["new"] == 0  # the factory came along
    box.items.append(2)
    assert skeleton["box"].items == [1]


def test_a_sparse_tensor_stays_in_the_skeleton_as_a_host_copy():
    sparse = torch.eye(3).to_sparse()
    skeleton, tensors = split({"s": sparse})
    assert tensors == [] and skeleton["s"].is_sparse
    assert torch.equal(join(skeleton, [], clone=True)["s"].to_dense(), torch.eye(3))


def test_capture_reuses_the_spare_buffers_and_new_shapes_get_new_ones():
    snapshot = HostSnapshot()
    live = {"w": torch.zeros(4)}
    pointers = []
    for value in range(3):
        live["w"].fill_(value)
        snapshot.capture(live, meta={"step": value})
        pointers.append(snapshot.committed().tensors[0].data_ptr())
    assert pointers[0] != pointers[1] and pointers[2] == pointers[0]
    committed = snapshot.committed()
    assert committed.meta == {"step": 2} and committed.tree()["w"].tolist() == [2.0] * 4
    assert committed.specs == (TensorSpec((4,), torch.float32),)
    snapshot.capture({"w": torch.zeros(4), "m": torch.ones(2)})
    assert len(snapshot.committed().tensors) == 2


class ScriptedCopy:
    """A copy still running, like a CUDA event on a side stream."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class ScriptedCopier(HostCopier):
    """Copies at once but reports the copy as running; ``fail_next`` makes it fail."""

    def __init__(self) -> None:
        self.fail_next = False
        self.pending: list[ScriptedCopy] = []

    def copy(self, destinations: Any, sources: Any) -> ScriptedCopy:
        super().copy(destinations, sources)
        copy = ScriptedCopy(self.fail_next)
        self.fail_next = False
        self.pending.append(copy)
        return copy


def test_an_asynchronous_commit_counts_only_once_its_copy_completed():
    copier = ScriptedCopier()
    snapshot = HostSnapshot(copier)
    snapshot.capture({"w": torch.ones(2)}, meta=1)
    assert not copier.pending[0].finished
    assert snapshot.committed().meta == 1  # reading waits for the copy
    assert copier.pending[0].finished


def test_a_failed_asynchronous_copy_falls_back_to_the_previous_commit(caplog):
    copier = ScriptedCopier()
    snapshot = HostSnapshot(copier)
    snapshot.capture({"w": torch.ones(2)}, meta=1)
    snapshot.committed()
    copier.fail_next = True
    snapshot.capture({"w": torch.full((2,), 5.0)}, meta=2)
    committed = snapshot.committed()
    assert committed.meta == 1 and committed.tree()["w"].tolist() == [1.0, 1.0]
    assert "the previous commit stays" in caplog.text


def test_a_new_commit_first_settles_the_running_one_so_the_last_good_commit_is_never_overwritten():
    copier = ScriptedCopier()
    snapshot = HostSnapshot(copier)
    snapshot.capture({"w": torch.ones(2)}, meta=1)
    snapshot.capture({"w": torch.full((2,), 2.0)}, meta=2)  # settles commit 1 first
    assert copier.pending[0].finished
    copier.fail_next = True
    snapshot.capture({"w": torch.full((2,), 3.0)}, meta=3)  # written over commit 1's buffers
    committed = snapshot.committed()
    assert committed.meta == 2 and committed.tree()["w"].tolist() == [2.0, 2.0]


def test_received_buffers_count_only_when_promoted():
    snapshot = HostSnapshot()
    snapshot.capture({"w": torch.ones(3)}, meta="mine")
    snapshot.capture({"w": torch.ones(3)}, meta="mine")
    committed = snapshot.committed()
    buffers = snapshot.buffers_for(committed.specs)
    assert buffers[0].data_ptr() not in {t.data_ptr() for t in committed.tensors}  # the spare set
    buffers[0].fill_(7.0)  # a transfer that stops here...
    assert snapshot.committed().meta == "mine"  # ...changes nothing
    snapshot.receive(committed.skeleton, "theirs", committed.specs, buffers)
    assert snapshot.committed().meta == "theirs" and snapshot.committed().tree()["w"].tolist() == [7.0] * 3


def test_clear_drops_the_commit():
    snapshot = HostSnapshot()
    snapshot.capture({"w": torch.ones(1)})
    snapshot.clear()
    assert snapshot.committed() is None
