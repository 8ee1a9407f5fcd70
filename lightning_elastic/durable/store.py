"""The background snapshot writer, and reading a snapshot back.

One rank per round (rank 0: it holds the newest commit, and every other rank takes its
state) offers its ``HostSnapshot`` to a ``SnapshotWriter`` after every commit. When a
snapshot is due (``every`` seconds after the previous one started) and none is being
written, the writer leases the newest commit's host buffers (``HostSnapshot.lease``) and a
thread of its own writes them to disk (``durable.files``: temporary name, fsync, atomic
rename, checksummed manifest, the last ``keep`` kept). The training thread only takes the
lease: it never waits for the disk.

A commit made while a snapshot is being written is not written (**skipped**): the next
snapshot takes whatever commit is newest when it is due. Memory stays bounded: the leased
buffers are not reused meanwhile, so commits alternate between the two other sets (one
extra copy of the state at most, allocated once; see ``HostSnapshot.lease``).

A write that fails (a read-only directory, a full disk) never stops training: it is
logged once per distinct error, counted, and the driver prints the count in its summary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_elastic.durable import files
from lightning_elastic.commit.buffers import Committed, HostSnapshot
from lightning_elastic.durable.files import (
    ENV_DIR,
    ENV_EVERY,
    ENV_KEEP,
    ENV_NO_RESUME,
    ENV_RESUME_FROM,
    Found,
    Location,
    Manifest,
    SnapshotError,
    SnapshotSettings,
)

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """What a commit says about itself, for the manifest."""

    round: int
    step: int
    epoch: int
    world_size: int
    sampler: dict[str, int] | None
    kind: str = "state"
    # Top-level entries added to the tree written (Lightning: what its checkpoint leaves
    # out and an elastic resume needs); plain data, never changed after the offer.
    extra: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class WriterStats:
    """What the driver's summary reports (sent with the worker's heartbeats)."""

    written: int = 0
    failed: int = 0
    last_error: str = ""


def settings_from_environment(environ: Any = os.environ) -> SnapshotSettings | None:
    """The launcher's ``--snapshot-*`` options as its workers receive them, or None."""
    directory = environ.get(ENV_DIR, "").strip()
    if not directory:
        return None
    try:
        every = float(environ.get(ENV_EVERY, "60"))
        keep = int(environ.get(ENV_KEEP, "2"))
    except ValueError as err:
        raise SnapshotError(f"{ENV_EVERY}/{ENV_KEEP}: {err}") from None
    resume = environ.get(ENV_NO_RESUME, "").strip().lower() not in ("1", "true", "yes", "on")
    return SnapshotSettings(files.as_location(directory), every, keep, resume)


