"""The rendezvous service: an authenticated JSON-over-HTTP front for the registry.

Every request must be signed with the job's secret (see ``protocol.sign_request``), recent
and not seen before; anything else is answered 401, and a body that does not match the
protocol 400, before it can reach the registry. Replies to authenticated requests are
signed so workers can trust them. Nothing is unpickled.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.registry import Registry, UnknownWorker
from lightning_elastic.launcher.store_service import KeyValueStore
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


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker that exits (or is killed) mid-request resets its connection: routine here.
        log.debug("Rendezvous connection from %s ended abruptly.", client_address[0], exc_info=True)


class RendezvousServer:
    def __init__(
        self, registry: Registry, secret: str, host: str = "127.0.0.1", *,
        wall_clock: Callable[[], float] = time.time,
        store: KeyValueStore | None = None,
        listen_queue: int = 1024,
    ) -> None:
        self._registry = registry
        self._store = store if store is not None else KeyValueStore()
        self._secret = secret
        self._host = host
        self._listen_queue = listen_queue  # see listen_queue_for
        self._wall_clock = wall_clock  # wall time: it is compared with other hosts' clocks
        self._nonce_lock = threading.Lock()
        self._seen_nonces: set[str] = set()
        self._nonce_expiry: list[tuple[int, str]] = []  # heap of (request timestamp, nonce)
        # Oldest timestamp still accepted; it never moves back, even if the wall clock steps
        # back, so a nonce forgotten below it can never be replayed.
        self._oldest_accepted = float("-inf")
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.rejected = 0  # requests refused for auth or form; shown in the job summary

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        routes: dict[str, tuple[type, Callable[[Any], Any]]] = {
            p.PATH_RENDEZVOUS: (p.RendezvousRequest, self._registry.rendezvous),
            p.PATH_HEARTBEAT: (p.HeartbeatRequest, self._registry.heartbeat),
            p.PATH_ROUND_LOST: (p.RoundLostRequest, self._registry.round_lost),
            p.PATH_REPORT: (p.Report, self._report),
            p.PATH_LEAVE: (p.LeaveRequest, self._registry.leave),
            p.PATH_STORE: (p.StoreRequest, self._store.handle),
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            # Headers and body go out in separate writes: without TCP_NODELAY, Nagle holds
            # the body back until the client's delayed ACK (~40 ms a request).
            disable_nagle_algorithm = True
            protocol_version = "HTTP/1.1"
            # The nonce of the request being answered, once its signature is verified: replies
            # are signed only then (signing for an unverified, hence anyone's, nonce would
            # hand out valid answers to requests the secret's holder never made).
            reply_nonce: str | None = None

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                self.reply_nonce = None  # a keep-alive connection reuses this handler
                auth = p.parse_request_auth(self.headers)
                if auth is None:
                    return self._refuse(
                        HTTPStatus.UNAUTHORIZED, p.ErrorReply("missing or malformed signature headers")
                    )
                length = self._body_length()
                if length is None:
                    return self._refuse(
                        HTTPStatus.BAD_REQUEST, p.ErrorReply(f"Content-Length must be 0..{MAX_BODY}")
                    )
                body = self.rfile.read(length)  # the signature covers the body's hash
                if not p.verify_request(server._secret, self.command, self.path, auth, body):
                    return self._reply(HTTPStatus.UNAUTHORIZED, p.ErrorReply("bad signature (wrong job secret?)"))
                self.reply_nonce = auth.nonce
                stale = server._admit(auth)
                if stale is not None:
                    return self._reply(HTTPStatus.UNAUTHORIZED, p.ErrorReply(stale))
                route = routes.get(self.path)
                if route is None:
                    return self._reply(HTTPStatus.NOT_FOUND, p.ErrorReply(f"no such path {self.path}"))
                cls, call = route
                try:
                    message = p.decode(cls, body)
                    reply = call(message)
                except p.ProtocolError as err:
                    return self._reply(HTTPStatus.BAD_REQUEST, p.ErrorReply(str(err)))
                except UnknownWorker as err:
                    return self._reply(HTTPStatus.CONFLICT, p.ErrorReply(str(err)))
                self._reply(HTTPStatus.OK, reply)

            def _body_length(self) -> int | None:
                """The body's length, or None unless a Content-Length of 0..MAX_BODY gives it."""
                if "Transfer-Encoding" in self.headers:
                    return None  # a chunked body has no Content-Length: its end is unknown here
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    return None
                return length if 0 <= length <= MAX_BODY else None

            def _refuse(self, status: HTTPStatus, message: Any) -> None:
                """Reply to a request before reading its body.

                On a keep-alive connection the unread body would be parsed as the next
                request: discard it when its length is valid, otherwise close the
                connection (a body of unknown or excessive length is never read).
                """
                length = self._body_length()
                if length is None:
                    self.close_connection = True
                else:
                    self.rfile.read(length)
                self._reply(status, message)

            def _reply(self, status: HTTPStatus, message: Any) -> None:
                if status != HTTPStatus.OK:
                    server.rejected += 1
                    log.warning(
                        "Rendezvous service rejected %s from %s: %d %s",
                        self.path, self.client_address[0], status, getattr(message, "error", ""),
                    )
                body = p.to_json(message)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if self.reply_nonce is not None:
                    signature = p.sign_reply(server._secret, status, self.reply_nonce, body)
                    self.send_header(p.HEADER_SIGNATURE, signature)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("rendezvous: " + format, *args)

        self._server = _QuietServer((self._host, 0), Handler, bind_and_activate=False)
        self._server.request_queue_size = self._listen_queue  # read by server_activate's listen()
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError:
            self._server.server_close()
            raise
        self._thread = threading.Thread(target=self._server.serve_forever, name="rendezvous", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _admit(self, auth: p.RequestAuth) -> str | None:
        """Why a correctly signed request is refused (stale or replayed), or None to admit it.

        Only verified nonces are remembered, so forged requests cannot fill the cache.
        """
        now = self._wall_clock()
        with self._nonce_lock:
            self._oldest_accepted = max(self._oldest_accepted, now - TIMESTAMP_WINDOW)
            if not self._oldest_accepted <= auth.timestamp <= now + TIMESTAMP_WINDOW:
                return f"timestamp outside {TIMESTAMP_WINDOW:g} s of the driver's clock (clock skew?)"
            # A nonce older than the window is refused by its timestamp alone: forget it.
            while self._nonce_expiry and self._nonce_expiry[0][0] < self._oldest_accepted:
                self._seen_nonces.discard(heapq.heappop(self._nonce_expiry)[1])
            if auth.nonce in self._seen_nonces:
                return "replayed request (nonce already seen)"
            self._seen_nonces.add(auth.nonce)
            heapq.heappush(self._nonce_expiry, (auth.timestamp, auth.nonce))
            return None

    def _report(self, report: p.Report) -> p.Ack:
        self._registry.report(report)
        return p.Ack()
