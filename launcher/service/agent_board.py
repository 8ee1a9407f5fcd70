"""The agents connected to the driver (``lightning-elastic agent``), as the service and the driver see them.

An agent joins over the signed channel (``protocol.AgentJoin``), then holds a long poll
for its orders (which is also its heartbeat) and reports its workers' starts, output and
exits. The board is where both sides meet, under a lock of its own (never the job's):

- the rendezvous service records what agents say (``join``, ``poll``, ``report``,
  ``leave``) on its event loop, and never waits here for anything but this lock;
- the driver reads the hosts agents offer (``hosts``, from the discovery thread), queues
  orders (``start``, ``signal``) and reads its workers' fates (``fate``) from its loop:
  in memory, O(1) per worker, so the decision loop never waits on an agent's network.

An agent is lost when nothing was heard from it for the heartbeat timeout, or when its
waiting poll's connection closed and it did not poll again within ``CLOSED_GRACE`` (its
process killed: no need to wait out the timeout): its workers then count as lost with
their host (``WorkerFate.host_gone``: their round is broken, the
survivors recover as from a host loss, nothing is blacklisted: the host left with its
agent, and an agent that comes back is a host added). A graceful leave (SIGTERM to the
agent) takes the host off the list: its workers leave at their next check, as when
discovery stops listing a host.

Silence is counted only while this process ran (``liveness.Absences``, as for workers): a
driver stopped (SIGSTOP, a debugger, a frozen container, a long GC or swap) hears no agent
meanwhile, and on its return it must not find every agent silent past the timeout before
its service has read their waiting polls. Every judging call notes the time; a gap between
two longer than the poll period (the driver's loop judges every tick) starts every agent's
silence again.

A driver restarted with ``--state-dir`` knows from the saved state which workers ran on
agents' hosts (``expect``): until their agents join again they are *awaited*, their hosts
still offered with the slots they used. An agent that lost its driver keeps its workers for
the patience the driver gave it (``AgentJoinReply.patience``), joins the new driver and lists
them (``AgentJoin.workers``); the board adopts each one its saved state has on that host
(with that pid, once known) and names them in the reply: the agent stops every other one
(a worker the old driver started and never saved, or one this driver gave up on). What an
agent does not list, or an agent that does not come back within the heartbeat timeout,
counts as lost with its host. Only an agent that proves the secret can claim a worker, and
only a worker of its own host; a join recorded before the restart is refused by its
timestamp (``RendezvousServer``'s ``not_before``), a replay since by its nonce.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from lightning_elastic import protocol as p
from lightning_elastic.launcher.job.liveness import Absences
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.service.long_poll import LongPoll, Signal

log = logging.getLogger("lightning_elastic.driver")

# A host name as an agent may offer it: what a machine's or pod's name can be (RFC 1123
# labels), bounded; anything else would end up in log lines and file names.
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
_AGENT_ID = re.compile(r"[0-9a-f]{32}")
MAX_AGENT_SLOTS = 4096
MAX_WORKER_ID = 200  # a worker id the driver gave is far shorter; anything longer is not ours
# Agents dropped (lost, refused after they joined) remembered so that their late requests
# are answered "dropped" and not taken for strangers; bounded.
DROPPED_KEPT = 4096
# An agent whose waiting poll's connection closed (its process killed, its pod deleted by
# force) is lost unless it polls again within this: a live agent whose connection broke
# polls again at once (launcher/agent/run.py), a dead one never does, and waiting for the
# heartbeat timeout would cost every survivor that long.
CLOSED_GRACE = 2.0
# Worker output held for the driver's forwarder beyond what it drained: past this the
# newest chunks are dropped, never the agent's requests stalled; a drop is said in the
# worker's stream where the gap is (one line per gap) and once per worker in the driver's log.
OUTPUT_HELD = 4 * 1024 * 1024


def dropped_line(nbytes: int, why: str) -> bytes:
    """The line a worker's stream holds where ``nbytes`` of its output were dropped."""
    return f"[{nbytes} bytes of output dropped: {why}]\n".encode()