def plan(environ: Any = os.environ, directory: str | os.PathLike[str] | None = None, every: float | None = None,
         keep: int | None = None, resume: bool | None = None) -> tuple[SnapshotSettings | None, Location | None]:
    """``(settings, resume_from)``: the launcher's environment, overridden by ``le.init``'s
    arguments. ``resume_from`` is the snapshot the driver chose (None: it chose none, or
    there is no driver)."""
    settings = settings_from_environment(environ)
    if directory is not None:
        base = settings or SnapshotSettings(files.as_location(directory))
        settings = SnapshotSettings(files.as_location(directory), base.every, base.keep, base.resume)
    elif settings is None and (every is not None or keep is not None or resume is not None):
        raise SnapshotError("snapshot_every, snapshot_keep and resume need snapshot_dir (or the launcher's "
                            "--snapshot-dir)")
    if settings is None:
        return None, None
    settings = SnapshotSettings(
        settings.directory,
        settings.every if every is None else every,
        settings.keep if keep is None else keep,
        settings.resume if resume is None else resume,
    )
    chosen = environ.get(ENV_RESUME_FROM, "").strip()
    return settings, (files.as_location(chosen) if chosen and settings.resume else None)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What the first round resumes from: ``path``, the snapshot the driver chose and
    verified, or (None) the newest valid one in ``directory``, searched by rank 0."""

    path: Location | None
    directory: Location

    def locate(self) -> Found | None:
        if self.path is not None:
            # Verified by the driver just now; the size check still catches a file
            # replaced since.
            return locate(self.path, verify=False, warn=_warn)
        return files.newest_valid(self.directory, _warn)


def _warn(text: str) -> None:
    log.warning("%s", text)


def _versions() -> tuple[str, str]:
    import torch

    from lightning_elastic._version import __version__

    return __version__, str(torch.__version__)


class SnapshotWriter:
    """Persists the newest commit of a ``HostSnapshot`` every ``settings.every`` seconds.

    ``offer()`` is called by the training thread after a commit; ``stats`` may be read from
    any thread. ``close()`` waits (bounded) for a write in progress.
    """

    def __init__(self, settings: SnapshotSettings, job_id: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._job_id = job_id
        self._clock = clock
        self._last_start = clock()  # the first snapshot is due one period after start
        self._lock = threading.Lock()
        self._stats = WriterStats()
        self._said: set[str] = set()  # errors logged already: a failing disk says so once
        self._busy: tuple[threading.Thread, HostSnapshot] | None = None
        self._sequence: int | None = None

    @property
    def stats(self) -> WriterStats:
        with self._lock:
            return self._stats

    def offer(self, snapshot: HostSnapshot, info: SnapshotInfo, may_start: bool = True, force: bool = False) -> bool:
        """Start writing ``snapshot``'s newest commit if one is due and none is in progress.

        ``may_start``: False on a rank that does not write (not rank 0 of its round), which
        still collects a write it started earlier. Returns whether a write started. Never
        blocks on the disk.
        """
        self._collect()
        if self._busy is not None or not may_start:
            return False
        now = self._clock()
        if not force and now - self._last_start < self.settings.every:
            return False
        committed = snapshot.lease()
        if committed is None:
            return False
        self._last_start = now
        thread = threading.Thread(target=self._write, args=(committed, info), name="elastic-snapshot", daemon=True)
        self._busy = (thread, snapshot)
        thread.start()
        return True

    def _collect(self) -> None:
        """A finished write gives its buffers back (on the training thread, which owns the
        ``HostSnapshot``)."""
        if self._busy is not None and not self._busy[0].is_alive():
            self._busy[1].release()
            self._busy = None

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` s for a write in progress (its temporary file would be left)."""
        if self._busy is not None:
            self._busy[0].join(timeout)
            self._collect()

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait for a write in progress; True when none is left (for tests and flushes)."""
        self.close(timeout)
        return self._busy is None

    # ----- the writer thread --------------------------------------------------------------

    def _write(self, committed: Committed, info: SnapshotInfo) -> None:
        started = time.monotonic()
        try:
            manifest = self._write_files(committed, info)
            if manifest is None:
                return
        except Exception as err:  # noqa: BLE001 - a snapshot never stops training
            text = f"{type(err).__name__}: {err}" if not isinstance(err, OSError) else _os_error(err)
            with self._lock:
                self._stats = dataclasses.replace(self._stats, failed=self._stats.failed + 1, last_error=text)
            # Said once per kind of failure (not per file name: each attempt names its own).
            kind = (err.strerror or type(err).__name__) if isinstance(err, OSError) else type(err).__name__
            if kind not in self._said and len(self._said) < 16:
                self._said.add(kind)
                log.warning("Could not write a snapshot to %s (%s); training goes on, the next one is tried "
                            "in %g s.", self.settings.directory, text, self.settings.every)
            return
        with self._lock:
            self._stats = dataclasses.replace(self._stats, written=self._stats.written + 1)
        log.info("Snapshot %s written (step %d, %.1f MB, %.2f s).", manifest.data_name, manifest.step,
                 manifest.size / 1e6, time.monotonic() - started)

    def _write_files(self, committed: Committed, info: SnapshotInfo) -> Manifest | None:
        """Write the snapshot; None when another writer of the job wrote the same one."""
        import torch

        directory = files.open_store(self.settings.directory)  # a local directory or an object store
        directory.make()
        # What dead writers left (a rank 0 killed mid-write, whatever its pid): before this
        # write, whose space it may need.
        directory.clean_up()
        # The next number after this writer's last and after any in the directory (the
        # previous rank 0 of the job wrote there too); a failed write uses none up. Another
        # writer may take the same number (nothing reserves it before the write ends): the
        # step in the name tells the two snapshots apart and orders them.
        sequence = max((self._sequence or 0) + 1, files.next_sequence(directory))
        taken_at = time.time()
        tree = committed.tree(clone=False)  # the leased buffers themselves: only read
        if info.kind == "fabric":
            tree = flatten(tree)
        if info.extra:
            tree = {**tree, **info.extra}
        box: dict[str, files.HashingWriter] = {}

        def fill(f: Any) -> None:
            writer = box["w"] = files.HashingWriter(f)
            try:
                torch.save(tree, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None  # "No space left on device", not torch's "unexpected pos"
                raise

        library, torch_version = _versions()
        partial = Manifest(
            sequence=sequence, round=info.round, step=info.step, epoch=info.epoch, world_size=info.world_size,
            sampler=info.sampler, time=taken_at, library=library, torch=torch_version, job_id=self._job_id,
            kind=info.kind, sha256="", size=0,
        )
        try:
            # Published without replacing anything (see durable.fs): a name taken already
            # is this same commit, written by another writer of the job.
            directory.write(partial.data_name, fill, exclusive=True)
        except FileExistsError:
            log.info("Snapshot %s was written by another writer of the job already: this one is skipped.",
                     partial.data_name)
            self._sequence = sequence
            return None
        manifest = dataclasses.replace(partial, sha256=box["w"].hexdigest(), size=box["w"].size)
        files.publish(directory, manifest)
        self._sequence = sequence
        files.prune(directory, self.settings.keep)
        return manifest


def _os_error(err: OSError) -> str:
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or err}{where}"


# ----- reading ---------------------------------------------------------------------------


def load_snapshot(path: str | os.PathLike[str], verify: bool = True) -> Any:
    """The state tree of a snapshot: ``path`` is its data file (``snapshot-N-step-STEP.pt``), its
    manifest (``.json``) or a snapshot directory (its newest valid snapshot). A sharded
    snapshot is refused: ``torch.distributed.checkpoint.load`` reads it.

    For a ``le.TorchState`` the tree is ``{"values": {...}, "stateful": {name:
    state_dict}}``; for an ``elastic_hvd`` job a Lightning checkpoint dict. The checksum
    is verified first (``verify=False`` skips it). Like ``torch.load`` of a full
    checkpoint, it unpickles Python objects: load snapshots from directories you trust.
    """
    found = locate(files.as_location(path), verify, lambda text: log.warning("%s", text))
    if found.manifest.kind == files.SHARDED:
        raise SnapshotError(f"{found.path}: a sharded snapshot (a torch.distributed.checkpoint directory): load it "
                            "with torch.distributed.checkpoint.load(state_dict, checkpoint_id=...) or "
                            "lightning_elastic.sharded.snapshots.read_sharded")
    return read_tree(found.path)


def locate(path: Location, verify: bool, warn: Callable[[str], None]) -> Found:
    """The snapshot ``path`` names (see ``load_snapshot``; also a sharded snapshot's DCP
    directory, ``snapshot-step-STEP-TOKEN.dcp``), or ``SnapshotError``."""
    if files.base_name(path).endswith(".dcp"):
        return files.check_sharded(path, verify)
    if isinstance(path, str):  # a URL: a snapshot file's, else a directory's
        name = files.base_name(path)
        if not name.endswith((".pt", ".json")):
            found = files.newest_valid(path, warn)
            if found is None:
                raise SnapshotError(f"{path}: no valid snapshot there")
            return found
        return files.check(path[: -len(name)] + name.rsplit(".", 1)[0] + ".json", verify)
    if path.is_dir():
        found = files.newest_valid(path, warn)
        if found is None:
            raise SnapshotError(f"{path}: no valid snapshot in this directory")
        return found
    manifest = path if path.suffix == ".json" else path.with_suffix(".json")
    if not manifest.exists():
        raise SnapshotError(f"{path}: no such snapshot (expected snapshot-N-step-STEP.pt with its .json manifest)")
    return files.check(manifest, verify)


def read_tree(path: Location) -> Any:
    import torch

    try:
        if isinstance(path, str) and files.is_url(path):
            store, name = files.split(path)
            with store.open_read(name) as f:  # seekable: torch.load reads the zip's index first
                return torch.load(f, map_location="cpu", weights_only=False)
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling error: one line naming the file
        raise SnapshotError(f"{path}: cannot be loaded ({type(err).__name__}: {err})") from None


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
    """A ``FabricState`` tree as ``fabric.save`` lays a checkpoint out: one dict, each
    object's state dict under its name, the plain values beside them."""
    return {**tree.get("stateful", {}), **tree["values"]}


def unflatten(flat: dict[str, Any], stateful_names: set[str]) -> dict[str, Any]:
    """``flatten`` undone, given the names of the state's objects with a ``state_dict``."""
    return {"values": {k: v for k, v in flat.items() if k not in stateful_names},
            "stateful": {k: v for k, v in flat.items() if k in stateful_names}}


