"""The process-group store, served by the driver over its signed rendezvous channel.

Workers form each round's torch.distributed group through this store (gloo exchanges its
peers' addresses here, NCCL its unique id). A torch ``TCPStore`` would do the same with no
authentication at all: anyone who reaches its port can list every key and rewrite it, and
so point a round's ranks at an address of their choosing. Here every operation arrives
through the rendezvous service, which refuses any request not signed with the job's
secret.

Semantics follow ``torch.distributed.Store``: keys map to bytes, ``add`` keeps a decimal
counter, ``get`` waits for the key (bounded per request; the worker asks again until its
own timeout).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable

from lightning_elastic.protocol import ProtocolError, StoreOp, StoreReply, StoreRequest

MAX_WAIT = 5.0  # longest a GET is held before "not found yet" (the client asks again)


def _decode(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ProtocolError(f"StoreRequest.{field}: expected base64") from None


def _encode(value: bytes) -> str:
    return base64.b64encode(value).decode()


class KeyValueStore:
    """One job's keys; thread-safe, one lock. Its own lock, not the registry's: bootstrap
    traffic must not contend with the driver loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def handle(self, request: StoreRequest) -> StoreReply:
        op = request.op
        with self._cond:
            if op == StoreOp.SET:
                self._data[request.key] = _decode(request.value, "value")
                self._cond.notify_all()
                return StoreReply(True)
            if op == StoreOp.APPEND:
                self._data[request.key] = self._data.get(request.key, b"") + _decode(request.value, "value")
                self._cond.notify_all()
                return StoreReply(True)
            if op == StoreOp.GET:
                deadline = self._clock() + min(request.wait_seconds, MAX_WAIT)
                while request.key not in self._data:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        return StoreReply(False)
                    self._cond.wait(remaining)
                return StoreReply(True, _encode(self._data[request.key]))
            if op == StoreOp.ADD:
                try:
                    amount = int(request.amount)
                    total = int(self._data.get(request.key, b"0")) + amount
                except ValueError:
                    raise ProtocolError(f"StoreRequest.amount: expected an integer, got {request.amount!r}") from None
                self._data[request.key] = str(total).encode()
                self._cond.notify_all()
                return StoreReply(True, _encode(self._data[request.key]))
            if op == StoreOp.CHECK:
                return StoreReply(request.key in self._data)
            if op == StoreOp.COMPARE_SET:
                # torch's semantics: set when the current value is the expected one (or the
                # key is missing and nothing is expected); always answer the current value.
                expected = _decode(request.expected, "expected")
                current = self._data.get(request.key)
                if current == expected or (current is None and expected == b""):
                    self._data[request.key] = _decode(request.value, "value")
                    self._cond.notify_all()
                return StoreReply(request.key in self._data, _encode(self._data.get(request.key, expected)))
            if op == StoreOp.DELETE:
                return StoreReply(self._data.pop(request.key, None) is not None)
            if op == StoreOp.NUM_KEYS:
                return StoreReply(True, count=len(self._data))
        raise ProtocolError(f"StoreRequest.op: unsupported {op!r}")  # pragma: no cover - enum is closed
