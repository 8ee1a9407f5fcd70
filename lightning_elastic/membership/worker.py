"""``ElasticWorker``: a worker's membership in the job, as the rest of the package sees it.

A facade over the parts in this package: ``settings`` (what the launcher said),
``shared`` (what the training and heartbeat threads share, behind one lock),
``rendezvous``, ``heartbeat``, ``round_group``, ``host_check`` and ``preemption``.
``ElasticWorker.from_environment()`` joins the job the launcher describes in the
environment; without a launcher it is a world of one (so the same script runs alone).
Threads and sockets start in ``start()``, never in the constructor.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.commit.init_sync import SyncedModules
from lightning_elastic.durable.files import ENV_DIR, ENV_JOB_ID, Location, SnapshotSettings
from lightning_elastic.errors import CollectiveError, RendezvousError
from lightning_elastic.membership import rendezvous
from lightning_elastic.membership.client import RETRY_FOR
from lightning_elastic.membership.collective_wait import wait_or_give_up
from lightning_elastic.membership.heartbeat import Heartbeat, send_first_step
from lightning_elastic.membership.host_check import HostCheck, all_reduce_max
from lightning_elastic.membership.preemption import PreemptionHandler
from lightning_elastic.membership.process_group import choose_backend, validate_backend, validate_timeout
from lightning_elastic.membership.round_group import RoundGroup
from lightning_elastic.membership.settings import SlotInfo, WorkerSettings
from lightning_elastic.membership.shared import SharedState

if TYPE_CHECKING:
    from lightning_elastic.durable.store import ResumePlan, SnapshotWriter

__all__ = ["ElasticWorker", "SlotInfo", "WorkerSettings"]

log = logging.getLogger(__name__)

# How long a worker's end report waits for its first-step report still in flight.
FIRST_STEP_SEND_WAIT = 2.0

# At the exit of a worker whose training returned: how long its last host-check collective
# may take to complete (every rank starts it at the same call, within a step of each
# other), and how long the interpreter then lets the process group's threads hold the GIL
# before it finalizes (see ``ElasticWorker.shutdown``).
SETTLE_LAST_CHECK_S = 10.0
GIL_HANDOVER_S = 0.02


def _driver_chose(environ: os._Environ | dict[str, str]) -> bool:
    """Did the launcher choose the snapshot to resume from? It does whenever it has
    ``--snapshot-dir``: then no ``LIGHTNING_ELASTIC_RESUME_FROM`` means start over (none
    valid, or ``--no-resume``). Otherwise (``le.init(snapshot_dir=...)`` alone) the
    worker searches the directory itself."""
    return p.ENV_DRIVER_URL in environ and bool(environ.get(ENV_DIR, "").strip())


class ElasticWorker:
    """This process's membership of the job: its driver connection, heartbeat, current
    round and process group.

    Made by ``le.init()`` (one per process, ``le.current_worker()``); ``@le.run`` and the
    Lightning and Fabric strategies drive it. Without the launcher's environment it is a
    world of one that never resets. Of its methods a training script may use
    ``check_host_updates()`` (what ``state.commit()`` calls), ``slot_info()``, ``device``
    and ``backend``; the rest serve the retry loop.

    Every method is called from the training thread; what the heartbeat thread also
    touches lives in ``self._shared`` (``SharedState``) and nowhere else.
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
        self._shared = SharedState()
        # One client for the training thread and the heartbeat thread: one pool of connections
        # to the driver per worker (its session and nonce sequence are safe to share).
        self._client = settings.client() if settings else None
        self._heartbeat = Heartbeat(settings, self._client, self._shared) if settings and self._client else None
        self._group = RoundGroup(settings, self._shared, self._round_broken_reason)
        self._assignment: p.Assignment | None = None
        self._host_check: HostCheck | None = None  # the current round's
        self._preemption: PreemptionHandler | None = None
        self._commits_in_round = 0
        self.commits_total = 0  # commits by this process, every round
        self._first_step_sender: threading.Thread | None = None  # rank 0's, of its newest round
        self._reset_started_at: float | None = None
        self.resets = 0  # resets this worker went through (recoveries and host changes)
        # What the newest round's state sync loaded: a torch DDP of it skips its own broadcast.
        self.synced_modules = SyncedModules()
        # Set by the retry loop (``@le.run``, the Trainer's fit): recoveries are possible.
        self.in_retry_loop = False
        self.last_recovery_s: float | None = None  # from its last reset to the next first step
        # The snapshot the first round resumes from (lightning_elastic.durable.store).
        self.resume_from: ResumePlan | None = None

    @property
    def reported(self) -> p.Outcome | None:
        """What this worker last told the driver of its end (DONE, FAILED, REMOVED), if anything."""
        return self._shared.reported

    @reported.setter
    def reported(self, outcome: p.Outcome | None) -> None:
        self._shared.reported = outcome

    @property
    def snapshot_writer(self) -> SnapshotWriter | None:
        """Durable snapshots: the writer rank 0 offers its commits to (heartbeats carry its counts)."""
        return self._shared.snapshot_writer

    @snapshot_writer.setter
    def snapshot_writer(self, writer: SnapshotWriter | None) -> None:
        self._shared.snapshot_writer = writer

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
        assert self._heartbeat is not None
        self._heartbeat.start()
        if threading.current_thread() is threading.main_thread():
            self._preemption = PreemptionHandler(self.request_leave, self.settings.preemption_grace)
            self._preemption.install()
        self._join_next_round()

    def reset(self) -> None:
        """Leave the current round and join the next one (called by ``@run``)."""
        self._reset_started_at = time.time()
        self.resets += 1
        self._group.leave()
        if self.settings is None:
            self._form_group()
        else:
            self._join_next_round()

    def shutdown(self) -> None:
        """Leave the job at the process's exit (``le.init`` registers this with ``atexit``).

        The end of a process is a race with the process group's threads: a gloo thread
        that finishes an operation may be the last holder of its tensors, and releasing a
        tensor Python also knew needs the GIL. A thread that asks for the GIL once the
        interpreter is finalizing is ended by Python in the middle of C++ code, which
        aborts the whole process after training succeeded. Once a DDP module has used the
        group, torch keeps references to it that outlive the module and ``destroy``, so the
        group's threads live on into finalization. Hence, in this order: the host check's
        last background collective completes (a peer's start of it would otherwise
        complete it here at any later time), the group is left, and the GIL is released
        for a moment so that every thread waiting for it has its turn before the
        interpreter finalizes (how often it aborted without: docs/reliability.md).
        """
        if self.snapshot_writer is not None:
            self.snapshot_writer.close(timeout=30.0)  # a write in progress completes
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._settle_host_check()
        formed = self._group.leave_at_exit()
        if self._client is not None:
            self._client.close()
        self._group.close_store()
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
        assignment = rendezvous.next_assignment(self._client, self.settings, after)
        if assignment is None:
            self._leave_the_job(after)
        self._assignment = assignment
        self._commits_in_round = 0
        self._host_check = None  # the last round's, gone with its group
        rendezvous.publish_environment(assignment)
        self._form_group()
        self._host_check = self._new_host_check(assignment)

    def _leave_the_job(self, after: int) -> NoReturn:
        """The driver says this worker is no longer part of the job: report, and exit."""
        assert self._client is not None and self.settings is not None
        log.info("Worker %s is no longer part of the job: leaving.", self.settings.worker_id)
        if self._preemption is not None:
            self._preemption.left()  # leaving in time: no forced exit during teardown
        self.reported = p.Outcome.REMOVED
        self._client.report(after, p.Outcome.REMOVED)
        self.shutdown()
        sys.exit(0)

    def _new_host_check(self, a: p.Assignment, all_reduce: Callable[[torch.Tensor], dist.Work] = all_reduce_max,
                        ) -> HostCheck:
        """The round's host check; its pending all-reduce waited for as every small collective
        of the worker is (given up once the round lost a member, not held for the group's timeout)."""
        return HostCheck(a.round, a.generation, self.device, all_reduce, wait=self.wait_collective)

    def _form_group(self) -> None:
        a = self._assignment
        assert a is not None
        choice = choose_backend(self.cuda_index, self.use_cuda, self._requested_backend)
        self._group.form(a, choice, self.collective_timeout)

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
        return self._group.backend

    @property
    def device(self) -> torch.device:
        """Where this worker's tensors go: ``cuda:cuda_index`` with NCCL, else the CPU."""
        return self._group.device

    def slot_info(self) -> SlotInfo:
        """``le.slot_info()``: this worker's place in the current round."""
        a = self.assignment
        hostname = self.settings.hostname if self.settings else a.hostname
        return SlotInfo(hostname, a.rank, a.local_rank, a.local_size, a.cross_rank, a.cross_size, a.size)

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank at once if hosts changed.

        See ``lightning_elastic.membership.host_check``: one background all-reduce makes the
        newest generation any rank's heartbeat saw common knowledge; calls that come faster
        than ``CHECK_PERIOD_S`` apart share one, and every rank raises at the same call.
        """
        self._note_step()
        if self.settings is None or self._host_check is None:
            return
        self._host_check.check(self._shared.seen())

    def note_commit(self) -> None:
        """Count a commit: the driver tells a repeating error from one that makes progress."""
        self._commits_in_round += 1
        self.commits_total += 1
        self._note_step()

    def _note_step(self) -> None:
        """A training step completed (a commit or a host check follows one): the first of a
        round is when training resumed, for the timeline and ``last_recovery_s``."""
        a = self._assignment
        if a is None or self._shared.stepped[0] == a.round:
            return
        now = time.time()
        stepped = self._shared.stepped = (a.round, now)
        if self._reset_started_at is not None:
            self.last_recovery_s = now - self._reset_started_at
            self._reset_started_at = None
        if a.rank == 0 and self.settings is not None:
            self._first_step_sender = send_first_step(self.settings, self._shared, stepped)

    def classify_error(self, error: str, collective: bool) -> p.RoundLostReply:
        """The driver's decision on an error this worker caught: recover (a lost peer), or not.

        ``collective`` errors (by their type) leave the round whatever the answer: the
        driver then counts the round as broken by this member, so its peers recover too,
        unless the same error keeps ending rounds with no commit in between. The answer
        takes at most --error-wait, or, while a peer has been silent since the question
        (a crashed machine whose exit the driver cannot see), until the driver's verdict
        on it: at most --heartbeat-timeout plus ``VERDICT_GRACE``.
        """
        if self._client is None or self.settings is None:
            return p.RoundLostReply(False)  # a world of one has no peer to lose
        if self._shared.broken(self.assignment.round):
            return p.RoundLostReply(True)
        reply = self._client.round_lost(
            self.assignment.round, self.settings.lost_member_wait, collective, error, self._commits_in_round,
            verdict_wait=self.settings.verdict_wait,
        )
        if reply.lost:  # the round is broken: its group's connections are cut at the reset
            self._shared.mark_broken(self.assignment.round)
        return reply

    def wait_collective(self, work: dist.Work) -> None:
        """Wait for an asynchronous collective of the current round, or give it up.

        With gloo, once the driver has said the round lost a member, a collective still
        pending ``collective_wait.ABANDON_AFTER_BROKEN_S`` later is given up (see
        ``collective_wait``), and the next ``reset`` leaves the group without destroying
        it: the destroy would wait for the stuck operation. NCCL needs none of this: the
        heartbeat aborts its communicator, which fails every pending operation.
        """
        if self.backend == "nccl" or self.settings is None:
            work.wait()
            return
        try:
            wait_or_give_up(work, self._round_broken_reason)
        except CollectiveError:
            self._group.abandoned = True
            raise

    def _round_broken_reason(self) -> str | None:
        """Why the current round cannot complete, once the driver says a member is lost."""
        a = self._assignment
        if a is not None and self._shared.broken(a.round):
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
        client = s.client(RETRY_FOR)  # the training thread's may be mid-request
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
