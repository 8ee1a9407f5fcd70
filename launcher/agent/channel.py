"""The agent's signed requests to the driver (standard library only: ``http.client``).

Each request is signed with the job secret and carries a fresh nonce of this agent's
sequence (``protocol.sign_request``): the driver refuses a wrong signature, and a replay
by its nonce. Each reply must be signed by the driver for that very nonce
(``protocol.verify_reply``), or the agent trusts nothing in it: so both sides prove they
hold the secret before an order is ever carried out, and a recorded reply cannot be played
back to the agent (its nonce is never asked again).
"""

from __future__ import annotations

import http.client
import socket
from typing import Any, TypeVar

from lightning_elastic import protocol as p
from lightning_elastic.launcher.secret_source import ENV_SECRET

T = TypeVar("T")
CONNECT_TIMEOUT = 5.0
MAX_REPLY = 4 * 1024 * 1024  # the driver's replies are small; orders with their env a few KiB


class Unreachable(Exception):
    """The driver could not be reached (refused, unreachable, timed out, connection lost)."""


class NotTheDriver(Exception):
    """The reply failed authentication: a wrong secret on either side, or not our driver.
    The message never quotes the reply (a spoofer must not choose what the agent says)."""


class Refused(Exception):
    """The driver answered, signed, with an error status (its message, which it signed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class DriverChannel:
    """One persistent HTTP connection to the driver; not thread-safe (one per thread)."""

    def __init__(self, host: str, port: int, secret: str, nonces: p.NonceSequence, slack: float = 30.0) -> None:
        self._host, self._port = host, port
        # How long past its own wait a request may take (and a connection to open): a cut-off
        # driver must show as one within the heartbeat timeout, not at TCP's own timeouts.
        self._slack = slack
        self._secret = secret
        self._nonces = nonces  # shared by the agent's channels: one sender, one sequence
        self._connection: http.client.HTTPConnection | None = None

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def post(self, path: str, message: Any, reply_type: type[T], wait: float = 0.0) -> T:
        body = p.to_json(message)
        headers = {"Content-Type": "application/json", **p.sign_request(self._secret, "POST", path, body, self._nonces)}
        try:
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self._host, self._port,
                                                              timeout=min(CONNECT_TIMEOUT, self._slack))
                self._connection.connect()
            self._connection.sock.settimeout(wait + self._slack)  # type: ignore[union-attr]
            self._connection.request("POST", path, body, headers)
            response = self._connection.getresponse()
            content = response.read(MAX_REPLY + 1)
        except (OSError, http.client.HTTPException) as err:
            self.close()
            raise Unreachable(_describe(err)) from None
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        version = response.getheader(p.HEADER_PROTOCOL)
        if version != str(p.PROTOCOL_VERSION):
            raise NotTheDriver(p.version_mismatch(version, side="driver").replace("worker", "agent"))
        if len(content) > MAX_REPLY or not p.verify_reply(self._secret, response.status, headers[p.HEADER_NONCE],
                                                          content, response.getheader(p.HEADER_SIGNATURE)):
            why = ("the driver did not accept this agent's signature" if response.status == 401
                   else "the reply is not signed with this agent's secret")
            raise NotTheDriver(f"{why}: wrong job secret (--secret-file or {ENV_SECRET}), or not this job's driver")
        if response.status != 200:
            try:
                said = p.decode(p.ErrorReply, content).error
            except p.ProtocolError:
                said = "no reason given"
            raise Refused(response.status, p.clip(said, 300))
        return p.decode(reply_type, content)


def _describe(err: BaseException) -> str:
    if isinstance(err, socket.gaierror):
        return f"its name does not resolve ({err.strerror})"
    if isinstance(err, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err) or type(err).__name__
