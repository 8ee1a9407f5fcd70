"""HTTP/1.1 framing for the rendezvous service: one ``asyncio.Protocol`` per connection.

Requests are parsed by ``httptools`` (Python bindings of llhttp, the parser of Node.js):
a C parser that is fuzzed and maintained by others, in front of an authenticated service
whose every request must be framed before it can be checked. Per connection, requests
are answered in order, one at a time (a long poll holds the next until it is answered);
nothing here knows the protocol's paths or messages.

A request whose body cannot be framed safely (chunked, a Content-Length that is not a
number in 0..max_body) is answered at once and its connection closed, the body unread:
on a keep-alive connection an unread body would be parsed as the next request.
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


# A handler answers at once (most requests) or later (a long poll): no task is created
# for the common case.
Handler = Callable[[HttpRequest], Union[HttpResponse, Awaitable[HttpResponse]]]
# Answer to a request refused before its body is read: (status, why, was it signed).
Refusal = Callable[[HTTPStatus, str, dict[str, str]], HttpResponse]


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a refused request."""


class HttpConnection(asyncio.Protocol):
    def __init__(self, handler: Handler, refuse: Refusal, max_body: int,
                 connections: set[HttpConnection]) -> None:
        self._handler = handler
        self._refuse = refuse
        self._max_body = max_body
        self._connections = connections  # the server's, to close them all at shutdown
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._peer = ""
        self._queue: collections.deque[HttpRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None  # answering the queue's requests
        self._closing = False
        # The request being parsed.
        self._method = ""
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0

    # ----- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if peer else ""
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._connections.discard(self)
        if self._task is not None:
            self._task.cancel()  # a pending long poll of a worker that went away

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse_and_close(HTTPStatus.BAD_REQUEST, "protocol upgrades are not supported")
        except httptools.HttpParserError as err:
            # Also how a refusal of ours stops the parser: then the reply is already sent.
            self._refuse_and_close(HTTPStatus.BAD_REQUEST, f"malformed HTTP request: {err}")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ----- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
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
        self._queue.append(HttpRequest(
            self._method, self._url.decode("latin-1"), self._headers, b"".join(self._body), self._peer,
        ))
        if self._task is None:
            self._answer_queue()

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
        """Answer queued requests in order; a long poll continues in a task."""
        while self._queue and not self._closing:
            request = self._queue.popleft()
            try:
                result = self._handler(request)
            except Exception:  # a bug of ours: said, and this connection closed, not the service
                log.exception("The rendezvous service failed on %s from %s.", request.path, request.peer)
                return self._refuse_and_close(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")
            if isinstance(result, HttpResponse):
                self._send(result)
                continue
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
