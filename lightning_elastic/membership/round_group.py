"""The current round's process group, as the training thread forms and leaves it.

Formed on the driver's store (``DriverStore``) or, in a world of one, on a ``HashStore``.
A gloo group's own TCP connections are recorded in ``SharedState.group``: a partitioned
peer can only be cut off by shutting them down (see ``group_sockets``), which the
heartbeat does when the driver says the round lost a member.

Only the training thread calls these methods; what the heartbeat may touch goes through
``SharedState`` and its lock.
"""

from __future__ import annotations

import datetime
import threading
import urllib.parse
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.membership import group_sockets
from lightning_elastic.membership.driver_store import DriverStore
from lightning_elastic.membership.process_group import (
    BackendChoice,
    abandon_round_group,
    destroy_round_group,
    init_round_group,
)
from lightning_elastic.membership.settings import WorkerSettings
from lightning_elastic.membership.shared import FormedGroup, SharedState


class RoundGroup:
    """One worker's process group, re-formed every round.

    ``broken_reason``: why the current round cannot complete (``None`` while it can); the
    driver's store gives up a wait with it, and ``leave`` cuts the group's connections when
    it names one.
    """

    def __init__(self, settings: WorkerSettings | None, shared: SharedState,
                 broken_reason: Callable[[], str | None]) -> None:
        self._settings = settings
        self._shared = shared
        self._broken_reason = broken_reason
        self._store: DriverStore | None = None
        self.choice: BackendChoice | None = None  # the newest round's backend and device
        self.abandoned = False  # a collective of the current group was given up

    @property
    def backend(self) -> str:
        return self.choice.backend if self.choice else "gloo"

    @property
    def device(self) -> torch.device:
        return self.choice.device if self.choice else torch.device("cpu")

    def form(self, a: p.Assignment, choice: BackendChoice, timeout_s: float) -> None:
        """Form round ``a``'s group and record it (with its gloo connections) for the heartbeat."""
        self.choice = choice
        timeout = datetime.timedelta(seconds=timeout_s)
        settings = self._settings
        if settings is None:
            store: dist.Store = dist.HashStore()
        else:
            if self._store is None:
                self._store = DriverStore(settings.client(), timeout, interrupted=self._broken_reason)
            self._store.set_timeout(timeout)
            store = self._store
        if choice.backend != "gloo" or settings is None:
            init_round_group(store, a.round, a.rank, a.size, choice, timeout)
            # NCCL: the round, for its abort.
            self._shared.record_group(FormedGroup(a.round, frozenset(), choice.backend == "nccl"))
            return
        # Remember the group's own connections: a partitioned peer can only be cut off by
        # shutting them down (see group_sockets).
        before = group_sockets.established()
        assert self._store is not None
        with self._store.recording() as published:
            init_round_group(store, a.round, a.rank, a.size, choice, timeout)
        driver = urllib.parse.urlsplit(settings.locator.url)
        excluded = {(driver.hostname or "", driver.port or 0)}
        opened = group_sockets.new_connections(before, group_sockets.established(), excluded)
        # Only those to or from the listeners the ranks published: another thread may have
        # opened connections of its own meanwhile.
        connections = group_sockets.published_by(opened, published)
        self._shared.record_group(FormedGroup(a.round, connections, False))
        self._shared.training_thread = threading.get_ident()

    def leave(self) -> None:
        """Leave the group between rounds (``reset``): cut, abandon or destroy it."""
        connections = self._shared.forget_group()
        nccl = self.backend == "nccl"
        if connections and not nccl and self._broken_reason() is not None:
            # A round that lost a member: an operation of its group still queued or waiting
            # on a peer that left it (whose group, kept alive by its DDP module, keeps its
            # sockets open) would hold the destroy below, which joins the group's threads,
            # for the group's whole timeout. The heartbeat cuts these connections when it
            # learns of the loss while the group stands; when this worker's own collective
            # failed first, it is done here.
            group_sockets.shut_down(connections)
        if self.abandoned:
            abandon_round_group()
            self.abandoned = False
        else:
            destroy_round_group(abort=nccl)

    def leave_at_exit(self) -> bool:
        """Leave the group at the process's exit; True if one was formed (torch's threads may
        then still hold its tensors: see ``ElasticWorker.shutdown``)."""
        self._shared.forget_group()
        formed = dist.is_initialized()
        if self.abandoned:
            abandon_round_group()
        else:
            destroy_round_group()
        return formed

    def close_store(self) -> None:
        if self._store is not None:
            self._store.close()
