"""Stand-ins for the unit tests of the state and commit code: a fake worker and real ranks.

``FakeWorker`` quacks like ``ElasticWorker`` as far as ``state.py``, ``sampler.py`` and
``lightning/commit.py`` use it (``assignment``, ``backend``, ``device``, ``note_commit``,
``check_host_updates``, ``synced_modules``) without a driver, heartbeats or a process group.

``run_ranks(n, fn)`` runs ``fn(rank, worker)`` in n fresh processes joined in a real gloo
group (over a ``FileStore`` in a temporary directory), for the few tests that need real
collectives. Every wait is bounded and every rank process is gone when it returns.

The ranks start from a forkserver rather than by plain spawn: a spawned rank imports torch
(and Lightning, for the commit tests) itself, some 3-8 s of CPU each on a small machine,
while the forkserver imports them once per test session and forks each rank from that
clean, single-purpose process (never from pytest's). The server lives until pytest exits,
and ranks see the environment it started with (not a test's monkeypatched one).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_elastic.errors import HostsUpdatedInterrupt
from lightning_elastic.commit.init_sync import SyncedModules
from lightning_elastic.protocol import Assignment


class FakeWorker:
    """An ``ElasticWorker`` of a fixed world: gloo on the CPU, host checks that can be scripted.

    ``interrupt_at`` holds the (1-based) numbers of the ``check_host_updates()`` calls that
    raise ``HostsUpdatedInterrupt``; ``interrupt_next()`` adds the next one. ``checks``
    counts the calls, ``commits`` the ``note_commit()`` calls. Anything else an
    ``ElasticWorker`` has is missing on purpose: a new use of the worker shows up here.
    """

    backend = "gloo"
    device = torch.device("cpu")

    def __init__(
        self, rank: int = 0, size: int = 1, round: int = 1, generation: int = 0, interrupt_at: Iterable[int] = ()
    ) -> None:
        self.assignment = Assignment(round, rank, size, rank, size, 0, 1, "localhost", "127.0.0.1", 0, generation)
        self.interrupt_at = set(interrupt_at)
        self.checks = 0
        self.commits = 0
        self.resets = 0
        self.last_recovery_s: float | None = None
        self.snapshot_writer: Any = None  # a SnapshotWriter: rank 0 offers its commits
        self.resume_from: Any = None  # a ResumePlan: the first prepare loads it
        self.synced_modules = SyncedModules()  # what TorchState.sync loaded, per round

    @property
    def commits_total(self) -> int:
        return self.commits

    def note_commit(self) -> None:
        self.commits += 1

    def wait_collective(self, work: Any) -> None:
        work.wait()

    def interrupt_next(self) -> None:
        self.interrupt_at.add(self.checks + 1)

    def check_host_updates(self) -> None:
        self.checks += 1
        if self.checks in self.interrupt_at:
            raise HostsUpdatedInterrupt(f"scripted host change at check {self.checks}")


# ----- real ranks ----------------------------------------------------------------------


# Imported once by the forkserver: what the ranks of the unit tests need...
PRELOAD = ["torch", "torch.distributed", "lightning_elastic.training.state", "lightning_elastic.training.sampler", "tests.unit.fakes"]
# ...and, when this session's tests have imported them already, these (Lightning: some 3 s).
PRELOAD_IF_IMPORTED = ["lightning_elastic.lightning.commit"]


class RankError(AssertionError):
    """A rank raised, died or did not finish in time (the message holds its traceback)."""


def _rank_main(
    fn: Callable[[int, FakeWorker], Any], rank: int, size: int, store_path: str, timeout: float, results: Any
) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    # A rank outlives neither its bound nor a parent that died without killing it.
    watchdog = threading.Timer(timeout + 10, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    try:
        store = dist.FileStore(store_path, size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout)
        )
        try:
            value = fn(rank, FakeWorker(rank, size))
        finally:
            dist.destroy_process_group()
        # Pickled here, with the plain pickler: torch's multiprocessing reducers would send
        # tensors through shared memory, which must outlive this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, False, traceback.format_exc()))


def _failures(rank: int, payload: str, results: Any, grace: float = 1.0) -> str:
    """Every rank's traceback that arrives within ``grace`` s of the first: the first one
    to arrive may be a peer's broken connection rather than the cause."""
    failed = {rank: payload}
    deadline = time.monotonic() + grace
    while (left := deadline - time.monotonic()) > 0:
        try:
            other, ok, text = results.get(timeout=left)
        except queue.Empty:
            break
        if not ok:
            failed[other] = text
    return "\n".join(f"rank {r} raised:\n{text}" for r, text in sorted(failed.items()))


def run_ranks(n: int, fn: Callable[[int, FakeWorker], Any], timeout: float = 30) -> list[Any]:
    """``[fn(0, worker0), ..., fn(n-1, worker n-1)]``, each run in its own process of a gloo group.

    ``fn`` must be picklable (a module-level function) and return something picklable.
    Raises ``RankError`` if a rank raises, exits without a result or the ranks do not all
    finish within ``timeout`` seconds; the processes are killed then.
    """
    ctx = multiprocessing.get_context("forkserver")
    # Takes effect when the server starts, at the first call of the session.
    ctx.set_forkserver_preload(PRELOAD + [m for m in PRELOAD_IF_IMPORTED if m in sys.modules] + [fn.__module__])
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="le-ranks-")
    store_path = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, n, store_path, timeout, results), daemon=True, name=f"rank{r}")
        for r in range(n)
    ]
    values: dict[int, Any] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        while len(values) < n:
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                dead = [p for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
                if dead:
                    time.sleep(0.2)  # a result put just before exiting may still be in the pipe
                    if results.empty():
                        raise RankError(f"{dead[0].name} exited with code {dead[0].exitcode} without a result") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(n)) - set(values))
                    raise RankError(f"ranks {missing} did not finish within {timeout:g} s") from None
                continue
            if not ok:
                raise RankError(_failures(rank, payload, results))
            values[rank] = pickle.loads(payload)
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        results.close()
        results.join_thread()
        shutil.rmtree(tmp, ignore_errors=True)
    return [values[r] for r in range(n)]
