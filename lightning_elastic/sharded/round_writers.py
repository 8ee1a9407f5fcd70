"""``RoundWriters``: the sharded snapshot writer of each round (``--snapshot-dir``).

A writer belongs to one round (its ranks and world size); it is made at the round's first
commit offered to it, with a plan every rank agrees on: rank 0's seconds per step since the
round started turn ``--snapshot-every`` seconds into steps, broadcast to all (a collective,
so every rank offers every commit). A writer of an earlier round still writing finishes in
the background; while any writes, the commit must not reuse the rows it reads (``writing``).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from lightning_elastic.commit import collectives
from lightning_elastic.durable import files
from lightning_elastic.durable.store import SnapshotInfo
from lightning_elastic.membership.worker import ElasticWorker
from lightning_elastic.sharded.snapshots import ShardedSnapshotWriter, SnapshotPlan, steps_between


class RoundWriters:
    def __init__(self) -> None:
        self._writers: list[tuple[int, ShardedSnapshotWriter]] = []  # (round, writer): this round's last
        self._start = (0, 0.0, 0)  # (round, time it started, step then): the snapshot pace

    @property
    def writing(self) -> bool:
        """True while a write still reads the rows of an offered commit."""
        return any(writer.writing for _, writer in self._writers)

    def round_started(self, round_: int, step: int) -> None:
        """The round's training starts from ``step`` now (its pace is measured from here)."""
        self._start = (round_, time.monotonic(), step)

    def offer(self, worker: ElasticWorker, tree: Callable[[], dict[str, Any]], info: SnapshotInfo) -> bool:
        """Every rank, after every commit: the commit's ``tree()`` to this round's writer,
        which writes it in the background when its step is due. False without ``--snapshot-dir``."""
        settings = getattr(worker.snapshot_writer, "settings", None)
        if settings is None:
            return False
        writer = self._writer_for_round(worker, settings, info.step)
        if not writer.plan.due(info.step):
            return False  # the tree (views, and the rest serialised) is made only for a commit written
        return writer.offer(tree(), info)

    def _writer_for_round(self, worker: ElasticWorker, settings: files.SnapshotSettings,
                          step: int) -> ShardedSnapshotWriter:
        a = worker.assignment
        if self._writers and self._writers[-1][0] == a.round:
            return self._writers[-1][1]
        alive = [(r, w) for r, w in self._writers if w.writing]  # an older round's, still writing
        round_, started, first_step = self._start
        plan = None
        if a.rank == 0:
            per_step = (time.monotonic() - started) / max(1, step - first_step) if round_ == a.round else 1.0
            plan = SnapshotPlan(secrets.token_hex(4), steps_between(settings.every, max(per_step, 1e-3)))
        if a.size > 1:
            plan = collectives.broadcast_object(plan, a.rank, 0, worker.device, worker.wait_collective)
        writer = ShardedSnapshotWriter(settings, a.rank, a.size, plan, os.environ.get(files.ENV_JOB_ID, ""))
        self._writers = [*alive, (a.round, writer)]
        worker.snapshot_writer = writer  # its counts reach the driver with the heartbeats
        return writer
