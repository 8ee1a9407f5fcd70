"""Durable sharded snapshots: every rank writes its shards of a commit in the background, into
one torch.distributed.checkpoint (DCP) directory that ``dcp.load`` reads at any world size.

**Which commits are written.** A commit is written when its step is a multiple of the
round's ``SnapshotPlan.every_steps``. Every rank decides alone, and all of them decide
the same way: the step is the commit's, so it is the same on every rank, and the plan is
agreed once per round (``agree_plan``: rank 0's plan, broadcast by the training thread).
A clock cannot decide this. Ranks read their clocks at slightly different moments (and
machines' clocks differ), so near a period's end one rank would write a commit that its
peer skips, and that snapshot could never be complete. A rank that joins the round
decides as the others do, from the same plan. ``--snapshot-every`` (seconds) becomes
steps through rank 0's seconds per step (``steps_between``).

**Never on the training thread's time.** ``offer`` flattens the tree, starts a thread
that writes this rank's part and returns. The training thread must leave the offered
tensors unchanged while ``writing`` is True. If a commit is due while this rank is still
writing its previous part, this rank does not write it: that is logged and counted as a
failure, and the snapshot will be incomplete. So choose ``every_steps`` so that a part is
written well within that many steps.

**Layout.** The snapshot directory is ``snapshot-step-STEP-TOKEN.dcp``, named from the
step and the round's token (every rank knows both, while ``N`` is picked by rank 0
alone). Each rank writes its data file ``__R_0.distcp`` (published without replacing
anything, like every snapshot file), then its part's description ``.part-R.json``
(``dcp_format``).

**Complete when.** Once its own part is written, rank 0 waits for every rank's
description. It polls the directory, every 50 ms to 1 s: the parts come from other
processes, perhaps on other machines, and the store is the only thing the writer threads
share. The wait is bounded by ``publish_wait``: by default ``PUBLISH_GRACE`` (60 s) plus
twice the time rank 0's own part took (the parts are balanced, so a healthy rank takes
about as long). Rank 0 then merges the parts into ``.metadata`` and publishes the
manifest ``snapshot-N-step-STEP.json`` (kind ``"sharded"``, format 2, with every file's
size and SHA-256), N being one more than the highest in the directory when rank 0's own
part started. Only then does the snapshot exist for the resume plan
(``durable.files.newest_valid``). Last, the directory is pruned to ``--snapshot-keep``.
Rank 0 publishes one snapshot at a time, in step order.

**Giving up.** When a part is still missing at the deadline (its rank died, or skipped the
commit), rank 0 logs one line, counts a failure and removes the directory. The newest
published snapshot stays the newest. A straggler's later part, or a directory that a dead
rank 0 left behind, is removed as a leftover (``durable.files.remove_sharded_leftovers``).

**Counts** (``WriterStats``, carried by the heartbeats like a DDP writer's): ``written``
counts the snapshots published (on rank 0 only, so the driver's sum counts each
snapshot once). ``failed`` counts each rank's own failed or skipped parts, and on rank 0
each snapshot given up or not published, so one lost snapshot can count on two ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightning_elastic.durable import files
from lightning_elastic.durable.files import Location, Manifest, SnapshotError, SnapshotSettings, Store
from lightning_elastic.durable.store import SnapshotInfo, WriterStats
from lightning_elastic.sharded.dcp_format import (
    METADATA_NAME,
    Flat,
    KeyPath,
    Part,
    ShardPiece,
    check_leaves,
    data_file_name,
    flatten,
    merge,
    metadata_bytes,
    part_name,
    write_items,
)

__all__ = ["ShardPiece", "ShardedSnapshotWriter", "SnapshotPlan", "agree_plan", "read_sharded", "steps_between"]

log = logging.getLogger(__name__)

PUBLISH_GRACE = 60.0  # s rank 0 waits for the other parts, beyond twice its own part's time
POLL_FIRST, POLL_MAX = 0.05, 1.0  # s between two looks for the other parts (doubling)
CLOSE_GRACE = 2.0  # s close() still gives a publication told to give up (it wakes at once)


@dataclasses.dataclass(frozen=True)
class SnapshotPlan:
    """What every rank of a round decides with; the same on all of them (``agree_plan``)."""

    token: str  # names the round's snapshot directories: 4 to 32 lowercase hex digits, new each round
    every_steps: int  # a commit whose step is a positive multiple of it is written

    def __post_init__(self) -> None:
        files.sharded_data_name(0, self.token)  # refuses a token that cannot be part of a name
        if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int) or self.every_steps < 1:
            raise SnapshotError(f"every_steps: expected a whole number of steps, 1 or more, got {self.every_steps!r}")

    def due(self, step: int) -> bool:
        """Whether the commit of ``step`` is written (on every rank alike). Step 0, the state
        before training, is not."""
        return step > 0 and step % self.every_steps == 0


def steps_between(every_seconds: float, seconds_per_step: float) -> int:
    """``--snapshot-every`` in steps, given the seconds a step takes (at least 1)."""
    if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
        raise SnapshotError(f"seconds_per_step: expected a positive, finite number of seconds, got {seconds_per_step}")
    return max(1, round(every_seconds / seconds_per_step))


def agree_plan(settings: SnapshotSettings, seconds_per_step: float, group: Any = None) -> SnapshotPlan:
    """The round's plan: a fresh token and ``settings.every`` in steps from rank 0's
    ``seconds_per_step``, broadcast from rank 0 of ``group`` (default: the default group).

    A collective: call it on the training thread of every rank of the round, at the same
    point (when the round starts, or once rank 0 has measured a few steps), and give its
    plan to each rank's ``ShardedSnapshotWriter``.
    """
    import torch.distributed as dist  # noqa: PLC0415

    steps_between(settings.every, seconds_per_step)  # every rank checks its own argument before the collective
    rank = dist.get_rank(group)
    box: list[SnapshotPlan | None] = [None]
    if rank == 0:
        box[0] = SnapshotPlan(secrets.token_hex(4), steps_between(settings.every, seconds_per_step))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    plan = box[0]
    if not isinstance(plan, SnapshotPlan):
        raise SnapshotError(f"agree_plan: rank 0 sent {type(plan).__name__}, expected a SnapshotPlan")
    return plan


class _Job:
    """One snapshot on this rank: its thread, and whether it still reads the offered tensors."""

    def __init__(self, flat: Flat, info: SnapshotInfo) -> None:
        self._flat: Flat | None = flat
        self.info = info
        self.part_done = threading.Event()
        self.thread: threading.Thread | None = None
        self.previous: threading.Thread | None = None  # the snapshot started before it, still running then

    def take(self) -> Flat:
        """The offered tree, forgotten here: once the part is written nothing of this job
        holds the commit's tensors, while rank 0's publication goes on."""
        flat, self._flat = self._flat, None
        if flat is None:
            raise RuntimeError("a sharded snapshot job ran twice")
        return flat


class ShardedSnapshotWriter:
    """Writes this rank's part of every due commit (see the module's docstring).

    ``offer`` is called by the training thread of every rank; ``writing`` and ``stats`` may
    be read from any thread; ``close`` waits, bounded, for the writes in progress. A new
    round (another rank or world size) takes a new writer, with the round's plan.
    """

    def __init__(self, settings: SnapshotSettings, rank: int, world_size: int, plan: SnapshotPlan,
                 job_id: str = "", publish_wait: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= rank < world_size:
            raise SnapshotError(f"rank {rank}: expected 0 <= rank < world_size ({world_size})")
        if publish_wait is not None and not publish_wait >= 0:
            raise SnapshotError(f"publish_wait: expected seconds, 0 or more, got {publish_wait}")
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self._job_id = job_id
        self._publish_wait = publish_wait
        self._clock = clock
        self._lock = threading.Lock()
        self._stats = WriterStats()
        self._said: set[str] = set()  # failures logged already: a failing disk says so once
        self._jobs: list[_Job] = []  # started and not yet seen finished
        self._last_step = -1  # the highest step decided on: an offer of it again is not due
        self._sequence = 0  # rank 0: N of its last snapshot
        self._stop = threading.Event()  # close(): publications waiting for parts give up

    @property
    def stats(self) -> WriterStats:
        with self._lock:
            return self._stats

    @property
    def writing(self) -> bool:
        """True while this rank's background write still reads the tensors of an offered tree."""
        return any(not job.part_done.is_set() for job in self._jobs)

    def offer(self, tree: Mapping[str, Any], info: SnapshotInfo) -> bool:
        """Start writing this rank's part of the commit ``tree`` if it is due; returns whether
        a write started. Called after every commit on every rank, with the same commit.

        ``tree`` is nested dicts and lists; its leaves are ``ShardPiece``s (this rank's rows)
        or tensors and values that are the same on every rank (written once, by rank 0).
        ``info.extra``'s entries are added to its top level. Never waits for the disk; an
        ill-formed tree raises ``SnapshotError`` here.
        """
        self._jobs = [job for job in self._jobs if job.thread is None or job.thread.is_alive()]
        if info.world_size != self.world_size:
            raise SnapshotError(f"info.world_size: {info.world_size}, but this writer is for a world of "
                                f"{self.world_size} (a new round takes a new writer)")
        if not self.plan.due(info.step) or info.step <= self._last_step:
            return False
        self._last_step = info.step
        if self.writing:
            self._fail("busy", f"step {info.step}: still writing the part of an earlier snapshot, none of this one "
                               "(that snapshot will be incomplete; a larger every_steps leaves a part more time)")
            return False
        extra = info.extra or {}
        clash = sorted(set(extra) & set(tree))
        if clash:
            raise SnapshotError(f"info.extra: {clash[0]!r} is also a key of the tree")
        flat = flatten({**tree, **extra})
        check_leaves(flat.leaves)
        job = _Job(flat, info)
        job.previous = self._jobs[-1].thread if self._jobs else None
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"elastic-sharded-snapshot-{info.step}",
                                      daemon=True)
        self._jobs.append(job)
        job.thread.start()
        return True

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait up to ``timeout`` s for this writer's threads; True when none is left."""
        deadline = time.monotonic() + timeout
        for job in list(self._jobs):
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(job.thread is not None and job.thread.is_alive() for job in self._jobs)

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` s for this rank's writes and rank 0's publications; a
        publication still waiting for parts then gives up (counted). A file still being
        written then is left to the leftover rules."""
        if not self.wait(timeout):
            self._stop.set()
            self.wait(CLOSE_GRACE)

    # ----- the writer threads -------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        info = job.info
        started = time.monotonic()
        directory = files.open_store(self.settings.directory)
        data_name = files.sharded_data_name(info.step, self.plan.token)
        flat = job.take()
        paths = flat.paths
        try:
            if self.rank == 0:
                directory.make()
                directory.clean_up()  # what dead writers left, before this write, whose space it may need
                # One part at a time on a rank (see offer): no other thread touches _sequence.
                self._sequence = max(self._sequence + 1, files.next_sequence(directory))
            sequence, taken_at = self._sequence, time.time()  # (used by rank 0 alone)
            own = self._write_part(directory, data_name, flat, info)
        except Exception as err:  # noqa: BLE001 - a snapshot never stops training
            self._fail(_kind(err), f"step {info.step}: {_text(err)}")
            return
        finally:
            del flat  # the commit's tensors: not held while rank 0 publishes
            job.part_done.set()
        if self.rank != 0:
            return
        own_seconds = time.monotonic() - started
        if job.previous is not None:
            # Rank 0 publishes in step order (the leftover rule relies on it): the previous
            # snapshot's publication, itself bounded, ends first; past twice its bound this
            # one goes on regardless.
            job.previous.join(2 * self._wait_for(own_seconds) + 1.0)
        try:
            self._publish(directory, data_name, own, paths, info, sequence, taken_at, own_seconds)
        except Exception as err:  # noqa: BLE001
            self._fail(_kind(err), f"step {info.step}: not published: {_text(err)}")
            _remove_leftovers(directory, self.plan.token, info.step)

    def _write_part(self, directory: Store, data_name: str, flat: Flat, info: SnapshotInfo) -> Part:
        sub = directory.child(data_name)
        sub.make()
        box: dict[str, Any] = {}

        def fill(f: Any) -> None:
            writer = box["w"] = files.HashingWriter(f)
            try:
                box["items"] = write_items(flat.leaves, self.rank, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None  # "No space left on device", not torch's "unexpected pos"
                raise

        name = data_file_name(self.rank)
        sub.write(name, fill, exclusive=True)
        part = Part(self.rank, self.world_size, info.step, self.plan.token, name, box["w"].size,
                    box["w"].hexdigest(), box["items"])
        text = part.to_json().encode()
        # After the data file, which is complete and durable by now: a description means a part.
        sub.write(part_name(self.rank), lambda f: f.write(text), exclusive=True)
        return part

    def _wait_for(self, own_seconds: float) -> float:
        return self._publish_wait if self._publish_wait is not None else PUBLISH_GRACE + 2 * own_seconds

    def _publish(self, directory: Store, data_name: str, own: Part, paths: dict[str, KeyPath],
                 info: SnapshotInfo, sequence: int, taken_at: float, own_seconds: float) -> None:
        started = time.monotonic()
        sub = directory.child(data_name)
        wait = self._wait_for(own_seconds)
        missing = self._await_parts(sub, self._clock() + wait)
        if missing:
            ranks = ", ".join(map(str, missing))
            if self._stop.is_set():
                wait = min(wait, time.monotonic() - started)  # close() cut the wait short
            self._fail(f"incomplete {missing}", f"step {info.step}: no part from rank(s) {ranks} within {wait:.1f} s",
                       f"The sharded snapshot of step {info.step} in {directory.location(data_name)} is incomplete: "
                       f"no part from rank(s) {ranks} within {wait:.1f} s; it is not published (the newest complete "
                       "snapshot stays the newest) and is removed; training goes on.")
            _remove_leftovers(directory, self.plan.token, info.step)
            return
        parts = [own] + [self._read_part(sub, r, info) for r in range(1, self.world_size)]
        metadata = merge(parts, paths, str(directory.location(data_name)))
        blob = metadata_bytes(metadata)
        sub.write(METADATA_NAME, lambda f: f.write(blob))  # the manifest, written after it, decides
        checksums = {p.file: {"size": p.size, "sha256": p.sha256} for p in parts}
        checksums[METADATA_NAME] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        library, torch_version = _versions()
        manifest = Manifest(
            sequence=sequence, round=info.round, step=info.step, epoch=info.epoch, world_size=self.world_size,
            sampler=info.sampler, time=taken_at, library=library, torch=torch_version, job_id=self._job_id,
            kind=files.SHARDED, sha256=hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest(),
            size=sum(c["size"] for c in checksums.values()), format=files.FORMAT_SHARDED, data=data_name,
            parts=checksums,
        )
        try:
            files.publish(directory, manifest)
        except FileExistsError:
            # The name carries the step: another writer of the job published this same commit.
            log.info("Sharded snapshot %s was published by another writer of the job already: this one is dropped.",
                     manifest.manifest_name)
            directory.delete_tree(data_name)
            return
        with self._lock:
            self._stats = dataclasses.replace(self._stats, written=self._stats.written + 1)
        log.info("Sharded snapshot %s written (step %d, %d ranks, %.1f MB).", manifest.manifest_name, info.step,
                 self.world_size, manifest.size / 1e6)
        try:  # the snapshot exists now: what fails from here fails no snapshot
            for r in range(self.world_size):
                sub.delete(part_name(r))  # merged into .metadata and the manifest
            files.prune(directory, self.settings.keep)
        except OSError as err:
            log.info("Could not prune %s after the sharded snapshot of step %d (%s); the next one tries again.",
                     directory.location(""), info.step, _text(err))
        _remove_leftovers(directory, self.plan.token, info.step)

    def _await_parts(self, sub: Store, deadline: float) -> list[int]:
        """The ranks whose part is still missing at ``deadline`` ([] once all are there)."""
        interval = POLL_FIRST
        while True:
            names = set(sub.names())
            missing = [r for r in range(self.world_size) if part_name(r) not in names]
            left = deadline - self._clock()
            if not missing or left <= 0 or self._stop.is_set():
                return missing
            # The other parts are written by other processes, perhaps on other machines, and
            # the store is all these threads share: it is looked at again, not waited on.
            self._stop.wait(min(interval, left))
            interval = min(interval * 2, POLL_MAX)

    def _read_part(self, sub: Store, rank: int, info: SnapshotInfo) -> Part:
        where = str(sub.location(part_name(rank)))
        part = Part.from_json(sub.read_bytes(part_name(rank)).decode(), where)
        if (part.rank, part.world_size, part.step, part.token) != (rank, self.world_size, info.step, self.plan.token):
            raise SnapshotError(f"{where}: rank {part.rank} of {part.world_size}, step {part.step}, token "
                                f"{part.token}; expected rank {rank} of {self.world_size}, step {info.step}, token "
                                f"{self.plan.token}")
        size = sub.size(part.file)
        if size != part.size:
            raise SnapshotError(f"{sub.location(part.file)}: {size} bytes, its part says {part.size}")
        return part

    def _fail(self, kind: str, error: str, line: str = "") -> None:
        """Count a failure (``error``: the summary's reason) and log ``line`` once per ``kind``:
        a failing disk or a dead rank would say it at every snapshot."""
        with self._lock:
            self._stats = dataclasses.replace(self._stats, failed=self._stats.failed + 1, last_error=error)
            new = kind not in self._said and len(self._said) < 16
            if new:
                self._said.add(kind)
        if new:
            log.warning("%s", line or f"Rank {self.rank} could not write its part of a sharded snapshot to "
                                      f"{self.settings.directory} ({error}); training goes on.")


def _remove_leftovers(directory: Store, token: str, step: int) -> None:
    try:
        files.remove_sharded_leftovers(directory, token, step)
    except OSError as err:
        log.info("Could not remove the leftovers of sharded snapshots in %s (%s); the next writer tries again.",
                 directory.location(""), _text(err))


def _kind(err: Exception) -> str:
    return (err.strerror or type(err).__name__) if isinstance(err, OSError) else type(err).__name__


def _text(err: Exception) -> str:
    if isinstance(err, OSError):
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where}"
    return f"{type(err).__name__}: {err}"


def _versions() -> tuple[str, str]:
    import torch  # noqa: PLC0415

    from lightning_elastic._version import __version__  # noqa: PLC0415

    return __version__, str(torch.__version__)


# ----- reading ---------------------------------------------------------------------------


def read_sharded(path: Location | os.PathLike[str], target: dict[str, Any], process_group: Any = None) -> None:
    """Fill ``target`` from the sharded snapshot ``path`` (its DCP directory, as the resume
    plan's ``Found.path`` names it), with ``torch.distributed.checkpoint.load``.

    A collective over ``process_group`` (default: the default group, or none) at any world
    size. ``target`` has the layout that was written: sharded leaves are DTensors of the
    current layout or plain full tensors, filled in place; other leaves are replaced by the
    saved values.
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    location = files.as_location(os.fspath(path))
    dcp.load(target, checkpoint_id=location, process_group=process_group)


def saved_tensors(path: Location | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], Any] | None]:
    """Every key of the sharded snapshot ``path``: its tensor's global shape and dtype, or
    None for a value that is not a tensor (from the DCP metadata alone, no data read)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    location = files.as_location(os.fspath(path))
    if "://" in str(location):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415 - what dcp.load uses

        reader: Any = FsspecReader(location)
    else:
        reader = dcp.FileSystemReader(location)
    metadata = reader.read_metadata()
    return {key: ((tuple(m.size), m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None)
            for key, m in metadata.state_dict_metadata.items()}
