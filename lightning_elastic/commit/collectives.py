"""The small collectives of a reset (who holds the newest commit, a commit's header, the
loggers' versions), each waited through a ``wait`` that can give it up.

torch's blocking forms (``all_gather``, ``broadcast_object_list``) wait for the group's
whole timeout, 30 minutes by default, when a peer is lost part-way: gloo fails a pending
receive once the peer's connection closes, but not always a pending send. A worker's
``wait_collective`` gives an operation up once the driver says its round lost a member.
So every collective a reset runs is asynchronous and handed to ``wait``; the tensors
themselves travel in ``transfer``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Wait = Callable[[dist.Work], None]


def wait_plainly(work: dist.Work) -> None:
    """A ``Wait`` without a way out (tests, and callers with no worker)."""
    work.wait()


def all_gather(row: torch.Tensor, device: torch.device, wait: Wait) -> list[torch.Tensor]:
    """Every rank's ``row`` (same shape and dtype on every rank), in rank order, on CPU."""
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(rows, row, async_op=True))
    return [r.cpu() for r in rows]


def broadcast_object(value: Any, rank: int, src: int, device: torch.device, wait: Wait) -> Any:
    """Rank ``src``'s picklable ``value`` on every rank: its length, then its bytes.

    Peers are the members of the job's own process group, as for torch's
    ``broadcast_object_list``, which unpickles what it receives the same way.
    """
    if rank == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)),
                                   dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    wait(dist.broadcast(length, src=src, async_op=True))
    data = payload.to(device) if rank == src else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wait(dist.broadcast(data, src=src, async_op=True))
    if rank == src:
        return value
    return pickle.loads(data.cpu().numpy().tobytes())


def all_gather_object(value: Any, device: torch.device, wait: Wait) -> list[Any]:
    """Every rank's picklable ``value``, in rank order: the lengths, then the padded bytes."""
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    lengths = all_gather(torch.tensor([len(payload)], dtype=torch.int64), device, wait)
    longest = max(int(n.item()) for n in lengths)
    row = torch.zeros(longest, dtype=torch.uint8)
    row[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = all_gather(row, device, wait)
    return [pickle.loads(r[:int(n.item())].numpy().tobytes()) for r, n in zip(rows, lengths, strict=True)]
