"""Where snapshots are kept: a local directory, or an fsspec URL (an object store).

The snapshot logic (``durable.files``) reads and writes through one small interface,
``Store``: list the names in the directory, read, size, write one file, delete; and, for a
sharded snapshot's DCP directory, a sub-directory's store, its removal, and when anything
in it last changed. Two kinds:

* ``LocalStore`` (a path): a file is written under a temporary name, fsynced, renamed (or,
  for a snapshot's files, hard-linked: never over an existing file) into place and the
  directory fsynced, so a crash leaves the old file or the new, never half. The temporary
  file is locked (``flock``) by its writer for the whole write and named after it (the
  process's pid space, pid and start time): the next writer, whatever its pid, removes the
  temporary files of writers that are dead and leaves a live writer's alone.
* ``FsspecStore`` (``s3://bucket/prefix``, ``gs://...``, ``file://...``, any URL whose
  scheme has an fsspec implementation installed): object stores have no rename, but one
  object's upload is all or nothing, so a file is written under its final name, with
  fsspec's exclusive mode (``"xb"``: S3's ``If-None-Match: *``) where the implementation
  has one, so that an object is never replaced. That a snapshot exists is still decided by
  its manifest, written after its data; a data object whose upload was cut off has no
  manifest (or a manifest whose size or checksum it fails) and is not resumed from. There
  are no temporary objects to clean up; a killed writer's S3 multipart upload is invisible
  and left to the bucket's ``AbortIncompleteMultipartUpload`` lifecycle rule (nothing here
  can tell a dead writer's upload from a live one's).

Standard library only: fsspec is imported when a URL is first used (the extras
``lightning-elastic[snapshots]``, ``lightning-elastic[snapshots-s3]``). Credentials and
endpoints are fsspec's: for S3, the ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for another
endpoint) or fsspec's configuration files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

# A snapshot directory or file: a local path, or an fsspec URL (kept as a string:
# Path("s3://b/k") would fold the double slash).
Location = Path | str

TEMP_PREFIX = ".tmp-snapshot-"
# A temporary file's name: TEMP_PREFIX, the writer's pid space, pid and start time, the final name.
_TEMP = re.compile(r"^\.tmp-snapshot-([0-9a-f]{12})-(\d+)-(\d+)-(.+)$")
# The previous versions' temporary names: TEMP_PREFIX, pid, the final name (never locked).
_LEGACY_TEMP = re.compile(r"^\.tmp-snapshot-(\d+)-(.+)$")
# A temporary file whose writer cannot be checked from here (another machine's, or one of
# a previous version, which took no lock) is removed once untouched for this long: a live
# writer writes to it continuously, and a shared file system's lock may be local only.
FOREIGN_TEMP_AGE = 600.0
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The extra that brings each common scheme's implementation (the error says what to install).
_EXTRAS = {"s3": "lightning-elastic[snapshots-s3]", "s3a": "lightning-elastic[snapshots-s3]"}


class SnapshotError(ValueError):
    """A snapshot setting or file that cannot be used; the message is one line."""


def is_url(text: Any) -> bool:
    return isinstance(text, str) and _URL.match(text) is not None


def as_location(value: str | os.PathLike[str]) -> Location:
    """A URL stays a string (without a trailing slash); anything else is a ``Path``."""
    if is_url(value):
        text = str(value)
        return text.rstrip("/") if not text.endswith("://") else text
    return Path(value)


def base_name(location: Location) -> str:
    """The last component: ``snapshot-3.pt`` of a path or of a URL."""
    if isinstance(location, Path):
        return location.name
    return location.rstrip("/").rsplit("/", 1)[-1]


def split(location: Location) -> tuple[Store, str]:
    """The store holding the file at ``location``, and the file's name in it."""
    if isinstance(location, Path):
        return LocalStore(location.parent), location.name
    head, _, name = location.rstrip("/").rpartition("/")
    return open_store(head), name


def open_store(directory: Location | Store) -> Store:
    """The store of a snapshot directory (a ``Store`` is returned as it is)."""
    if isinstance(directory, Path):
        return LocalStore(directory)
    if isinstance(directory, str):
        return FsspecStore(directory) if is_url(directory) else LocalStore(Path(directory))
    return directory


