"""The rendezvous service: an authenticated JSON-over-HTTP front for the registry.

Every request must be signed with the job's secret (see ``protocol.sign_request``), recent
and not seen before; anything else is answered 401, and a body that does not match the
protocol 400, before it can reach the registry. Replies to authenticated requests are
signed so workers can trust them. Nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.service.agent_board import AgentBoard
from lightning_elastic.launcher.service.http_connection import ConnectionLimits, HttpConnection, HttpRequest, HttpResponse
from lightning_elastic.launcher.service.long_poll import LongPoll, LoopWaker
from lightning_elastic.launcher.service.registry import Registry, UnknownWorker
from lightning_elastic.launcher.service.replay_guard import ReplayGuard
from lightning_elastic.launcher.service.store_service import KeyValueStore
from lightning_elastic import protocol as p

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024  # every protocol message is tiny; refuse anything larger
# Accept request timestamps this far either side of the driver's wall clock. Cluster hosts
# keep their clocks NTP-synced, so honest skew is far smaller; the window also bounds how
# long a nonce must be remembered to refuse a replay, hence the size of that cache.
TIMESTAMP_WINDOW = 300.0


# Connections a worker keeps to the service: its main thread's, its heartbeat's, its store's.
CONNECTIONS_PER_WORKER = 3
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def listen_queue_for(workers: int) -> int:
    """A listen queue that holds every connection a fleet of ``workers`` opens at once.

    A connection the queue has no room for is dropped by the kernel and retried by the
    client a second later, then three, then seven: a fleet starting together would form
    its first round seconds late. The kernel caps the queue at ``net.core.somaxconn``.
    """
    wanted = max(1024, CONNECTIONS_PER_WORKER * workers + 64)
    try:
        cap = int(SOMAXCONN.read_text())
    except (OSError, ValueError):
        return wanted
    if cap < wanted:
        log.warning(
            "The kernel caps the driver's listen queue at %d (net.core.somaxconn); %d workers may open %d "
            "connections at once: raise it (sysctl -w net.core.somaxconn=%d) if arrivals are dropped.",
            cap, workers, CONNECTIONS_PER_WORKER * workers, wanted,
        )
    return min(cap, wanted)


def limits_for(workers: int) -> ConnectionLimits:
    """Room for every connection a fleet of ``workers`` opens at once before its first
    request is answered (3 each: a fleet starting together), and no more: past it the
    oldest unauthenticated connection is closed."""
    return ConnectionLimits(max_unauthenticated=max(512, CONNECTIONS_PER_WORKER * workers + 64))


_VERSION = str(p.PROTOCOL_VERSION)

# A path's message class and its handler, which gives the reply, or a LongPoll when the
# answer may have to wait for the driver.
Route = tuple[type, Callable[[Any], Any]]


class RendezvousServer:
    """The service on one event loop, in one thread, whatever the number of workers.

    Each request is framed (``http_connection``), authenticated and decoded here, then
    handed to the registry (or the store): an immediate answer is written at once, a long
    poll waits as an ``asyncio`` future, never as a thread.
    """

    def __init__(
        self, registry: Registry, secret: str, host: str = "127.0.0.1", *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        store: KeyValueStore | None = None,
        listen_queue: int = 1024,
        limits: ConnectionLimits | None = None,
        port: int = 0,
        not_before: float | None = None,
        agents: AgentBoard | None = None,
    ) -> None:
        self._registry = registry
        # A driver that adopted a job (--state-dir) refuses requests signed before it started:
        # its nonce cache is new, and those could only be replays of requests to its predecessor.
        self._not_before = not_before
        self._store = store if store is not None else KeyValueStore()
        self._secret = secret
        self._host = host
        self._port = port  # 0: any free port
        self._listen_queue = listen_queue  # see listen_queue_for
        self._wall_clock = wall_clock  # wall time: it is compared with other hosts' clocks
        self._clock = clock  # how long a nonce is remembered: immune to clock steps
        self._replays = ReplayGuard(forget_after=2 * TIMESTAMP_WINDOW)
        self._address: tuple[str, int] | None = None
        self._sock: socket.socket | None = None  # listening (``listen``), served once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waker: LoopWaker | None = None
        self._connections: set[HttpConnection] = set()
        self._limits = limits if limits is not None else ConnectionLimits()
        self._rejections = RejectionLog(clock)
        self._thread: threading.Thread | None = None
        self._routes: dict[str, Route] = {
            p.PATH_RENDEZVOUS: (p.RendezvousRequest, self._registry.rendezvous_poll),
            p.PATH_HEARTBEAT: (p.HeartbeatRequest, self._registry.heartbeat_poll),
            p.PATH_ROUND_LOST: (p.RoundLostRequest, self._registry.round_lost_poll),
            p.PATH_REPORT: (p.Report, self._report),
            p.PATH_LEAVE: (p.LeaveRequest, self._registry.leave),
            p.PATH_STORE: (p.StoreRequest, self._store.poll),
        }
        if agents is not None:  # launch --agents: the same signed channel, four more paths
            self._routes.update({
                p.PATH_AGENT_JOIN: (p.AgentJoin, agents.join),
                p.PATH_AGENT_POLL: (p.AgentPoll, agents.poll),
                p.PATH_AGENT_REPORT: (p.AgentReport, agents.report),
                p.PATH_AGENT_LEAVE: (p.AgentLeave, agents.leave),
            })
        self.rejected = 0  # requests refused for auth or form; shown in the job summary
        self.late_requests = 0  # from workers already finished (answered 409, not rejections)

    @property
    def unauthenticated_connections(self) -> int:
        return len(self._limits)

    @property
    def port(self) -> int:
        assert self._address is not None, "start() first"
        return self._address[1]

    @property
    def url(self) -> str:
        assert self._address is not None, "start() first"
        return f"http://{self._address[0]}:{self._address[1]}"

    def listen(self) -> None:
        """Bind and listen, not serve yet: connections made meanwhile wait in the kernel's
        queue (an adopting driver listens before it restores the job, so that a worker's
        request then is answered a moment later rather than refused and retried)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(self._listen_queue)
        except OSError:
            sock.close()
            raise
        self._address = sock.getsockname()[:2]
        self._sock = sock

    def start(self) -> None:
        if self._sock is None:
            self.listen()
        sock = self._sock
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._waker = LoopWaker(loop)
        loop.set_exception_handler(self._loop_error)
        listening = loop.run_until_complete(loop.create_server(
            lambda: HttpConnection(self._dispatch, self._refuse, MAX_BODY, self._connections, self._limits),
            sock=sock, backlog=self._listen_queue,  # asyncio listens again: with this queue, not its 100
        ))
        self._thread = threading.Thread(target=self._serve, args=(loop, listening), name="rendezvous", daemon=True)
        self._thread.start()

    def _serve(self, loop: asyncio.AbstractEventLoop, listening: asyncio.AbstractServer) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            listening.close()
            for connection in list(self._connections):
                connection.close()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(listening.wait_closed())
            loop.close()

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            if self._sock is not None:  # listened, never served
                self._sock.close()
            return
        if not self._loop.is_closed():
            # Also right after start(): a stop queued before run_forever begins ends it at once.
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._rejections.flush()

    # ----- one request -------------------------------------------------------------------

    def _dispatch(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        version = request.headers.get(p.HEADER_PROTOCOL.lower())
        auth = p.parse_request_auth(_SignedHeaders(request.headers))
        if version != _VERSION and (version is not None or auth is not None):
            # Before the signature: another version may sign differently ("bad signature"
            # would mislead). A request with neither header is no worker's: 401 below.
            return self._reject(request, HTTPStatus.BAD_REQUEST, p.version_mismatch(version))
        if auth is None:
            return self._reject(request, HTTPStatus.UNAUTHORIZED, "missing or malformed signature headers")
        if not p.verify_request(self._secret, request.method, request.path, auth, request.body):
            return self._reject(request, HTTPStatus.UNAUTHORIZED, "bad signature (wrong job secret?)")
        # From here the request is the secret holder's: replies are signed for its nonce
        # (signing for an unverified, hence anyone's, nonce would hand out valid answers
        # to requests the secret's holder never made).
        stale = self._admit(auth)
        if stale is not None:
            return self._reject(request, HTTPStatus.UNAUTHORIZED, stale, auth.nonce)
        route = self._routes.get(request.path)
        if route is None:
            return self._reject(request, HTTPStatus.NOT_FOUND, f"no such path {request.path}", auth.nonce)
        cls, call = route
        try:
            reply = call(p.decode(cls, request.body))
        except p.ProtocolError as err:
            return self._reject(request, HTTPStatus.BAD_REQUEST, str(err), auth.nonce)
        except UnknownWorker as err:
            if err.ended:
                # A request the worker sent just before it exited (its last heartbeat, say),
                # answered after the driver reaped it: routine at every worker's end, so
                # neither a warning nor a rejection in a successful job's summary.
                log.debug("Rendezvous service: %s from %s after it finished: %s", request.path, request.peer, err)
                self.late_requests += 1
                return self._response(HTTPStatus.CONFLICT, p.ErrorReply(str(err)), auth.nonce)
            return self._reject(request, HTTPStatus.CONFLICT, str(err), auth.nonce)
        if isinstance(reply, LongPoll):
            known = reply.answer_now()
            if known is None:
                return self._await(reply, auth.nonce)
            reply = known
        return self._response(HTTPStatus.OK, reply, auth.nonce)

    async def _await(self, poll: LongPoll[Any], nonce: str) -> HttpResponse:
        assert self._waker is not None
        return self._response(HTTPStatus.OK, await poll.wait_async(self._waker), nonce)

    def _refuse(self, status: HTTPStatus, why: str, headers: dict[str, str]) -> HttpResponse:
        """A request refused before its body was read (framing): never signed."""
        self._count_rejection(status, why, "")
        return self._response(status, p.ErrorReply(why), None)

    def _reject(self, request: HttpRequest, status: HTTPStatus, why: str, nonce: str | None = None) -> HttpResponse:
        self._count_rejection(status, why, f"{request.path} from {request.peer}")
        return self._response(status, p.ErrorReply(why), nonce)

    def _count_rejection(self, status: HTTPStatus, why: str, what: str) -> None:
        self.rejected += 1
        self._rejections.note(f"{what or 'a request'}: {status.value} {why}")

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's own errors (an accept that failed for want of descriptors, retried a
        second later): one line per interval, never a traceback per attempt."""
        error = context.get("exception")
        self._rejections.note(f"{context.get('message', 'event loop error')}"
                              f"{f': {type(error).__name__}: {error}' if error else ''}", kind="service error")

    def _response(self, status: HTTPStatus, message: Any, nonce: str | None) -> HttpResponse:
        body = p.to_json(message)
        headers: tuple[tuple[str, str], ...] = ((p.HEADER_PROTOCOL, _VERSION),)
        if nonce is not None:
            headers += ((p.HEADER_SIGNATURE, p.sign_reply(self._secret, status, nonce, body)),)
        return HttpResponse(status, body, headers, authenticated=nonce is not None)

    def _admit(self, auth: p.RequestAuth) -> str | None:
        """Why a correctly signed request is refused (stale or replayed), or None to admit it.

        A request's timestamp must lie within TIMESTAMP_WINDOW of the driver's wall clock
        now, in either direction, so a step of that clock (an NTP correction, forward or
        back) locks nobody out once it is corrected. A nonce is remembered for twice the
        window of *monotonic* time (per sender: ``ReplayGuard``): a replay is refused by its
        nonce while its timestamp could still pass, and by its timestamp afterwards, unless
        the wall clock itself stepped back by more than the window in between. Only verified
        nonces are remembered, so forged requests cannot fill the table.
        """
        now = self._wall_clock()
        # Only the service's loop thread admits requests: no lock.
        if not abs(auth.timestamp - now) <= TIMESTAMP_WINDOW:
            return f"timestamp outside {TIMESTAMP_WINDOW:g} s of the driver's clock (clock skew?)"
        if self._not_before is not None and auth.timestamp < self._not_before:
            return "signed before this driver started (a replay of a request to the previous driver?)"
        return self._replays.check(auth.nonce, self._clock())

    def _report(self, report: p.Report) -> p.Ack:
        self._registry.report(report)
        return p.Ack()


class RejectionLog:
    """Rejected requests said at a bounded rate: the first one at once, then one line per
    ``interval`` with how many followed and the latest. A flood of unsigned requests must
    not become a flood of log lines (nor block the loop on a slow stderr)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, interval: float = 10.0) -> None:
        self._clock = clock
        self._interval = interval
        self._said_at = float("-inf")
        self._since: dict[str, int] = {}  # kind -> count not yet said
        self._latest: dict[str, str] = {}

    def note(self, what: str, kind: str = "rejected") -> None:
        now = self._clock()
        if now - self._said_at >= self._interval:
            self._said_at = now
            held = self._since.pop(kind, 0)
            more = f" ({held} more since the last line, the latest: {self._latest.pop(kind)})" if held else ""
            log.warning("Rendezvous service %s %s%s", kind, what, more)
        else:
            self._since[kind] = self._since.get(kind, 0) + 1
            self._latest[kind] = what

    def flush(self) -> None:
        """Say what is held (at shutdown)."""
        for kind in list(self._since):
            log.warning("Rendezvous service %s %d more request(s) in the last %.0f s; the latest: %s",
                        kind, self._since.pop(kind), self._interval, self._latest.pop(kind))


class _SignedHeaders(Mapping[str, str]):
    """A request's headers (lower-cased names) looked up by the protocol's header names."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers

    def __getitem__(self, name: str) -> str:
        return self._headers[name.lower()]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._headers)

    def __len__(self) -> int:
        return len(self._headers)
