"""HTTP/1.1 framing for the rendezvous service: one ``asyncio.Protocol`` per connection.

Requests are parsed by ``httptools`` (Python bindings of llhttp, the parser of Node.js):
a C parser that is fuzzed and maintained by others, in front of an authenticated service
whose every request must be framed before it can be checked. Per connection, requests
are answered in order, one at a time (a long poll holds the next until it is answered);
nothing here knows the protocol's paths or messages.

A request whose body cannot be framed safely (chunked, a Content-Length that is not a
number in 0..max_body) is answered at once and its connection closed, the body unread:
on a keep-alive connection an unread body would be parsed as the next request.

Bytes from the network are hostile until a request's signature checks, so one connection
costs the service a bounded share whatever it sends: a request head (line and headers)
of at most MAX_HEAD bytes and MAX_HEADERS headers; at most MAX_PIPELINED requests queued
(workers never pipeline); at most ANSWERS_PER_TURN answered before the loop serves the
other connections; no more reading or answering while its replies are not read
(back-pressure from the transport's write buffer). A connection that has sent no
authenticated request is closed after ``idle_timeout``, and the service keeps at most
``max_unauthenticated`` of them (the oldest goes first: a worker's new connection
authenticates within milliseconds).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Union

import httptools

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str  # as sent, query string included
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    body: bytes
    peer: str  # the client's address


@dataclasses.dataclass(frozen=True)
class HttpResponse:
    status: HTTPStatus
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    close: bool = False  # close the connection once this is sent
    authenticated: bool = False  # the answer to a request whose signature checked


MAX_HEAD = 16 * 1024  # request line and headers of one request, in bytes
MAX_HEADERS = 32
MAX_PIPELINED = 8  # requests queued on one connection; a worker sends one at a time
ANSWERS_PER_TURN = 4  # then the other connections are served first


class ConnectionLimits:
    """The service's connections that have not authenticated yet, oldest first, at most
    ``max_unauthenticated``; each is closed ``idle_timeout`` seconds after it opened unless
    a request of it was authenticated by then."""

    def __init__(self, max_unauthenticated: int = 512, idle_timeout: float = 10.0) -> None:
        self.max_unauthenticated = max_unauthenticated
        self.idle_timeout = idle_timeout
        self._unauthenticated: dict[HttpConnection, None] = {}  # insertion-ordered set

    def opened(self, connection: HttpConnection) -> None:
        self._unauthenticated[connection] = None
        while len(self._unauthenticated) > self.max_unauthenticated:
            oldest = next(iter(self._unauthenticated))
            self.forget(oldest)
            oldest.close()

    def forget(self, connection: HttpConnection) -> None:
        self._unauthenticated.pop(connection, None)

    def __len__(self) -> int:
        return len(self._unauthenticated)


# A handler answers at once (most requests) or later (a long poll): no task is created
# for the common case.
Handler = Callable[[HttpRequest], Union[HttpResponse, Awaitable[HttpResponse]]]
# Answer to a request refused before its body is read: (status, why, was it signed).
Refusal = Callable[[HTTPStatus, str, dict[str, str]], HttpResponse]


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a refused request."""


