"""N simulated workers in one asyncio process, speaking the real protocol to the real driver.

Each worker does what ``ElasticWorker`` does, minus torch: its main connection asks the
rendezvous for a round (``after_round`` = the last one it was in), and a second connection
sends heartbeats as long polls of one interval (the generation and the broken round it
knows, as the real heartbeat thread). When a heartbeat shows its round broken, it goes
back to the rendezvous (the real worker's collective is unblocked then, and it does not
ask ``round-lost`` about a round it knows is broken); so does a new generation (a host
change).
Requests are signed and replies checked with the job secret, as ``DriverClient`` does,
over a minimal HTTP/1.1 keep-alive client (no dependency, little CPU per request).

Workers start when the driver asks for them (the control socket); all at once, as a
fleet whose processes start together: the worst case for the service.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from lightning_elastic import protocol as p
from lightning_elastic.membership.client import RETRY_FOR, backoff, first_request_spread, heartbeat_hold, heartbeat_retry_delay



class DriverGone(Exception):
    """The connection failed (refused, reset, timed out): counted, then retried."""


class Connection:
    """One keep-alive HTTP/1.1 connection to the driver, for one request at a time."""

    def __init__(self, host: str, port: int, stats: Stats) -> None:
        self._host, self._port = host, port
        self._stats = stats
        self._nonces = p.NonceSequence()  # one sender per connection, as a worker's client is
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, secret: str, timeout: float) -> tuple[int, bytes]:
        auth = p.sign_request(secret, "POST", path, body, self._nonces)
        head = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n{head}\r\n").encode() + body
        try:
            exchange = self._exchange(request, secret, auth[p.HEADER_NONCE])
            if sys.version_info < (3, 11):
                return await asyncio.wait_for(exchange, timeout)
            # In this task, not in a task of its own as wait_for's: one process plays every
            # worker, and a task (and a loop turn) per request is a good part of its cost.
            async with asyncio.timeout(timeout):
                return await exchange
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as err:
            self.close()
            self._stats.connection_errors += 1
            kind = f"{path} {type(err).__name__}"
            self._stats.error_kinds[kind] = self._stats.error_kinds.get(kind, 0) + 1
            raise DriverGone(f"{type(err).__name__}: {err}") from None

    async def _exchange(self, request: bytes, secret: str, nonce: str) -> tuple[int, bytes]:
        if self._reader is not None and (self._reader.at_eof() or self._reader.exception() is not None):
            # The driver closed this kept-alive connection while it was idle (it exited: a
            # driver restart): reconnect without an error, as the real client's pool does
            # (urllib3 checks a pooled connection before reusing it).
            self.close()
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
            self._stats.connections += 1
        reader, writer = self._reader, self._writer  # close() may drop them while this waits
        assert reader is not None
        writer.write(request)
        await writer.drain()
        # The reply's head in one read (a line at a time was a coroutine call per header).
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as err:
            if not err.partial:
                raise ConnectionResetError("connection closed by the driver") from None
            raise
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection", "").lower() == "close":
            self.close()
        if not p.verify_reply(secret, status, nonce, body, headers.get(p.HEADER_SIGNATURE.lower())):
            raise ValueError(f"reply with status {status} failed authentication")
        return status, body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


@dataclasses.dataclass
class Stats:
    connections: int = 0
    connection_errors: int = 0
    requests: int = 0
    # (sent at, reply - (sent + hold)) in seconds, for long polls answered at their end
    heartbeat_overheads: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    heartbeat_early: int = 0  # long polls answered early (a change)
    disowned: int = 0  # requests answered 409: the driver had declared the worker gone
    error_kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # "path ErrorType" -> count


@dataclasses.dataclass
class Assigned:
    worker_id: str
    round: int
    rank: int
    at: float


class SimulatedWorker:
    def __init__(self, worker_id: str, url: str, secret: str, heartbeat_interval: float, world_size: int,
                 stats: Stats, on_assigned: Callable[[Assigned], None],
                 on_first_ask: Callable[[str, float], None]) -> None:
        parsed = urllib.parse.urlsplit(url)
        assert parsed.hostname is not None and parsed.port is not None
        self.worker_id = worker_id
        self._secret = secret
        self._interval = heartbeat_interval  # the driver's, as the real workers receive it
        self._world_size = world_size
        self._stats = stats
        self._main = Connection(parsed.hostname, parsed.port, stats)
        self._beat = Connection(parsed.hostname, parsed.port, stats)
        self._store = Connection(parsed.hostname, parsed.port, stats)  # DriverStore's own client
        self._on_assigned = on_assigned
        self._on_first_ask = on_first_ask
        self.round = 0
        self._generation_at_round = 0
        self._known_generation = 0
        self._known_broken = 0
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.finished = asyncio.Event()
        self.exit_status: int | None = None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._main_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def _post(self, conn: Connection, path: str, message: Any, reply_type: type, timeout: float,
                    retry_for: float = RETRY_FOR) -> Any:
        """A request as ``DriverClient._post`` makes it: retried while the driver is unreachable."""
        body = p.to_json(message)
        deadline = time.monotonic() + retry_for
        attempt = 0
        while True:
            try:
                status, reply = await conn.post(path, body, self._secret, timeout)
            except DriverGone:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(backoff(attempt))
                attempt += 1
                continue
            self._stats.requests += 1
            if status == 409:
                # The driver counts this worker as gone (it missed its heartbeats): the real
                # worker exits with status 1 (lightning_elastic.membership.heartbeat.Heartbeat.run).
                self._stats.disowned += 1
                self.exit(1)
                raise asyncio.CancelledError
            if status != 200:
                raise RuntimeError(f"{path} refused ({status}): {reply[:200]!r}")
            return p.decode(reply_type, reply)

    async def _main_loop(self) -> None:
        await asyncio.sleep(first_request_spread(self._world_size))
        first = True
        while True:
            if first:
                self._on_first_ask(self.worker_id, time.monotonic())
                first = False
            reply = await self._post(self._main, p.PATH_RENDEZVOUS, p.RendezvousRequest(self.worker_id, self.round),
                                     p.RendezvousReply, timeout=p.RENDEZVOUS_POLL + 30)
            if reply.status == p.RendezvousStatus.WAIT:
                continue
            if reply.status == p.RendezvousStatus.EXIT:
                await self._post(self._main, p.PATH_REPORT, p.Report(self.worker_id, self.round, p.Outcome.REMOVED),
                                 p.Ack, timeout=30)
                self.exit(0)
                return
            a = reply.assignment
            self.round, self._generation_at_round = a.round, a.generation
            self._known_generation = max(self._known_generation, a.generation)
            self._on_assigned(Assigned(self.worker_id, a.round, a.rank, time.monotonic()))
            await self._wait_for_change()
            # Back to the rendezvous. Its heartbeat said the round broke (its collective was
            # unblocked by that): like ElasticWorker.classify_error, it does not ask
            # round-lost about a round it already knows is broken.

    async def _wait_for_change(self) -> None:
        while not (self._known_broken >= self.round or self._known_generation > self._generation_at_round):
            self._changed.clear()
            await self._changed.wait()

    async def _heartbeat_loop(self) -> None:
        first = True
        failures = 0  # in a row
        while True:
            sent = time.monotonic()
            hold, first = heartbeat_hold(self._interval, first), False  # as ElasticWorker
            request = p.HeartbeatRequest(self.worker_id, self._known_generation, self._known_broken, hold)
            try:
                # One attempt, retried by this loop as ElasticWorker's heartbeat thread does.
                reply = await self._post(self._beat, p.PATH_HEARTBEAT, request, p.HeartbeatReply,
                                         timeout=self._interval + 30, retry_for=0.0)
            except DriverGone:
                await asyncio.sleep(heartbeat_retry_delay(self._interval, failures))
                failures += 1
                continue
            failures = 0
            took = time.monotonic() - sent
            changed = reply.generation > self._known_generation or reply.last_broken_round > self._known_broken
            if changed:
                self._stats.heartbeat_early += 1
            elif self.round:
                self._stats.heartbeat_overheads.append((sent, took - hold))
            self._known_generation = max(self._known_generation, reply.generation)
            self._known_broken = max(self._known_broken, reply.last_broken_round)
            if changed:
                self._changed.set()

    async def store_bootstrap(self, pattern: str, rank: int, size: int, prefix: str) -> int:
        """The store traffic of forming one process group, as torch makes it (through
        ``DriverStore``); returns the requests sent. Patterns (see docs/performance.md):

        - ``nccl``: rank 0 publishes the 128-byte unique id, every other rank reads it;
        - ``nccl-scalable`` (NCCL >= 2.23 beyond 128 ranks): one id per 128 ranks, published
          by each 128th rank, read by every rank in one MULTI_GET;
        - ``gloo``: every rank publishes its address (154 + 8N bytes), then waits for and
          reads every rank's, one key at a time (gloo's full mesh: 2N + 1 operations).
        """
        sent = 0

        async def op(request: p.StoreRequest) -> p.StoreReply:
            nonlocal sent
            while True:
                sent += 1
                reply = await self._post(self._store, p.PATH_STORE, request, p.StoreReply, timeout=35)
                if reply.found or request.op not in (p.StoreOp.GET, p.StoreOp.MULTI_GET):
                    return reply

        def put(key: str, size_bytes: int) -> p.StoreRequest:
            value = base64.b64encode(os.urandom(size_bytes)).decode()
            return p.StoreRequest(self.worker_id, p.StoreOp.SET, f"{prefix}/{key}", value=value)

        def get(*keys: str) -> p.StoreRequest:
            full = tuple(f"{prefix}/{k}" for k in keys)
            if len(full) == 1:
                return p.StoreRequest(self.worker_id, p.StoreOp.GET, full[0], wait_seconds=2.0)
            return p.StoreRequest(self.worker_id, p.StoreOp.MULTI_GET, keys=full, wait_seconds=2.0)

        if pattern == "nccl":
            if rank == 0:
                await op(put("0", 128))
            else:
                await op(get("0"))
        elif pattern == "nccl-scalable":
            roots = (size + 127) // 128
            if rank % 128 == 0:
                await op(put(f"UniqueNCCLID:{rank // 128}", 128))
            await op(get(*(f"UniqueNCCLID:{i}" for i in range(roots))))
        elif pattern == "gloo":
            await op(put(str(rank), 154 + 8 * size))
            for peer in range(size):
                await op(get(str(peer)))  # torch's wait on the key (one DriverStore request)
                await op(get(str(peer)))  # then its get
        else:
            raise ValueError(f"unknown store pattern {pattern!r}")
        return sent

    async def report_done(self) -> None:
        await self._post(self._main, p.PATH_REPORT, p.Report(self.worker_id, self.round, p.Outcome.DONE), p.Ack,
                         timeout=30)

    def exit(self, status: int) -> None:
        """The process ends: its connections close, nothing more is sent."""
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._main.close()
        self._beat.close()
        self._store.close()
        self.exit_status = status
        self.finished.set()


class Simulator:
    """The workers the driver started, by id; the control socket's server end."""

    def __init__(self) -> None:
        self.stats = Stats()
        self.workers: dict[str, SimulatedWorker] = {}
        self.assigned: dict[int, dict[str, Assigned]] = {}
        self.first_asks: dict[str, float] = {}
        self.unexpected_kills: list[str] = []  # SIGKILLs the simulator did not cause: wedged verdicts
        self.killed_by_us: set[str] = set()
        self._writer: asyncio.StreamWriter | None = None
        self.worker_added = asyncio.Event()

    async def serve(self, path: str) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._on_driver, path)

    async def _on_driver(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        while line := await reader.readline():
            message = json.loads(line)
            if message["op"] == "start":
                worker = SimulatedWorker(message["worker_id"], message["url"], message["secret"],
                                         message["heartbeat_interval"], message["world_size"], self.stats,
                                         self._record_assigned, self.first_asks.setdefault)
                self.workers[worker.worker_id] = worker
                worker.start()
                asyncio.create_task(self._report_exit(worker))
                self.worker_added.set()
            elif message["op"] == "adopt":
                # A restarted driver finds a worker again: one that ended meanwhile is
                # reported ended at once, as a keeper's status file would say.
                worker = self.workers.get(message["worker_id"])
                if worker is None or worker.finished.is_set():
                    status = -signal.SIGKILL if worker is None else worker.exit_status
                    writer.write(json.dumps({"worker_id": message["worker_id"], "status": status}).encode() + b"\n")
            elif message["op"] == "signal":
                worker = self.workers.get(message["worker_id"])
                sig = message["signal"]
                if worker is None or worker.finished.is_set() or sig == signal.SIGCONT:
                    continue
                if sig == signal.SIGKILL and worker.worker_id not in self.killed_by_us:
                    self.unexpected_kills.append(worker.worker_id)
                worker.exit(-sig)

    def _record_assigned(self, a: Assigned) -> None:
        self.assigned.setdefault(a.round, {})[a.worker_id] = a

    async def _report_exit(self, worker: SimulatedWorker) -> None:
        await worker.finished.wait()
        assert self._writer is not None
        self._writer.write(json.dumps({"worker_id": worker.worker_id, "status": worker.exit_status}).encode() + b"\n")
        await self._writer.drain()

    def kill(self, worker_id: str) -> None:
        """SIGKILL of one worker process, as the driver would see it."""
        self.killed_by_us.add(worker_id)
        self.workers[worker_id].exit(-signal.SIGKILL)

    def live(self) -> list[SimulatedWorker]:
        return [w for w in self.workers.values() if not w.finished.is_set()]
