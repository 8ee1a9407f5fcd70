"""When torch DDP's initial broadcast is redundant, and leaving it out safely.

Building a ``torch.nn.parallel.DistributedDataParallel`` verifies the parameters' shapes
across ranks and broadcasts rank 0's parameters and buffers (``init_sync=True``). After a
reset the elastic state sync has already given every rank the same weights: ``@le.run``
loads rank 0's commit into every module of a ``le.TorchState``, and the Lightning strategy
loads the agreed commit into the LightningModule. The DDP built next on the new group
would send the whole model again (403 MB for 100M parameters), so it is built with
``init_sync=False`` when, and only when:

- this round's sync loaded the module (or a module holding it) on every rank: never on a
  rank that trains weights no sync touched (ranks may start from different random ones);
- the user did not choose ``init_sync`` themselves;
- every parameter is in the module's ``state_dict`` (what the sync carries); a buffer left
  out of it (``persistent=False``) is aligned only by DDP itself, so it must be either
  broadcast by DDP at every forward (the default) or by the initial sync, which is then kept;
- every rank agrees, in one small all-gather: each rank's own answer and a fingerprint of
  its parameters (names, shapes, strides, dtypes, ``requires_grad``). The initial sync is
  torch's only cross-rank check that the gradient buckets line up; a state sync carries
  values, not which parameters are trainable, so a rank that froze another layer would
  otherwise all-reduce mismatched buckets. On any difference every rank keeps the initial
  sync, and torch reports the mismatch as it always did.

torch builds its gradient buckets from the local parameter order either way; nothing else
in its constructor is a collective (its bucket rebuild after the first iteration
broadcasts rank 0's order whatever ``init_sync`` was).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lightning_elastic.commit import collectives


class SyncedModules:
    """The modules the newest round's state sync made identical on every rank (weakly held)."""

    def __init__(self) -> None:
        self._round: int | None = None
        self._modules: list[weakref.ref[torch.nn.Module]] = []

    def note(self, round_: int, modules: Iterable[torch.nn.Module]) -> None:
        """Round ``round_``'s sync loaded ``modules`` (on rank 0: sent them)."""
        if self._round != round_:
            self._round, self._modules = round_, []
        self._modules.extend(weakref.ref(m) for m in modules)

    def holds(self, module: torch.nn.Module, round_: int) -> bool:
        """Did round ``round_``'s sync load ``module``, or a module it is part of?"""
        if self._round != round_:
            return False
        for ref in self._modules:
            synced = ref()
            if synced is not None and any(part is module for part in synced.modules()):
                return True
        return False


@functools.cache
def torch_accepts_init_sync() -> bool:
    """torch's DDP takes ``init_sync`` (2.6 and later); older ones always sync."""
    return "init_sync" in inspect.signature(TorchDDP.__init__).parameters


def needs_init_sync(module: torch.nn.Module, ddp_kwargs: Mapping[str, Any], synced: bool) -> bool:
    """This rank's own answer (``init_sync`` not given by the user): must DDP's initial sync run?"""
    if not synced:
        return True
    in_state = set(module.state_dict(keep_vars=True))
    if any(name not in in_state for name, _ in module.named_parameters()):
        return True  # a custom state_dict leaves a parameter out: the sync did not carry it
    left_out = [name for name, _ in module.named_buffers() if name not in in_state]
    return bool(left_out) and not forward_syncs_buffers(ddp_kwargs)


def forward_syncs_buffers(ddp_kwargs: Mapping[str, Any]) -> bool:
    """Does the DDP built with ``ddp_kwargs`` broadcast rank 0's buffers before every forward?

    ``forward_sync_buffers`` (torch 2.13) or its deprecated ``broadcast_buffers``; both
    default to yes. (With ``broadcast_buffers=False`` torch's initial sync leaves buffers
    out too; the initial sync is kept then all the same, so nothing rests on that detail.)
    """
    for key in ("forward_sync_buffers", "broadcast_buffers"):
        if ddp_kwargs.get(key) is not None:
            return bool(ddp_kwargs[key])
    return True


def fingerprint(module: torch.nn.Module) -> int:
    """A number equal on two ranks when their parameters and buffers line up for DDP."""
    digest = hashlib.blake2b(digest_size=7)  # < 2**56: fits an int64
    for kind, named in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, tensor in named:
            grad = getattr(tensor, "requires_grad", False)
            digest.update(f"{kind}|{name}|{tuple(tensor.shape)}|{tensor.stride()}|{tensor.dtype}|{grad};".encode())
    return int.from_bytes(digest.digest(), "big")


Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def agree(needed: bool, print_: int, gather: Gather) -> bool:
    """Collective: may every rank leave the initial sync out? Only if none needs it and all
    fingerprints are equal."""
    rows = gather(torch.tensor([int(needed), print_], dtype=torch.int64))
    first = rows[0].tolist()
    return all(row.tolist() == [0, first[1]] for row in rows)


def group_gather(device: torch.device, wait: collectives.Wait) -> Gather:
    """``agree``'s all-gather over the current default group (on ``device``: NCCL needs CUDA),
    waited for with ``wait`` (the worker's ``wait_collective``: a peer lost mid-gather must
    not hold the survivors until the group's timeout)."""

    return lambda row: collectives.all_gather(row, device, wait)


def ddp_kwargs_for(
    module: torch.nn.Module, ddp_kwargs: Mapping[str, Any], synced: bool, size: int, gather: Gather
) -> dict[str, Any]:
    """``ddp_kwargs`` for the torch DDP of ``module`` about to be built on every rank of a group
    of ``size``: with ``init_sync=False`` added when it is redundant (a collective when size > 1)."""
    if "init_sync" in ddp_kwargs or size < 2 or not torch_accepts_init_sync():
        return dict(ddp_kwargs)  # the user's choice; in a world of one there is nothing to send
    if agree(needs_init_sync(module, ddp_kwargs, synced), fingerprint(module), gather):
        return {**ddp_kwargs, "init_sync": False}
    return dict(ddp_kwargs)
