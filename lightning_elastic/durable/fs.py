"""Where snapshots are kept: a local directory, or an fsspec URL (an object store).

The snapshot logic (``durable.files``) reads and writes through one small interface,
``Store``: list the names in the directory, read, size, write one file, delete. Two kinds:

* ``LocalStore`` (a path): a file is written under a temporary name, fsynced, renamed into
  place and the directory fsynced, so a crash leaves the old file or the new, never half.
* ``FsspecStore`` (``s3://bucket/prefix``, ``gs://...``, ``file://...``, any URL whose
  scheme has an fsspec implementation installed): object stores have no rename, but one
  object's upload is all or nothing, so a file is written under its final name. That a
  snapshot exists is still decided by its manifest, written after its data; a data object
  whose upload was cut off has no manifest (or a manifest whose size or checksum it fails)
  and is not resumed from.

Standard library only: fsspec is imported when a URL is first used (the extras
``lightning-elastic[snapshots]``, ``lightning-elastic[snapshots-s3]``). Credentials and
endpoints are fsspec's: for S3, the ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for another
endpoint) or fsspec's configuration files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol

# A snapshot directory or file: a local path, or an fsspec URL (kept as a string:
# Path("s3://b/k") would fold the double slash).
Location = Path | str

TEMP_PREFIX = ".tmp-snapshot-"
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

    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> None:
        """Write ``name`` through ``fill(file)``, all or nothing as far as the store allows."""

    def delete(self, name: str) -> None:
        """Remove ``name``; a file already gone is no error."""

    def make(self) -> None:
        """Create the directory (and its parents) if needed."""

    def writable(self) -> bool:
        """A guess, without writing: False when writes certainly fail."""

    def clean_up(self) -> None:
        """Remove what this process's own crashed writes left (temporary files)."""


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

    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> None:
        write_atomically(self.directory / name, fill)

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
        # Another process's temporary file may be a write in progress (two jobs, one
        # directory); only this process's own leftovers are certainly dead.
        mine = f"{TEMP_PREFIX}{os.getpid()}-"
        for name in self.names():
            if name.startswith(mine):
                self.delete(name)


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

    def write(self, name: str, fill: Callable[[BinaryIO], None]) -> None:
        path = self._path(name)
        f = self._call(name, lambda: self._fs.open(path, "wb"))
        try:
            fill(f)
        except BaseException:
            # Abandon the upload (s3fs aborts its multipart upload) and mark the file closed,
            # or its finaliser would upload the part written; whatever reached the store
            # under this name has no manifest, and the next snapshot reuses the name.
            for undo in (getattr(f, "discard", None), lambda: setattr(f, "closed", True),
                         lambda: self._fs.rm_file(path)):
                try:
                    if undo is not None:
                        undo()
                except Exception:  # noqa: BLE001, S110 - best effort, the write failed already
                    pass
            raise
        self._call(name, f.close)  # the upload completes here: the object exists

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
        pass  # no temporary objects
