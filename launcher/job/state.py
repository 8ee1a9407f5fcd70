"""The job's state: every fact the driver's decisions and a restarted driver need, in one place.

``JobState`` is the one representation of the job: the rendezvous service records what
workers say into it, the decision loop's rules read and change it, and ``--state-dir``
saves it as it is (``launcher/restart/state_codec.py``), fields marked ``transient`` left out:
what a restarted driver learns again at once (pending requests, heartbeat ages, the hosts
discovery lists) or that only bounds a wait; times on the driver's clock are marked
``clock`` (``job/field_marks.py``). One lock guards it, the registry's
(``launcher/service/registry.py``); the decision loop holds it for a whole pass, the service
for each request, and no process is started while it is held.

Invariants:
- a worker id is never reused (``Tally.next_worker`` only grows, past what a predecessor
  may have reserved);
- a worker is in ``workers`` from its start until the first round formed after it
  finished; the live ones are those whose state is not ``finished``;
- ``round`` is the newest round formed; its members are worker ids in rank order, and a
  member's ``assignment.round`` is that round's number;
- ``broken_rounds`` and the other per-round facts hold the newest ``ROUNDS_KEPT`` rounds.
"""

from __future__ import annotations

import collections
import dataclasses
from enum import Enum
from typing import Any

from lightning_elastic.launcher.job.blacklist import Blacklist, HostManager
from lightning_elastic.launcher.job.field_marks import TRANSIENT, clock, transient
from lightning_elastic.launcher.job.history import BoundedHistory
from lightning_elastic.launcher.job.liveness import Absences
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.protocol import Assignment, Outcome, Report

class WorkerState(str, Enum):
    """Life cycle of a worker, as the driver sees it.

    STARTING -> WAITING (asked for a round) -> MEMBER (in the current round) -> WAITING ...
    and finally DONE (reported that training returned, then exited), REMOVED (left because
    its slot was taken out of the job, or was stopped by the driver) or FAILED (exited
    without reporting success, or was killed as wedged).
    """

    STARTING = "starting"
    WAITING = "waiting"
    MEMBER = "member"
    DONE = "done"
    REMOVED = "removed"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        # Identity, not ``in (...)``: an Enum's __eq__/__hash__ are Python-level, and the
        # driver asks this of every worker several times per decision.
        return self is WorkerState.DONE or self is WorkerState.REMOVED or self is WorkerState.FAILED



@dataclasses.dataclass
class WorkerRecord:
    worker_id: str
    slot: SlotKey
    started_at: float = clock()
    state: WorkerState = WorkerState.STARTING
    assignment: Assignment | None = None
    arrived_after_round: int | None = transient(default=None)  # set while it waits at the rendezvous
    waiting_since: float | None = transient(default=None)  # since when (driver clock)
    last_heartbeat: float | None = clock(default=None)
    asking_round: int | None = transient(default=None)  # set while it asks whether its round lost a member
    report: Report | None = None
    # When its report arrived: it stops heartbeating to exit then, and --exit-timeout, not
    # the heartbeat timeout, bounds the exit (the group's teardown, the interpreter's end).
    reported_at: float | None = clock(default=None)
    leave: bool = False  # answer EXIT at its next rendezvous
    departing: str = ""  # why it asked to leave (a preemption notice): its slot is vacant
    # The driver is stopping it (SIGTERM, or SIGKILL for a wedged one): SIGKILL at this time.
    stop_deadline: float | None = clock(default=None)
    kill_reason: str = ""  # why the driver killed or stopped it: part of its failure
    failure: str = ""  # how it failed ("worker ID <how>"), once it has
    standby: bool = False  # a hot spare (--spares): waits at the rendezvous, in no round
    joined: bool = False  # has reached the rendezvous at least once (le.init() ran)
    exit_status: int | None = None
    # Durable snapshots it wrote and failed to write, and the newest failure (heartbeats).
    snapshots: tuple[int, int, str] = (0, 0, "")
    # What outlives the driver, for the next one to find (``--state-dir``): the pid of the
    # process the driver signals (a keeper, processes/detached.py; 0: none to adopt) and its
    # start time (/proc/PID/stat field 22: a reused pid has another), and its --log-dir file.
    # Taken from its process once the driver learns them (ssh: when the supervisor says).
    keeper_pid: int = 0
    start_ticks: int = 0
    log_file: str = ""
    # Started through an agent (launch --agents): a restarted driver awaits it from its
    # agent, keeper_pid then its pid on the agent's host (service/agent_board.py).
    via_agent: bool = False
    # Started by a previous driver and adopted by this one (``--state-dir``): such a worker
    # may have exited while no driver ran, giving up on it (``protocol.EXIT_DRIVER_GONE``).
    adopted: bool = transient(default=False)
    # Its pending requests wait on this: fired when their answers may have changed.
    # (The service's ``Signal``, given by ``Registry.add_worker``: the core holds no threading.)
    wake: Any = dataclasses.field(default=None, repr=False, compare=False, metadata=TRANSIENT)

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None

    @property
    def reported_done(self) -> bool:
        return self.report is not None and self.report.outcome == Outcome.DONE

    @property
    def rank(self) -> int | None:
        return self.assignment.rank if self.assignment and self.state == WorkerState.MEMBER else None


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    number: int
    members: tuple[str, ...]  # worker ids in rank order
    generation: int
    slots: tuple[SlotKey, ...] = ()  # the members' slots, in rank order


