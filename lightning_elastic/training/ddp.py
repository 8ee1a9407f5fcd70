"""torch's DistributedDataParallel in a hand-written elastic loop, across resets.

A ``torch.nn.parallel.DistributedDataParallel`` is bound to the process group it was built
on; a reset destroys that group and forms a new one, so a wrapper built once would
all-reduce on a dead group. ``le.DistributedDataParallel`` is built once, like torch's, and
holds a torch DDP of the module for the current group: at the first forward in a new
group it drops the old one (its reducer's hooks go with it) and builds another with the
same arguments. Building one is a collective, which every rank of the new group reaches
at the same point: its first forward after the reset. torch's DDP broadcasts rank 0's
parameters and buffers when it is built; when this round's state sync has already loaded
the module on every rank (it is, or is part of, a module of a ``le.TorchState``), it is
built with ``init_sync=False`` instead (``lightning_elastic.commit.init_sync``). Gradients are
all-reduced by torch's DDP itself: bucketed, overlapped with the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lightning_elastic.commit import init_sync
from lightning_elastic.api import current_worker


class DistributedDataParallel(torch.nn.Module):
    """``DistributedDataParallel(module, **ddp_kwargs)``: torch's DDP, rebuilt on each new group.

    ``ddp_kwargs`` are torch's (``device_ids``, ``bucket_cap_mb``, ``find_unused_parameters``,
    ``static_graph``, ...); ``process_group`` is not accepted: the wrapper always uses the
    job's current group. ``state_dict()`` has torch DDP's keys (``module.`` prefix); give the
    unwrapped module to ``le.TorchState``.
    """

    def __init__(self, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__()
        if "process_group" in ddp_kwargs:
            raise ValueError("le.DistributedDataParallel: process_group is not accepted "
                             "(the wrapper follows the job's group across resets)")
        self.module = module
        self._ddp_kwargs = ddp_kwargs
        # Not attributes of the Module: a registered torch DDP would add a second copy of
        # the module's parameters to parameters() and state_dict().
        self.__dict__["_wrapped"] = None
        self.__dict__["_group"] = None

    @property
    def wrapped(self) -> TorchDDP:
        """The torch DDP for the current group (built now if the group changed)."""
        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("le.DistributedDataParallel: no process group; call le.init() first")
        if self.__dict__["_wrapped"] is None or self.__dict__["_group"] is not group:
            self.__dict__["_wrapped"] = None  # the old reducer (and its autograd hooks) goes first
            self.__dict__["_wrapped"] = TorchDDP(self.module, **self._kwargs_for_group())
            self.__dict__["_group"] = group
        return self.__dict__["_wrapped"]

    def _kwargs_for_group(self) -> dict[str, Any]:
        """The user's kwargs, with ``init_sync=False`` when this round's sync made it redundant."""
        try:
            worker = current_worker()
        except RuntimeError:  # a group formed without le.init: no state sync ran
            return dict(self._ddp_kwargs)
        synced = worker.synced_modules.holds(self.module, worker.assignment.round)
        return init_sync.ddp_kwargs_for(self.module, self._ddp_kwargs, synced, dist.get_world_size(),
                                        init_sync.group_gather(worker.device, worker.wait_collective))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """torch DDP's ``no_sync``: accumulate gradients locally inside the block."""
        with self.wrapped.no_sync():
            yield
