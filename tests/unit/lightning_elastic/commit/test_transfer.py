"""lightning_elastic/commit/transfer.py: chunk plans, and commits sent between real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.commit.transfer import Segment, broadcast_commit, plan_chunks
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("sizes", "chunk", "expected"),
    [
        ([4, 4, 4], 8, [[Segment(0, 0, 4), Segment(1, 0, 4)], [Segment(2, 0, 4)]]),
        ([20], 8, [[Segment(0, 0, 8)], [Segment(0, 8, 16)], [Segment(0, 16, 20)]]),
        ([3, 8, 3], 8, [[Segment(1, 0, 8)], [Segment(0, 0, 3), Segment(2, 0, 3)]]),
        ([0, 2, 0], 8, [[Segment(1, 0, 2)]]),
        ([], 8, []),
    ],
)
def test_chunks_pack_small_tensors_and_slice_large_ones(sizes, chunk, expected):
    assert plan_chunks(sizes, chunk) == expected


def test_a_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_bytes: expected a positive number of bytes, got 0"):
        plan_chunks([1], 0)


def mixed_tree(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1000, generator=g),  # 4000 bytes: sliced in place
        "small": [torch.randint(0, 9, (3,), generator=g), torch.tensor(seed * 1.5)],  # packed, one 0-dim
        "flags": torch.rand(5, generator=g) > 0.5,  # bool
        "empty": torch.zeros(0),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous in the live state
        "step": seed,
    }


def as_lists(tree: dict[str, Any]) -> dict[str, Any]:
    return {
        "big": tree["big"].tolist(), "small": [t.tolist() for t in tree["small"]], "flags": tree["flags"].tolist(),
        "empty": tree["empty"].tolist(), "strided": tree["strided"].tolist(), "step": tree["step"],
    }


def send_mixed(rank: int, worker: FakeWorker) -> tuple[dict[str, Any], dict[str, Any], str]:
    snapshot = HostSnapshot()
    if rank != 2:  # rank 2 joins with nothing
        snapshot.capture(mixed_tree(seed=rank), meta=f"rank {rank}")
    committed = broadcast_commit(snapshot, rank, worker.assignment.size, 0, worker.device, chunk_bytes=1024)
    return as_lists(mixed_tree(seed=0)), as_lists(committed.tree()), committed.meta


def test_every_rank_holds_the_sources_commit_after_a_chunked_transfer():
    for expected, received, meta in run_ranks(3, send_mixed):
        assert received == expected
        assert meta == "rank 0"


def test_alone_the_commit_is_the_own_one():
    snapshot = HostSnapshot()
    snapshot.capture({"w": torch.ones(2)}, meta=1)
    committed = broadcast_commit(snapshot, 0, 1, 0, torch.device("cpu"))
    assert committed.meta == 1


def test_a_source_without_a_commit_is_an_error():
    with pytest.raises(RuntimeError, match="the source rank holds no commit"):
        broadcast_commit(HostSnapshot(), 0, 1, 0, torch.device("cpu"))