@dataclasses.dataclass(frozen=True)
class RoundBreak:
    """How a round ended early: the first fact that broke it."""

    round: int
    slots: tuple[SlotKey, ...]  # the round's members
    cause: str  # for the log and the verdict
    error: str = ""  # the collective error a member left the round with; "" when a member was lost
    commits: int = 0  # commits the round made before the error



# Facts kept per round (its break, its first step, its verdicts) for this many rounds back:
# a job of weeks with a host that keeps failing forms thousands of rounds, and a break of a
# round of 4,096 holds its 4,096 slots. Nothing asks about a round this old.
ROUNDS_KEPT = 64


@dataclasses.dataclass
class CheckIn:
    """An asker's call-in: the other members of ``round`` show they are alive after ``since``."""

    asker: str
    round: int
    since: float
    cursor: int = 0  # members before it (in rank order) are shown alive or finished


@dataclasses.dataclass
class Tally:
    """What the job summary counts, carried across driver restarts."""

    next_worker: int = 0  # the next worker's number (ids are never reused)
    rounds: BoundedHistory[int] = dataclasses.field(default_factory=BoundedHistory)  # each round's world size
    failures: BoundedHistory[str] = dataclasses.field(default_factory=BoundedHistory)
    blacklisted: list[str] = dataclasses.field(default_factory=list)  # hosts, in order
    departures: BoundedHistory[str] = dataclasses.field(default_factory=BoundedHistory)
    outages: list[str] = dataclasses.field(default_factory=list)  # one line per driver restart


@dataclasses.dataclass
class StartFailures:
    """Workers whose script failed before they ever reached the rendezvous (an import error,
    a syntax error, a missing file): how many, on which hosts, and the first one's exit."""

    count: int = 0
    hosts: set[str] = dataclasses.field(default_factory=set)  # bounded by the job's hosts
    first: tuple[str, int, str] | None = None  # (worker id, exit status, its last output line)

    def add(self, worker_id: str, host: str, status: int, last_line: str) -> None:
        self.count += 1
        self.hosts.add(host)
        if self.first is None:
            self.first = (worker_id, status, last_line)


