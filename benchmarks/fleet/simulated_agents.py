"""Simulated agents (``lightning-elastic agent``) in the fleet simulator's process.

Each one speaks the real agent protocol to the real driver (``launch --agents``): it joins
with its host name and slots, holds a long poll for its orders and reports its workers'
starts and exits, numbered, until acknowledged. A START order makes a ``SimulatedWorker``
(the simulator's, speaking the real worker protocol); a SIGNAL order ends it as the signal
would. ``lose()`` is the agent's pod or machine gone at once: its workers die with it and
nothing more is said to the driver, which must notice the silence.
"""

from __future__ import annotations

import asyncio
import secrets
import signal

from benchmarks.fleet.simulated_workers import Connection, DriverGone, SimulatedWorker, Simulator
from lightning_elastic import protocol as p


class SimulatedAgent:
    def __init__(self, sim: Simulator, host: str, slots: int, port: int, secret: str) -> None:
        self._sim = sim
        self.host = host
        self._slots = slots
        self._secret = secret
        self._polls = Connection("127.0.0.1", port, sim.stats)
        self._reports = Connection("127.0.0.1", port, sim.stats)
        self._agent_id = secrets.token_hex(16)
        self._through = 0  # the highest order carried out
        self._pending: list[p.AgentEvent] = []
        self._next_event = 1
        self._event_ready = asyncio.Event()
        self.workers: dict[str, SimulatedWorker] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.joined_at: float | None = None
        self.lost = False

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run()))

    async def _post(self, conn: Connection, path: str, message: object, reply_type: type, timeout: float):
        status, body = await conn.post(path, p.to_json(message), self._secret, timeout)
        if status != 200:
            raise RuntimeError(f"{path} refused ({status}): {body[:200]!r}")
        return p.decode(reply_type, body)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:  # the driver may not be up yet: retried, as the real agent does
            try:
                welcome = await self._post(self._polls, p.PATH_AGENT_JOIN, p.AgentJoin(self._agent_id, self.host,
                                                                                      self._slots),
                                           p.AgentJoinReply, timeout=30)
                break
            except DriverGone:
                await asyncio.sleep(0.2)
        if not welcome.accepted:
            raise RuntimeError(f"agent {self.host} refused: {welcome.reason}")
        self.joined_at = loop.time()
        self._tasks.append(asyncio.create_task(self._report_loop()))
        wait = welcome.poll_seconds
        while True:
            try:
                reply = await self._post(self._polls, p.PATH_AGENT_POLL, p.AgentPoll(self._agent_id, wait, self._through),
                                         p.AgentPollReply, timeout=wait + 30)
            except DriverGone:
                await asyncio.sleep(0.2)
                continue
            if reply.dropped:
                return
            for order in reply.orders:
                if order.number <= self._through:
                    continue
                if order.kind is p.AgentOrderKind.START:
                    self._start(order)
                elif order.kind is p.AgentOrderKind.SIGNAL:
                    self._signal(order)
                self._through = order.number

    def _start(self, order: p.AgentOrder) -> None:
        env = dict(entry.split("=", 1) for entry in order.env)
        sim = self._sim
        worker = SimulatedWorker(order.worker_id, env[p.ENV_DRIVER_URL], self._secret,
                                 float(env[p.ENV_HEARTBEAT_INTERVAL]), int(env["WORLD_SIZE"]), sim.stats,
                                 sim._record_assigned, sim.first_asks.setdefault)  # noqa: SLF001 - the simulator's own
        sim.workers[worker.worker_id] = worker
        self.workers[worker.worker_id] = worker
        worker.start()
        self._event(p.AgentEventKind.STARTED, worker.worker_id, pid=1)
        self._tasks.append(asyncio.create_task(self._watch(worker)))
        sim.worker_added.set()

    def _signal(self, order: p.AgentOrder) -> None:
        worker = self.workers.get(order.worker_id)
        sig = order.signal
        if worker is None or worker.finished.is_set() or sig == signal.SIGCONT:
            return
        if sig == signal.SIGKILL and worker.worker_id not in self._sim.killed_by_us:
            self._sim.unexpected_kills.append(worker.worker_id)
        worker.exit(-sig)

    async def _watch(self, worker: SimulatedWorker) -> None:
        await worker.finished.wait()
        status = worker.exit_status or 0
        if not self.lost:
            self._event(p.AgentEventKind.EXITED, worker.worker_id, status=max(status, 0), signal=max(-status, 0))

    def _event(self, kind: p.AgentEventKind, worker_id: str, **fields: int) -> None:
        self._pending.append(p.AgentEvent(self._next_event, kind, worker_id, **fields))  # type: ignore[arg-type]
        self._next_event += 1
        self._event_ready.set()

    async def _report_loop(self) -> None:
        while True:
            await self._event_ready.wait()
            self._event_ready.clear()
            while self._pending:
                batch = tuple(self._pending[:64])
                try:
                    reply = await self._post(self._reports, p.PATH_AGENT_REPORT, p.AgentReport(self._agent_id, batch),
                                             p.AgentReportReply, timeout=30)
                except DriverGone:
                    await asyncio.sleep(0.2)
                    continue
                if reply.dropped:
                    return
                self._pending = [e for e in self._pending if e.number > reply.through]

    def lose(self) -> None:
        """The agent's machine is gone at once: its workers with it, its connections silent."""
        self.lost = True
        for worker in self.workers.values():
            if not worker.finished.is_set():
                self._sim.killed_by_us.add(worker.worker_id)
                worker.exit(-signal.SIGKILL)
        for task in self._tasks:
            task.cancel()
        self._polls.close()
        self._reports.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._polls.close()
        self._reports.close()
