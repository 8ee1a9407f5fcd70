"""Rows between members, point to point: the copy for a holder at a commit, and the
transfers of a re-shard.

Every operation is posted asynchronously, then waited for without a time limit: gloo
treats a point-to-point wait that times out as fatal to the whole group (it closes every
connection, "Application timeout caused pair closure"), so the slices in which the worker
waits for a collective (``membership.collective_wait``) cannot be used here. A wait on a
lost peer still ends: gloo fails a receive when the peer's connection closes, and once
the driver says the round lost a member the heartbeat shuts the group's connections down
(``membership.group_sockets``), which fails a pending send too. Each message carries its
position in the plan as its tag, so two messages between the same pair can never be
matched the wrong way round.

gloo moves host memory, so rows go from the host buffers straight into their
destination. NCCL moves device memory only: there a row range from a host buffer is sent
from a device copy of it (made just before, freed when sent), and received straight into
its destination on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_elastic.sharded.layout import Transfer

_COPY_TAG = 1 << 20  # the commit's copy; a re-shard's transfers are tagged 0, 1, 2, ...


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def swap_copies(own: torch.Tensor, held: torch.Tensor, holder: int, covered: int, device: torch.device) -> None:
    """Send this rank's committed rows ``own`` to ``holder``; receive ``covered``'s into ``held``."""
    works = []
    if own.numel():
        works.append(dist.isend(_on(device, own), dst=holder, tag=_COPY_TAG))
    landing = held if held.device == device else torch.empty_like(held, device=device)
    if held.numel():
        works.append(dist.irecv(landing, src=covered, tag=_COPY_TAG))
    for work in works:
        work.wait()
    if landing is not held:
        held.copy_(landing)


def run_transfers(transfers: Sequence[Transfer], me: int, source: Callable[[Transfer], torch.Tensor],
                  destination: Callable[[Transfer], torch.Tensor], device: torch.device) -> int:
    """Post this member's part of ``transfers`` (the same list on every member) and wait for
    it: rows read with ``source`` on the sender, written into ``destination`` on the receiver,
    copied locally when both are this member. Returns the bytes received from others."""
    works: list[dist.Work] = []
    received = 0
    with torch.no_grad():
        for tag, t in enumerate(transfers):
            if t.src == me and t.dst == me:
                destination(t).copy_(source(t))
            elif t.src == me:
                works.append(dist.isend(_on(device, source(t)).contiguous(), dst=t.dst, tag=tag))
            elif t.dst == me:
                target = destination(t)
                works.append(dist.irecv(target, src=t.src, tag=tag))
                received += target.numel() * target.element_size()
        for work in works:
            work.wait()
    return received
