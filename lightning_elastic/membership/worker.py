"""A worker's membership in the job: rendezvous, process group, heartbeats, host-change checks.

``ElasticWorker.from_environment()`` joins the job the launcher describes in the
environment; without a launcher it is a world of one (so the same script runs alone).
Threads and sockets start in ``start()``, never in the constructor.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_elastic.membership import group_sockets
from lightning_elastic import protocol as p
from lightning_elastic.membership.client import (
    RETRY_FOR,
    DriverClient,
    first_request_spread,
    heartbeat_hold,
    heartbeat_retry_delay,
)
from lightning_elastic.membership.driver_locator import DriverLocator
from lightning_elastic.membership.driver_store import DriverStore
from lightning_elastic.errors import CollectiveError, RendezvousError
from lightning_elastic.membership.host_check import HostCheck, all_reduce_max
from lightning_elastic.commit.init_sync import SyncedModules
from lightning_elastic.membership.preemption import PreemptionHandler
from lightning_elastic.durable.files import ENV_DIR, ENV_JOB_ID, Location, SnapshotSettings
from lightning_elastic.membership.stuck_round import Action, StuckRoundWatch, stack_of
from lightning_elastic.membership.process_group import (
    BackendChoice,
    abandon_round_group,
    choose_backend,
    destroy_round_group,
    init_round_group,
    validate_backend,
    validate_timeout,
)

if TYPE_CHECKING:
    from lightning_elastic.durable.store import ResumePlan, SnapshotWriter

log = logging.getLogger(__name__)

# A worker that has not reached its driver for this many heartbeat timeouts leaves: by
# then the driver has declared it lost (a partition, or the driver is gone) and killed it
# as far as it could, so lingering could only leave a stray process on its host.
DRIVER_LOST_AFTER_TIMEOUTS = 2.0

# wait_collective: how often a pending collective looks whether its round broke, and how
# long it may stay pending once the round is known broken (the heartbeat has then cut the
# group's connections: an operation gloo did fail has raised well within this).
COLLECTIVE_WAIT_SLICE = datetime.timedelta(seconds=0.25)
ABANDON_AFTER_BROKEN_S = 2.0

# How long a worker's end report waits for its first-step report still in flight.
FIRST_STEP_SEND_WAIT = 2.0

# At the exit of a worker whose training returned: how long its last host-check collective
# may take to complete (every rank starts it at the same call, within a step of each
# other), and how long the interpreter then lets the process group's threads hold the GIL
# before it finalizes (see ``ElasticWorker.shutdown``).
SETTLE_LAST_CHECK_S = 10.0
GIL_HANDOVER_S = 0.02


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where a worker stands in the current round (``le.slot_info()``).

    ``hostname``: the host the launcher started it on, as discovery or ``-H`` names it;
    ``rank`` and ``size``: ``le.rank()`` and ``le.size()``; ``local_rank`` and
    ``local_size``: its slot on the host and the round's workers there; ``cross_rank``
    and ``cross_size``: its host among the hosts with a worker of the same local rank.
    """

    hostname: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    driver_url: str
    secret: str = dataclasses.field(repr=False)  # never in a log line or a traceback
    worker_id: str
    hostname: str
    heartbeat_interval: float
    heartbeat_timeout: float
    elastic_timeout: float
    lost_member_wait: float
    process_group_timeout: float
    preemption_grace: float
    cuda_device: int | None = None  # pinned by the launcher; None: cuda:LOCAL_RANK
    # How long the driver may be unreachable before this worker exits (--driver-patience,
    # with --state-dir: a restarted driver adopts it); 0: DRIVER_LOST_AFTER_TIMEOUTS.
    driver_patience: float = 0.0
    # --state-dir: the file a restarted driver writes its URL to (protocol.ENV_DRIVER_URL_FILE).
    driver_url_file: Path | None = None
    world_size: int = 1  # at the start: bounds how often a fleet re-reads driver_url_file
    # Where the driver is now, shared by every client of this worker (built from the two above).
    locator: DriverLocator = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "locator", DriverLocator(self.driver_url, self.driver_url_file,
                                                          world_size=self.world_size))

    @property
    def driver_lost_after(self) -> float:
        return max(self.driver_patience, DRIVER_LOST_AFTER_TIMEOUTS * self.heartbeat_timeout)

    def client(self, retry_for: float | None = None) -> DriverClient:
        """A client whose requests wait out an unreachable driver for as long as this worker
        does (``retry_for``: less, for a request that must not wait that long)."""
        return DriverClient(self.driver_url, self.secret, self.worker_id,
                            retry_for=max(RETRY_FOR, self.driver_patience) if retry_for is None else retry_for,
                            locator=self.locator)

    @classmethod
    def from_environment(cls, environ: os._Environ | dict[str, str]) -> WorkerSettings | None:
        if p.ENV_DRIVER_URL not in environ:
            return None
        try:
            return cls(
                driver_url=environ[p.ENV_DRIVER_URL],
                secret=_read_secret(environ),
                worker_id=environ[p.ENV_WORKER_ID],
                hostname=environ[p.ENV_HOSTNAME],
                heartbeat_interval=float(environ.get(p.ENV_HEARTBEAT_INTERVAL, "1")),
                heartbeat_timeout=float(environ.get(p.ENV_HEARTBEAT_TIMEOUT, "10")),
                elastic_timeout=float(environ.get(p.ENV_ELASTIC_TIMEOUT, "600")),
                lost_member_wait=float(environ.get(p.ENV_LOST_MEMBER_WAIT, "5")),
                process_group_timeout=float(environ.get(p.ENV_PROCESS_GROUP_TIMEOUT, "1800")),
                preemption_grace=float(environ.get(p.ENV_PREEMPTION_GRACE, "30")),
                cuda_device=int(environ[p.ENV_CUDA_DEVICE]) if environ.get(p.ENV_CUDA_DEVICE) else None,
                driver_patience=float(environ.get(p.ENV_DRIVER_PATIENCE, "0")),
                driver_url_file=Path(environ[p.ENV_DRIVER_URL_FILE]) if environ.get(p.ENV_DRIVER_URL_FILE) else None,
                world_size=_int_or(environ.get("WORLD_SIZE"), 1),
            )
        except KeyError as err:
            raise RendezvousError(
                f"environment variable {err.args[0]} is missing: start workers with lightning-elastic launch"
            ) from None


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _driver_chose(environ: os._Environ | dict[str, str]) -> bool:
    """Did the launcher choose the snapshot to resume from? It does whenever it has
    ``--snapshot-dir``: then no ``LIGHTNING_ELASTIC_RESUME_FROM`` means start over (none
    valid, or ``--no-resume``). Otherwise (``le.init(snapshot_dir=...)`` alone) the
    worker searches the directory itself."""
    return p.ENV_DRIVER_URL in environ and bool(environ.get(ENV_DIR, "").strip())


