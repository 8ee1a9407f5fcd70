"""The elastic driver: discovers hosts, starts workers, forms rounds, and decides how the job ends.

``launch(config)`` runs one job. The driver loop owns every membership decision; the
discovery poller and the rendezvous service only report to it. Each tick it:

1. takes the latest discovery result and lets cooled-down hosts come back;
2. reaps exited workers (a worker that exits without reporting success has failed: its slot,
   or its whole host when the host is bad, is blacklisted and its round is marked broken, so
   survivors learn it was a lost peer);
3. kills wedged workers (missed heartbeats, or too slow to arrive at the rendezvous);
4. asks ``policy.decide_verdict`` whether the job has ended;
5. plans the target set of slots (oldest hosts first, at most --max-np), starts workers for
   new slots, and announces the change (a generation bump) once joiners are ready;
6. forms the next round once every target worker waits at the rendezvous.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import resource
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from lightning_elastic.launcher.job import membership
from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.restart import adoption
from lightning_elastic.launcher.restart import resume as snapshots
from lightning_elastic.launcher.config import LaunchConfig
from lightning_elastic.launcher.hosts.discovery import DiscoveryPoller, FixedHosts, HostDiscovery, ScriptDiscovery
from lightning_elastic.launcher.errors import ConfigError, LaunchError, StartError
from lightning_elastic.launcher.observe.events import EventLog, prepare_log_dir
from lightning_elastic.launcher.driver.gc_policy import ServiceGc
from lightning_elastic.launcher.job.history import BoundedHistory
from lightning_elastic.launcher.job.blacklist import HostManager
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey, count_slots
from lightning_elastic.launcher.hosts.network import HostClassifier, choose_driver_address, unresolved_names_message
from lightning_elastic.launcher.job.exits import ExitFacts, ExitKind, classify_exit
from lightning_elastic.launcher.job.liveness import Absences, WorkerClock, exit_overdue, wedged
from lightning_elastic.launcher.processes.base import (
    HostRouter,
    WorkerLauncher,
    WorkerProcess,
    WorkerSpec,
    stop_all,
)
from lightning_elastic.launcher.processes.detached import DetachedLauncher
from lightning_elastic.launcher.processes.exit_watch import ExitWatcher
from lightning_elastic.launcher.processes.local import LocalLauncher
from lightning_elastic.launcher.processes.output import OutputSink
from lightning_elastic.launcher.processes.ssh import SshLauncher
from lightning_elastic.launcher.processes.warm_start import WarmStarts
from lightning_elastic.launcher.job.state import JobState, WorkerRecord, WorkerState
from lightning_elastic.launcher.service.registry import Registry, outcome_of
from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer, limits_for, listen_queue_for
from lightning_elastic.launcher.restart.state_dir import StateDir, WorkerEntry
from lightning_elastic import protocol as p

# Put first on the workers' PYTHONPATH: lightning_elastic/_autoload/sitecustomize.py.
AUTOLOAD_DIR = Path(p.__file__).resolve().parent / "_autoload"

log = logging.getLogger("lightning_elastic.driver")
T = TypeVar("T")


def _listed(items: tuple[str, ...], omitted: int) -> list[str]:
    """Summary lines of a bounded history: its first entries, a count, its newest."""
    lines = [f"    - {item}" for item in items]
    if omitted:
        lines.insert(BoundedHistory.FIRST, f"    ... {omitted} more (events.jsonl in --log-dir has every one)")
    return lines


# Hosts the driver said it ignores ("say it once"), at most this many remembered.
REFUSED_HOSTS_KEPT = 4096


@dataclasses.dataclass(frozen=True)
class JobResult:
    success: bool
    reason: str
    rounds: tuple[int, ...]  # world size of every round, in order
    failures: tuple[str, ...]
    blacklisted: tuple[str, ...]
    duration: float
    rejected_requests: int
    departures: tuple[str, ...] = ()  # workers that left gracefully on a preemption notice
    # A long job keeps the first and the newest entries of each (launcher/job/history.py):
    # how many in between are counted only (events.jsonl has them all).
    rounds_omitted: int = 0
    failures_omitted: int = 0
    departures_omitted: int = 0
    # Ended by an invalid input found before any worker started (an address this machine
    # does not have, a port in use, no host name resolving): ``launch`` raises it as a
    # ConfigError, which the CLI prints as one line with exit status 2.
    refused: bool = False
    # Durable snapshots (--snapshot-dir): what this launch resumed from ("": started over),
    # and the snapshots written and failed, with the newest failure's reason.
    resumed_from: str = ""
    snapshots: tuple[int, int, str] | None = None

    def _sizes(self) -> str:
        sizes = [str(n) for n in self.rounds]
        if self.rounds_omitted:
            sizes.insert(BoundedHistory.FIRST, f"({self.rounds_omitted} more)")
        return " -> ".join(sizes) or "none"
    outages: tuple[str, ...] = ()  # --state-dir: each restart of the driver that adopted the job
    # --state-dir and SIGTERM: this driver exited and left the job running for the next one
    # (a Kubernetes rolling restart, `systemctl restart`). Exit status 0: nothing failed.
    handed_over: bool = False

    @property
    def exit_code(self) -> int:
        return 0 if self.success or self.handed_over else 1

    @property
    def verdict(self) -> str:
        """The CLI's last line says the job ``succeeded``, ``failed`` or was ``handed over``."""
        return "handed over" if self.handed_over else "succeeded" if self.success else "failed"

    def summary(self) -> str:
        lines = [
            "lightning-elastic job summary",
            f"  result:        {'HANDED OVER' if self.handed_over else 'SUCCESS' if self.success else 'FAILURE'}: "
            f"{self.reason}",
            f"  duration:      {self.duration:.1f} s",
            f"  rounds:        {len(self.rounds) + self.rounds_omitted} (world sizes: {self._sizes()})",
            f"  failures:      {len(self.failures) + self.failures_omitted}",
        ]
        lines += _listed(self.failures, self.failures_omitted)
        if self.departures:
            lines.append(f"  preempted:     {len(self.departures) + self.departures_omitted} (left without rollback)")
            lines += _listed(self.departures, self.departures_omitted)
        lines.append(f"  blacklisted:   {', '.join(self.blacklisted) or 'none'}")
        if self.outages:
            lines.append(f"  driver outages: {len(self.outages)}")
            lines += [f"    - {o}" for o in self.outages]
        if self.rejected_requests:
            lines.append(f"  rejected rendezvous requests: {self.rejected_requests}")
        if self.snapshots is not None:
            lines.append(f"  resumed from:  {self.resumed_from or 'nothing (started over)'}")
            written, failed, error = self.snapshots
            lines.append(f"  snapshots:     {written} written, {failed} failed" + (f" ({error})" if failed else ""))
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _PendingStart:
    """A worker planned under the registry's lock, started once it is released."""

    record: WorkerRecord
    spec: WorkerSpec
    prefix: Callable[[], str]


