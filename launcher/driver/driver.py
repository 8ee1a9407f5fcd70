"""The elastic driver's loop: what happened goes into the job's state, decisions come out.

``Driver`` owns one ``JobState`` (job/state.py) and the lock that guards it (the
registry's, shared with the rendezvous service). Each turn of ``_loop`` it:

1. takes discovery's newest result and lets cooled-down hosts come back (host_intake.py);
2. reaps exited workers and classifies each exit (reaping.py, job/exits.py);
3. when something changed or a timer is due, runs one decision pass (decisions.py): kills
   wedged workers (job/liveness.py), asks for the verdict (job/verdict.py), plans the target
   world and announces a change (job/membership.py), forms the next round;
4. starts the workers the pass planned, with the lock released (starts.py);
5. saves the state when due (keeping.py, ``--state-dir``).

The lock is held for a whole turn except while workers start; the service takes it per
request. The parts are mixins of one class by concern, each a module of its own.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable

from lightning_elastic.launcher.config import LaunchConfig
from lightning_elastic.launcher.driver.executor import Executor
from lightning_elastic.launcher.driver.gc_policy import ServiceGc
from lightning_elastic.launcher.driver.host_intake import HostIntake
from lightning_elastic.launcher.driver.keeping import Keeping
from lightning_elastic.launcher.driver.lifecycle import Lifecycle
from lightning_elastic.launcher.driver.lifecycle import raise_descriptor_limit
from lightning_elastic.launcher.driver.reaping import Reaping
from lightning_elastic.launcher.driver.result import JobResult
from lightning_elastic.launcher.driver.starts import WorkerStarts
from lightning_elastic.launcher.driver.starts import _PendingStart
from lightning_elastic.launcher.errors import ConfigError, LaunchError
from lightning_elastic.launcher.hosts.discovery import DiscoveryPoller, FixedHosts, HostDiscovery
from lightning_elastic.launcher.hosts.network import choose_driver_address, unresolved_names_message
from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.job.blacklist import HostManager
from lightning_elastic.launcher.job.liveness import Absences
from lightning_elastic.launcher.job.rules import Rules
from lightning_elastic.launcher.job.state import JobState
from lightning_elastic.launcher.job.step import Turn, step
from lightning_elastic.launcher.observe.events import EventLog
from lightning_elastic.launcher.processes.base import WorkerLauncher, WorkerProcess, WorkerSpec
from lightning_elastic.launcher.processes.exit_watch import ExitWatcher
from lightning_elastic.launcher.restart import adoption
from lightning_elastic.launcher.restart import resume as snapshots
from lightning_elastic.launcher.service.agent_board import AgentBoard
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer


log = logging.getLogger("lightning_elastic.driver")


class _Stop(Exception):
    """The driver was asked to stop (SIGINT/SIGTERM)."""


class Driver(Lifecycle, HostIntake, WorkerStarts, Reaping, Keeping, Executor):
    def __init__(
        self,
        config: LaunchConfig,
        discovery: HostDiscovery,
        launcher: WorkerLauncher,
        is_local: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
        events: EventLog | None = None,
        resolves: Callable[[str], bool] | None = None,
        keeping: adoption.StateKeeping | None = None,
        agents: AgentBoard | None = None,
        secret: str | None = None,
    ) -> None:
        self._config = config
        self._events = events if events is not None else EventLog(config.log_dir)
        self._clock = clock
        self._launcher = launcher
        self._is_local = is_local
        # Does a host's name resolve here? Asked only when the driver picks its address from
        # the routes to the hosts; None: every name does (Ray's nodes are not DNS names).
        self._resolves = resolves
        self._address = "127.0.0.1"  # where workers reach the driver; chosen from the first hosts
        self._discovery = DiscoveryPoller(discovery, config.discovery_interval, config.timeouts.discovery,
                                          prepare=self._look_up)
        # The job's one state, guarded by the registry's lock (see job/state.py).
        self._state = JobState(hosts=HostManager(config.blacklist_cooldown, clock))
        self._registry = Registry(clock, config.repeated_error_limit, self._state)
        # --state-dir: the job's state kept for a restarted driver, and the job it adopts.
        self._keeping = keeping
        self._adopting = keeping is not None and keeping.previous is not None
        # Until the loop starts, an adopting driver is still taking the job over: should it
        # fail then, the job stays in the state dir for the next driver (lifecycle._shutdown).
        self._taking_over = self._adopting
        # The job's secret: the state dir's (a restarted driver's workers hold it), the one
        # given for the agents (--agents: they hold it too), or drawn for this job.
        self._secret = keeping.secret if keeping is not None else secret or secrets.token_hex(32)
        # --agents: the agents connected to the service, a host source beside discovery.
        self._agents = agents
        self._agents_version = 0
        self._discovered: list = []  # discovery's newest good result (host_intake.py)
        self._adoption_watch: adoption.AdoptionWatch | None = None  # until the adopted workers are back
        self._save_pacing = adoption.SavePacing()
        self._server: RendezvousServer | None = None
        self._processes: dict[str, WorkerProcess] = {}
        # The newest workers forgotten after a round formed, still flushed at the end.
        self._retired: collections.deque[WorkerProcess] = collections.deque(maxlen=256)
        self._gc = ServiceGc(clock)  # no full collection while a round forms (gc_policy.py)
        self._exit_watcher: ExitWatcher | None = None  # wakes the loop at a child's exit (run())
        self._discovery_seq = 0
        # What the core's rules need besides the state. A fixed host list never grows (unless
        # agents add hosts); with no blacklist cooldown a blacklisted host never returns.
        self._prepare: Callable[[WorkerSpec], None] | None = getattr(launcher, "prepare", None)
        self._rules = Rules(config, fixed_hosts=isinstance(discovery, FixedHosts) and agents is None
                            and config.blacklist_cooldown is None,
                            prepare_hosts=self._prepare is not None)
        self._pending_starts: list[_PendingStart] = []  # planned by a pass, started after it
        # --preload: fork servers to start after the pass (WarmStarts.prepare).
        self._pending_prepares: list[WorkerSpec] = []
        self._refused_hosts: set[str] = set()
        self._stop_requested = threading.Event()
        self._stop_signal = ""
        self._handed_over = False  # SIGTERM with --state-dir: the job is left to the next driver
        self._started_at = clock()
        self._resume: snapshots.Resume | None = None  # chosen at the start of run()
        # The driver's own pauses (Ctrl-Z, a suspended machine) are nobody's silence (job/liveness.py).
        self._state.absences = Absences.starting(self._started_at, config.timeouts.heartbeat_period)

    def request_stop(self, signame: str) -> None:
        self._stop_signal = signame
        self._stop_requested.set()
        with self._registry.cond:
            self._registry.cond.notify_all()

    def run(self) -> JobResult:
        c = self._config
        raise_descriptor_limit()
        if not self._adopting:
            self._events.emit("job_started", np=c.np, min_np=c.min_np, max_np=c.max_np)
        try:
            self._resume = snapshots.choose(c.snapshots, c.command, self._events)
        except ConfigError as err:
            return self._result(policy.Verdict(False, str(err)), refused=True)
        try:
            first = self._discovery.start()
        except LaunchError as err:
            return self._result(policy.Verdict(False, str(err)))
        refused = False
        self._exit_watcher = ExitWatcher(self._wake_loop)
        try:
            if first and all(self._name_unresolved(h.host) for h in first):
                raise ConfigError(unresolved_names_message(h.host for h in first))
            usable = [h for h in first if self._name_usable(h.host)]
            self._address = choose_driver_address(
                [h.host for h in usable], self._is_local, self._config.driver_address, self._config.network_interface
            )
            if self._adopting:
                self._adopt_address()
                # Listening first: a worker that retries meanwhile waits in the kernel's
                # queue for the restore (0.1-0.2 s at 4,096), instead of being refused and
                # retrying up to 0.5 s later.
                self._listen()
                self._adopt()  # before the service: the workers' first requests must find them known
            self._start_services()
            self._gc.start()
            if self._keeping is not None:
                self._keeping.writer.start()
            with self._registry.cond:
                self._state.hosts.update(usable)
                self._events.emit("hosts_changed", added=[h.host for h in usable], removed=[])
            self._taking_over = False  # the job is this driver's now
            verdict = self._loop()
        except ConfigError as err:
            # Before any worker started nothing ran: an invalid input, said in one line. Later
            # (a worker's command vanished) the job ends with its summary like any other.
            verdict = policy.Verdict(False, str(err))
            refused = not self._processes or self._server is None
        except _Stop:
            if self._can_hand_over():
                self._handed_over = True
                verdict = policy.Verdict(False, self._hand_over_reason())
            else:
                verdict = policy.Verdict(False, f"interrupted by {self._stop_signal}: stopped every worker")
        except Exception as err:  # noqa: BLE001 - crash-only: a bug of ours still ends in a verdict
            if self._taking_over:  # _shutdown leaves the job as it was
                log.exception("The driver failed while taking the job over; its workers are left running.")
                verdict = policy.Verdict(False, self._take_over_failed_reason(err))
            else:
                log.exception("The driver failed; stopping every worker.")
                verdict = policy.Verdict(False, f"the driver failed: {type(err).__name__}: {err} (a bug: the "
                                                "traceback is above; please report it)")
        finally:
            self._shutdown()
        return self._result(verdict, refused)

    def _loop(self) -> policy.Verdict:
        """Every turn, feed the core what happened; decide only when something changed.

        A decision pass looks at every worker (O(N)); at thousands of workers, one per turn
        would cost the driver most of a core. So a pass runs when a request told the driver
        something (``Registry.changes``), a process exited, discovery or a blacklist cooldown
        changed the hosts, the last pass acted, or every ``decide_every`` seconds while a
        decision waits on time alone (``job/step.py``). Wedged workers and the exit timeout
        are checked every ``decide_every`` seconds in any case.

        The lock (the registry's ``cond``) is held for the whole turn except while workers
        start (``_start_pending`` releases it: a start may take seconds).
        """
        reg = self._registry
        state = self._state
        decide_every = self._config.timeouts.decide_every
        seen = -1
        saved_reports = reg.reports
        next_pass = 0.0
        with reg.cond:
            while True:
                missed = False
                if self._stop_requested.is_set():
                    raise _Stop()
                now = self._clock()
                self._turn(now)
                if self._adoption_watch is not None:
                    self._adoption_progress(now)
                requests_changed = reg.changes != seen
                timer_due = now >= next_pass
                result = step(state, Turn(now, self._poll_exits(), self._take_discovery(), requests_changed,
                                          timer_due), self._rules)
                if result.decided:
                    dirty = result.observed_change or requests_changed
                    seen = reg.changes  # what the pass itself changes is decided on next turn
                    next_pass = now + decide_every
                    verdict = self._perform(result.effects)
                    self._events.observe(state.breaks, state.first_steps, state.round.number if state.round else 0)
                    if state.reset_pending_since is not None:
                        self._gc.reforming()  # no collection while the members come back (gc_policy.py)
                    if verdict is not None:
                        return verdict  # workers planned in that pass are never started
                    before_start = reg.changes
                    self._start_pending()
                    # The start released the lock: a request that changed something meanwhile
                    # notified nobody, and waiting a turn for it would delay (say) the round
                    # the survivors of a fault came back for by a whole turn.
                    missed = reg.changes != before_start
                    if dirty or reg.changes != seen:  # not after a pass on a timer alone
                        self._save_pacing.changed()
                        saved_reports = reg.reports
                else:
                    if timer_due:
                        next_pass = now + decide_every
                    self._perform(result.effects)
                if reg.reports != saved_reports:  # reports that needed no decision: kept, paced as any change
                    saved_reports = reg.reports
                    self._save_pacing.changed()
                self._save_state_when_due(now)
                self._gc.tick()  # every turn: a re-formation's hold on collections is bounded
                if not missed:
                    reg.cond.wait(self._config.timeouts.tick)
