"""Durable snapshots on disk: their layout, manifests, checksums, and which one to resume.

Standard library only: the driver picks the snapshot a launch resumes from without
importing torch. A snapshot is two files in the snapshot directory, named by its number
``N`` and the ``STEP`` of its commit:

* ``snapshot-N-step-STEP.pt``: the committed state tree as ``torch.save`` writes it (for
  an ``elastic_hvd`` job, a Lightning checkpoint);
* ``snapshot-N-step-STEP.json``: its manifest (``Manifest``), with the data file's SHA-256.

Snapshots are ordered by ``(N, STEP)``. ``N`` is one more than the highest in the
directory when the write starts, so two writers of one job (a rank 0 whose round ended
while it wrote, and the next round's) may take the same ``N``; their commits then differ
in ``STEP``, the newer one orders after the older, and neither name is another's. Both
files are published without replacing anything (a hard link, ``O_EXCL``, fsspec's
exclusive mode): a newer snapshot is never replaced by an older one. The previous naming,
``snapshot-N.pt`` and ``snapshot-N.json``, is still read (ordered as ``(N, -1)``).

Both are written under a temporary name, fsynced and published, data file first: the
manifest's is what makes a snapshot exist, so a crash at any moment leaves either a
complete snapshot or none (a stray temporary file, removed by the next writer whatever its
pid, once its own writer is dead; a data file without a manifest, pruned with the older
snapshots). A data file that no longer matches its manifest's checksum (truncated,
overwritten) is skipped when resuming, with a warning, in favour of the previous snapshot.

The directory may also be an fsspec URL (``s3://bucket/prefix``): every file operation
goes through a ``snapshot_fs.Store``, which for an object store writes each file under
its final name (no rename there); the manifest, written last, still decides.

A **sharded** snapshot (``lightning_elastic.sharded.snapshots``, manifest kind
``"sharded"``, format 2) keeps its data in a torch.distributed.checkpoint directory,
``snapshot-step-STEP-TOKEN.dcp`` (one data file per rank and ``.metadata``), which every
rank of a round writes into without knowing ``N``; its manifest, ``snapshot-N-step-STEP.json``
as above, names that directory (``data``) and each file's size and SHA-256 (``parts``).
A directory that no manifest names is incomplete (a rank did not write its part) and is
removed as a leftover: by the round that wrote it once a later snapshot of the round is
published or given up on, or by anyone once nothing in it changed for
``FOREIGN_TEMP_AGE`` seconds (``remove_sharded_leftovers``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from lightning_elastic.durable.fs import (  # noqa: F401 - re-exported: files is the API
    FOREIGN_TEMP_AGE,
    TEMP_PREFIX,
    Location,
    SnapshotError,
    Store,
    as_location,
    base_name,
    fsync_directory,
    check_url,
    is_url,
    open_store,
    split,
    write_atomically,
)

# The newest manifest format this version reads: a newer one is refused, not guessed at.
FORMAT = 2
FORMAT_SINGLE = 1  # the data in one file, snapshot-N-step-STEP.pt (what older versions read too)
FORMAT_SHARDED = 2  # the data in a DCP directory that the manifest names, with each file's checksum
SHARDED = "sharded"  # the manifest kind of a sharded snapshot
# A snapshot's files: snapshot-N-step-STEP.{pt,json}, or the previous naming snapshot-N.{pt,json}.
_FILE = re.compile(r"^snapshot-(\d{1,12})(?:-step-(\d{1,18}))?\.(json|pt)$")
# A sharded snapshot's DCP directory: the commit's step and the round's token (see sharded_data_name).
_SHARDED_DATA = re.compile(r"^snapshot-step-(\d{1,18})-([0-9a-f]{4,32})\.dcp$")
_CHUNK = 1 << 22

# What the launcher tells its workers (--snapshot-*); read by lightning_elastic.durable.store.
ENV_DIR = "LIGHTNING_ELASTIC_SNAPSHOT_DIR"
ENV_EVERY = "LIGHTNING_ELASTIC_SNAPSHOT_EVERY"
ENV_KEEP = "LIGHTNING_ELASTIC_SNAPSHOT_KEEP"
ENV_NO_RESUME = "LIGHTNING_ELASTIC_NO_RESUME"
# The data file of the snapshot the driver chose (and verified) for this launch to resume from.
ENV_RESUME_FROM = "LIGHTNING_ELASTIC_RESUME_FROM"
ENV_JOB_ID = "LIGHTNING_ELASTIC_JOB_ID"  # the launch's job id, recorded in each manifest


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    """Where and how often the newest commit is persisted (``--snapshot-*``)."""

    directory: Location  # a Path, or an fsspec URL (a str)
    every: float = 60.0  # seconds between the starts of two snapshots
    keep: int = 2  # complete snapshots kept; older ones are deleted
    resume: bool = True  # False: --no-resume, start over even if the directory holds snapshots
    # --resume-other-command: resume from a snapshot another command wrote (its job id
    # differs: other arguments, another script); refused without it (the launcher's check).
    resume_other_command: bool = False

    def __post_init__(self) -> None:
        if not str(self.directory).strip():
            raise SnapshotError("--snapshot-dir: expected a directory, got an empty path")
        object.__setattr__(self, "directory", as_location(self.directory))
        if isinstance(self.directory, str):
            check_url(self.directory)
        elif self.directory.exists() and not self.directory.is_dir():
            raise SnapshotError(f"--snapshot-dir: {self.directory} is a file, expected a directory")
        # "not > 0" refuses NaN too; inf would mean never.
        if not (self.every > 0 and math.isfinite(self.every)):
            raise SnapshotError(f"--snapshot-every: expected a positive, finite number of seconds, got {self.every}")
        if self.keep < 1:
            raise SnapshotError(f"--snapshot-keep: expected 1 or more snapshots to keep, got {self.keep}")
        if self.resume_other_command and not self.resume:
            raise SnapshotError("--resume-other-command: not with --no-resume, which starts over")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a snapshot holds, written next to it as JSON."""

    sequence: int  # N of snapshot-N-step-STEP: one more than the highest in the directory when written
    round: int  # the round whose rank 0 committed it
    step: int  # the training step of the commit (the state's step or the commit count)
    epoch: int
    world_size: int
    sampler: dict[str, int] | None  # the ElasticSampler's position: epoch and samples consumed
    time: float  # wall clock when the commit was taken for writing
    library: str  # lightning-elastic version
    torch: str
    job_id: str  # the launch that wrote it (same command: same id); "" when unknown
    kind: str  # "state" (le.TorchState / ObjectState), "lightning" (a checkpoint), "fabric", "sharded"
    sha256: str  # of the data file (sharded: of ``parts`` as sorted JSON)
    size: int  # the data file's bytes (sharded: all its files')
    format: int = FORMAT_SINGLE
    # A sharded snapshot's DCP directory, and each of its files' {"size", "sha256"} by name.
    data: str = ""
    parts: dict[str, dict[str, Any]] | None = None

    @property
    def data_name(self) -> str:
        """The data's name as this version writes it (a manifest read from the directory
        names a data file by its own name: see ``data_name_of``)."""
        return self.data or f"snapshot-{self.sequence}-step-{self.step}.pt"

    @property
    def manifest_name(self) -> str:
        return f"snapshot-{self.sequence}-step-{self.step}.json"

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
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise SnapshotError(f"{where}: missing field(s) {', '.join(missing)}")
        fmt = data.get("format", FORMAT_SINGLE)
        if not isinstance(fmt, int) or fmt > FORMAT:
            raise SnapshotError(f"{where}: written in snapshot format {fmt!r}, this lightning-elastic reads "
                                f"format {FORMAT} and older: resume with the version that wrote it")
        values = {k: v for k, v in data.items() if k in fields}
        for name, kind in (("sequence", int), ("step", int), ("round", int), ("size", int), ("sha256", str)):
            if not isinstance(values[name], kind) or isinstance(values[name], bool):
                raise SnapshotError(f"{where}: field {name} is not {kind.__name__}")
        if values.get("data") or fmt >= FORMAT_SHARDED:
            _check_sharded_fields(values, where)
        return cls(**values)