class _Stop(Exception):
    """The driver was asked to stop (SIGINT/SIGTERM)."""


class Driver:
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
        self._secret = keeping.secret if keeping is not None else secrets.token_hex(32)
        self._adoption_watch: adoption.AdoptionWatch | None = None  # until the adopted workers are back
        self._save_pacing = adoption.SavePacing()
        self._server: RendezvousServer | None = None
        self._processes: dict[str, WorkerProcess] = {}
        # The newest workers forgotten after a round formed, still flushed at the end.
        self._retired: collections.deque[WorkerProcess] = collections.deque(maxlen=256)
        self._gc = ServiceGc(clock)  # no full collection while a round forms (gc_policy.py)
        self._exit_watcher: ExitWatcher | None = None  # wakes the loop at a child's exit (run())
        self._view: membership.MembershipView | None = None  # this decision pass's snapshot
        self._discovery_seq = 0
        # A fixed host list never grows; with no cooldown a blacklisted host never returns.
        self._fixed_hosts = isinstance(discovery, FixedHosts) and config.blacklist_cooldown is None
        self._pending_starts: list[_PendingStart] = []  # planned by a pass, started after it
        # --preload: the launcher that keeps fork servers (WarmStarts.prepare), the hosts
        # given theirs, and those to give one after the pass.
        self._prepare: Callable[[WorkerSpec], None] | None = getattr(launcher, "prepare", None)
        self._prepared: set[str] = set()
        self._pending_prepares: list[WorkerSpec] = []
        self._refused_hosts: set[str] = set()
        self._stop_requested = threading.Event()
        self._stop_signal = ""
        self._handed_over = False  # SIGTERM with --state-dir: the job is left to the next driver
        self._started_at = clock()
        self._resume: snapshots.Resume | None = None  # chosen at the start of run()
        # The driver's own pauses (Ctrl-Z, a suspended machine) are nobody's silence (job/liveness.py).
        t = config.timeouts
        self._absences = Absences.starting(self._started_at, t.heartbeat_period)

    # ----- life cycle -----------------------------------------------------------------

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
            log.exception("The driver failed; stopping every worker.")
            verdict = policy.Verdict(False, f"the driver failed: {type(err).__name__}: {err} (a bug: the traceback "
                                            "is above; please report it)")
        finally:
            self._shutdown()
        return self._result(verdict, refused)

    def _wake_loop(self) -> None:
        """A worker process exited: reap it now, not at the next tick (a survivor's
        recovery waits for the driver to see its peer gone)."""
        with self._registry.cond:
            self._registry.cond.notify_all()

    def _listen(self) -> None:
        """One listening socket, on the job's address only: the signed rendezvous service,
        which also serves the process-group store (see launcher/service/store_service.py)."""
        workers = self._config.max_np + self._config.spares
        port = self._config.port
        not_before = None
        if self._adopting:
            previous = self._keeping.previous  # type: ignore[union-attr]
            # Where the adopted workers look for their driver first: the same address and
            # port, unless this driver serves elsewhere (--port, another machine).
            if not port and self._address == previous.address:  # type: ignore[union-attr]
                port = previous.port  # type: ignore[union-attr]
            not_before = adoption.not_before(self._keeping.started)  # type: ignore[union-attr]
        self._server = RendezvousServer(self._registry, self._secret, host=self._address,
                                        listen_queue=listen_queue_for(workers), limits=limits_for(workers),
                                        port=port or 0, not_before=not_before)
        try:
            self._server.listen()
        except OSError as err:
            if port:
                raise ConfigError(f"--port: cannot serve on {self._address}:{port}: {err.strerror or err}") from None
            raise ConfigError(f"cannot serve on {self._address}: {err.strerror or err}") from None

    def _start_services(self) -> None:
        """Serve on the socket ``_listen`` opened (opened here unless an adoption did)."""
        if self._server is None:
            self._listen()
        assert self._server is not None
        self._server.start()
        log.info("Rendezvous service and process-group store at %s.", self._server.url)
        if self._keeping is not None:
            # Workers that cannot reach their driver look here (another address, another
            # machine): written before the loop, which never waits on the disk.
            try:
                self._keeping.dir.write_url(self._server.url)
            except OSError as err:
                log.warning("--state-dir: cannot write %s (%s): workers find this driver only at the address "
                            "they were started with.", self._keeping.dir.url_file, err.strerror or err)

    def _can_hand_over(self) -> bool:
        """SIGTERM with --state-dir ends the driver alone: a Kubernetes rolling restart or
        `systemctl restart` replaces the driver, not the job. SIGINT (Ctrl-C) still stops it.
        Only once there is a job to leave: served (its state saved) or adopted."""
        return (self._stop_signal == "SIGTERM" and self._keeping is not None
                and (self._server is not None or self._adopting))

    def _hand_over_reason(self) -> str:
        running = sum(p_.poll() is None for p_ in self._processes.values())
        return (f"SIGTERM: the driver exited and left {running} worker(s) running; the next driver started with "
                f"--state-dir {self._keeping.dir.path} adopts them (they wait --driver-patience "  # type: ignore[union-attr]
                f"{self._config.driver_patience:g} s for it)")

    def _hand_over(self) -> None:
        """Exit without touching a worker: the state saved (the writer flushed), every
        connection to a worker closed as a crash would close it, nothing signalled."""
        if self._server is not None:
            with self._registry.cond:
                self._save_state()  # the newest state, whatever the last pass saved
        self._discovery.close()
        if self._server is not None:
            self._server.close()  # no new request answered: the workers wait for the next driver
        for proc in self._processes.values():
            detach = getattr(proc, "detach", None)  # an ssh session: its supervisor keeps the worker
            if detach is not None:
                detach()
        if self._exit_watcher is not None:
            self._exit_watcher.close()
        self._gc.stop()
        self._keeping.finish(job_over=False)  # type: ignore[union-attr]
        log.info("Handed the job over: %d worker(s) left running for the next driver on --state-dir %s.",
                 sum(p_.poll() is None for p_ in self._processes.values()), self._keeping.dir.path)  # type: ignore[union-attr]

    def _shutdown(self) -> None:
        if self._handed_over:
            self._hand_over()
            return
        with self._registry.cond:
            self._registry.state.closing = True  # a SIGTERM from stop_all below means "exit now"
            self._registry.wake_all()
        self._discovery.close()
        if self._adopting and self._server is None:
            # This driver could not take the job over (its port is taken, say): the workers
            # wait for the next one, within their patience.
            self._keeping.finish(job_over=False)  # type: ignore[union-attr]
            if self._exit_watcher is not None:
                self._exit_watcher.close()
            self._gc.stop()
            return
        procs = [*self._processes.values(), *self._retired]
        if any(p_.poll() is None for p_ in procs):
            log.info("Stopping %d worker process(es).", sum(p_.poll() is None for p_ in procs))
        stop_all(procs, self._config.timeouts.stop_grace)
        if self._exit_watcher is not None:
            self._exit_watcher.close()
        self._gc.stop()
        if self._server is not None:
            self._server.close()
        if self._keeping is not None:
            self._keeping.finish(job_over=True)

    def _result(self, verdict: policy.Verdict, refused: bool = False) -> JobResult:
        if self._handed_over:  # the job goes on: the next driver's timeline continues this one
            self._events.emit("driver_handed_over", reason=verdict.reason)
        else:
            self._events.emit("job_ended", success=verdict.success, reason=verdict.reason)
        self._events.close()
        return JobResult(
            success=verdict.success,
            reason=verdict.reason,
            rounds=tuple(self._state.tally.rounds),
            rounds_omitted=self._state.tally.rounds.omitted,
            failures=tuple(self._state.tally.failures),
            failures_omitted=self._state.tally.failures.omitted,
            blacklisted=tuple(self._state.tally.blacklisted),
            duration=self._clock() - self._started_at,
            rejected_requests=self._server.rejected if self._server else 0,
            departures=tuple(self._state.tally.departures),
            departures_omitted=self._state.tally.departures.omitted,
            refused=refused,
            resumed_from=str(self._resume.found.path) if self._resume and self._resume.found else "",
            snapshots=snapshots.totals(self._registry.state.workers.values()) if self._config.snapshots else None,
            outages=tuple(self._state.tally.outages),
            handed_over=self._handed_over,
        )

    # ----- the loop -------------------------------------------------------------------

    def _loop(self) -> policy.Verdict:
        """Every tick, reap exits; re-decide only when something changed.

        A decision pass looks at every worker (O(N)); at thousands of workers, one per tick
        would cost the driver most of a core. So a pass runs when a request told the
        driver something (``Registry.changes``), a process exited, discovery or a blacklist
        cooldown changed the hosts, the last pass acted, or every ``decide_every`` seconds
        while a decision waits on time alone. Wedged workers and the exit timeout are
        checked every ``decide_every`` seconds in any case.
        """
        reg = self._registry
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
                changed = self._take_discovery()
                changed = bool(self._state.hosts.tick()) or changed
                changed = self._reap(now) or changed
                if changed or reg.changes != seen or (now >= next_pass and self._timers_pending(now)):
                    dirty = changed or reg.changes != seen
                    seen = reg.changes
                    next_pass = now + decide_every
                    verdict = self._decide(now)
                    if verdict is not None:
                        return verdict  # workers planned in that pass are never started
                    before_start = reg.changes
                    self._start_pending()
                    # The start released the lock: a request that changed something meanwhile
                    # notified nobody, and waiting a tick for it would delay (say) the round
                    # the survivors of a fault came back for by a whole tick.
                    missed = reg.changes != before_start
                    if dirty or reg.changes != seen:  # not after a pass on a timer alone
                        self._save_pacing.changed()
                        saved_reports = reg.reports
                elif now >= next_pass:
                    next_pass = now + decide_every
                    self._kill_wedged(now)  # O(N), but no views built: cheap at any N
                    self._enforce_exit_timeout(now)
                if reg.reports != saved_reports:  # reports that needed no decision: kept, paced as any change
                    saved_reports = reg.reports
                    self._save_pacing.changed()
                self._save_state_when_due(now)
                self._gc.tick()  # every turn: a re-formation's hold on collections is bounded
                if not missed:
                    reg.cond.wait(self._config.timeouts.tick)

    def _timers_pending(self, now: float) -> bool:
        """Does a decision depend on time alone now (the elastic timeout while slots are
        missing, a preempted slot's hold or its end)? Otherwise an unchanged job needs none."""
        ended = [slot for slot, until in self._state.held_until.items() if until <= now]
        for slot in ended:
            del self._state.held_until[slot]
        return self._state.below_since is not None or bool(self._state.held_until) or bool(ended)

    def _decide(self, now: float) -> policy.Verdict | None:
        reg = self._registry
        self._invalidate_view()
        self._kill_wedged(now)
        self._enforce_exit_timeout(now)
        verdict = self._verdict(now)
        if verdict is None:
            verdict = self._plan()
        if verdict is None:
            verdict = self._maybe_form_round()
        if verdict is None:
            self._prepare_hosts()
        self._events.observe(reg.state.breaks, reg.state.first_steps, reg.state.round.number if reg.state.round else 0)
        if verdict is None:
            reg.await_arrivals(*membership.awaited_arrivals(self._membership_view()))
        if self._state.reset_pending_since is not None:
            self._gc.reforming()  # no collection while the members come back (gc_policy.py)
        return verdict

    def _take_discovery(self) -> bool:
        """Apply discovery's newest result; True when the hosts or its error changed (a
        poll that found the same hosts, every few seconds, needs no decision)."""
        latest = self._discovery.latest()
        if latest is None or latest.sequence == self._discovery_seq:
            return False
        self._discovery_seq = latest.sequence
        error_changed = latest.error != self._state.discovery_error
        self._state.discovery_error = latest.error
        if latest.hosts is None:
            return error_changed
        usable = [h for h in latest.hosts if self._reachable(h.host)]
        change = self._state.hosts.update(usable)
        if change:
            log.info(
                "Hosts changed: added %s, removed %s, resized %s.",
                list(change.added), list(change.removed), list(change.resized),
            )
            self._events.emit("hosts_changed", added=list(change.added), removed=list(change.removed))
        return bool(change) or error_changed

    def _reachable(self, host: str) -> bool:
        """A remote host cannot reach services bound to loopback: refuse it, say how to fix it."""
        if not self._name_usable(host):
            return False
        if self._is_local(host) or not self._address.startswith("127."):
            return True
        self._refuse(host, "it is another machine, and the driver serves on loopback (the first hosts were "
                           "all local); pass --driver-address or --network-interface")
        return False

    def _name_usable(self, host: str) -> bool:
        """Refuse a host whose name does not resolve, that host alone: the others go on."""
        if not self._name_unresolved(host):
            return True
        self._refuse(host, "its name does not resolve (check it, DNS or /etc/hosts; for an ssh config alias "
                           "pass --driver-address or --network-interface); the job goes on with the other hosts")
        return False

    def _look_up(self, host: str) -> None:
        """In the discovery thread: what the loop will ask of a host's name, asked first, so
        a slow resolver never holds the loop (and the service waiting on its lock)."""
        self._is_local(host)
        if self._resolves is not None:
            self._resolves(host)

    def _name_unresolved(self, host: str) -> bool:
        """Does the driver need ``host``'s name to resolve, and it does not?

        Only when the driver picks its address from the routes to the hosts. With
        --driver-address or --network-interface it never needs the name, and ssh may know it
        (an alias in ~/.ssh/config) where DNS does not; an ssh failure then refuses the host.
        """
        c = self._config
        if self._resolves is None or c.driver_address is not None or c.network_interface is not None:
            return False
        return not (self._is_local(host) or self._resolves(host))

    def _refuse(self, host: str, why: str) -> None:
        if host not in self._refused_hosts:  # discovery lists it again every second: say it once
            if len(self._refused_hosts) >= REFUSED_HOSTS_KEPT:
                # A discovery that lists ever new bad names for weeks: start again (a host
                # refused long ago is said once more at worst).
                self._refused_hosts.clear()
            self._refused_hosts.add(host)
            log.error("Ignoring host %s: %s.", host, why)

    # ----- workers --------------------------------------------------------------------

    def _spawn(self, slot: SlotAssignment) -> None:
        number = self._state.tally.next_worker
        self._state.tally.next_worker += 1
        worker_id = f"{slot.slot}#{number}"
        record = self._registry.add_worker(worker_id, slot.slot)
        assert self._server is not None
        env = {
            **self._job_env(),
            p.ENV_WORKER_ID: worker_id,
            p.ENV_HOSTNAME: slot.slot.host,
            # The usual torch variables, as planned; le.init() updates them every round.
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(slot.size),
            "LOCAL_RANK": str(slot.slot.local_rank),
            "LOCAL_WORLD_SIZE": str(slot.local_size),
            "GROUP_RANK": str(slot.cross_rank),
            "MASTER_ADDR": self._address,
            "MASTER_PORT": str(self._server.port),
        }
        log_file = None
        if self._config.log_dir is not None:
            log_file = self._config.log_dir / f"worker-{number}-{slot.slot.host}-{slot.slot.local_rank}.log"

        prefix = _prefix_of(record)
        spec = WorkerSpec(
            worker_id=worker_id,
            host=slot.slot.host,
            command=self._config.command,
            env=env,
            secret=self._secret,
            cwd=os.getcwd(),
            log_file=log_file,
        )
        self._pending_starts.append(_PendingStart(record, spec, prefix))

    def _job_env(self) -> dict[str, str]:
        """The variables every worker of the job gets (``_spawn`` adds each one's own)."""
        assert self._server is not None
        t = self._config.timeouts
        # The driver's PYTHONPATH with our sitecustomize first: it registers
        # strategy="elastic_hvd" when the script imports Lightning.
        pythonpath = os.pathsep.join(filter(None, [str(AUTOLOAD_DIR), os.environ.get("PYTHONPATH")]))
        return {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # several workers per host would thrash
            "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1"),
            "PYTHONPATH": pythonpath,
            **dict(self._config.env),
            p.ENV_DRIVER_URL: self._server.url,
            p.ENV_HEARTBEAT_INTERVAL: str(t.heartbeat_period),
            p.ENV_HEARTBEAT_TIMEOUT: str(t.heartbeat_timeout),
            p.ENV_ELASTIC_TIMEOUT: str(self._config.elastic_timeout),
            p.ENV_LOST_MEMBER_WAIT: str(t.lost_member_wait),
            p.ENV_PROCESS_GROUP_TIMEOUT: str(t.process_group),
            p.ENV_PREEMPTION_GRACE: str(t.preemption_grace),
            **(self._resume.env if self._resume else {}),
            **({p.ENV_DRIVER_PATIENCE: str(self._config.driver_patience),
                p.ENV_DRIVER_URL_FILE: str(self._keeping.dir.url_file)} if self._keeping is not None else {}),
        }

    def _prepare_hosts(self) -> None:
        """With ``--preload``: every host the job may use gets its fork server before a worker
        needs it (a listed spare's replacement then forks at once). Started after the pass,
        as workers are; once per host while it stays listed."""
        if self._prepare is None:
            return
        available = {h.host for h in self._state.hosts.available()}
        self._prepared &= available  # bounded by the hosts listed now; one that comes back is prepared again
        new = sorted(available - self._prepared)
        if not new:
            return
        env, cwd = self._job_env(), os.getcwd()  # the same for every host
        for host in new:
            self._prepared.add(host)
            self._pending_prepares.append(WorkerSpec(
                worker_id=f"fork server on {host}", host=host, command=self._config.command, env=env,
                secret=self._secret, cwd=cwd))

    def _start_pending(self) -> None:
        """Start the workers the last pass planned, with the registry's lock released.

        A process start takes ~20 ms here (an ssh client's more, 4,096 of them minutes), and
        every request of the rendezvous service takes that lock: heartbeats are answered
        meanwhile. Nothing else changes hands: only this thread starts, reaps or signals
        workers, and a worker cannot ask the service about itself before it exists.
        """
        pending, self._pending_starts = self._pending_starts, []
        prepares, self._pending_prepares = self._pending_prepares, []
        if not pending and not prepares:
            return
        started: list[tuple[_PendingStart, WorkerProcess]] = []
        failed: StartError | None = None
        self._registry.cond.release()
        try:
            for item in pending:
                if item.spec.log_file is not None:
                    item.spec.log_file.parent.mkdir(parents=True, exist_ok=True)
                started.append((item, self._launcher.start(item.spec, item.prefix)))
                self._turn(self._clock())  # busy, not away: minutes of starts are no pause
            for spec in prepares:  # after the workers: a fork server no worker waits for yet
                self._prepare(spec)  # type: ignore[misc]  # (set whenever prepares are queued)
                self._turn(self._clock())
        except StartError as err:
            failed = err
        finally:
            self._registry.cond.acquire()
            for item, proc in started:  # whatever else failed: every started process is known
                self._started(item.record, proc)
        if failed is not None:
            # The same command (or ssh) fails for every slot of this kind: the job cannot run.
            for item in pending[len(started):]:
                item.record.state = WorkerState.FAILED
            raise failed

    def _started(self, record: WorkerRecord, proc: WorkerProcess) -> None:
        worker_id = record.worker_id
        self._processes[worker_id] = proc
        log.info("Started worker %s%s.", worker_id, f" (pid {proc.pid})" if proc.pid else "")
        self._events.emit("worker_started", worker=worker_id, host=record.slot.host, pid=proc.pid)
        child = getattr(proc, "child_pid", None)  # test doubles may have none
        if child is not None and self._exit_watcher is not None:
            self._exit_watcher.watch(child)

    def _stop_worker(self, record: WorkerRecord, why: str) -> None:
        if record.stopping or record.state.finished:
            return
        log.info("Stopping worker %s: %s.", record.worker_id, why)
        record.leave = True
        self._registry.note_change()
        self._registry.wake(record)  # a rendezvous it waits in answers EXIT now
        proc = self._processes[record.worker_id]
        proc.signal(signal.SIGTERM)
        proc.signal(signal.SIGCONT)
        record.stop_deadline = self._clock() + self._config.timeouts.stop_grace

    def _turn(self, now: float) -> None:
        away = self._absences.turn(now)
        if away > self._config.timeouts.heartbeat_timeout:
            log.warning("The driver did not run for %.1f s (stopped, suspended or starved of CPU): every worker's "
                        "heartbeat timeout starts again now.", away)

    def _reap(self, now: float) -> bool:
        """Record the workers that exited (and SIGKILL those past their stop deadline);
        True if any exited."""
        reg = self._registry
        reaped = False
        for record in reg.live_workers():
            proc = self._processes[record.worker_id]
            status = proc.poll()
            if status is None:
                deadline = record.stop_deadline
                if deadline is not None and now >= deadline:
                    proc.signal(signal.SIGKILL)
                continue
            reaped = True
            record.exit_status = status
            finishing = self._finishing()
            report = record.report
            verdict = classify_exit(ExitFacts(
                record.worker_id, status, proc.exit_detail(), report.outcome if report else None,
                report.message if report else "", record.joined, record.leave, record.departing,
                record.kill_reason, reg.current_member(record), finishing))
            if verdict.kind is ExitKind.DONE:
                record.state = WorkerState.DONE
                log.info("Worker %s finished training and exited.", record.worker_id)
                self._events.emit("worker_done", worker=record.worker_id, host=record.slot.host)
            elif verdict.kind is ExitKind.LEFT:
                record.state = WorkerState.REMOVED
                if record.departing:
                    self._state.tally.departures.append(f"worker {record.worker_id} left on {record.departing}")
                    self._state.held_until[record.slot] = now + self._config.timeouts.preemption_grace
                    log.info("Worker %s left the job on %s; host %s stays usable.",
                             record.worker_id, record.departing, record.slot.host)
                    self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host,
                                      reason=f"left on {record.departing}")
                else:
                    log.info("Worker %s left the job (exit status %d).", record.worker_id, status)
                    self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host,
                                      reason="removed from the job")
            elif verdict.kind is ExitKind.STOPPED:
                record.state = WorkerState.REMOVED
                log.info("Worker %s left the job (exit status %d).", record.worker_id, status)
                self._events.emit("worker_left", worker=record.worker_id, host=record.slot.host, reason="stopped")
                if verdict.break_round:
                    reg.mark_round_broken(reg.state.round.number, f"worker {record.worker_id} was stopped")  # type: ignore[union-attr]
            else:
                self._fail(record, verdict.failure, verdict.break_round, verdict.blacklist, verdict.host_failed,
                           verdict.never_joined)
            if finishing and self._state.first_exit is None:
                self._state.first_exit = (now, record.worker_id)
            reg.wake(record)  # its requests still waiting must end
        return reaped

    def _finishing(self) -> bool:
        """Has training returned in the current round (some member reported DONE)?"""
        current = self._registry.state.round
        return current is not None and any(self._registry.state.workers[w].reported_done for w in current.members)

    def _fail(self, record: WorkerRecord, text: str, break_round: bool, blacklist: bool, host_failed: bool,
              never_joined: bool) -> None:
        record.state = WorkerState.FAILED
        if never_joined and not self._state.never_joined:
            self._state.never_joined = text
        record.failure = text
        self._state.tally.failures.append(text)
        log.warning("%s.", text[:1].upper() + text[1:])
        self._events.emit("worker_failed", worker=record.worker_id, host=record.slot.host, reason=text)
        round_ = self._registry.state.round
        if break_round and round_ is not None:
            self._registry.mark_round_broken(round_.number, text)
        host = record.slot.host
        if not blacklist:
            return  # training is over: nothing more to run on any host
        if not self._state.hosts.is_blacklisted(host):
            # A slot, or the whole host when the failure says the machine is bad (see
            # HostManager.record_failure): a sibling's death never stops healthy workers.
            taken = self._state.hosts.record_failure(record.slot, host_failed=host_failed)
            if taken.name not in self._state.tally.blacklisted:
                self._state.tally.blacklisted.append(taken.name)
            if taken.whole_host:
                self._events.emit("host_blacklisted", host=host, reason=text)
                log.warning("Blacklisted host %s %s: %s.", host, taken.describe(), taken.why)
            else:
                self._events.emit("slot_blacklisted", host=host, slot=taken.name, reason=text)
                log.warning("Blacklisted slot %s %s: %s.", taken.name, taken.describe(), taken.why)
                return
        for other in self._registry.live_workers():
            if other.slot.host == host:
                self._stop_worker(other, f"its host {host} is blacklisted")

    def _enforce_exit_timeout(self, now: float) -> None:
        """Training returned and a worker exited: the others get --exit-timeout to follow."""
        why = exit_overdue(self._state.first_exit, now, self._absences, self._config.timeouts)
        if why is None:
            return
        for record in self._registry.live_workers():
            if not record.stopping:
                record.kill_reason = why  # counted as failed when reaped
                self._stop_worker(record, why)

    def _kill_wedged(self, now: float) -> None:
        reg = self._registry
        current = reg.state.round
        round_broken = current is not None and current.number in reg.state.broken_rounds
        timeouts, absences, since = self._config.timeouts, self._absences, self._state.reset_pending_since
        for record in reg.live_workers():
            if record.stopping:
                continue
            report = record.report
            why = wedged(WorkerClock(record.started_at, record.last_heartbeat, record.reported_at,
                                     report.outcome.value if report else "", record.state is WorkerState.MEMBER),
                         now, absences, timeouts, since, round_broken)
            if why is not None:
                self._kill(record, why)

    def _kill(self, record: WorkerRecord, why: str) -> None:
        """SIGKILL a wedged worker: its peers then fail promptly instead of at a timeout."""
        log.warning("Killing worker %s: %s.", record.worker_id, why)
        record.kill_reason = why
        self._registry.note_change()
        self._processes[record.worker_id].signal(signal.SIGKILL)
        record.stop_deadline = self._clock() + self._config.timeouts.stop_grace
        reg = self._registry
        if reg.current_member(record) and not self._finishing():
            # Its peers learn at once, not when the kill has been reaped.
            reg.mark_round_broken(reg.state.round.number, f"worker {record.worker_id} was killed: {why}")  # type: ignore[union-attr]

    # ----- --state-dir ----------------------------------------------------------------

    def _save_state_when_due(self, now: float) -> None:
        """Save what decision passes changed, paced by the save's cost (``SavePacing``)."""
        if self._keeping is None:
            return
        current = self._registry.state.round
        key = (current.number if current else 0, self._registry.state.generation)
        if self._save_pacing.due(now, key):
            started = time.perf_counter()
            self._save_state()
            cost = time.perf_counter() - started + self._keeping.writer.last_write_s
            self._save_pacing.saved(now, key, cost)

    def _save_state(self) -> None:
        """Hand the job's state to the writer thread."""
        if self._keeping is None or self._server is None:
            return
        # Read under the lock (references only), built and written by the writer thread.
        self._keeping.writer.submit(adoption.snapshot(
            self._address, self._server.port, self._registry, self._processes, self._state.target,
            self._state.announced_for is not None, self._state.hosts, adoption.counters_of(self._state.tally),
            adoption.waits_of(self._state), self._clock()).state)

    def _adopt_address(self) -> None:
        """Serve where the previous driver did, if this machine has its address."""
        keeping = self._keeping
        assert keeping is not None and keeping.previous is not None
        state = keeping.previous
        if self._address != state.address:
            if self._is_local(state.address):
                log.info("Serving on %s, as the previous driver did (not %s): its workers look for it there.",
                         state.address, self._address)
                self._address = state.address
            else:  # another machine: the workers follow the address this driver writes
                log.info("Serving on %s: the previous driver's address %s is not one of this machine's; its "
                         "workers find this driver through %s.", self._address, state.address,
                         keeping.dir.url_file)

    def _adopt(self) -> None:
        """Take over the job a previous driver left in the state dir: its workers, its
        round (not re-formed), its blacklist and counters."""
        keeping = self._keeping
        assert keeping is not None and keeping.previous is not None
        state = keeping.previous
        started = time.perf_counter()
        with self._registry.cond:
            restored = adoption.restore(state, self._registry, self._state.hosts, keeping.adopt, _prefix_of,  # type: ignore[arg-type]
                                        self._clock())
            current = self._registry.state.round
            # What is on disk is what was just restored: the next save waits its window (as
            # after a save as costly), not the adopted fleet's first requests, the service's
            # busiest moment after a restart.
            self._save_pacing.saved(self._clock(), (current.number if current else 0, self._registry.state.generation),
                                    time.perf_counter() - started)
        self._processes.update(restored.processes)
        # What the previous driver was waiting out: spares stay spares, a preempted slot
        # keeps the rest of its hold, the workers after training returned the rest of
        # their --exit-timeout.
        waits = restored.waits
        self._state.standby, self._state.held_until, self._state.first_exit = (
            waits.standby, dict(waits.held_until), waits.first_exit)
        self._state.target = restored.target
        self._state.announced_for = membership.slots_of(self._state.target) if state.announced else None
        self._state.tally = adoption.tally_of(state)
        round_number = state.round.number if state.round else 0
        line = (f"driver restarted after {keeping.outage:.1f} s without one: adopted {restored.adopted} "
                f"worker(s) in round {round_number}"
                + (f"; {restored.ended} ended while no driver ran" if restored.ended else ""))
        self._state.tally.outages.append(line)
        log.info("Adopting the job in %s: %s.", keeping.dir.path, line)
        self._adoption_watch = adoption.AdoptionWatch(
            [self._registry.state.workers[w] for w, proc in restored.processes.items() if proc.poll() is None],
            self._clock(), self._started_at)
        self._events.resume(round_number)
        self._events.emit("driver_restarted", outage_s=round(keeping.outage, 3), adopted=restored.adopted,
                          ended=restored.ended, round=round_number)

    def _adoption_progress(self, now: float) -> None:
        took = self._adoption_watch.check(now)  # type: ignore[union-attr]
        if took is not None:
            self._adoption_watch = None
            log.info("Every adopted worker reached this driver %.2f s after its start.", took)
            self._events.emit("workers_adopted", after_s=round(took, 3))

    # ----- decisions ------------------------------------------------------------------

    def _verdict(self, now: float) -> policy.Verdict | None:
        reg = self._registry
        members = ()
        if reg.state.round is not None:
            members = tuple(
                policy.MemberView(
                    w, reg.state.workers[w].state, reg.state.workers[w].failure, reg.state.workers[w].reported_done
                )
                for w in reg.state.round.members
            )
        hosts = self._state.hosts.available()
        vacant = membership.vacant_slots(self._membership_view())
        slots_of_host = {h.host: h.slots for h in hosts}
        available = count_slots(hosts) - sum(s.local_rank < slots_of_host.get(s.host, 0) for s in vacant)
        required = self._required_slots()
        if available < required:
            if self._state.below_since is None:
                self._state.below_since = now
            if now - self._state.short_of_slots_said_at >= self._config.timeouts.progress_every:
                # Every few seconds, not once: a wait of minutes must not look like a hang.
                self._state.short_of_slots_said_at = now
                left = self._config.elastic_timeout - (now - self._state.below_since)
                log.warning("Waiting for %d slot(s): %d available on %s; the job fails in %.0f s without them.",
                            required, available, listing(hosts, lambda h: f"{h.host}:{h.slots}") or "no host", left)
        else:
            self._state.below_since = None
            self._state.short_of_slots_said_at = 0.0
        view = policy.JobView(
            round_number=reg.state.round.number if reg.state.round else 0,
            members=members,
            live_workers=len(reg.live_workers()),
            blacklisted_hosts=self._state.hosts.all_blacklisted_hosts(),
            required_slots=required,
            available_slots=available,
            below_required_for=None if self._state.below_since is None else now - self._state.below_since,
            discovery_error=self._state.discovery_error,
            last_failure=self._state.tally.failures.last or "",
            repeated_error=reg.state.repeated_error,
            slots_can_grow=(available >= required or not self._fixed_hosts or bool(self._state.held_until)
                            or self._members_training()),
            blacklisted=tuple(self._state.tally.blacklisted),
            never_joined=self._state.never_joined if self._state.never_joined and not self._anyone_joined() else "",
        )
        return policy.decide_verdict(view, self._config.elastic_timeout)

    def _members_training(self) -> bool:
        """Is a member of the current round still in it? Then the round's end is not known
        yet: it may fail in a more telling way (every member raising the same error)."""
        reg = self._registry
        return any(reg.current_member(w) for w in reg.live_workers())
    def _anyone_joined(self) -> bool:
        """Has any worker of the job reached the rendezvous (O(N): asked after a worker that
        never joined exited, not every pass)?"""
        return bool(self._state.tally.rounds) or any(w.joined for w in self._registry.state.workers.values())

    def _required_slots(self) -> int:
        return self._config.min_np if self._registry.state.round is not None else self._config.np

    def _membership_view(self) -> membership.MembershipView:
        """The snapshot this decision pass decides on: built once per pass (it is O(N)),
        again only after the pass itself changed the job (``_invalidate_view``)."""
        if self._view is None:
            self._view = self._build_membership_view()
        return self._view

    def _invalidate_view(self) -> None:
        self._view = None

    def _build_membership_view(self) -> membership.MembershipView:
        reg = self._registry

        def view_of(record: WorkerRecord) -> membership.WorkerView:
            return membership.WorkerView(
                record.worker_id, record.slot, record.state, record.leave, bool(record.departing),
                record.arrived_after_round,
            )

        current = reg.state.round
        return membership.MembershipView(
            hosts=tuple(self._state.hosts.available()),
            max_np=self._config.max_np,
            workers=tuple(view_of(w) for w in reg.live_workers()),
            target=tuple(self._state.target),
            round_number=current.number if current else 0,
            round_members=tuple(view_of(reg.state.workers[w]) for w in current.members) if current else (),
            round_broken=current is not None and current.number in reg.state.broken_rounds,
            announced_for=self._state.announced_for,
            required_slots=self._required_slots(),
            held=frozenset(slot for slot, until in self._state.held_until.items() if self._clock() < until)
            | self._state.hosts.blacklisted_slots(),
            spares=self._config.spares,
            standby=self._state.standby,
        )

    def _plan(self) -> policy.Verdict | None:
        view = self._membership_view()
        if self._state.below_since is not None and not membership.vacant_slots(view):
            return None  # wait for hosts; the elastic timeout bounds this
        if self._finishing():
            return None  # training has returned in this round: no new round, only exits to await
        new = membership.plan(view)
        if new is not None:
            verdict = membership.check_plan_keeps_state(view, new)
            if verdict is not None:
                return verdict
            self._apply(new)
            self._invalidate_view()
            view = self._membership_view()
        if view.round_broken and self._state.reset_pending_since is None:
            self._state.reset_pending_since = self._clock()
        if membership.announcement_due(view):
            generation = self._registry.bump_generation()
            self._state.announced_for = membership.slots_of(self._state.target)
            self._invalidate_view()
            self._state.reset_pending_since = self._clock()
            log.info("Announced host change to the workers of round %d (generation %d).", view.round_number, generation)
            self._events.host_change_announced(view.round_number, generation)
        return None

    def _apply(self, new: membership.Plan) -> None:
        reg = self._registry
        self._state.target = list(new.target)
        self._state.standby = new.standby
        log.info("Target world: %d slot(s): %s%s.", len(new.target), listing(new.target, lambda a: str(a.slot)),
                 f"; standby: {listing(new.standby)}" if new.standby else "")
        for worker_id in new.leave:
            reg.state.workers[worker_id].leave = True  # answered EXIT at its next rendezvous
            reg.wake(reg.state.workers[worker_id])
        standby = set(new.standby)
        for record in reg.live_workers():
            record.standby = record.slot in standby
        reg.note_change()  # decide again next tick, on the world just planned
        for a in new.spawn:
            self._spawn(a)

    def _maybe_form_round(self) -> policy.Verdict | None:
        reg = self._registry
        if self._finishing():
            return None  # training returned: the job ends with this round
        view = self._membership_view()
        chosen = membership.round_to_form(view)
        if chosen is None:
            return None
        if reg.state.round is not None:
            verdict = policy.check_reset_limit(self._state.tally.rounds.total - 1, self._config.reset_limit)
            if verdict is not None:
                return verdict
        assert self._server is not None
        members = [(reg.state.workers[worker_id], a) for worker_id, a in chosen]
        info = reg.form_round(members, (self._address, self._server.port))
        self._gc.round_formed()
        for worker_id in reg.forget_finished({r.worker_id for r, _ in members}):
            # Its process was reaped; its output may still be draining: wait for that at the end.
            proc = self._processes.pop(worker_id, None)
            if proc is not None:
                self._retired.append(proc)
        self._invalidate_view()
        self._state.tally.rounds.append(len(members))
        self._state.announced_for = None
        self._state.reset_pending_since = None
        later = len(view.target) - len(members)
        log.info(
            "Round %d formed with %d worker(s): %s%s.",
            info.number, len(members), listing(members, lambda m: f"rank {m[1].rank}={m[0].worker_id}"),
            f"; {later} more still starting will join the next round" if later else "",
        )
        self._events.round_formed(
            info.number, [{"rank": a.rank, "worker": r.worker_id, "host": r.slot.host} for r, a in members])
        return None