def _read_secret(environ: os._Environ | dict[str, str]) -> str:
    """Read the job secret from the pipe the launcher passed (once: the pipe is then closed).

    The variable is removed so that processes this worker starts do not look for a closed
    descriptor.
    """
    text = environ[p.ENV_SECRET_FD]
    if not text.isdigit():
        environ.pop(p.ENV_SECRET_FD, None)
        raise RendezvousError(f"{p.ENV_SECRET_FD}={text!r} is not a file descriptor: start workers with lightning-elastic launch")
    fd = int(text)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except OSError as err:
        raise RendezvousError(
            f"cannot read the job secret from descriptor {fd} ({err}): start workers with lightning-elastic launch"
        ) from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
        environ.pop(p.ENV_SECRET_FD, None)
    return b"".join(chunks).decode()


def wait_or_give_up(
    work: dist.Work, broken_reason: Callable[[], str | None],
    wait_slice: datetime.timedelta = COLLECTIVE_WAIT_SLICE, grace_s: float = ABANDON_AFTER_BROKEN_S,
    give_up_after_s: float | None = None,
) -> None:
    """``work.wait()``, but raise ``CollectiveError`` once ``broken_reason()`` has named a
    reason for ``grace_s`` seconds and the work is still pending, or once the work has been
    pending for ``give_up_after_s`` seconds (if given)."""
    broken_since: float | None = None
    started = time.monotonic()
    while True:
        try:
            work.wait(wait_slice)
            return
        except RuntimeError:
            if work.is_completed():
                # Failed, or completed just after the slice ran out (the error raised is then
                # the slice's own "Operation timed out!"): a wait now, on completed work,
                # returns or raises the operation's own error, e.g. a lost peer's.
                work.wait()
                return
        if give_up_after_s is not None and time.monotonic() - started >= give_up_after_s:
            raise CollectiveError(f"a collective was still pending {give_up_after_s:g} s later and was given up")
        reason = broken_reason()
        if reason is None:
            continue
        now = time.monotonic()
        broken_since = now if broken_since is None else broken_since
        if now - broken_since >= grace_s:
            raise CollectiveError(f"{reason}; a collective of its group was still pending {grace_s:g} s later "
                                  "and was given up")


