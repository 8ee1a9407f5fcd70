"""What a worker's threads share: one object, behind one lock.

The threads: the training thread (it joins rounds, forms and leaves their process groups,
commits and checks for host changes), the heartbeat thread (``heartbeat``), and rank 0's
one-shot sender of a round's first step. Whatever two of them both touch lives here and
nowhere else; each field says which thread writes it.

Invariants:

- ``seen_generation`` and ``last_broken_round`` only grow; both are read and written
  under ``lock``.
- ``group`` is the process group that exists now: the round it was formed for (0 while
  there is none), its gloo connections, whether it is NCCL. The training thread sets it to
  ``NO_GROUP`` under ``lock`` before it destroys or replaces a group, and records the next
  one once formed. The heartbeat acts on a group (cuts its connections, aborts its
  communicator) only under ``lock`` and only while ``group.round`` is the broken round, so
  it never touches a healthy successor.
- ``stepped``, ``training_thread``, ``reported`` and ``snapshot_writer`` are each written by
  the training thread alone, as one reference swap, and read without the lock: a reader sees
  the old value or the new one, never a mix, and none of them needs to agree with another.

Not here: the worker's ``DriverClient``, which both threads use as it is (a pool of
connections to the driver and a nonce counter, both safe to share between threads).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from lightning_elastic import protocol as p
from lightning_elastic.membership.group_sockets import Connection

if TYPE_CHECKING:
    from lightning_elastic.durable.store import SnapshotWriter


@dataclasses.dataclass(frozen=True)
class FormedGroup:
    """A round's process group as the heartbeat may act on it."""

    round: int  # 0: no group
    connections: frozenset[Connection]  # gloo's, to or from the listeners the ranks published
    nccl: bool  # aborted rather than cut


NO_GROUP = FormedGroup(0, frozenset(), False)


class SharedState:
    """The state the training and heartbeat threads share (see the module's invariants)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Under ``lock``:
        self.seen_generation = 0  # the newest host generation a heartbeat reply named
        self.last_broken_round = 0  # the newest round the driver said lost a member
        self.group = NO_GROUP
        # Written by the training thread only, read without the lock:
        # (round, wall time) of the first training step in the newest round, for the timeline.
        self.stepped: tuple[int, float] = (0, 0.0)
        self.training_thread: int | None = None  # the thread forming the groups (whose stack to show)
        self.reported: p.Outcome | None = None  # what the worker told the driver of its end
        self.snapshot_writer: SnapshotWriter | None = None  # whose counts heartbeats carry

    def known(self) -> tuple[int, int]:
        """(seen_generation, last_broken_round): what a heartbeat tells the driver it knows."""
        with self.lock:
            return self.seen_generation, self.last_broken_round

    def seen(self) -> int:
        with self.lock:
            return self.seen_generation

    def learn(self, generation: int, last_broken_round: int) -> bool:
        """Take in a heartbeat's reply; True if it names a newly broken round."""
        with self.lock:
            self.seen_generation = max(self.seen_generation, generation)
            newly_broken = last_broken_round > self.last_broken_round
            self.last_broken_round = max(self.last_broken_round, last_broken_round)
        return newly_broken

    def broken(self, round_: int) -> bool:
        """Has the driver said ``round_`` (or a later one) lost a member?"""
        with self.lock:
            return self.last_broken_round >= round_

    def mark_broken(self, round_: int) -> None:
        with self.lock:
            self.last_broken_round = max(self.last_broken_round, round_)

    def current_group(self) -> FormedGroup:
        with self.lock:
            return self.group

    def record_group(self, group: FormedGroup) -> None:
        with self.lock:
            self.group = group

    def forget_group(self) -> frozenset[Connection]:
        """Mark the group gone before it is destroyed: the heartbeat then leaves it (and its
        successor, until formed) alone. Returns the group's connections."""
        with self.lock:
            connections = self.group.connections
            self.group = NO_GROUP
        return connections