def listing(items: Sequence[T], show: Callable[[T], str] = str, limit: int = 16) -> str:
    """At most ``limit`` items, then how many more: a line of the driver's log stays a
    line at 4,096 workers (the whole list made ~100 KB lines), and only the items shown
    are formatted."""
    shown = [show(item) for item in itertools.islice(items, limit)]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more else "")


def _prefix_of(record: WorkerRecord) -> Callable[[], str]:
    """The prefix of a worker's output lines: its rank in the current round, read per line."""

    def prefix() -> str:
        rank = record.rank
        return f"[{rank if rank is not None else '-'}] "

    return prefix


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one. The driver holds up to
    four per worker (its three connections and its output pipe; six for an ssh worker, whose
    client has three pipes; README, "Large jobs"): the usual soft limit of 1024 ends a job
    of a few hundred workers with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the kernel refuses "unlimited" here
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:
            log.warning("Could not raise the open-file limit from %d to %d: %s.", soft, wanted, err)


def make_discovery(config: LaunchConfig) -> HostDiscovery:
    if config.discovery_script is not None:
        return ScriptDiscovery(config.discovery_script, config.slots_per_host, config.timeouts.discovery)
    assert config.hosts is not None
    return FixedHosts(config.hosts)


def launch(config: LaunchConfig, out: IO[str] | None = None) -> JobResult:
    """Run one elastic job to its end; SIGINT and SIGTERM stop it and every worker (with
    --state-dir, SIGTERM ends the driver alone and leaves the job to the next one).

    Raises ConfigError only before any worker started: an input found invalid only here (a
    --log-dir that cannot be written, a Ray cluster that cannot be reached, an address or
    port the driver cannot serve on, no host name that resolves, another driver holding
    --state-dir).
    """
    state_dir = None
    if config.state_dir is not None:
        state_dir = StateDir(config.state_dir)
        state_dir.lock()  # another driver runs this job: ConfigError, exit 2
    try:
        return _launch(config, out, state_dir)
    finally:
        if state_dir is not None:
            state_dir.release()


