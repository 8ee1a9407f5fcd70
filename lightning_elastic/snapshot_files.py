"""Durable snapshots on disk: their layout, manifests, checksums, and which one to resume.

Standard library only: the driver picks the snapshot a launch resumes from without
importing torch. A snapshot ``N`` is two files in the snapshot directory:

* ``snapshot-N.pt``: the committed state tree as ``torch.save`` writes it (for an
  ``elastic_hvd`` job, a Lightning checkpoint);
* ``snapshot-N.json``: its manifest (``Manifest``), with the data file's SHA-256.

Both are written under a temporary name, fsynced and renamed into place, data file first:
the manifest's rename is what makes a snapshot exist, so a crash at any moment leaves
either a complete snapshot or none (a stray temporary file, removed by the next writer).
A data file that no longer matches its manifest's checksum (truncated, overwritten) is
skipped when resuming, with a warning, in favour of the previous snapshot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

# The manifest's format: a snapshot written by a newer format is refused, not guessed at.
FORMAT = 1
_NAME = re.compile(r"^snapshot-(\d{1,12})\.json$")
TEMP_PREFIX = ".tmp-snapshot-"
_CHUNK = 1 << 22

# What the launcher tells its workers (--snapshot-*); read by lightning_elastic.snapshot_store.
ENV_DIR = "LIGHTNING_ELASTIC_SNAPSHOT_DIR"
ENV_EVERY = "LIGHTNING_ELASTIC_SNAPSHOT_EVERY"
ENV_KEEP = "LIGHTNING_ELASTIC_SNAPSHOT_KEEP"
ENV_NO_RESUME = "LIGHTNING_ELASTIC_NO_RESUME"
# The data file of the snapshot the driver chose (and verified) for this launch to resume from.
ENV_RESUME_FROM = "LIGHTNING_ELASTIC_RESUME_FROM"
ENV_JOB_ID = "LIGHTNING_ELASTIC_JOB_ID"  # the launch's job id, recorded in each manifest


class SnapshotError(ValueError):
    """A snapshot setting or file that cannot be used; the message is one line."""


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    """Where and how often the newest commit is persisted (``--snapshot-*``)."""

    directory: Path
    every: float = 60.0  # seconds between the starts of two snapshots
    keep: int = 2  # complete snapshots kept; older ones are deleted
    resume: bool = True  # False: --no-resume, start over even if the directory holds snapshots

    def __post_init__(self) -> None:
        if not str(self.directory).strip():
            raise SnapshotError("--snapshot-dir: expected a directory, got an empty path")
        if self.directory.exists() and not self.directory.is_dir():
            raise SnapshotError(f"--snapshot-dir: {self.directory} is a file, expected a directory")
        # "not > 0" refuses NaN too; inf would mean never.
        if not (self.every > 0 and math.isfinite(self.every)):
            raise SnapshotError(f"--snapshot-every: expected a positive, finite number of seconds, got {self.every}")
        if self.keep < 1:
            raise SnapshotError(f"--snapshot-keep: expected 1 or more snapshots to keep, got {self.keep}")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a snapshot holds, written next to it as JSON."""

    sequence: int  # N of snapshot-N: increases with every snapshot written to the directory
    round: int  # the round whose rank 0 committed it
    step: int  # the training step of the commit (the state's step or the commit count)
    epoch: int
    world_size: int
    sampler: dict[str, int] | None  # the ElasticSampler's position: epoch and samples consumed
    time: float  # wall clock when the commit was taken for writing
    library: str  # lightning-elastic version
    torch: str
    job_id: str  # the launch that wrote it (same command: same id); "" when unknown
    kind: str  # "state" (le.TorchState / ObjectState), "lightning" (a checkpoint), "fabric"
    sha256: str  # of the data file
    size: int  # the data file's bytes
    format: int = FORMAT

    @property
    def data_name(self) -> str:
        return f"snapshot-{self.sequence}.pt"

    @property
    def manifest_name(self) -> str:
        return f"snapshot-{self.sequence}.json"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise SnapshotError(f"{where}: not a JSON manifest ({err})") from None
        if not isinstance(data, dict):
            raise SnapshotError(f"{where}: expected a JSON object")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data) - {"format"})
        if missing:
            raise SnapshotError(f"{where}: missing field(s) {', '.join(missing)}")
        fmt = data.get("format", FORMAT)
        if not isinstance(fmt, int) or fmt > FORMAT:
            raise SnapshotError(f"{where}: written in snapshot format {fmt!r}, this lightning-elastic reads "
                                f"format {FORMAT} and older: resume with the version that wrote it")
        values = {k: v for k, v in data.items() if k in fields}
        for name, kind in (("sequence", int), ("step", int), ("round", int), ("size", int), ("sha256", str)):
            if not isinstance(values[name], kind) or isinstance(values[name], bool):
                raise SnapshotError(f"{where}: field {name} is not {kind.__name__}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Found:
    """A snapshot on disk: its manifest and the data file's path."""

    manifest: Manifest
    path: Path


class HashingWriter:
    """A file opened for writing that hashes what goes through it (``torch.save`` takes it)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)
        return self._file.write(view)

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def next_sequence(directory: Path) -> int:
    """One more than the highest snapshot number in ``directory`` (1 when there is none)."""
    numbers = [n for n, _ in _manifest_files(directory)]
    return max(numbers, default=0) + 1


def _manifest_files(directory: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), directory / name))
    return sorted(found)


def write_atomically(path: Path, fill: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``fill(file)``: a temporary name, fsync, rename, fsync the directory."""
    temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        with open(temp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            temp.unlink()
        except OSError:
            pass
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest`` next to its data file, which is complete and durable already."""
    text = manifest.to_json().encode()
    write_atomically(directory / manifest.manifest_name, lambda f: f.write(text))


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` snapshots (manifest first: a snapshot stops
    existing before its data goes) and temporary files left by a crashed writer."""
    manifests = _manifest_files(directory)
    for number, manifest in manifests[: max(0, len(manifests) - keep)]:
        for path in (manifest, directory / f"snapshot-{number}.pt"):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    mine = f"{TEMP_PREFIX}{os.getpid()}-"
    for name in names:
        # Another process's temporary file may be a write in progress (two jobs, one
        # directory); only this process's own leftovers are certainly dead.
        if name.startswith(mine):
            try:
                (directory / name).unlink()
            except FileNotFoundError:
                pass


def snapshots(directory: Path) -> Iterator[tuple[int, Path]]:
    """``(number, manifest path)`` of every snapshot in ``directory``, newest first."""
    return iter(reversed(_manifest_files(directory)))


def check(manifest_path: Path, verify: bool = True) -> Found:
    """The snapshot of ``manifest_path``, its checksum verified; ``SnapshotError`` says why not."""
    try:
        text = manifest_path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{manifest_path}: cannot read the manifest ({err})") from None
    manifest = Manifest.from_json(text, str(manifest_path))
    data = manifest_path.with_name(manifest.data_name)
    try:
        size = data.stat().st_size
    except OSError as err:
        raise SnapshotError(f"{data}: {err.strerror or err}") from None
    if size != manifest.size:
        raise SnapshotError(f"{data}: {size} bytes, its manifest says {manifest.size} (torn or truncated)")
    if verify:
        try:
            digest = file_sha256(data)
        except OSError as err:
            raise SnapshotError(f"{data}: {err.strerror or err}") from None
        if digest != manifest.sha256:
            raise SnapshotError(f"{data}: checksum mismatch (corrupt or overwritten)")
    return Found(manifest, data)


def newest_valid(directory: Path, warn: Callable[[str], None]) -> Found | None:
    """The newest snapshot in ``directory`` whose data matches its manifest, or None.

    Each newer one that does not is named through ``warn`` and skipped.
    """
    for _, manifest_path in snapshots(directory):
        try:
            return check(manifest_path)
        except SnapshotError as err:
            warn(f"skipping snapshot {manifest_path.name}: {err}")
    return None


def job_id_of(command: tuple[str, ...] | list[str]) -> str:
    """A launch's job id: the same command line (hence a relaunch of it) has the same one."""
    return hashlib.sha256("\0".join(command).encode()).hexdigest()[:16]