def check_url(url: str, option: str = "--snapshot-dir") -> None:
    """Raise ``SnapshotError`` (one line, naming what to install) unless fsspec can open ``url``."""
    scheme = url.split("://", 1)[0].lower()
    extra = _EXTRAS.get(scheme)
    install = (f"pip install '{extra}'" if extra else
               f"pip install 'lightning-elastic[snapshots]' and the fsspec implementation of {scheme}://")
    try:
        import fsspec  # noqa: PLC0415 - an optional dependency, for URLs only
    except ImportError:
        raise SnapshotError(f"{option}: {url}: a URL needs fsspec, which is not installed: {install}") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "its package is missing"
        raise SnapshotError(f"{option}: {url}: no fsspec implementation of {scheme}:// is installed ({reason}): "
                            f"{install}") from None
    except ValueError:
        raise SnapshotError(f"{option}: {url}: fsspec knows no file system for {scheme}://: expected a local "
                            "directory or a URL such as s3://bucket/prefix") from None


class Store(Protocol):
    """The few operations snapshots need from a directory. Errors are ``OSError``s
    (``FileNotFoundError`` for a missing file)."""

    def location(self, name: str) -> Location:
        """Where ``name`` is, as messages and the driver name it (a path or a URL)."""

    def names(self) -> list[str]:
        """The names of the files in the directory ([] when it does not exist)."""

    def read_bytes(self, name: str) -> bytes: ...

    def size(self, name: str) -> int: ...

    def open_read(self, name: str) -> IO[bytes]:
        """A seekable binary file (a context manager)."""

    def write(self, name: str, fill: Callable[[BinaryIO], None], exclusive: bool = False) -> None:
        """Write ``name`` through ``fill(file)``, all or nothing as far as the store allows.
        ``exclusive``: never replace an existing ``name`` (``FileExistsError`` instead)."""

    def delete(self, name: str) -> None:
        """Remove ``name``; a file already gone is no error."""

    def make(self) -> None:
        """Create the directory (and its parents) if needed."""

    def writable(self) -> bool:
        """A guess, without writing: False when writes certainly fail."""

    def clean_up(self) -> None:
        """Remove the temporary files of dead writers (any process's), never a live one's."""

    def child(self, name: str) -> Store:
        """The store of the sub-directory ``name`` (a sharded snapshot's DCP directory)."""

    def delete_tree(self, name: str) -> None:
        """Remove the sub-directory ``name`` and everything in it; one already gone is no error."""

    def quiet_since(self, name: str) -> float | None:
        """When anything in the sub-directory ``name`` last changed (wall clock, seconds), or
        None when it cannot tell, the directory is gone, or a live writer writes in it."""


class LocalStore:
    """A directory on a local or shared file system: temporary name, fsync, atomic rename."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def location(self, name: str) -> Path:
        return self.directory / name

    def names(self) -> list[str]:
        try:
            return os.listdir(self.directory)
        except FileNotFoundError:
            return []

    def read_bytes(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.directory / name).stat().st_size

    def open_read(self, name: str) -> IO[bytes]:
        return open(self.directory / name, "rb")

    def write(self, name: str, fill: Callable[[BinaryIO], None], exclusive: bool = False) -> None:
        write_atomically(self.directory / name, fill, exclusive)

    def delete(self, name: str) -> None:
        try:
            (self.directory / name).unlink()
        except FileNotFoundError:
            pass

    def make(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def writable(self) -> bool:
        return os.access(self.directory, os.W_OK | os.X_OK)

    def clean_up(self) -> None:
        for name in self.names():
            if name.startswith(TEMP_PREFIX) and temp_is_abandoned(self.directory / name):
                self.delete(name)

    def child(self, name: str) -> LocalStore:
        return LocalStore(self.directory / name)

    def delete_tree(self, name: str) -> None:
        try:
            shutil.rmtree(self.directory / name)
        except FileNotFoundError:
            pass

    def quiet_since(self, name: str) -> float | None:
        path = self.directory / name
        try:
            newest = path.stat().st_mtime
            with os.scandir(path) as entries:
                for entry in entries:
                    # A file being written changes no directory entry for as long as the write
                    # lasts: its writer's lock says it is alive (see temp_is_abandoned).
                    if entry.name.startswith(TEMP_PREFIX) and not temp_is_abandoned(Path(entry.path)):
                        return None
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            return None
        return newest


def _pid_space() -> str:
    """This machine's boot and pid namespace, hashed: pids are comparable only within one."""
    parts = []
    for read in (lambda: open("/proc/sys/kernel/random/boot_id").read().strip(),  # noqa: SIM115
                 lambda: str(os.stat("/proc/self/ns/pid").st_ino)):
        try:
            parts.append(read())
        except OSError:
            parts.append(os.uname().nodename)
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:12]


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22; fields[0] is field 3 (after "pid (comm)")
    except (OSError, IndexError, ValueError):
        return None