def _launch(config: LaunchConfig, out: IO[str] | None, state_dir: StateDir | None) -> JobResult:
    sink = OutputSink(out)  # one for every worker's output: a broken stdout is said once
    keeping = adoption.StateKeeping(state_dir) if state_dir else None
    # An adopted job goes on writing its --log-dir: its timeline continues.
    if config.log_dir is not None and not (keeping and keeping.previous):
        moved = prepare_log_dir(config.log_dir)
        if moved:
            log.info("%s.", moved)
    if config.ray is not None:
        from lightning_elastic.launcher.ray.backend import ray_backend  # noqa: PLC0415 - Ray only when asked

        with ray_backend(config, sink) as backend:
            result = run_driver(Driver(backend.config, backend.nodes, backend.launcher, backend.nodes.is_local))
    elif config.slurm is not None:
        from lightning_elastic.launcher.processes.slurm import SlurmLauncher  # noqa: PLC0415 - only when asked
        from lightning_elastic.launcher.hosts.slurm import SlurmDiscovery, SlurmNodes  # noqa: PLC0415

        # Every worker is an srun step, on this node too: a step is what Slurm accounts,
        # signals and cleans up with the allocation.
        classifier = HostClassifier()
        nodes = SlurmNodes(config.slurm.job_ids[0])
        slurm_launcher = SlurmLauncher(nodes, sink)
        try:
            result = run_driver(Driver(config, SlurmDiscovery(config.slurm, nodes, config.timeouts.discovery),
                                       slurm_launcher, classifier.is_local, resolves=classifier.resolves))
        finally:
            slurm_launcher.close()
    else:
        classifier = HostClassifier()
        ssh = SshLauncher(config.ssh, sink, state_dir)
        if keeping is not None:  # workers that outlive the driver, and finding them again
            detached = DetachedLauncher(state_dir, sink)  # type: ignore[arg-type]
            local: WorkerLauncher = detached

            def adopt(entry: WorkerEntry, prefix: Callable[[], str]) -> WorkerProcess:
                return (detached if classifier.is_local(entry.host) else ssh).adopt(entry, prefix)

            keeping.adopt = adopt
        else:
            local = LocalLauncher(sink)
        router: WorkerLauncher = HostRouter(local, ssh, classifier.is_local)
        warm = WarmStarts(router, config.preload, classifier.is_local, p.ENV_SECRET_FD) if config.preload else None
        try:
            result = run_driver(Driver(config, make_discovery(config), warm or router, classifier.is_local,
                                       resolves=classifier.resolves, keeping=keeping))
        finally:
            if warm is not None:
                warm.close()  # the fork servers, after the driver stopped their workers
    if result.refused:
        raise ConfigError(result.reason)
    return result


def run_driver(driver: Driver) -> JobResult:
    """``driver.run()``, with SIGINT and SIGTERM asking it to stop (from the main thread)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda s, _f: driver.request_stop(signal.Signals(s).name))
    try:
        return driver.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()
