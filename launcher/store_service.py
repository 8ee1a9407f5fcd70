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

from lightning_elastic.launcher.long_poll import LongPoll, Signal
from lightning_elastic.protocol import ProtocolError, StoreOp, StoreReply, StoreRequest

MAX_WAIT = 5.0  # longest a GET is held before "not found yet" (the client asks again)
MAX_KEYS = 4096  # keys of one MULTI_GET (NCCL's scalable bootstrap reads one per 128 ranks)


def _decode(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ProtocolError(f"StoreRequest.{field}: expected base64") from None


def _encode(value: bytes) -> str:
    return base64.b64encode(value).decode()


class KeyValueStore:
    """One job's keys; thread-safe, one lock. Its own lock, not the registry's: bootstrap
    traffic must not contend with the driver loop. A GET of a missing key is a long poll
    woken only when that key is written."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._written: dict[str, Signal] = {}  # key -> GETs waiting for it

    def handle(self, request: StoreRequest) -> StoreReply:
        """Answer ``request``, blocking this thread while a GET waits."""
        reply = self.poll(request)
        return reply.wait() if isinstance(reply, LongPoll) else reply

    def poll(self, request: StoreRequest) -> StoreReply | LongPoll[StoreReply]:
        """The answer, or for a GET of missing keys, a poll that waits for them."""
        op = request.op
        with self._lock:
            if op in (StoreOp.GET, StoreOp.MULTI_GET):
                keys = (request.key,) if op == StoreOp.GET else request.keys
                if len(keys) > MAX_KEYS:
                    raise ProtocolError(f"StoreRequest.keys: at most {MAX_KEYS} keys, got {len(keys)}")
                read = self._get if op == StoreOp.GET else self._multi_get
                reply = read(keys, request.wait_seconds <= 0)
                if reply is not None:
                    return reply
                return LongPoll(
                    self._lock, lambda final: read(keys, final), lambda: self._signal_of_missing(keys),
                    self._clock() + min(request.wait_seconds, MAX_WAIT), self._clock,
                    finish=lambda: self._forget_idle(keys),
                )
            reply = self._apply(request)
            if op in _WRITES:
                signal = self._written.pop(request.key, None)
                if signal is not None:
                    signal.fire()
            return reply

    def _get(self, keys: tuple[str, ...], final: bool) -> StoreReply | None:
        (key,) = keys
        if key in self._data:
            return StoreReply(True, _encode(self._data[key]))
        return StoreReply(False) if final else None

    def _multi_get(self, keys: tuple[str, ...], final: bool) -> StoreReply | None:
        if all(key in self._data for key in keys):
            return StoreReply(True, values=tuple(_encode(self._data[key]) for key in keys))
        return StoreReply(False) if final else None

    def _signal_of_missing(self, keys: tuple[str, ...]) -> Signal:
        """The signal of the first key still missing: a waiter is woken once per key written."""
        missing = next(key for key in keys if key not in self._data)
        return self._written.setdefault(missing, Signal())

    def _forget_idle(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            signal = self._written.get(key)
            if signal is not None and not signal.waiting:
                del self._written[key]

    def _apply(self, request: StoreRequest) -> StoreReply:
        op = request.op
        if op == StoreOp.SET:
            self._data[request.key] = _decode(request.value, "value")
            return StoreReply(True)
        if op == StoreOp.APPEND:
            self._data[request.key] = self._data.get(request.key, b"") + _decode(request.value, "value")
            return StoreReply(True)
        if op == StoreOp.ADD:
            try:
                amount = int(request.amount)
                total = int(self._data.get(request.key, b"0")) + amount
            except ValueError:
                raise ProtocolError(f"StoreRequest.amount: expected an integer, got {request.amount!r}") from None
            self._data[request.key] = str(total).encode()
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
            return StoreReply(request.key in self._data, _encode(self._data.get(request.key, expected)))
        if op == StoreOp.DELETE:
            return StoreReply(self._data.pop(request.key, None) is not None)
        if op == StoreOp.NUM_KEYS:
            return StoreReply(True, count=len(self._data))
        raise ProtocolError(f"StoreRequest.op: unsupported {op!r}")  # pragma: no cover - enum is closed


# Operations after which a waiting GET of the key may be answered.
_WRITES = frozenset({StoreOp.SET, StoreOp.APPEND, StoreOp.ADD, StoreOp.COMPARE_SET})
