"""Sending a commit from one rank to every rank: tensors straight into the receivers' buffers.

The skeleton, tensor specs and metadata of a commit (small) travel pickled in one
``collectives.broadcast_object``; the tensors travel as raw bytes, in chunks of at most
``chunk_bytes``, with no pickling. A tensor of a chunk's size or more is broadcast in place,
slice by slice; smaller ones are packed into one staging chunk. Receivers write into their
snapshot's spare buffers (a survivor's are already there; a joiner allocates one commit's
worth), which become their commit once every chunk has arrived: a source lost part-way
leaves a receiver's previous commit whole. So the extra memory on any rank is at most one
commit plus one chunk. NCCL moves device memory only: there every chunk is staged through
one device buffer of a chunk's size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_elastic.commit import collectives
from lightning_elastic.commit.collectives import Wait, wait_plainly
from lightning_elastic.commit.prefault import Prefaulter
from lightning_elastic.commit.buffers import Committed, HostSnapshot, TensorSpec

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of tensor number ``index``."""

    index: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class CommitHeader:
    """What a receiver needs before the bytes: where they go and what they are."""

    skeleton: Any
    meta: Any
    specs: tuple[TensorSpec, ...]


def plan_chunks(sizes: Sequence[int], chunk_bytes: int) -> list[list[Segment]]:
    """Group tensors of ``sizes`` bytes into chunks of at most ``chunk_bytes`` bytes.

    A tensor of ``chunk_bytes`` or more gets chunks of its own (one segment each: sent in
    place); smaller ones share a chunk (sent through a staging buffer), in order.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected a positive number of bytes, got {chunk_bytes!r}")
    chunks: list[list[Segment]] = []
    packed: list[Segment] = []
    packed_bytes = 0
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= chunk_bytes:
            chunks.extend([Segment(index, a, min(a + chunk_bytes, size))] for a in range(0, size, chunk_bytes))
            continue
        if packed_bytes + size > chunk_bytes:
            chunks.append(packed)
            packed, packed_bytes = [], 0
        packed.append(Segment(index, 0, size))
        packed_bytes += size
    if packed:
        chunks.append(packed)
    return chunks


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous host tensor (any dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


def broadcast_commit(
    snapshot: HostSnapshot, rank: int, size: int, src: int, device: torch.device,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES, wait: Wait = wait_plainly,
) -> Committed:
    """Rank ``src``'s commit in every rank's ``snapshot`` (``device``: where NCCL stages chunks).

    ``wait`` waits for each chunk's broadcast: a worker's ``wait_collective`` gives up one
    that its broken round left pending.
    """
    if rank == src:
        committed = snapshot.committed()
        if committed is None:
            raise RuntimeError("broadcast_commit: the source rank holds no commit")
        if size == 1:
            return committed
        header = CommitHeader(committed.skeleton, committed.meta, committed.specs)
        buffers = list(committed.tensors)
    header = collectives.broadcast_object(header if rank == src else None, rank, src,
                                          device if device.type == "cuda" else torch.device("cpu"), wait)
    new_memory = False
    if rank != src:
        new_memory = not snapshot.has_spare_for(header.specs)
        buffers = snapshot.buffers_for(header.specs)
    # New memory (a joiner's) is faulted in alongside the receive, not page by page inside it.
    with Prefaulter(buffers if new_memory else ()):
        send_tensors(buffers, src, device, chunk_bytes, wait)
    if rank != src:
        snapshot.receive(header.skeleton, header.meta, header.specs, buffers)
    committed = snapshot.committed()
    assert committed is not None
    return committed


def send_tensors(tensors: Sequence[torch.Tensor], src: int, device: torch.device, chunk_bytes: int,
                 wait: Wait = wait_plainly) -> None:
    """Broadcast the contents of contiguous host ``tensors`` from ``src`` into every rank's."""
    flat = [_bytes_of(t) for t in tensors]
    staged_on_device = device.type == "cuda"
    chunks = plan_chunks([f.numel() for f in flat], chunk_bytes)
    staged = [c for c in chunks if len(c) > 1 or staged_on_device]
    # As large as the largest staged chunk, no larger: a small model's commit is one chunk.
    staging_bytes = max((sum(s.nbytes for s in c) for c in staged), default=0)
    staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device) if staged else None
    is_source = dist.get_rank() == src
    for chunk in chunks:
        if len(chunk) == 1 and not staged_on_device:
            segment = chunk[0]
            wait(dist.broadcast(flat[segment.index][segment.start:segment.end], src=src, async_op=True))
            continue
        assert staging is not None
        total = sum(s.nbytes for s in chunk)
        if is_source:
            _pack(staging, chunk, flat)
        wait(dist.broadcast(staging[:total], src=src, async_op=True))
        if not is_source:
            _unpack(staging, chunk, flat)


def _pack(staging: torch.Tensor, chunk: list[Segment], flat: list[torch.Tensor]) -> None:
    offset = 0
    for s in chunk:
        staging[offset:offset + s.nbytes].copy_(flat[s.index][s.start:s.end])
        offset += s.nbytes


def _unpack(staging: torch.Tensor, chunk: list[Segment], flat: list[torch.Tensor]) -> None:
    offset = 0
    for s in chunk:
        flat[s.index][s.start:s.end].copy_(staging[offset:offset + s.nbytes])
        offset += s.nbytes
