"""The module-level worker API: ``le.init()``, ``le.rank()``, ``le.size()``, ...

``init()`` creates this process's one ``ElasticWorker`` and keeps it here so the
functions below can answer; everything else takes a worker explicitly where it can.
"""

from __future__ import annotations

import atexit
import logging
import sys

from lightning_elastic.worker import ElasticWorker, SlotInfo

_worker: ElasticWorker | None = None


def init(
    use_cuda: bool | None = None, collective_timeout: float | None = None, backend: str | None = None
) -> ElasticWorker:
    """Join the job described by the launcher's environment (a world of one without it).

    ``use_cuda=False`` keeps a GPU machine's worker on gloo and the CPU; the default uses
    NCCL and ``cuda:LOCAL_RANK`` whenever CUDA is available. ``collective_timeout``
    (seconds) overrides the launcher's ``--collective-timeout``; ``backend`` ("gloo" or
    "nccl") the backend choice. Later calls return the same worker.
    """
    global _worker
    if _worker is None:
        _log_to_stderr()
        worker = ElasticWorker.from_environment(use_cuda, collective_timeout, backend)
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
    if _worker is None:
        raise RuntimeError("lightning_elastic is not initialised: call lightning_elastic.init() first")
    return _worker


def rank() -> int:
    return current_worker().assignment.rank


def size() -> int:
    return current_worker().assignment.size


def local_rank() -> int:
    return current_worker().assignment.local_rank


def local_size() -> int:
    return current_worker().assignment.local_size


def cross_rank() -> int:
    return current_worker().assignment.cross_rank


def cross_size() -> int:
    return current_worker().assignment.cross_size


def slot_info() -> SlotInfo:
    return current_worker().slot_info()
