"""``lightning-elastic agent``: a host that joins a job by itself and supervises its workers there.

The agent connects to the driver (outbound only: no inbound port, no sshd on its machine),
joins with its host name and slots, and from then on:

- holds a long poll for its orders (start a worker, signal one), which is also its
  heartbeat; every order comes in a reply the driver signed for this agent's own request;
- reports its workers' starts, output and exits, numbered, until acknowledged;
- on SIGTERM (a pod deleted, a scale-down, a node drained, a spot reclaim) leaves
  gracefully: the driver takes its host off the job, its workers leave at their next check
  (no rollback, nothing blacklisted), and it exits once they have ended;
- when the driver is unreachable for the heartbeat timeout it gave, the driver counts the
  host lost: the agent SIGKILLs its workers, then joins again;
- unless the driver keeps the job in ``--state-dir``: its welcome gives a patience (its
  ``--driver-patience``), and the agent keeps its workers that long without a driver (the
  driver killed, its pod restarted: the workers themselves wait as long). It joins again
  (the same address: a Kubernetes Service's name, or the driver's --driver-address and
  --port) listing them; the restarted driver adopts those its saved state has here and
  names them, and the agent SIGKILLs every other one. Its events not yet acknowledged,
  the adopted workers' output and exits meanwhile, go to the new driver numbered afresh.

While the driver is not up yet (an agent pod before the driver's), it retries, saying so
every ``PROGRESS_EVERY`` seconds. Standard library only, as the ssh supervisor.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
import sys
import threading
import time

from lightning_elastic import protocol as p
from lightning_elastic.launcher.agent.channel import DriverChannel, NotTheDriver, Refused, Unreachable
from lightning_elastic.launcher.agent.workers import Events, Workers

log = logging.getLogger("lightning_elastic.agent")

PROGRESS_EVERY = 10.0  # a line while the driver cannot be reached, this often
RETRY_DELAY = 1.0  # between attempts to reach the driver
STOP_GRACE = 5.0  # SIGTERM, then SIGKILL after this long, to workers the agent ends itself
EXIT_REFUSED = 2  # refused by the driver (a bad input: secret, host name, slots): as a bad option


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    driver_host: str
    driver_port: int
    slots: int
    host_name: str
    secret: str = dataclasses.field(repr=False)  # never in a log line or a traceback
    # After SIGTERM, how long the workers have to leave the job before the agent ends them
    # (a Kubernetes pod's terminationGracePeriodSeconds must cover it, plus STOP_GRACE).
    leave_timeout: float = 20.0


class _Dropped(Exception):
    """The driver no longer counts this agent (the message says why)."""

    def __init__(self, why: str, ended: bool = False, kept: bool = False) -> None:
        super().__init__(why)
        self.ended = ended  # the job is over
        self.kept = kept  # its workers kept for a restarted driver to adopt


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self._s = settings
        self._nonces = p.NonceSequence()
        self._leaving = threading.Event()  # SIGTERM arrived
        self._stopped = threading.Event()  # the session is over (the reporter ends)
        # One set of workers and events for the agent's life: they outlive a session when
        # kept for a restarted driver.
        self._events = Events()
        self._workers = Workers(settings.secret, self._events)
        # While its workers are kept without a driver: until when (monotonic), else None.
        self._kept_until: float | None = None

    def request_leave(self) -> None:
        self._leaving.set()

    def run(self) -> int:
        """Join, serve, and join again after a loss, until a graceful leave or the job's end."""
        while True:
            welcome = self._join()
            if welcome is None:  # SIGTERM while it had no driver: nothing to leave
                if self._workers.live():
                    log.info("SIGTERM with no driver: stopping the %d worker(s) kept for it.", self._workers.live())
                self._stop(self._workers)
                return 0
            try:
                return self._serve(welcome)
            except _Dropped as dropped:
                if self._leaving.is_set():
                    self._stop(self._workers)  # (kept ones: no driver to leave the job through)
                    return 0
                if dropped.ended:
                    log.info("The job ended: exiting.")
                    return 0
                if dropped.kept:
                    log.warning("Lost the driver (%s): keeping %d worker(s) for up to %.0f s (its --driver-patience) "
                                "for it to adopt once restarted; joining again.", dropped, self._workers.live(),
                                max(0.0, (self._kept_until or 0.0) - time.monotonic()))
                else:
                    log.warning("The driver dropped this agent (%s): joining again.", dropped)

    # ----- joining ---------------------------------------------------------------------

    def _join(self) -> p.AgentJoinReply | None:
        s = self._s
        channel = DriverChannel(s.driver_host, s.driver_port, s.secret, self._nonces)
        self._agent_id = secrets.token_hex(16)  # each session its own: orders and events numbered afresh
        started = time.monotonic()
        said_at: float | None = None
        try:
            while not self._leaving.is_set():
                self._give_up_kept_past_patience()
                # The workers it kept (listed afresh each attempt: one may have ended meanwhile).
                kept = self._workers.held() if self._kept_until is not None else ()
                request = p.AgentJoin(self._agent_id, s.host_name, s.slots, kept)
                try:
                    reply = channel.post(p.PATH_AGENT_JOIN, request, p.AgentJoinReply)
                except Unreachable as err:
                    now = time.monotonic()
                    if said_at is None or now - said_at >= PROGRESS_EVERY:
                        log.info("The driver at %s is not reachable yet (%s); retrying (%.0f s so far).",
                                 channel.address, err, now - started)
                        said_at = now
                    self._leaving.wait(RETRY_DELAY)
                    continue
                except Refused as err:
                    raise SystemExit(self._refused(f"the driver at {channel.address} refused this agent: "
                                                   f"{err.message}"))
                if not reply.accepted:
                    raise SystemExit(self._refused(f"the driver at {channel.address} refused this agent: "
                                                   f"{reply.reason}"))
                self._take_adoption(kept, reply)
                log.info("Joined the job at %s as host %s with %d slot(s).", channel.address, s.host_name, s.slots)
                return reply
            return None
        except NotTheDriver as err:
            raise SystemExit(self._refused(f"cannot trust {channel.address}: {err}")) from None
        finally:
            channel.close()

    def _give_up_kept_past_patience(self) -> None:
        if self._kept_until is not None and time.monotonic() > self._kept_until:
            log.warning("No driver within its --driver-patience: stopping the %d worker(s) kept for it.",
                        self._workers.live())
            self._kill(self._workers)
            self._kept_until = None

    def _take_adoption(self, kept: tuple[p.AgentWorker, ...], reply: p.AgentJoinReply) -> None:
        """The driver took ``reply.adopted`` of the workers it kept: SIGKILL every other one
        (never saved by the driver that started it, or given up on), and number the events
        not yet acknowledged of the adopted ones afresh for this driver."""
        adopted = frozenset(reply.adopted) & {w.worker_id for w in kept}
        killed = self._workers.kill_except(adopted)
        if kept:
            log.info("The restarted driver adopted %d of the %d worker(s) kept for it%s.", len(adopted), len(kept),
                     f"; stopped {killed} it does not know" if killed else "")
        self._kept_until = None
        self._events.restart(adopted)

    def _refused(self, line: str) -> int:
        print(f"lightning-elastic agent: error: {line}", file=sys.stderr, flush=True)
        return EXIT_REFUSED

    # ----- serving ---------------------------------------------------------------------

    def _serve(self, welcome: p.AgentJoinReply) -> int:
        s = self._s
        events, workers = self._events, self._workers
        self._stopped.clear()
        # A request may take its wait and a quarter of the heartbeat timeout more: a cut-off
        # driver shows within the timeout (plus that quarter), not at TCP's own timeouts.
        self._slack = max(1.0, welcome.heartbeat_timeout / 4)
        reporter = threading.Thread(target=self._report, args=(events,), name="agent-reporter", daemon=True)
        reporter.start()
        channel = DriverChannel(s.driver_host, s.driver_port, s.secret, self._nonces, self._slack)
        through = 0  # the highest order carried out
        heard = time.monotonic()
        failures = 0  # polls failed in a row
        said_leaving = False
        leave_deadline: float | None = None
        try:
            while True:
                if self._leaving.is_set():
                    if not said_leaving:
                        said_leaving = self._say_leaving(channel)
                        if said_leaving:
                            leave_deadline = time.monotonic() + s.leave_timeout
                            log.info("SIGTERM: leaving the job; %d worker(s) leave at their next check.",
                                     workers.live())
                    if said_leaving and workers.live() == 0:
                        workers.end_servers()  # --preload: its fork server, once its workers ended
                        if not workers.wait_all(STOP_GRACE):
                            workers.force_all()
                            workers.wait_all(STOP_GRACE)
                        events.drained(welcome.heartbeat_timeout)  # their exits told first
                        self._say_gone(channel)
                        log.info("Left the job: every worker has ended.")
                        return 0
                    if leave_deadline is not None and time.monotonic() > leave_deadline:
                        log.warning("Workers still running %.0f s after SIGTERM: stopping them.", s.leave_timeout)
                        self._stop(workers)
                        leave_deadline = None
                try:
                    wait = welcome.poll_seconds if not self._leaving.is_set() else min(1.0, welcome.poll_seconds)
                    reply = channel.post(p.PATH_AGENT_POLL, p.AgentPoll(self._agent_id, wait, through),
                                         p.AgentPollReply, wait=wait)
                except (Unreachable, Refused) as err:
                    silent = time.monotonic() - heard
                    if silent > welcome.heartbeat_timeout and welcome.patience > 0 and not self._leaving.is_set():
                        self._kept_until = heard + welcome.patience  # --state-dir: a restarted driver adopts them
                        raise _Dropped(f"unreachable for {silent:.1f} s: {err}", kept=True) from None
                    if silent > welcome.heartbeat_timeout:
                        log.warning("The driver at %s is unreachable for %.1f s (%s): it counts this host lost; "
                                    "stopping %d worker(s).", channel.address, silent, err, workers.live())
                        self._kill(workers)
                        raise _Dropped("unreachable") from None
                    # The first retry at once: the driver counts an agent whose poll's
                    # connection closed as lost unless it polls again within seconds.
                    failures += 1
                    self._leaving.wait(0.05 if failures == 1 else min(RETRY_DELAY, welcome.poll_seconds))
                    continue
                heard, failures = time.monotonic(), 0
                if (reply.dropped and reply.unknown and not reply.ended and welcome.patience > 0
                        and not self._leaving.is_set()):
                    # A driver that never knew this agent: the previous one's successor
                    # (--state-dir). Its workers kept, for it to adopt at the join.
                    self._kept_until = heard + welcome.patience
                    raise _Dropped("the driver restarted", kept=True)
                if reply.dropped:
                    if reply.ended:  # the driver stopped the workers: what is left (a fork
                        self._stop(workers)  # server) ends with SIGTERM, cleaning up after itself
                    else:
                        self._kill(workers)
                    raise _Dropped(reply.reason, reply.ended)
                for order in reply.orders:
                    if order.number <= through:
                        continue  # carried out already (its acknowledgement was lost)
                    if order.kind is p.AgentOrderKind.START:
                        workers.start(order)
                    elif order.kind is p.AgentOrderKind.SIGNAL:
                        workers.signal(order.worker_id, order.signal)
                    through = order.number
        except NotTheDriver as err:
            log.error("Cannot trust the driver's reply any more (%s): stopping every worker.", err)
            self._kill(workers)
            return EXIT_REFUSED
        finally:
            self._stopped.set()
            events.wake()
            channel.close()

    def _say_leaving(self, channel: DriverChannel) -> bool:
        try:
            channel.post(p.PATH_AGENT_LEAVE, p.AgentLeave(self._agent_id), p.Ack)
            return True
        except (Unreachable, Refused):
            return False  # tried again next turn; unreachable for long, the host is lost anyway

    def _say_gone(self, channel: DriverChannel) -> None:
        try:
            channel.post(p.PATH_AGENT_LEAVE, p.AgentLeave(self._agent_id, gone=True), p.Ack)
        except (Unreachable, Refused, NotTheDriver):
            pass  # the driver counts it lost after the heartbeat timeout: its workers are gone already

    def _stop(self, workers: Workers) -> None:
        workers.signal_all(signal.SIGTERM)
        workers.signal_all(signal.SIGCONT)
        if not workers.wait_all(STOP_GRACE):
            workers.force_all()

    def _kill(self, workers: Workers) -> None:
        """The host is lost to the job: its workers SIGKILLed now (a fork server ended)."""
        workers.kill_all()
        if not workers.wait_all(STOP_GRACE):
            workers.force_all()
            workers.wait_all(STOP_GRACE)

    def _report(self, events: Events) -> None:
        """Send the events in order until acknowledged, on a connection of its own."""
        s = self._s
        channel = DriverChannel(s.driver_host, s.driver_port, s.secret, self._nonces, self._slack)
        generation = events.generation  # this session's numbering
        try:
            while not self._stopped.is_set():
                batch = events.batch(timeout=1.0)
                if not batch:
                    continue
                try:
                    reply = channel.post(p.PATH_AGENT_REPORT, p.AgentReport(self._agent_id, batch), p.AgentReportReply)
                except (Unreachable, Refused, NotTheDriver):
                    self._stopped.wait(0.2)  # the poll loop judges the driver's absence
                    continue
                if reply.dropped:
                    return
                events.acknowledged(reply.through, generation)
        finally:
            channel.close()


def run_agent(settings: AgentSettings) -> int:
    """Run the agent in this process until it leaves; SIGTERM (and SIGINT) is a graceful leave."""
    agent = Agent(settings)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda _s, _f: agent.request_leave())
    try:
        return agent.run()
    except SystemExit as refused:
        return int(refused.code or 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