@dataclasses.dataclass
class JobState:
    """The whole job as the driver knows it (see the module docstring)."""

    # Where the workers reach the driver's rendezvous service.
    address: str = "127.0.0.1"
    port: int = 0
    # --- workers and rounds: written by the service (what workers say) and the loop ---
    workers: dict[str, WorkerRecord] = dataclasses.field(default_factory=dict)
    round: RoundInfo | None = None
    generation: int = 0  # bumped to tell every member to re-form at its next check
    broken_rounds: set[int] = dataclasses.field(default_factory=set)
    # Round breaks in round order (the newest ROUNDS_KEPT, or the repeated-error limit if more).
    breaks: collections.deque[RoundBreak] = transient(default_factory=lambda: collections.deque(maxlen=ROUNDS_KEPT))
    # Round -> the earliest first training step any member reported in it (wall clock).
    first_steps: dict[int, float] = transient(default_factory=dict)
    repeated_error: str | None = transient(default=None)  # the same collective error ended too many rounds
    # Rounds in which every live member once asked round_lost at the same time: the same
    # error everywhere is the user's own. Sticky, so members answered later agree.
    user_error_rounds: set[int] = transient(default_factory=set)
    # Round -> the errors (normalized) of members told their error is their own: they are
    # leaving it. Current and previous round only.
    own_errors: dict[int, set[str]] = transient(default_factory=dict)
    # The round in which a member first reported that training returned.
    returned_in: int | None = transient(default=None)
    # An adopting driver's only: the (round, generation) its predecessor may have announced
    # unsaved; once a worker shows it knows more, the next ones are numbered past them.
    reserved: tuple[int, int] | None = transient(default=None)
    # The next round is numbered past this (a predecessor's unsaved rounds; a round every
    # member of which left while no driver ran, ``job/step.py``).
    round_floor: int = 0
    closing: bool = transient(default=False)  # the driver is shutting down: no graceful leaves any more
    # Workers with a round-lost request pending (the service's).
    asking: set[str] = transient(default_factory=set)
    # The driver's own absences (job/liveness.py): set when the loop starts.
    absences: Absences = transient(default_factory=lambda: Absences.starting(0.0, float("inf")))
    # --preload: the hosts given a fork server (bounded by the hosts listed now).
    prepared: set[str] = transient(default_factory=set)
    # Groups of worker ids whose arrival at the rendezvous the loop awaits: an arrival wakes
    # it only once a whole group has come (see membership.awaited_arrivals); None: every one.
    awaited: list[set[str]] | None = transient(default=None)
    # --- the world the driver plans ---
    target: list[SlotAssignment] = dataclasses.field(default_factory=list)
    standby: tuple[SlotKey, ...] = ()  # slots of hot spares (--spares)
    announced_for: tuple[SlotKey, ...] | None = None  # the target last announced to the members
    # A slot left on a preemption notice -> the end of its hold (driver clock).
    held_until: dict[SlotKey, float] = clock(default_factory=dict)
    # (when, who): training returned and this worker exited first; the others have --exit-timeout.
    first_exit: tuple[float, str] | None = clock(default=None)
    # --- what the loop is waiting out ---
    reset_pending_since: float | None = transient(default=None)  # members were asked to re-rendezvous
    below_since: float | None = transient(default=None)  # fewer slots than required since then
    short_of_slots_said_at: float = transient(default=0.0)  # the last "waiting for slots" line
    discovery_error: str | None = transient(default=None)  # the latest poll's failure
    # The failure of a worker that exited 0 without ever reaching the rendezvous: a script
    # that does not join the job (see verdict.JobView.never_joined).
    never_joined: str = transient(default="")
    # Workers that failed before ever reaching the rendezvous (see verdict.StartFailures).
    start_failures: StartFailures = transient(default_factory=lambda: StartFailures())
    # --- what the summary counts, and the blacklist ---
    tally: Tally = dataclasses.field(default_factory=lambda: Tally())
    blacklist: Blacklist = dataclasses.field(default_factory=Blacklist)
    # The rules over the blacklist and what discovery lists; works on ``blacklist`` (bound here).
    hosts: HostManager = transient(default_factory=lambda: HostManager(None, lambda: 0.0))

    def __post_init__(self) -> None:
        self.hosts.table = self.blacklist  # one blacklist: the one saved is the one the rules change

    # ----- queries (O(N) unless said) -------------------------------------------------

    def live_workers(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if not w.state.finished]

    def current_member(self, record: WorkerRecord) -> bool:
        """O(1): by its assignment, not ``in self.round.members`` (a scan of the members on
        every arrival made re-forming thousands of workers quadratic)."""
        a = record.assignment
        return (self.round is not None and record.state == WorkerState.MEMBER and a is not None
                and a.round == self.round.number)

    def finishing(self) -> bool:
        """Has training returned in the current round (some member reported DONE)?"""
        current = self.round
        return current is not None and any(self.workers[w].reported_done for w in current.members)

    def round_broken(self) -> bool:
        return self.round is not None and self.round.number in self.broken_rounds

    def round_key(self) -> tuple[int, int]:
        """(round, generation): what a save paces itself by."""
        return (self.round.number if self.round else 0, self.generation)
