"""The module-level worker API: ``le.init()``, ``le.rank()``, ``le.size()``, ...

``init()`` creates this process's one ``ElasticWorker`` and keeps it here so the
functions below can answer; everything else takes a worker explicitly where it can.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any

from lightning_elastic.durable import store as snapshot_store
from lightning_elastic.membership.worker import ElasticWorker, SlotInfo

_worker: ElasticWorker | None = None


def init(
    use_cuda: bool | None = None,
    collective_timeout: float | None = None,
    backend: str | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_every: float | None = None,
    snapshot_keep: int | None = None,
    resume: bool | None = None,
) -> ElasticWorker:
    """Join the job described by the launcher's environment (a world of one without it).

    ``use_cuda=False`` keeps a GPU machine's worker on gloo and the CPU; the default uses
    NCCL and ``cuda:LOCAL_RANK`` whenever CUDA is available. ``collective_timeout``
    (seconds) overrides the launcher's ``--collective-timeout``; ``backend`` ("gloo" or
    "nccl") the backend choice. Later calls return the same worker.

    ``snapshot_dir``, ``snapshot_every`` (seconds), ``snapshot_keep`` and ``resume``
    override the launcher's ``--snapshot-dir``, ``--snapshot-every``, ``--snapshot-keep`` and
    ``--no-resume`` (for a job started otherwise): rank 0 writes its newest commit there in
    the background, and the first round resumes from the newest valid snapshot found.
    ``snapshot_dir`` may be an fsspec URL (``"s3://bucket/prefix"``; the extra
    ``lightning-elastic[snapshots-s3]``).
    """
    global _worker
    if _worker is None:
        _log_to_stderr()
        settings, resume_from = snapshot_store.plan(os.environ, snapshot_dir, snapshot_every, snapshot_keep, resume)
        worker = ElasticWorker.from_environment(use_cuda, collective_timeout, backend)
        worker.configure_snapshots(settings, resume_from)
        worker.start()
        atexit.register(worker.shutdown)
        _worker = worker
    return _worker


def _log_to_stderr() -> None:
    """Show the worker's elastic events (resets, restores) unless the user configured logging."""
    logger = logging.getLogger("lightning_elastic")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("lightning-elastic: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def current_worker() -> ElasticWorker:
    """This process's ``ElasticWorker``, the one ``init()`` returned.

    Raises ``RuntimeError`` before ``init()``. The functions below read it; the Lightning
    and Fabric strategies call ``init()`` themselves.
    """
    if _worker is None:
        raise RuntimeError("lightning_elastic is not initialised: call lightning_elastic.init() first")
    return _worker


def initialised_worker() -> ElasticWorker | None:
    """The worker ``init()`` made, or ``None`` before it (what a default ``ElasticSampler``
    follows: a world of one until ``init()``)."""
    return _worker


def rank() -> int:
    """This worker's rank in the current round, ``0`` to ``size() - 1``.

    Rank 0 is the oldest surviving worker (the one whose state the others take after a
    reset). Ranks are given anew at every reset: read it again after one (in a reset
    callback, or at the top of the function ``@run`` retries) rather than keeping it.
    Raises ``RuntimeError`` before ``init()``.
    """
    return current_worker().assignment.rank


def size() -> int:
    """How many workers train in the current round (the world size).

    It changes at every reset (a lost worker, a host added or removed): scale what depends
    on it, such as the learning rate, in a reset callback. Raises ``RuntimeError`` before
    ``init()``.
    """
    return current_worker().assignment.size


def local_rank() -> int:
    """This worker's slot on its host, ``0`` to the host's slots - 1.

    Fixed for the worker's life (slots are not renumbered when a sibling is lost, so it can
    be ``local_size()`` or more); the CUDA device is ``cuda:local_rank()`` unless the
    launcher pinned another (on Ray, ``cuda:0``). Raises ``RuntimeError`` before ``init()``.
    """
    return current_worker().assignment.local_rank


def local_size() -> int:
    """How many workers of the current round run on this worker's host.

    Changes at every reset. Raises ``RuntimeError`` before ``init()``.
    """
    return current_worker().assignment.local_size


def cross_rank() -> int:
    """This worker's host's index among the current round's hosts that have a worker with
    the same ``local_rank()``, ``0`` to ``cross_size() - 1`` (as in Horovod).

    With one worker per host it is the host's index. Changes at every reset. Raises
    ``RuntimeError`` before ``init()``.
    """
    return current_worker().assignment.cross_rank


def cross_size() -> int:
    """How many of the current round's hosts have a worker with this worker's
    ``local_rank()`` (as in Horovod); with one worker per host, the number of hosts.

    Changes at every reset. Raises ``RuntimeError`` before ``init()``.
    """
    return current_worker().assignment.cross_size


def slot_info() -> SlotInfo:
    """All of the above at once, with the host's name, as a frozen ``SlotInfo``.

    A snapshot of the current round: take a new one after a reset. Raises ``RuntimeError``
    before ``init()``.
    """
    return current_worker().slot_info()


def load_snapshot(path: str | os.PathLike[str], verify: bool = True) -> Any:
    """The state tree a durable snapshot holds (``--snapshot-dir``), on the CPU.

    ``path``: a snapshot's data file (``snapshot-N-step-STEP.pt``), its manifest (``.json``)
    or the snapshot directory itself (its newest valid snapshot); a local path or an fsspec
    URL (``"s3://bucket/prefix/snapshot-3-step-600.pt"``). A ``le.TorchState``'s
    snapshot is ``{"values": {name: value}, "stateful": {name: state_dict}}``; an
    ``elastic_hvd`` job's is a Lightning checkpoint. The checksum in the manifest is checked
    first (``verify=False`` skips it); a snapshot that fails it raises ``ValueError``. It
    unpickles Python objects, as ``torch.load`` of a full checkpoint does: load snapshots
    only from directories you trust. Needs no ``init()``.
    """
    return snapshot_store.load_snapshot(path, verify)
