"""``--state-dir``: what a restarted driver needs to adopt the running job, on disk.

The directory holds:

- ``lock``: ``flock``ed by the driver for its whole life, so that two drivers never both
  act on one job (the second says so and exits 2);
- ``secret`` (mode 0600): the job secret the workers sign with; a restarted driver must
  verify them with the same one;
- ``state.json``: the job's state, the driver's ``JobState`` itself (``job/state.py``),
  replaced atomically (temp file + rename) by a writer thread, never by the decision loop
  itself. One JSON object: ``version`` (2; a file of another version is not adopted: the
  driver says so in one line and starts a new job), ``saved_at`` (wall clock, for people)
  and ``job``, the ``JobState`` as ``restart/state_codec.py`` writes it: its fields but the
  ``transient`` ones, times on the driver's clock as seconds from the save (negative: past);
- ``alive``: touched every second by the running driver; its age on restart is the outage;
- ``driver-url``: ``http://HOST:PORT`` where the running driver serves, one line. A worker
  that cannot reach its driver re-reads it (``lightning_elastic/membership/driver_locator.py``): a
  driver restarted on another machine (the directory on a shared filesystem) is found so;
- ``workers/``: per worker, its output (``ID.log``, written by the worker itself, so a dead
  driver breaks nothing), how far the driver forwarded it (``ID.offset``) and its exit
  status (``ID.status``, written by its keeper, ``processes/keeper.py``).

One snapshot file rather than a replayed journal: the state a restart needs is small
(workers, rounds, the target, the blacklist, counters) and a snapshot is read in one
``json.loads`` whatever the job's age, where a journal would need compaction to stay so.
``events.jsonl`` stays the timeline, for people.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.state import JobState
from lightning_elastic.launcher.restart import state_codec

log = logging.getLogger("lightning_elastic.driver")

# 2: the JobState itself (1: a translation of it, SavedState, before 2026-11).
STATE_VERSION = 2
ALIVE_EVERY = 1.0  # seconds between touches of ``alive``


def safe_name(worker_id: str) -> str:
    """A worker id as a file name (ids stay unique: they end in their own number)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so that a reader (or a crash) sees the old or the new whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def check_owner(path: Path) -> None:
    """ConfigError unless ``path`` is a directory of this user that no one else can write.

    The directory holds the job's secret and the pids the driver signals: one that another
    local user created (under /tmp, say) could hold a secret they know and a state naming
    any of this user's processes. So it must be this user's, writable by this user alone
    (a new one is created with mode 0700; logs and files in it are 0600)."""
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(f"--state-dir: {path} is owned by uid {st.st_uid}, not by this user (uid {me}): expected "
                          "a directory of your own (a new one is created with mode 0700)")
    if st.st_mode & 0o022:
        raise ConfigError(f"--state-dir: {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                          f"expected a directory only its owner can write (chmod 700 {path})")


class StateDir:
    """The files of one ``--state-dir``; ``lock()`` first, ``release()`` at the very end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.workers = path / "workers"
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take the directory for this driver; ConfigError when another driver holds it, or
        when it is not this user's alone (``check_owner``)."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_owner(self.path)
            self.workers.mkdir(mode=0o700, exist_ok=True)
            check_owner(self.workers)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise ConfigError(f"--state-dir: cannot use {self.path}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"--state-dir {self.path}: another driver (pid {holder}) runs this job; "
                              "it must exit before another can take over") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    @property
    def url_file(self) -> Path:
        """``driver-url``, as an absolute path: workers read it from their own directory."""
        return (self.path / "driver-url").absolute()

    def write_url(self, url: str) -> None:
        """Say where this driver serves (at its start, before any worker can need it)."""
        write_atomic(self.url_file, f"{url}\n".encode())

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the flock
            self._lock_fd = None

    def secret(self) -> str:
        """The job's secret: the one saved here, else a new one saved with mode 0600."""
        path = self.path / "secret"
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text().strip()
            if len(text) == 64:
                return text
        value = secrets.token_hex(32)
        write_atomic(path, value.encode(), 0o600)
        return value

    def load(self) -> JobState | None:
        """The saved state of a job still running, or None (none saved, or unreadable: said).
        Its clock fields are seconds from the save: ``state_codec.rebase`` puts them on a clock."""
        path = self.path / "state.json"
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
                found = raw.get("version") if isinstance(raw, dict) else None
                raise ValueError(f"version {found}, not {STATE_VERSION}: saved by another version of the driver")
            return state_codec.decode(raw["job"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            log.warning("--state-dir: ignoring %s, which cannot be read (%s): starting a new job.", path, err)
            return None

    def save(self, state: JobState, now: float) -> None:
        """Write ``state`` (a ``state_codec.capture``), its clock fields as seconds from ``now``."""
        job = state_codec.encode(state, now)
        text = f'{{"version":{STATE_VERSION},"saved_at":{time.time()!r},"job":{job}}}'
        write_atomic(self.path / "state.json", text.encode())

    def touch_alive(self) -> None:
        path = self.path / "alive"
        try:
            os.utime(path)
        except FileNotFoundError:
            path.touch(mode=0o600)

    def last_alive(self) -> float | None:
        try:
            return (self.path / "alive").stat().st_mtime
        except OSError:
            return None

    def worker_file(self, worker_id: str, suffix: str) -> Path:
        """``workers/<id>.<suffix>``, the id made a safe file name."""
        return self.workers / f"{safe_name(worker_id)}.{suffix}"

    def clear(self) -> None:
        """The job has ended: nothing is left to adopt (the secret goes too: a new job, a new one)."""
        for name in ("state.json", "alive", "secret", "driver-url"):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        # remote/: ssh workers' files, here when the hosts share this directory.
        for path in [*self.workers.glob("*"), *(self.path / "remote").glob("*")]:
            with contextlib.suppress(OSError):
                path.unlink()


class StateWriter:
    """Saves the newest submitted state from a thread of its own, and touches ``alive``.

    ``submit`` only hands a captured state over (``state_codec.capture``): encoding it and
    a slow disk delay the file, never the driver's decisions. States submitted while one is
    written are coalesced: the newest wins.
    """

    def __init__(self, state_dir: StateDir) -> None:
        self._dir = state_dir
        self._cond = threading.Condition()
        self._pending: tuple[JobState, float] | None = None  # (a capture, the driver clock then)
        self._closed = False
        self._failed = False
        self.last_write_s = 0.0  # how long the last save took here (JSON, write): paces the next
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)

    def start(self) -> None:
        self._dir.touch_alive()
        self._thread.start()

    def submit(self, state: JobState, now: float) -> None:
        """Save ``state``, a ``state_codec.capture`` taken at ``now`` (driver clock): nothing
        else may change it."""
        with self._cond:
            self._pending = (state, now)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is pending, then stop (bounded)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    def _run(self) -> None:
        next_touch = time.monotonic() + ALIVE_EVERY
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    if not self._cond.wait(max(0.0, next_touch - time.monotonic())):
                        break
                pending, self._pending = self._pending, None
                closed = self._closed
            try:
                if pending is not None:
                    started = time.perf_counter()
                    self._dir.save(*pending)
                    self.last_write_s = time.perf_counter() - started
                if time.monotonic() >= next_touch:
                    self._dir.touch_alive()
                    next_touch = time.monotonic() + ALIVE_EVERY
                self._failed = False
            except OSError as err:
                if not self._failed:  # said once, not every second
                    log.warning("--state-dir: cannot write %s (%s): a restarted driver may not adopt the job.",
                                self._dir.path, err.strerror or err)
                self._failed = True
            if closed:
                return