class ElasticWorker:
    """This process's membership of the job: its driver connection, heartbeat, current
    round and process group.

    Made by ``le.init()`` (one per process, ``le.current_worker()``); ``@le.run`` and the
    Lightning and Fabric strategies drive it. Without the launcher's environment it is a
    world of one that never resets. Of its methods a training script may use
    ``check_host_updates()`` (what ``state.commit()`` calls), ``slot_info()``, ``device``
    and ``backend``; the rest serve the retry loop.
    """

    def __init__(
        self,
        settings: WorkerSettings | None,
        use_cuda: bool | None = None,
        collective_timeout: float | None = None,
        backend: str | None = None,
    ) -> None:
        self.settings = settings
        # None: NCCL on cuda:LOCAL_RANK when CUDA is available. False: gloo on the CPU even
        # on a GPU machine (a Lightning Trainer with accelerator="cpu").
        self.use_cuda = use_cuda
        self._collective_timeout = collective_timeout  # None: the launcher's --collective-timeout
        self._requested_backend = backend  # None: NCCL with CUDA, else gloo
        self._commits_in_round = 0
        self.commits_total = 0  # commits by this process, every round
        self._host_check: HostCheck | None = None  # the current round's
        self._preemption: PreemptionHandler | None = None
        self._client = settings.client() if settings else None
        self._store: DriverStore | None = None
        self._assignment: p.Assignment | None = None
        self._seen_generation = 0
        self._last_broken_round = 0
        self._lock = threading.Lock()
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._backend: BackendChoice | None = None
        # The group formed for round N and its gloo connections: (N, connections); (0, ...)
        # while there is none. Written and read under ``_lock``.
        self._group_connections: tuple[int, frozenset[group_sockets.Connection]] = (0, frozenset())
        self._group_abandoned = False  # a collective of the current group was given up
        self._stuck = StuckRoundWatch()  # the heartbeat's watch on a broken round this worker stays in
        self._training_thread: int | None = None  # the thread that forms the groups (whose stack to show)
        # (round, wall time) of this worker's first training step in its newest round: sent
        # with heartbeats, for the driver's timeline.
        self._stepped: tuple[int, float] = (0, 0.0)
        self._first_step_sender: threading.Thread | None = None  # rank 0's, of its newest round
        self._reset_started_at: float | None = None
        self.resets = 0  # resets this worker went through (recoveries and host changes)
        # What the newest round's state sync loaded: a torch DDP of it skips its own broadcast.
        self.synced_modules = SyncedModules()
        # What this worker last told the driver of its end (DONE, FAILED, REMOVED), if anything.
        self.reported: p.Outcome | None = None
        # Set by the retry loop (``@le.run``, the Trainer's fit): recoveries are possible.
        self.in_retry_loop = False
        self.last_recovery_s: float | None = None  # from its last reset to the next first step
        # Durable snapshots (lightning_elastic.durable.store): the writer, used by rank 0
        # after its commits, and the snapshot the first round resumes from.
        self.snapshot_writer: SnapshotWriter | None = None
        self.resume_from: ResumePlan | None = None

    def configure_snapshots(self, settings: SnapshotSettings | None, resume_from: Location | None = None) -> None:
        """Persist commits as ``settings`` say; ``resume_from``: the snapshot the driver chose.

        Without a driver's choice (a job started otherwise than by the launcher) the first
        round resumes from the newest valid snapshot in the directory, unless ``resume`` is off.
        """
        from lightning_elastic.durable.store import ResumePlan, SnapshotWriter  # noqa: PLC0415 - torch-heavy

        if settings is None:
            self.snapshot_writer, self.resume_from = None, None
            return
        self.snapshot_writer = SnapshotWriter(settings, os.environ.get(ENV_JOB_ID, ""))
        if resume_from is not None:
            self.resume_from = ResumePlan(resume_from, settings.directory)
        elif settings.resume and not _driver_chose(os.environ):
            self.resume_from = ResumePlan(None, settings.directory)
        else:
            self.resume_from = None

    @classmethod
    def from_environment(
        cls, use_cuda: bool | None = None, collective_timeout: float | None = None, backend: str | None = None
    ) -> ElasticWorker:
        return cls(WorkerSettings.from_environment(os.environ), use_cuda, collective_timeout, backend)

    def configure_collectives(self, timeout: float | None = None, backend: str | None = None) -> None:
        """Set the collective timeout or backend (a Lightning strategy's ``timeout=`` and
        ``process_group_backend=``); a group already formed keeps its own until the next round."""
        if timeout is not None:
            self._collective_timeout = validate_timeout(timeout)
        if backend is not None:
            validate_backend(backend)
            self._requested_backend = backend

    @property
    def collective_timeout(self) -> float:
        """Seconds a collective may take: ``init(collective_timeout=...)`` or the strategy's
        ``timeout``, else the launcher's ``--collective-timeout``."""
        if self._collective_timeout is not None:
            return self._collective_timeout
        return self.settings.process_group_timeout if self.settings else 1800.0

    @property
    def elastic(self) -> bool:
        """True under ``lightning-elastic launch``; False in a world of one without it."""
        return self.settings is not None

    # ----- membership -----------------------------------------------------------------

    def start(self) -> None:
        """Join: start heartbeats, wait for the first round, form its process group."""
        if self.settings is None:
            self._assignment = p.Assignment(1, 0, 1, 0, 1, 0, 1, "localhost", "", 0, 0)
            self._form_group()
            return
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="elastic-heartbeat", daemon=True)
        self._heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            self._preemption = PreemptionHandler(self.request_leave, self.settings.preemption_grace)
            self._preemption.install()
        self._join_next_round()

    def reset(self) -> None:
        """Leave the current round and join the next one (called by ``@run``)."""
        self._reset_started_at = time.time()
        self.resets += 1
        connections = self._forget_group()
        if connections and self.backend != "nccl" and self._round_broken_reason() is not None:
            # A round that lost a member: an operation of its group still queued or waiting
            # on a peer that left it (whose group, kept alive by its DDP module, keeps its
            # sockets open) would hold the destroy below, which joins the group's threads,
            # for the group's whole timeout. The heartbeat cuts these connections when it
            # learns of the loss while the group stands; when this worker's own collective
            # failed first, it is done here.
            group_sockets.shut_down(connections)
        if self._group_abandoned:
            abandon_round_group()
            self._group_abandoned = False
        else:
            destroy_round_group(abort=self.backend == "nccl")
        if self.settings is None:
            self._form_group()
        else:
            self._join_next_round()

    def _forget_group(self) -> frozenset:
        """Mark the group gone before it is destroyed: the heartbeat thread then leaves it
        (and its successor, until formed) alone. Returns the group's connections."""
        with self._lock:
            connections = self._group_connections[1]
            self._group_connections = (0, frozenset())
        return connections

    def shutdown(self) -> None:
        """Leave the job at the process's exit (``le.init`` registers this with ``atexit``).

        The end of a process is a race with the process group's threads: a gloo thread
        that finishes an operation may be the last holder of its tensors, and releasing a
        tensor Python also knew needs the GIL. A thread that asks for the GIL once the
        interpreter is finalizing is ended by Python in the middle of C++ code, which
        aborts the whole process ("terminate called without an active exception",
        SIGABRT) after training succeeded. Once a DDP module has used the group, torch keeps
        references to it that outlive the module and ``destroy`` (torch 2.13), so the
        group's threads live on into finalization. Hence, in this order: the host check's
        last background collective completes (a peer's start of it would otherwise
        complete it here at any later time), the group is left, and the GIL is released
        for a moment so that every thread waiting for it has its turn before the
        interpreter finalizes. Reproduced with torch alone (two gloo ranks, a DDP module,
        ``all_gather_object``, ``destroy_process_group``, exit): 9 of 65 runs aborted;
        with a 20 ms pause before the exit, none of 60.
        """
        if self.snapshot_writer is not None:
            self.snapshot_writer.close(timeout=30.0)  # a write in progress completes
        self._heartbeat_stop.set()
        self._settle_host_check()
        self._forget_group()
        formed = dist.is_initialized()
        if self._group_abandoned:
            abandon_round_group()
        else:
            destroy_round_group()
        if self._client is not None:
            self._client.close()
        if self._store is not None:
            self._store.close()
        if formed:
            time.sleep(GIL_HANDOVER_S)

    def _settle_host_check(self) -> None:
        """Let the host check's last background collective complete, when every rank's
        training returned (each started it at the same call); otherwise leave it."""
        check, self._host_check = self._host_check, None
        if check is None or self.settings is None or self.reported is not p.Outcome.DONE:
            return
        try:
            check.settle(lambda work: wait_or_give_up(
                work, self._round_broken_reason, give_up_after_s=SETTLE_LAST_CHECK_S))
        except Exception as err:  # noqa: BLE001 - training is over either way; only the exit's order is at stake
            log.debug("The last host check did not complete at the exit: %s", err)

    def _join_next_round(self) -> None:
        assert self._client is not None and self.settings is not None
        after = self._assignment.round if self._assignment else 0
        deadline = time.monotonic() + self.settings.elastic_timeout + 60.0
        if after == 0:
            time.sleep(first_request_spread(self.settings.world_size))  # the launch's WORLD_SIZE
        standby_said = False
        while True:
            reply = self._client.rendezvous(after)
            if reply.status == p.RendezvousStatus.ASSIGNED:
                assert reply.assignment is not None
                break
            if reply.status == p.RendezvousStatus.EXIT:
                log.info("Worker %s is no longer part of the job: leaving.", self.settings.worker_id)
                if self._preemption is not None:
                    self._preemption.left()  # leaving in time: no forced exit during teardown
                self.reported = p.Outcome.REMOVED
                self._client.report(after, p.Outcome.REMOVED)
                self.shutdown()
                sys.exit(0)
            if reply.standby:
                # A hot spare waits until a change needs it, however long the job runs.
                if not standby_said:
                    log.info("Worker %s is a hot spare: waiting at the rendezvous until the job needs it.",
                             self.settings.worker_id)
                    standby_said = True
                deadline = time.monotonic() + self.settings.elastic_timeout + 60.0
            if time.monotonic() > deadline:
                raise RendezvousError(f"no round was formed within {self.settings.elastic_timeout:g} s")
        self._assignment = reply.assignment
        self._commits_in_round = 0
        self._host_check = None  # the last round's, gone with its group
        self._publish_environment(reply.assignment)
        self._form_group()
        self._host_check = self._new_host_check(reply.assignment)

    def _new_host_check(self, a: p.Assignment, all_reduce: Callable[[torch.Tensor], dist.Work] = all_reduce_max,
                        ) -> HostCheck:
        """The round's host check; its pending all-reduce waited for as every small collective
        of the worker is (given up once the round lost a member, not held for the group's timeout)."""
        return HostCheck(a.round, a.generation, self.device, all_reduce, wait=self.wait_collective)

    def _form_group(self) -> None:
        a = self._assignment
        assert a is not None
        self._backend = choose_backend(self.cuda_index, self.use_cuda, self._requested_backend)
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        if self.settings is None:
            store: dist.Store = dist.HashStore()
        else:
            if self._store is None:
                client = self.settings.client()
                self._store = DriverStore(client, timeout, interrupted=self._round_broken_reason)
            self._store.set_timeout(timeout)
            store = self._store
        if self._backend.backend != "gloo" or self.settings is None:
            init_round_group(store, a.round, a.rank, a.size, self._backend, timeout)
            with self._lock:
                self._group_connections = (a.round, frozenset())  # NCCL: the round, for its abort
            return
        # Remember the group's own connections: a partitioned peer can only be cut off by
        # shutting them down (see group_sockets).
        before = group_sockets.established()
        assert self._store is not None
        with self._store.recording() as published:
            init_round_group(store, a.round, a.rank, a.size, self._backend, timeout)
        driver = urllib.parse.urlsplit(self.settings.locator.url)
        excluded = {(driver.hostname or "", driver.port or 0)}
        opened = group_sockets.new_connections(before, group_sockets.established(), excluded)
        # Only those to or from the listeners the ranks published: another thread may have
        # opened connections of its own meanwhile.
        connections = group_sockets.published_by(opened, published)
        with self._lock:
            self._group_connections = (a.round, connections)
        self._training_thread = threading.get_ident()

    @staticmethod
    def _publish_environment(a: p.Assignment) -> None:
        # Libraries that read torch's usual variables see the current round.
        os.environ.update(
            {
                "MASTER_ADDR": a.store_host,
                "MASTER_PORT": str(a.store_port),
                "RANK": str(a.rank),
                "WORLD_SIZE": str(a.size),
                "LOCAL_RANK": str(a.local_rank),
                "LOCAL_WORLD_SIZE": str(a.local_size),
                "GROUP_RANK": str(a.cross_rank),
            }
        )

    # ----- what the run loop asks -----------------------------------------------------

    @property
    def assignment(self) -> p.Assignment:
        if self._assignment is None:
            raise RuntimeError("lightning_elastic is not initialised: call lightning_elastic.init() first")
        return self._assignment

    @property
    def cuda_index(self) -> int:
        """This worker's CUDA device: the one its launcher pinned it to, else ``LOCAL_RANK``."""
        if self.settings is not None and self.settings.cuda_device is not None:
            return self.settings.cuda_device
        return self.assignment.local_rank

    @property
    def backend(self) -> str:
        """The current process group's backend: ``"nccl"`` or ``"gloo"``."""
        return self._backend.backend if self._backend else "gloo"

    @property
    def device(self) -> torch.device:
        """Where this worker's tensors go: ``cuda:cuda_index`` with NCCL, else the CPU."""
        return self._backend.device if self._backend else torch.device("cpu")

    def slot_info(self) -> SlotInfo:
        """``le.slot_info()``: this worker's place in the current round."""
        a = self.assignment
        hostname = self.settings.hostname if self.settings else a.hostname
        return SlotInfo(hostname, a.rank, a.local_rank, a.local_size, a.cross_rank, a.cross_size, a.size)

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank at once if hosts changed.

        See ``lightning_elastic.membership.host_check``: one background all-reduce makes the newest
        generation any rank's heartbeat saw common knowledge; calls that come faster than
        ``CHECK_PERIOD_S`` apart share one, and every rank raises at the same call.
        """
        self._note_step()
        if self.settings is None or self._host_check is None:
            return
        with self._lock:
            seen = self._seen_generation
        self._host_check.check(seen)

    def note_commit(self) -> None:
        """Count a commit: the driver tells a repeating error from one that makes progress."""
        self._commits_in_round += 1
        self.commits_total += 1
        self._note_step()

    def _note_step(self) -> None:
        """A training step completed (a commit or a host check follows one): the first of a
        round is when training resumed, for the timeline and ``last_recovery_s``."""
        a = self._assignment
        if a is None or self._stepped[0] == a.round:
            return
        now = time.time()
        self._stepped = (a.round, now)
        if self._reset_started_at is not None:
            self.last_recovery_s = now - self._reset_started_at
            self._reset_started_at = None
        if a.rank == 0 and self.settings is not None:
            self._send_first_step(self._stepped)

    def _send_first_step(self, stepped: tuple[int, float]) -> None:
        """Tell the driver at once when training resumed in this round, for the timeline.

        Heartbeats carry it too, but a round that ends within a heartbeat interval (a kill
        or a join shortly before training returns) would end without it, and the timeline
        without that recovery's duration. Rank 0 alone sends it (all ranks step together:
        one request per round, not a fleet's wave), from a thread: the training loop never
        waits on the driver. A failure is left to the next heartbeat.
        """
        s = self.settings
        assert s is not None

        def send() -> None:
            client = s.client(RETRY_FOR)  # the others' may be mid-request
            try:
                with self._lock:
                    known, known_broken = self._seen_generation, self._last_broken_round
                client.heartbeat(known, known_broken, 0.0, stepped)
            except RendezvousError:
                pass
            finally:
                client.close()

        self._first_step_sender = threading.Thread(target=send, name="elastic-first-step", daemon=True)
        self._first_step_sender.start()

    def classify_error(self, error: str, collective: bool) -> p.RoundLostReply:
        """The driver's decision on an error this worker caught: recover (a lost peer), or not.

        ``collective`` errors (by their type) leave the round whatever the answer: the
        driver then counts the round as broken by this member, so its peers recover too,
        unless the same error keeps ending rounds with no commit in between.
        """
        if self._client is None or self.settings is None:
            return p.RoundLostReply(False)  # a world of one has no peer to lose
        with self._lock:
            if self._last_broken_round >= self.assignment.round:
                return p.RoundLostReply(True)
        reply = self._client.round_lost(
            self.assignment.round, self.settings.lost_member_wait, collective, error, self._commits_in_round
        )
        if reply.lost:
            with self._lock:  # the round is broken: its group's connections are cut at the reset
                self._last_broken_round = max(self._last_broken_round, self.assignment.round)
        return reply

    def wait_collective(self, work: dist.Work) -> None:
        """Wait for an asynchronous collective of the current round, or give it up.

        gloo fails a pending receive when its peer goes away, but not always a pending
        send: the root of a broadcast whose receivers left it (one died, the others raised
        and went on to the next rendezvous) was seen waiting in a 64 MiB send for the
        group's whole timeout, 30 minutes by default, with every connection of the group
        already closed. So once the driver has said the round lost a member, a collective
        still pending ``ABANDON_AFTER_BROKEN_S`` later is given up (``wait_or_give_up``),
        and the next ``reset`` leaves the group without destroying it: the destroy would
        wait for the stuck send. NCCL needs none of this: the heartbeat aborts its
        communicator, which fails every pending operation.
        """
        if self.backend == "nccl" or self.settings is None:
            work.wait()
            return
        try:
            wait_or_give_up(work, self._round_broken_reason)
        except CollectiveError:
            self._group_abandoned = True
            raise

    def _round_broken_reason(self) -> str | None:
        """Why the current round cannot complete, once the driver says a member is lost."""
        with self._lock:
            broken = self._last_broken_round
        a = self._assignment
        if a is not None and broken >= a.round:
            return f"round {a.round} lost a member"
        return None

    def request_leave(self, reason: str) -> bool:
        """Ask the driver to let this worker leave at the next check (a preemption notice).

        False when it should exit at once: the driver is stopping it anyway, training is
        over, or the driver cannot be reached.
        """
        if self.settings is None:
            return False
        s = self.settings
        client = s.client(RETRY_FOR)  # the main thread's may be mid-request
        try:
            return client.leave(reason)
        except RendezvousError as err:
            log.warning("Could not tell the driver this worker is leaving: %s", err)
            return False
        finally:
            client.close()

    @property
    def handles_sigterm(self) -> bool:
        """Is a SIGTERM a graceful leave here (``lightning_elastic.membership.preemption``)?"""
        return self.settings is not None and PreemptionHandler.is_installed()

    def report(self, outcome: p.Outcome, message: str = "") -> None:
        self.reported = outcome
        sender = self._first_step_sender
        if sender is not None:
            # The round's first step before its end (a round that ends this quickly is
            # the one whose first step would be missing); bounded, as the request is.
            sender.join(FIRST_STEP_SEND_WAIT)
        if self._client is not None and self._assignment is not None:
            writer = self.snapshot_writer
            if writer is not None:
                writer.close(timeout=30.0)  # the final counts include a write in progress
            try:
                self._client.report(self._assignment.round, outcome, message,
                                    writer.stats if writer is not None else None)
            except RendezvousError as err:
                log.warning("Could not report %s to the driver: %s", outcome.value, err)

    # ----- heartbeat thread -----------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        assert self._client is not None and self.settings is not None
        last_ok = time.monotonic()
        interval = self.settings.heartbeat_interval
        first = True
        failures = 0  # in a row
        while not self._heartbeat_stop.is_set():
            try:
                with self._lock:
                    known, known_broken = self._seen_generation, self._last_broken_round
                # Held for a random part of the interval: a fleet's heartbeats must not
                # reach the driver in waves (see heartbeat_hold).
                hold = heartbeat_hold(interval, first)
                first = False
                writer = self.snapshot_writer
                stats = writer.stats if writer is not None else None
                reply = self._client.heartbeat(known, known_broken, hold, self._stepped, stats)
            except RendezvousError as err:
                if "(409)" in str(err):
                    # The driver counts this worker as gone (it missed heartbeats behind a
                    # partition, say) while it still runs: nobody will answer it again.
                    print("lightning-elastic: the driver no longer counts this worker in the job: exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
                # Training goes on meanwhile: collectives run peer to peer. With --state-dir
                # a restarted driver adopts this worker within the patience.
                lost_after = self.settings.driver_lost_after
                if time.monotonic() - last_ok > lost_after:
                    print(f"lightning-elastic: driver unreachable for {lost_after:g} s: exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
                self._heartbeat_stop.wait(heartbeat_retry_delay(interval, failures))
                failures += 1
                continue
            failures = 0
            last_ok = time.monotonic()
            with self._lock:
                self._seen_generation = max(self._seen_generation, reply.generation)
                newly_broken = reply.last_broken_round > self._last_broken_round
                self._last_broken_round = max(self._last_broken_round, reply.last_broken_round)
            if newly_broken:
                self._unblock_collectives(reply.last_broken_round)
            self._watch_broken_round()

    def _watch_broken_round(self) -> None:
        """Still in a round whose connections were cut long ago: cut again and say where
        the main thread is, then exit (see stuck_round)."""
        if self.reported is not None:
            return  # training returned (or the worker left): what it does now is its own
        with self._lock:
            group_round, connections = self._group_connections
        now = time.monotonic()
        action = self._stuck.check(group_round, now)
        if action is Action.NONE:
            return
        waited = self._stuck.waited(now)  # the watch acts only while the group is still the cut round's
        if action is Action.REPORT:
            cut = group_sockets.shut_down(connections)
            print(f"lightning-elastic: round {group_round} lost a member {waited:.0f} s ago and this worker is still in "
                  f"it ({cut} of its {len(connections)} connection(s) cut again); its training thread is at:\n"
                  f"{stack_of(self._training_thread)}", file=sys.stderr, end="", flush=True)
            return
        print(f"lightning-elastic: still in round {group_round} {waited:.0f} s after it lost a member: exiting, "
              "so that the job goes on without this worker", file=sys.stderr, flush=True)
        os._exit(1)

    def _unblock_collectives(self, broken_round: int) -> None:
        """The round lost a member: make a collective stuck waiting for it raise now.

        A dead peer usually fails a gloo collective within milliseconds, but one behind a
        partition sends nothing, and NCCL often hangs rather than fails: without this the
        survivors would wait for the process-group timeout.
        """
        with self._lock:
            # The round of the group that exists now, read under the lock: the main thread
            # may have left the broken round and formed the next one since the heartbeat
            # learned of it, and that group is healthy (reading ``_assignment`` instead
            # could abort it).
            formed_in, connections = self._group_connections
            if formed_in != broken_round:
                return
            self._stuck.cut(broken_round, time.monotonic())
            if self.backend == "nccl":
                # Aborted under the lock: the main thread marks the group gone under it
                # before it destroys or replaces it, so the group aborted here is the
                # broken round's. @run re-forms.
                self._group_connections = (0, frozenset())
                destroy_round_group(abort=True)
                return
        group_sockets.shut_down(connections)
