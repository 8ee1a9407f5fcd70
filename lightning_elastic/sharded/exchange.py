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
from lightning_elastic.sharded.rows import RankRows

_COPY_TAG = 1 << 20  # the commit's copy; a re-shard's transfers are tagged 0, 1, 2, ...


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def send_rows(rows: Sequence[torch.Tensor], stage: RankRows, holder: int, covered: int, device: torch.device,
              halfway: Callable[[], None] | None = None) -> None:
    """Send this rank's live rows (``rows``: one tensor per entry) to ``holder``, and receive
    ``covered``'s into ``stage``, one message per entry (tagged with its index): the rows go
    straight from the live state, so the rank's own committed rows stay untouched until
    every copy is in. ``halfway`` (fault injection): called once half of the sends are done."""
    works: list[dist.Work] = []
    landed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device landing, host view): NCCL only
    for index in range(len(stage.entries)):
        view = stage.view(index)
        if view.numel():
            landing = view if view.device == device else torch.empty_like(view, device=device)
            works.append(dist.irecv(landing, src=covered, tag=_COPY_TAG + index))
            if landing is not view:
                landed.append((landing, view))
    sends = [(index, tensor) for index, tensor in enumerate(rows) if tensor.numel()]
    with torch.no_grad():
        if halfway is not None:
            first, sends = sends[:len(sends) // 2], sends[len(sends) // 2:]
            for work in [dist.isend(_on(device, t).contiguous(), dst=holder, tag=_COPY_TAG + i) for i, t in first]:
                work.wait()
            halfway()
        works += [dist.isend(_on(device, t).contiguous(), dst=holder, tag=_COPY_TAG + i) for i, t in sends]
        for work in works:
            work.wait()
        for landing, view in landed:
            view.copy_(landing)


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