class OutputQueue:
    """A worker's output as the agent reports it, read by the driver's ``LineForwarder``
    like a pipe (``read1``): chunks put by the service, EOF once the worker ended."""

    def __init__(self, worker_id: str = "") -> None:
        self._worker_id = worker_id
        self._chunks: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._held = 0
        self._lock = threading.Lock()
        self._closed = False
        self._ends_line = True  # the last chunk queued ended a line (a gap's line starts on its own)
        self._gap = 0  # bytes dropped since the last chunk queued: said before the next one
        self.dropped = 0

    def put(self, data: bytes) -> None:
        with self._lock:
            if self._closed or not data:
                return
            if self._held + len(data) > OUTPUT_HELD:
                if not self.dropped:
                    log.warning("Output of worker %s dropped: more than %d MiB of it waiting for the driver's "
                                "output; its log says how much where the gap is.", self._worker_id,
                                OUTPUT_HELD >> 20)
                self.dropped += len(data)
                self._gap += len(data)
                return
            self._queue(self._gap_said() + data)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            gap = self._gap_said()
            if gap:
                self._queue(gap)
            self._chunks.put(b"")

    def _gap_said(self) -> bytes:
        """The line for the bytes dropped since the last chunk (b"" if none); the held bound
        may be passed by this line: one per gap, and a gap follows a chunk held."""
        if not self._gap:
            return b""
        said = (b"" if self._ends_line else b"\n") + dropped_line(
            self._gap, f"more than {OUTPUT_HELD >> 20} MiB waiting for the driver's output")
        self._gap = 0
        return said

    def _queue(self, data: bytes) -> None:
        self._held += len(data)
        self._ends_line = data.endswith(b"\n")
        self._chunks.put(data)

    def read1(self, size: int = -1) -> bytes:
        chunk = self._chunks.get()
        with self._lock:
            self._held -= len(chunk)
        if not chunk:
            self._chunks.put(b"")  # EOF stays EOF for a second read
        return chunk

    def read(self, size: int = -1) -> bytes:
        return self.read1(size)


@dataclasses.dataclass
class WorkerFate:
    """What the driver knows of a worker an agent runs: its pid once started, its exit."""

    pid: int = 0
    status: int | None = None  # as Popen.returncode: negative for a signal
    detail: str = ""  # why it was lost with its host (its agent lost or gone), or could not start
    host_gone: bool = False  # lost with its agent: not the host's fault (see the module docstring)


@dataclasses.dataclass
class _Worker:
    worker_id: str
    output: OutputQueue
    fate: WorkerFate = dataclasses.field(default_factory=WorkerFate)


@dataclasses.dataclass
class _Awaited:
    """A worker of the previous driver, on an agent's host, until that agent joins again."""

    host: str
    worker: _Worker
    signals: list[int] = dataclasses.field(default_factory=list)  # asked meanwhile (bounded)


# Signals the driver asks for an awaited worker, kept to be ordered once its agent is back
# (a stop is SIGTERM, SIGCONT, then SIGKILL: a few at most).
AWAITED_SIGNALS = 8


@dataclasses.dataclass
class Agent:
    agent_id: str
    host: str
    slots: int
    last_heard: float
    leaving: bool = False
    closed_at: float | None = None  # its waiting poll's connection closed then (CLOSED_GRACE)
    orders: collections.deque[p.AgentOrder] = dataclasses.field(default_factory=collections.deque)
    next_order: int = 1
    events_taken: int = 0
    wake: Signal = dataclasses.field(default_factory=Signal)
    workers: dict[str, _Worker] = dataclasses.field(default_factory=dict)
    adopted: tuple[str, ...] = ()  # of the workers it listed at its join, those taken (its reply)