def temp_name(final: str) -> str:
    """The temporary name this process writes ``final`` under."""
    pid = os.getpid()
    return f"{TEMP_PREFIX}{_pid_space()}-{pid}-{_start_time(pid) or 0}-{final}"


def _locked_by_someone(path: Path) -> bool | None:
    """Whether another open file holds ``path``'s flock: True, False, or None (cannot tell:
    the file is gone, or the file system has no locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        return True if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # (releases the lock just taken, if any)
    return False


def temp_is_abandoned(path: Path, now: Callable[[], float] = time.time) -> bool:
    """Whether the temporary file ``path`` was left by a writer that is dead.

    Its writer holds its flock from the file's creation to its rename: a held lock is a
    live writer. A free one is a dead writer when the name says it was a process of this
    pid space that no longer runs (its pid gone, or reused: another start time): this also
    covers the instant between the file's creation and its lock. A writer this machine
    cannot check (another machine's, on a shared file system whose locks may be local to
    each client; a previous version's, which took no lock) is taken for dead once its file
    was untouched for ``FOREIGN_TEMP_AGE`` seconds.
    """
    locked = _locked_by_someone(path)
    if locked:
        return False
    match = _TEMP.match(path.name)
    if match is not None and match.group(1) == _pid_space():
        pid, started = int(match.group(2)), int(match.group(3))
        alive = _start_time(pid)
        return alive is None or alive != started
    try:
        age = now() - path.lstat().st_mtime
    except OSError:
        return False
    return age > FOREIGN_TEMP_AGE


def write_atomically(path: Path, fill: Callable[[BinaryIO], None], exclusive: bool = False) -> None:
    """Write ``path`` through ``fill(file)``: a temporary name (locked while written), fsync,
    rename, fsync the directory. ``exclusive``: publish with a hard link, which never
    replaces an existing ``path`` (``FileExistsError``); where the file system has no hard
    links, ``path`` is created empty with ``O_EXCL`` first and the file renamed over it."""
    temp = path.with_name(temp_name(path.name))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with contextlib.suppress(OSError):  # no locks here: the name's pid and start time still tell
            fcntl.flock(fd, fcntl.LOCK_EX)
        with open(fd, "wb", closefd=False) as f:
            fill(f)
            f.flush()
            os.fsync(fd)
        if exclusive:
            _link_no_replace(temp, path)
        else:
            os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    finally:
        os.close(fd)  # after the rename or unlink: the lock is held until the name is gone
    fsync_directory(path.parent)


def _link_no_replace(temp: Path, path: Path) -> None:
    try:
        os.link(temp, path)
    except FileExistsError:
        raise
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        # No hard links here (FAT, some FUSE and SMB mounts): take the name with O_EXCL, then
        # put the file over the empty placeholder (a reader may see it empty for an instant:
        # a data file without its manifest yet, or a manifest it skips until the next look).
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.replace(temp, path)
        return
    temp.unlink()


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


class FsspecStore:
    """A "directory" of an fsspec file system, named by URL: each file one object, written
    under its final name (no rename; an object's upload is all or nothing)."""

    def __init__(self, url: str) -> None:
        check_url(url)
        import fsspec  # noqa: PLC0415 - optional, checked just above

        self.url = url.rstrip("/")
        try:
            self._fs, root = fsspec.core.url_to_fs(self.url)
        except Exception as err:  # noqa: BLE001 - any implementation's complaint: one line
            raise SnapshotError(f"--snapshot-dir: {url}: {type(err).__name__}: {err}") from None
        self._root = root.rstrip("/")

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _call(self, name: str, operation: Callable[[], Any]) -> Any:
        """``operation()`` with any error as an ``OSError`` naming the file (an SDK's own
        exceptions, such as missing credentials, are not all ``OSError``s)."""
        try:
            return operation()
        except OSError:
            raise
        except Exception as err:  # noqa: BLE001
            raise OSError(f"{type(err).__name__}: {err}" + (f": {self.location(name)}" if name else "")) from None

    def _fresh(self, path: str) -> None:
        # Listings and sizes are cached per file system object (s3fs): another process
        # (the previous writer, the driver) may have changed the store since.
        self._fs.invalidate_cache(path)

    def names(self) -> list[str]:
        def listing() -> list[str]:
            self._fresh(self._root)
            try:
                entries = self._fs.ls(self._root, detail=False)
            except FileNotFoundError:
                return []
            return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

        return self._call("", listing)

    def read_bytes(self, name: str) -> bytes:
        return self._call(name, lambda: self._fs.cat_file(self._path(name)))

    def size(self, name: str) -> int:
        def size() -> int:
            self._fresh(self._path(name))
            return int(self._fs.size(self._path(name)))

        return self._call(name, size)

    def open_read(self, name: str) -> IO[bytes]:
        return self._call(name, lambda: self._fs.open(self._path(name), "rb"))

    def write(self, name: str, fill: Callable[[BinaryIO], None], exclusive: bool = False) -> None:
        path = self._path(name)
        f = self._call(name, lambda: self._open_for_writing(path, exclusive))
        try:
            fill(f)
        except BaseException:
            # Abandon the upload (s3fs aborts its multipart upload) and mark the file closed,
            # or its finaliser would upload the part written; what an implementation that
            # writes in place (memory://, file://) holds under the name is removed. (Under
            # an exclusive write, another writer's object of the same name, which is the
            # same commit, would go too: rarer than rare, and then the previous snapshot
            # is resumed from.)
            for undo in (getattr(f, "discard", None), lambda: setattr(f, "closed", True),
                         lambda: self._fs.rm_file(path)):
                try:
                    if undo is not None:
                        undo()
                except Exception:  # noqa: BLE001, S110 - best effort, the write failed already
                    pass
            raise
        self._call(name, f.close)  # the upload completes here: the object exists

    def _open_for_writing(self, path: str, exclusive: bool) -> Any:
        """``path`` opened for writing; ``exclusive``: in fsspec's exclusive mode ("xb": the
        object is created only if there is none, ``FileExistsError`` otherwise), or, for an
        implementation without one, after checking that there is none (the name of a
        snapshot's file carries its step: two writers can only race for the same commit)."""
        if exclusive:
            try:
                return self._fs.open(path, "xb")
            except (ValueError, NotImplementedError, TypeError):
                self._fresh(path)
                if self._fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "exists already", self.location(base_name(path)))
        return self._fs.open(path, "wb")

    def delete(self, name: str) -> None:
        def delete() -> None:
            try:
                self._fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass

        self._call(name, delete)

    def make(self) -> None:
        self._call("", lambda: self._fs.makedirs(self._root, exist_ok=True))

    def writable(self) -> bool:
        return True  # only a write can tell

    def clean_up(self) -> None:
        pass  # no temporary objects (an S3 multipart upload of a killed writer: see the module's docstring)

    def child(self, name: str) -> FsspecStore:
        return FsspecStore(self.location(name))

    def delete_tree(self, name: str) -> None:
        def delete() -> None:
            try:
                self._fs.rm(self._path(name), recursive=True)
            except FileNotFoundError:
                pass

        self._call(name, delete)

    def quiet_since(self, name: str) -> float | None:
        """The newest modification time its objects report (implementations name it
        differently, and some report none: then None, and age never removes it)."""
        try:
            self._fresh(self._path(name))
            entries = self._fs.ls(self._path(name), detail=True)
        except Exception:  # noqa: BLE001 - cannot tell: kept
            return None
        times = [_timestamp(e.get(k)) for e in entries for k in ("mtime", "LastModified", "last_modified",
                                                                   "updated", "created")]
        known = [t for t in times if t is not None]
        return max(known) if known else None


def _timestamp(value: Any) -> float | None:
    """A modification time as fsspec implementations report one (a number or a datetime)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    timestamp = getattr(value, "timestamp", None)
    if callable(timestamp):
        try:
            return float(timestamp())
        except (TypeError, ValueError, OverflowError):
            return None
    return None
