"""The driver's part in durable snapshots: which snapshot a launch resumes from, and the
summary's counts.

The choice is made once, when the job starts and before any worker does (so it may read
and checksum files: the decision loop is not running yet). Workers learn it from their
environment; rank 0 of the first round loads it (``lightning_elastic.training.state``, the
Lightning strategy).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from lightning_elastic import __version__
from lightning_elastic.durable.files import (
    ENV_DIR,
    ENV_EVERY,
    ENV_JOB_ID,
    ENV_KEEP,
    ENV_NO_RESUME,
    ENV_RESUME_FROM,
    Found,
    SnapshotError,
    SnapshotSettings,
    job_id_of,
    newest_valid,
    open_store,
)
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.state import WorkerRecord
from lightning_elastic.launcher.observe.events import EventLog

log = logging.getLogger("lightning_elastic.driver")



@dataclasses.dataclass(frozen=True)
class Resume:
    """The snapshot settings as the workers receive them, and the snapshot chosen (or None)."""

    env: dict[str, str]
    found: Found | None


def choose(settings: SnapshotSettings | None, command: Iterable[str], events: EventLog) -> Resume | None:
    """Prepare the snapshot directory and pick the newest valid snapshot to resume from.

    Raises ``ConfigError`` (nothing has started) when the directory cannot be created, or
    when its newest snapshot was written by another command (another job id) and
    ``--resume-other-command`` was not given.
    """
    if settings is None:
        return None
    directory = settings.directory
    try:
        store = open_store(directory)  # a local directory, or an fsspec URL's object store
        store.make()
    except SnapshotError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:
        raise ConfigError(f"--snapshot-dir: cannot create {directory}: {err.strerror or err}") from None
    if not store.writable():
        log.warning("--snapshot-dir %s is not writable: no snapshot will be written (training goes on).", directory)
    job_id = job_id_of(tuple(command))
    env = {
        ENV_DIR: str(directory),
        ENV_EVERY: repr(settings.every),
        ENV_KEEP: str(settings.keep),
        ENV_NO_RESUME: "0" if settings.resume else "1",
        ENV_JOB_ID: job_id,
    }
    if not settings.resume:
        log.info("--no-resume: starting over; snapshots go to %s.", directory)
        return Resume(env, None)
    found = newest_valid(store, lambda text: log.warning("Resuming: %s.", text))
    if found is None:
        log.info("No snapshot to resume from in %s: starting from the beginning.", directory)
        return Resume(env, None)
    m = found.manifest
    if m.job_id and m.job_id != job_id:
        if not settings.resume_other_command:
            # Another script's or model's state, resumed silently, trained nothing (issue 37, item 8).
            raise ConfigError(
                f"--snapshot-dir: {found.name} in {directory} was written by another command (job id {m.job_id}, "
                f"this one's is {job_id}): pass --no-resume or another --snapshot-dir to start over, or "
                "--resume-other-command to resume from it")
        log.warning("Snapshot %s was written by a launch with another command (job id %s, this one %s): resuming "
                    "from it (--resume-other-command).", found.name, m.job_id, job_id)
    if m.library != __version__:
        log.warning("Snapshot %s was written by lightning-elastic %s, this is %s: resuming from it (its format, %d, "
                    "is one this version reads).", found.name, m.library, __version__, m.format)
    log.info("Resuming from snapshot %s (step %d, epoch %d, written at world size %d).",
             found.path, m.step, m.epoch, m.world_size)
    events.emit("resumed_from_snapshot", path=str(found.path), sequence=m.sequence, step=m.step, epoch=m.epoch,
                world_size=m.world_size, round=m.round, sampler=m.sampler, written_at=m.time, content=m.kind)
    return Resume({**env, ENV_RESUME_FROM: str(found.path)}, found)


def totals(workers: Iterable[WorkerRecord]) -> tuple[int, int, str]:
    """Snapshots written and failed by every worker of the job, and a failure's reason."""
    written = failed = 0
    error = ""
    for record in workers:
        w, f, e = record.snapshots
        written += w
        failed += f
        error = e or error
    return written, failed, error