class HttpConnection(asyncio.Protocol):
    def __init__(self, handler: Handler, refuse: Refusal, max_body: int,
                 connections: set[HttpConnection], limits: ConnectionLimits | None = None) -> None:
        self._handler = handler
        self._refuse = refuse
        self._max_body = max_body
        self._connections = connections  # the server's, to close them all at shutdown
        self._limits = limits if limits is not None else ConnectionLimits()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._peer = ""
        self._queue: collections.deque[HttpRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None  # answering the queue's requests
        self._closing = False
        self._authenticated = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self._writing_paused = False  # the peer does not read its replies: wait for it
        self._turn_scheduled = False  # the rest of the queue is answered on a later loop turn
        # The request being parsed.
        self._method = ""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._header_bytes = 0  # of the headers parsed so far
        self._in_head = True  # between a message's start and its headers' end
        self._head_data = 0  # bytes received while in the head (a read may hold a body too)
        self._body: list[bytes] = []
        self._body_size = 0

    # ----- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if peer else ""
        self._connections.add(self)
        self._limits.opened(self)
        if not self._closing:
            self._idle_timer = asyncio.get_running_loop().call_later(self._limits.idle_timeout, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._connections.discard(self)
        self._limits.forget(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None:
            self._task.cancel()  # a pending long poll of a worker that went away

    def pause_writing(self) -> None:
        # Replies pile up unread: stop reading and answering until they drain.
        self._writing_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()
            self._answer_queue()

    def _idle_expired(self) -> None:
        if not self._authenticated:
            self.close()

    def _authenticate(self) -> None:
        if not self._authenticated:
            self._authenticated = True
            self._limits.forget(self)
            if self._idle_timer is not None:
                self._idle_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._in_head:
            # httptools holds a header being received in its own buffer: bound what it may hold.
            self._head_data += len(data)
            if self._head_data > MAX_HEAD + self._max_body:
                return self._refuse_and_close(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                              f"request head over {MAX_HEAD} bytes")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return self._refuse_and_close(HTTPStatus.BAD_REQUEST, "protocol upgrades are not supported")
        except httptools.HttpParserError as err:
            # Also how a refusal of ours stops the parser: then the reply is already sent.
            return self._refuse_and_close(HTTPStatus.BAD_REQUEST, f"malformed HTTP request: {err}")
        if not self._turn_scheduled:
            self._answer_queue()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ----- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._header_count, self._header_bytes, self._in_head, self._head_data = 0, 0, True, 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEAD:
            self._fail(HTTPStatus.REQUEST_URI_TOO_LONG, f"request line over {MAX_HEAD} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value)
        if self._header_count > MAX_HEADERS or self._header_bytes > MAX_HEAD:
            self._fail(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                       f"request headers over {MAX_HEADERS} or {MAX_HEAD} bytes")
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._method = self._parser.get_method().decode("latin-1")
        if self._method != "POST":
            return self._fail(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self._method}")
        if self._body_length() is None:
            self._fail(HTTPStatus.BAD_REQUEST, f"Content-Length must be 0..{self._max_body}")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._max_body:  # pragma: no cover - Content-Length was checked
            return self._fail(HTTPStatus.BAD_REQUEST, f"Content-Length must be 0..{self._max_body}")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._closing:
            return
        if len(self._queue) >= MAX_PIPELINED:
            self._fail(HTTPStatus.TOO_MANY_REQUESTS, f"more than {MAX_PIPELINED} pipelined requests")
        self._queue.append(HttpRequest(
            self._method, self._url.decode("latin-1"), self._headers, b"".join(self._body), self._peer,
        ))  # answered once this read is parsed (data_received), a few per loop turn

    # ----- answering ----------------------------------------------------------------------------

    def _body_length(self) -> int | None:
        if "transfer-encoding" in self._headers:
            return None  # a chunked body has no Content-Length: its end is unknown here
        text = self._headers.get("content-length", "0")
        if not text.isdigit():
            return None
        length = int(text)
        return length if length <= self._max_body else None

    def _fail(self, status: HTTPStatus, why: str) -> None:
        """From a parser callback: refuse the request being parsed, and stop the parser."""
        self._refuse_and_close(status, why)
        raise _Refused(why)

    def _refuse_and_close(self, status: HTTPStatus, why: str) -> None:
        """Answer the request being parsed now and close the connection, its body unread."""
        if self._closing:
            return
        response = self._refuse(status, why, self._headers)
        self._send(dataclasses.replace(response, close=True))

    def _answer_queue(self) -> None:
        """Answer queued requests in order, a few per loop turn; a long poll continues in a task."""
        self._turn_scheduled = False
        answered = 0
        while self._queue and not self._closing and not self._writing_paused and self._task is None:
            if answered == ANSWERS_PER_TURN:
                # Fair to the other connections: the rest after the loop has served them.
                self._turn_scheduled = True
                asyncio.get_running_loop().call_soon(self._answer_queue)
                return
            request = self._queue.popleft()
            answered += 1
            try:
                result = self._handler(request)
            except Exception:  # a bug of ours: said, and this connection closed, not the service
                log.exception("The rendezvous service failed on %s from %s.", request.path, request.peer)
                return self._refuse_and_close(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
            if isinstance(result, HttpResponse):
                self._send(result)
                continue
            self._authenticate()  # only a verified request waits
            self._task = asyncio.ensure_future(self._finish(result))
            return

    async def _finish(self, pending: Awaitable[HttpResponse]) -> None:
        try:
            response = await pending
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("The rendezvous service failed while a request waited.")
            self._task = None
            return self._refuse_and_close(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
        self._task = None
        if not self._closing:
            self._send(response)
            self._answer_queue()

    def _send(self, response: HttpResponse) -> None:
        assert self._transport is not None
        if response.authenticated:
            self._authenticate()
        lines = [f"HTTP/1.1 {response.status.value} {response.status.phrase}",
                 "Content-Type: application/json",
                 f"Content-Length: {len(response.body)}"]
        lines += [f"{name}: {value}" for name, value in response.headers]
        if response.close:
            lines.append("Connection: close")
        # Headers and body in one write: no Nagle / delayed-ACK stall between them.
        self._transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body)
        if response.close:
            self._closing = True
            self._transport.close()