def _check_sharded_fields(values: dict[str, Any], where: str) -> None:
    data, parts = values.get("data"), values.get("parts")
    if not isinstance(data, str) or not _SHARDED_DATA.match(data):
        raise SnapshotError(f"{where}: field data is not a sharded snapshot's directory name "
                            "(snapshot-step-STEP-TOKEN.dcp)")
    if not isinstance(parts, dict) or not parts:
        raise SnapshotError(f"{where}: field parts is not a non-empty object")
    for name, part in parts.items():
        if "/" in name or name in ("", ".", "..") or not isinstance(part, dict) or \
                not isinstance(part.get("size"), int) or not isinstance(part.get("sha256"), str):
            raise SnapshotError(f"{where}: parts[{name!r}] is not a file name with its size and sha256")


@dataclasses.dataclass(frozen=True)
class Found:
    """A snapshot on disk: its manifest and the data file's path (or URL); a sharded
    snapshot's is its DCP directory, which ``torch.distributed.checkpoint.load`` reads."""

    manifest: Manifest
    path: Location

    @property
    def name(self) -> str:
        return base_name(self.path)


class HashingWriter:
    """A file opened for writing that hashes what goes through it (``torch.save`` takes it)."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0
        # The file's own error: torch.save's C++ writer reports a failed write as
        # "unexpected pos ..." (a full disk among them), which names no cause.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)
        try:
            return self._file.write(view)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def file_sha256(path: Location) -> str:
    store, name = split(path)
    return store_sha256(store, name)


def store_sha256(store: Store, name: str) -> str:
    digest = hashlib.sha256()
    with store.open_read(name) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def next_sequence(directory: Location | Store) -> int:
    """One more than the highest snapshot number in ``directory`` (1 when there is none),
    data files without a manifest included."""
    numbers = [key[0] for key, _name, _kind in _snapshot_files(open_store(directory))]
    return max(numbers, default=0) + 1


def _snapshot_files(store: Store) -> list[tuple[tuple[int, int], str, str]]:
    """``((N, STEP), name, "json" or "pt")`` of each snapshot file, oldest first (the
    previous naming's files as step -1)."""
    found = []
    for name in store.names():
        match = _FILE.match(name)
        if match:
            step = int(match.group(2)) if match.group(2) is not None else -1
            found.append(((int(match.group(1)), step), name, match.group(3)))
    return sorted(found)


def _manifest_files(store: Store) -> list[tuple[tuple[int, int], str]]:
    """``((N, STEP), manifest name)`` of each snapshot, oldest first."""
    return [(key, name) for key, name, kind in _snapshot_files(store) if kind == "json"]


def data_name_of(manifest_name: str) -> str:
    """The data file of the manifest ``manifest_name`` (either naming)."""
    return manifest_name.removesuffix(".json") + ".pt"


def sharded_data_name(step: int, token: str) -> str:
    """The DCP directory of a sharded snapshot: named from what every rank of the round
    knows (the commit's step and the round's token), not ``N``, which only rank 0 picks."""
    name = f"snapshot-step-{step}-{token}.dcp"
    if not _SHARDED_DATA.match(name):
        raise SnapshotError(f"token {token!r}: expected 4 to 32 lowercase hex digits")
    return name


def _data_of(store: Store, manifest_name: str) -> tuple[str, bool]:
    """``(name, is a directory)`` of the data of the manifest ``manifest_name``. A manifest
    that cannot be read is taken for a single file's: a sharded one's directory is then
    named by no manifest, a leftover (``remove_sharded_leftovers``)."""
    try:
        data = json.loads(store.read_bytes(manifest_name).decode())
    except (OSError, UnicodeDecodeError, ValueError):
        data = {}
    name = data.get("data") if isinstance(data, dict) else None
    if isinstance(name, str) and _SHARDED_DATA.match(name):
        return name, True
    return data_name_of(manifest_name), False


def publish(directory: Location | Store, manifest: Manifest) -> None:
    """Write ``manifest`` next to its data file, which is complete and durable already
    (never over an existing manifest: ``FileExistsError``)."""
    text = manifest.to_json().encode()
    open_store(directory).write(manifest.manifest_name, lambda f: f.write(text), exclusive=True)


def prune(directory: Location | Store, keep: int) -> None:
    """Delete all but the newest ``keep`` snapshots (manifest first: a snapshot stops
    existing before its data goes), data files without a manifest older than the oldest
    kept (a writer killed between the two, or an upload cut off), and the temporary files
    of dead writers."""
    store = open_store(directory)
    every = _snapshot_files(store)
    manifests = [(key, name) for key, name, kind in every if kind == "json"]
    for _key, manifest in manifests[: max(0, len(manifests) - keep)]:
        data, is_directory = _data_of(store, manifest)
        store.delete(manifest)
        (store.delete_tree if is_directory else store.delete)(data)
    kept = manifests[max(0, len(manifests) - keep):]
    if kept:
        with_manifest = {data_name_of(name) for _key, name in manifests}
        for key, name, kind in every:
            if kind == "pt" and name not in with_manifest and key < kept[0][0]:
                store.delete(name)
    store.clean_up()
    remove_sharded_leftovers(store)


def remove_sharded_leftovers(directory: Location | Store, token: str = "", up_to_step: int = -1,
                             now: Callable[[], float] = time.time) -> list[str]:
    """Remove the sharded snapshot directories that no manifest names and whose writers are
    done with them; returns their names.

    Those of the round ``token`` up to ``up_to_step`` go at once: the round's rank 0 calls
    this when it published or gave up on the snapshot of ``up_to_step``, and the round's
    earlier snapshots were published or given up before it (a rank still writing into one
    of them is a straggler whose part can no longer be used). Any other one goes when
    nothing in it changed for ``FOREIGN_TEMP_AGE`` seconds (another round's or launch's,
    whose rank 0 died or gave up), never while a live writer writes in it.
    """
    store = open_store(directory)
    names = store.names()
    named = set()
    for name in names:
        match = _FILE.match(name)
        if match and match.group(3) == "json":
            data, is_directory = _data_of(store, name)
            if is_directory:
                named.add(data)
    removed = []
    for name in names:
        match = _SHARDED_DATA.match(name)
        if match is None or name in named:
            continue
        ours = match.group(2) == token and int(match.group(1)) <= up_to_step
        if not ours:
            quiet = store.quiet_since(name)
            if quiet is None or now() - quiet <= FOREIGN_TEMP_AGE:
                continue
        store.delete_tree(name)
        removed.append(name)
    return removed


def snapshots(directory: Location | Store) -> Iterator[tuple[int, Location]]:
    """``(number, manifest path)`` of every snapshot in ``directory``, newest first."""
    store = open_store(directory)
    return iter([(key[0], store.location(name)) for key, name in reversed(_manifest_files(store))])


def check(manifest_path: Location, verify: bool = True) -> Found:
    """The snapshot of ``manifest_path``, its checksum verified; ``SnapshotError`` says why not."""
    store, name = split(manifest_path)
    return _check(store, name, verify)


def check_sharded(data: Location, verify: bool = True) -> Found:
    """The sharded snapshot whose DCP directory is ``data``, verified; ``SnapshotError`` says
    why not (no manifest names it: incomplete, or pruned)."""
    store, name = split(data)
    for _key, manifest_name in reversed(_manifest_files(store)):
        if _data_of(store, manifest_name) == (name, True):
            return _check(store, manifest_name, verify)
    raise SnapshotError(f"{data}: no manifest names this sharded snapshot (incomplete: a rank did not write its "
                        "part; or pruned)")


def _check(store: Store, manifest_name: str, verify: bool) -> Found:
    where = store.location(manifest_name)
    try:
        text = store.read_bytes(manifest_name).decode()
    except (OSError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{where}: cannot read the manifest ({err})") from None
    manifest = Manifest.from_json(text, str(where))
    if manifest.data:
        return _check_sharded(store, manifest, verify)
    data_name = data_name_of(manifest_name)
    data = store.location(data_name)
    try:
        size = store.size(data_name)
    except OSError as err:
        raise SnapshotError(f"{data}: {err.strerror or err}") from None
    if size != manifest.size:
        raise SnapshotError(f"{data}: {size} bytes, its manifest says {manifest.size} (torn or truncated)")
    if verify:
        try:
            digest = store_sha256(store, data_name)
        except OSError as err:
            raise SnapshotError(f"{data}: {err.strerror or err}") from None
        if digest != manifest.sha256:
            raise SnapshotError(f"{data}: checksum mismatch (corrupt or overwritten)")
    return Found(manifest, data)


def _check_sharded(store: Store, manifest: Manifest, verify: bool) -> Found:
    directory = store.child(manifest.data)
    for name, part in sorted((manifest.parts or {}).items()):
        where = directory.location(name)
        try:
            size = directory.size(name)
            if size != part["size"]:
                raise SnapshotError(f"{where}: {size} bytes, its manifest says {part['size']} (torn or truncated)")
            if verify and store_sha256(directory, name) != part["sha256"]:
                raise SnapshotError(f"{where}: checksum mismatch (corrupt or overwritten)")
        except OSError as err:
            raise SnapshotError(f"{where}: {err.strerror or err}") from None
    return Found(manifest, store.location(manifest.data))


def newest_valid(directory: Location | Store, warn: Callable[[str], None]) -> Found | None:
    """The newest snapshot in ``directory`` whose data matches its manifest, or None.

    Each newer one that does not is named through ``warn`` and skipped.
    """
    store = open_store(directory)
    for _, manifest_name in reversed(_manifest_files(store)):
        try:
            return _check(store, manifest_name, verify=True)
        except SnapshotError as err:
            warn(f"skipping snapshot {manifest_name}: {err}")
    return None


def job_id_of(command: tuple[str, ...] | list[str]) -> str:
    """A launch's job id: the same command line (hence a relaunch of it) has the same one."""
    return hashlib.sha256("\0".join(command).encode()).hexdigest()[:16]
