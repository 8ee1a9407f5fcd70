"""The rendezvous service: an authenticated JSON-over-HTTP front for the registry.

Every request must carry the job's secret; anything else is answered 401, and a body that
does not match the protocol 400, before it can reach the registry. Nothing is unpickled.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from launcher.registry import Registry, UnknownWorker
from lightning_elastic import protocol as p

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024  # every protocol message is tiny; refuse anything larger


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker that exits (or is killed) mid-request resets its connection: routine here.
        log.debug("Rendezvous connection from %s ended abruptly.", client_address[0], exc_info=True)


class RendezvousServer:
    def __init__(self, registry: Registry, secret: str, host: str = "127.0.0.1") -> None:
        self._registry = registry
        self._secret = secret
        self._host = host
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.rejected = 0  # requests refused for auth or form; shown in the job summary

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
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                route = routes.get(self.path)
                if route is None:
                    return self._refuse(HTTPStatus.NOT_FOUND, p.ErrorReply(f"no such path {self.path}"))
                if not server._authorized(self.headers.get(p.AUTH_HEADER, "")):
                    return self._refuse(HTTPStatus.UNAUTHORIZED, p.ErrorReply("missing or wrong job secret"))
                length = self._body_length()
                if length is None:
                    return self._refuse(
                        HTTPStatus.BAD_REQUEST, p.ErrorReply(f"Content-Length must be 0..{MAX_BODY}")
                    )
                cls, call = route
                try:
                    message = p.decode(cls, self.rfile.read(length))
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
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("rendezvous: " + format, *args)

        self._server = _QuietServer((self._host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="rendezvous", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme == p.AUTH_SCHEME and hmac.compare_digest(token.encode(), self._secret.encode())

    def _report(self, report: p.Report) -> p.Ack:
        self._registry.report(report)
        return p.Ack()