class AgentBoard:
    """See the module docstring. Thread-safe: one lock, held only for in-memory work."""

    def __init__(self, max_slots: int, heartbeat_timeout: float, poll_seconds: float,
                 clock: Callable[[], float] = time.monotonic, patience: float = 0.0) -> None:
        self._max_slots = max_slots  # --max-np: an agent offering more is refused
        self._heartbeat_timeout = heartbeat_timeout
        self._patience = patience  # --driver-patience with --state-dir, else 0 (module docstring)
        self._poll_seconds = poll_seconds
        self._clock = clock
        self._absences = Absences.starting(clock(), poll_seconds)  # this process's own pauses
        self.lock = threading.Lock()
        self._agents: dict[str, Agent] = {}  # by agent id
        self._by_host: dict[str, Agent] = {}
        self._by_worker: dict[str, tuple[Agent, _Worker]] = {}
        self._dropped: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why
        self._refused_said: set[str] = set()
        self._listed: frozenset[str] = frozenset()  # hosts of the job's host source (``list_hosts``)
        # A restarted driver's workers on agents' hosts, until their agents join again
        # (``expect``); bounded by the saved state, emptied by the joins or the deadline.
        self._awaited: dict[str, dict[str, _Awaited]] = {}  # host -> worker id -> awaited
        self._awaited_host_of: dict[str, str] = {}  # worker id -> its host
        self._awaited_slots: dict[str, int] = {}  # host -> the slots its awaited workers used
        self._awaited_since = 0.0
        self._closing = False
        # At the job's end: agents not yet answered that it ended (the driver waits, bounded,
        # for their polls before its service closes: else they would wait for a driver).
        self._untold: set[str] = set()
        self._told = threading.Condition(self.lock)
        # Bumped whenever the hosts agents offer change (a join, a leave, a loss): the driver
        # takes them again only then (read without the lock: an int).
        self.version = 0

    # ----- the service's side (its event loop) -------------------------------------------

    def join(self, request: p.AgentJoin) -> p.AgentJoinReply:
        why = self._invalid(request)
        if why:
            return self._refuse(request, why)
        with self.lock:
            now = self._now()
            self._expire(now)
            known = self._agents.get(request.agent_id)
            if known is not None:  # the same agent again (a lost reply): still welcome
                known.last_heard = now
                return self._welcome(known.adopted)
            holder = self._by_host.get(request.host)
            if holder is not None and self._unheard(holder, now):
                # The same name again while the old agent is not heard from: a pod or container
                # restarted under its name (a StatefulSet's pod, a container restarted in its
                # pod) before the old one was noticed lost. The newcomer proves the secret:
                # it replaces the old one at once rather than after the heartbeat timeout.
                log.warning("Agent on %s replaced: a new agent joined for it while the old one was not heard "
                            "from for %.1f s (a pod or container restarted under the same name).",
                            holder.host, self._absences.silent_for(holder.last_heard, now))
                self._drop(holder, f"its agent on {holder.host} was replaced by a new one (restarted)",
                           "a new agent joined for this host while this one was not heard from")
                holder = None
            if holder is not None:
                why = (f"another agent is connected for host {request.host} (two agents on one machine, or two "
                       "pods with one name): give each its own --host-name")
            elif request.host in self._listed:
                why = (f"host {request.host} is in the job's host list (-H or the discovery script), where the "
                       "driver starts its workers itself: give this agent another --host-name, or list the host "
                       "in one place")
            elif self._closing:
                why = "the job is ending"
            else:
                agent = Agent(request.agent_id, request.host, request.slots, now)
                self._agents[agent.agent_id] = agent
                self._by_host[agent.host] = agent
                self._dropped.pop(agent.agent_id, None)
                agent.adopted = self._adopt(agent, request.workers)
                self.version += 1
        if why:
            return self._refuse(request, why)
        if request.workers or agent.adopted:
            log.info("Agent on %s joined again with %d slot(s): %d of its %d worker(s) adopted.", request.host,
                     request.slots, len(agent.adopted), len(request.workers))
        else:
            log.info("Agent on %s joined with %d slot(s).", request.host, request.slots)
        return self._welcome(agent.adopted)

    def _unheard(self, agent: Agent, now: float) -> bool:
        """Is ``agent`` not polling as a live one does? Its waiting poll's connection closed
        and it did not poll again, or it started none for longer than a poll lasts (a live
        agent polls again as soon as a poll is answered)."""
        return (agent.closed_at is not None
                or self._absences.silent_for(agent.last_heard, now) > self._poll_seconds + CLOSED_GRACE)

    def _invalid(self, request: p.AgentJoin) -> str:
        if not _AGENT_ID.fullmatch(request.agent_id):
            return "malformed agent id (expected 32 hex digits)"
        if not _HOST_NAME.fullmatch(request.host):
            return f"host name {p.clip(request.host, 80)!r} is not a machine's name (letters, digits, '.', '-')"
        if not 1 <= request.slots <= MAX_AGENT_SLOTS:
            return f"--slots: expected 1..{MAX_AGENT_SLOTS}, got {request.slots}"
        if request.slots > self._max_slots:
            return (f"--slots {request.slots} is more than the job's --max-np {self._max_slots}: give the agent at "
                    f"most {self._max_slots} slot(s)")
        if len(request.workers) > MAX_AGENT_SLOTS:
            return f"it lists {len(request.workers)} workers, more than an agent can run ({MAX_AGENT_SLOTS})"
        for worker in request.workers:
            if not (0 < len(worker.worker_id) <= MAX_WORKER_ID and worker.pid >= 0):
                return "it lists a malformed worker (an id of 1..200 characters and a pid)"
        return ""

    def _refuse(self, request: p.AgentJoin, why: str) -> p.AgentJoinReply:
        said = f"{request.host}: {why}"
        if said not in self._refused_said and len(self._refused_said) < DROPPED_KEPT:  # once per host and reason
            self._refused_said.add(said)
            log.warning("Refused an agent for host %s: %s.", p.clip(request.host, 80), why)
        return p.AgentJoinReply(False, why)

    def _welcome(self, adopted: tuple[str, ...] = ()) -> p.AgentJoinReply:
        return p.AgentJoinReply(True, poll_seconds=self._poll_seconds, heartbeat_timeout=self._heartbeat_timeout,
                                patience=self._patience, adopted=adopted)

    def poll(self, request: p.AgentPoll) -> LongPoll[p.AgentPollReply] | p.AgentPollReply:
        """The agent's orders past ``orders_through``, as soon as there are any, or none after
        its wait (at most the poll period the driver gave it)."""
        wait = min(request.wait_seconds, self._poll_seconds)
        with self.lock:
            agent = self._heard(request.agent_id)
            if agent is None:
                return self._dropped_reply(request.agent_id)
            while agent.orders and agent.orders[0].number <= request.orders_through:
                agent.orders.popleft()  # carried out: acknowledged by this poll

        answered = []

        def answer(final: bool) -> p.AgentPollReply | None:
            reply = None
            if self._agents.get(agent.agent_id) is not agent:
                reply = self._dropped_reply(agent.agent_id)
            elif agent.orders:
                reply = p.AgentPollReply(orders=tuple(agent.orders))
            elif final:
                # (Not heard for that: a dead agent's poll ends the same way. It is heard at
                # its next poll, sent at once.)
                reply = p.AgentPollReply()
            if reply is not None:
                answered.append(True)
            return reply

        def finish() -> None:
            if not answered and self._agents.get(agent.agent_id) is agent:
                agent.closed_at = self._clock()  # its connection closed while it waited

        return LongPoll(self.lock, answer, agent.wake, self._clock() + wait, self._clock, finish)

    def report(self, request: p.AgentReport) -> p.AgentReportReply:
        """Take the events past those taken already (a retried report repeats some)."""
        with self.lock:
            agent = self._heard(request.agent_id)
            if agent is None:
                return p.AgentReportReply(through=0, dropped=True)
            for event in request.events:
                if event.number != agent.events_taken + 1:
                    continue  # taken already (a retry), or a gap the agent fills by resending
                agent.events_taken = event.number
                self._take(agent, event)
            return p.AgentReportReply(through=agent.events_taken)

    def leave(self, request: p.AgentLeave) -> p.Ack:
        with self.lock:
            agent = self._heard(request.agent_id)
            if agent is None:
                return p.Ack()
            if not request.gone:
                if not agent.leaving:
                    agent.leaving = True
                    self.version += 1
                    log.info("Agent on %s is leaving (SIGTERM): its workers leave the job at their next check.",
                             agent.host)
                return p.Ack()
            self._drop(agent, f"its agent on {agent.host} left before it ended", "it left the job")
        log.info("Agent on %s left the job.", agent.host)
        return p.Ack()

    # ----- the driver's side -----------------------------------------------------------

    def expire(self) -> None:
        """Lose the agents silent past the heartbeat timeout (each turn of the driver's loop:
        O(agents), in memory)."""
        with self.lock:
            self._expire(self._now())

    def hosts(self) -> list[HostSlots]:
        """The hosts agents offer now, in the order they joined (older first: lower ranks)."""
        with self.lock:
            offered = [HostSlots(a.host, a.slots) for a in self._agents.values() if not a.leaving]
            # A restarted driver's agents' hosts, until their agents are back: their adopted
            # workers keep their slots (not taken off the job for a host that seems gone).
            offered += [HostSlots(host, slots) for host, slots in self._awaited_slots.items()
                        if host not in self._by_host]
            return offered

    def list_hosts(self, hosts: frozenset[str]) -> None:
        """The hosts the job's host source (-H, discovery) lists now: an agent that offers one
        of them is refused at its join (the driver starts that host's workers itself); one
        connected before its host was listed keeps it (``HostIntake`` ignores the listing)."""
        with self.lock:
            self._listed = hosts

    def serves(self, host: str) -> bool:
        with self.lock:
            return host in self._by_host or host in self._awaited_slots

    def expect(self, host: str, worker_id: str, slot_index: int, pid: int) -> tuple[WorkerFate, OutputQueue]:
        """A worker a previous driver started on ``host`` through its agent (``--state-dir``),
        ``pid`` as saved (0: not known yet): awaited until that agent joins again and lists
        it, lost with its host if it does not within the heartbeat timeout (module docstring)."""
        output = OutputQueue(worker_id)
        worker = _Worker(worker_id, output, WorkerFate(pid=pid))
        with self.lock:
            self._awaited.setdefault(host, {})[worker_id] = _Awaited(host, worker)
            self._awaited_host_of[worker_id] = host
            self._awaited_slots[host] = max(self._awaited_slots.get(host, 0), slot_index + 1)
            self._awaited_since = self._now()
            self.version += 1
        return worker.fate, output

    def start(self, host: str, worker_id: str, command: Sequence[str], env: Mapping[str, str],
              cwd: str) -> tuple[WorkerFate, OutputQueue]:
        """Order the agent of ``host`` to start a worker; its fate is filled in as the agent
        reports. A host whose agent is gone gives a worker lost with it."""
        output = OutputQueue(worker_id)
        worker = _Worker(worker_id, output)
        with self.lock:
            agent = self._by_host.get(host)
            if agent is None:
                worker.fate = WorkerFate(status=-signal.SIGKILL, detail=f"its agent on {host} is gone",
                                         host_gone=True)
                output.close()
                return worker.fate, output
            agent.workers[worker_id] = worker
            self._by_worker[worker_id] = (agent, worker)
            self._order(agent, p.AgentOrder(0, p.AgentOrderKind.START, worker_id, tuple(command),
                                            tuple(f"{k}={v}" for k, v in env.items()), cwd))
        return worker.fate, output

    def signal(self, worker_id: str, sig: int) -> None:
        with self.lock:
            found = self._by_worker.get(worker_id)
            if found is None:
                awaited = self._awaited_entry(worker_id)
                if awaited is not None and len(awaited.signals) < AWAITED_SIGNALS:
                    awaited.signals.append(int(sig))  # ordered once its agent is back
                return
            if found[1].fate.status is not None:
                return
            self._order(found[0], p.AgentOrder(0, p.AgentOrderKind.SIGNAL, worker_id, signal=int(sig)))

    def check(self, worker_id: str) -> None:
        """Lose the worker's agent now if it has been silent past the heartbeat timeout (the
        driver's loop asks this of a running worker every turn: O(1))."""
        with self.lock:
            found = self._by_worker.get(worker_id)
            if found is not None and found[1].fate.status is None:
                self._expire_one(found[0], self._now())
            elif found is None and worker_id in self._awaited_host_of:
                self._expire_awaited(self._now())

    def close(self, timeout: float = 0.0) -> None:
        """The job is over: every agent's poll says so; wait up to ``timeout`` seconds until
        each one has been answered (a poll comes every poll period)."""
        with self.lock:
            self._closing = True
            self._end_awaited_all("the job ended before its agent came back")
            for agent in list(self._agents.values()):
                self._untold.add(agent.agent_id)
                self._drop(agent, f"its agent on {agent.host} was dropped: the job ended", "the job ended")
            self._told.wait_for(lambda: not self._untold, timeout)

    # ----- under the lock --------------------------------------------------------------

    def _now(self) -> float:
        """The clock, for a judgment of silence: a gap since the previous one longer than the
        poll period was this process's absence, no agent's (module docstring)."""
        now = self._clock()
        self._absences.turn(now)
        return now

    def _heard(self, agent_id: str) -> Agent | None:
        agent = self._agents.get(agent_id)
        now = self._now()
        if agent is not None:
            if self._expire_one(agent, now):
                return None
            agent.last_heard = now
            agent.closed_at = None
        return agent

    def _dropped_reply(self, agent_id: str) -> p.AgentPollReply:
        if agent_id in self._untold:
            self._untold.discard(agent_id)
            self._told.notify_all()
        return p.AgentPollReply(dropped=True, reason=self._why_dropped(agent_id), ended=self._closing,
                                unknown=agent_id not in self._dropped)

    def _why_dropped(self, agent_id: str) -> str:
        return self._dropped.get(agent_id, "the driver does not know this agent (it restarted, or lost it)")

    def _order(self, agent: Agent, order: p.AgentOrder) -> None:
        agent.orders.append(dataclasses.replace(order, number=agent.next_order))
        agent.next_order += 1
        agent.wake.fire()

    def _take(self, agent: Agent, event: p.AgentEvent) -> None:
        found = agent.workers.get(event.worker_id)
        if found is None:
            return  # a worker of this agent the driver forgot (it ended): nothing to record
        fate = found.fate
        if event.kind is p.AgentEventKind.STARTED:
            fate.pid = event.pid
        elif event.kind is p.AgentEventKind.OUTPUT:
            found.output.put(event.output.encode())
        elif event.kind is p.AgentEventKind.EXITED:
            self._end(agent, found, -event.signal if event.signal else event.status, "", False)
        elif event.kind is p.AgentEventKind.NOT_STARTED:
            found.output.put(f"{event.detail}\n".encode())
            self._end(agent, found, 127, "", False)  # as a shell says of a command it could not run

    def _end(self, agent: Agent, worker: _Worker, status: int, detail: str, host_gone: bool) -> None:
        worker.fate.status, worker.fate.detail, worker.fate.host_gone = status, detail, host_gone
        worker.output.close()
        agent.workers.pop(worker.worker_id, None)
        self._by_worker.pop(worker.worker_id, None)

    def _expire(self, now: float) -> None:
        for agent in list(self._agents.values()):
            self._expire_one(agent, now)
        self._expire_awaited(now)

    # ----- a restarted driver's workers, awaited (under the lock) -------------------------

    def _awaited_entry(self, worker_id: str) -> _Awaited | None:
        host = self._awaited_host_of.get(worker_id)
        return self._awaited[host].get(worker_id) if host is not None else None

    def _adopt(self, agent: Agent, listed: Sequence[p.AgentWorker]) -> tuple[str, ...]:
        """Of the workers a joining agent lists, those awaited on its host (with that pid,
        once the saved state knew it); every other awaited worker of its host is lost with
        it: it ended while no driver ran, or its agent restarted without it."""
        awaited = self._awaited.pop(agent.host, None)
        if awaited is None:
            return ()
        self._awaited_slots.pop(agent.host, None)
        taken = []
        for listed_worker in listed:
            entry = awaited.get(listed_worker.worker_id)
            if entry is None:
                continue  # not this driver's (never saved), or another host's: the agent stops it
            fate = entry.worker.fate
            if fate.pid and fate.pid != listed_worker.pid:
                log.warning("Agent on %s lists worker %s as pid %d, the saved state has pid %d: not adopted.",
                            agent.host, listed_worker.worker_id, listed_worker.pid, fate.pid)
                continue
            del awaited[listed_worker.worker_id]
            self._awaited_host_of.pop(listed_worker.worker_id, None)
            fate.pid = listed_worker.pid
            agent.workers[entry.worker.worker_id] = entry.worker
            self._by_worker[entry.worker.worker_id] = (agent, entry.worker)
            taken.append(entry.worker.worker_id)
            if not listed_worker.running:  # it ended while no driver ran: its status, as the agent saw it
                status = -listed_worker.signal if listed_worker.signal else listed_worker.status
                self._end(agent, entry.worker, status, "", False)
                continue
            for sig in entry.signals:  # asked while its agent was away
                self._order(agent, p.AgentOrder(0, p.AgentOrderKind.SIGNAL, entry.worker.worker_id, signal=sig))
        for worker_id, entry in awaited.items():
            self._awaited_host_of.pop(worker_id, None)
            self._lose_awaited(entry, f"its agent on {agent.host} came back without it (it ended while no driver "
                                      "ran, or its agent restarted)")
        return tuple(taken)

    def _expire_awaited(self, now: float) -> None:
        if not self._awaited or self._absences.silent_for(self._awaited_since, now) <= self._heartbeat_timeout:
            return
        for host, workers in self._awaited.items():
            log.warning("Agent on %s did not join this driver within %g s of its adoption (--heartbeat-timeout): "
                        "its %d worker(s) count as lost with it.", host, self._heartbeat_timeout, len(workers))
        self._end_awaited_all(f"its agent did not join the restarted driver within {self._heartbeat_timeout:g} s")

    def _end_awaited_all(self, detail: str) -> None:
        for workers in self._awaited.values():
            for entry in workers.values():
                self._lose_awaited(entry, detail)
        if self._awaited_slots:
            self.version += 1
        self._awaited.clear()
        self._awaited_host_of.clear()
        self._awaited_slots.clear()

    def _lose_awaited(self, entry: _Awaited, detail: str) -> None:
        fate = entry.worker.fate
        fate.status, fate.detail, fate.host_gone = -signal.SIGKILL, detail, True
        entry.worker.output.close()

    def _expire_one(self, agent: Agent, now: float) -> bool:
        closed = agent.closed_at
        if closed is not None and self._absences.silent_for(closed, now) > CLOSED_GRACE:
            log.warning("Agent on %s lost: its connection closed and it did not come back within %g s.",
                        agent.host, CLOSED_GRACE)
            self._drop(agent, f"its agent on {agent.host} was lost (its connection closed)",
                       f"its connection closed and it did not poll again within {CLOSED_GRACE:g} s")
            return True
        silent = self._absences.silent_for(agent.last_heard, now)
        if silent <= self._heartbeat_timeout:
            return False
        log.warning("Agent on %s lost: nothing heard from it for %.1f s (--heartbeat-timeout %g).",
                    agent.host, silent, self._heartbeat_timeout)
        self._drop(agent, f"its agent on {agent.host} was lost (silent for {silent:.1f} s)",
                   f"the driver heard nothing from it for {silent:.1f} s (--heartbeat-timeout)")
        return True

    def _drop(self, agent: Agent, detail: str, why: str) -> None:
        for worker in list(agent.workers.values()):
            self._end(agent, worker, -signal.SIGKILL, detail, True)
        self._agents.pop(agent.agent_id, None)
        if self._by_host.get(agent.host) is agent:
            del self._by_host[agent.host]
        self._dropped[agent.agent_id] = why
        self.version += 1
        while len(self._dropped) > DROPPED_KEPT:
            self._dropped.popitem(last=False)
        agent.wake.fire()  # its pending poll answers "dropped"
