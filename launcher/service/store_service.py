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

Two things keep it right and bounded over a job of weeks:

- A write is applied once however often it is sent. A worker whose reply was lost (a reset
  connection, a read timeout while the driver was busy) sends the same operation again
  with the same ``request_id``; the store answers the remembered reply instead of adding
  or appending a second time. A worker's store sends one request at a time
  (``DriverStore``), so only its latest write can be retried: one remembered reply per
  worker, for at most ``MAX_REMEMBERED`` workers.
- A round's keys (``STORE_ROUND_PREFIX``) are deleted once a round two later writes its
  first key: by then every member of the old round has formed a later group or left.
"""

from __future__ import annotations

import base64
import collections
import re
import threading
import time
from collections.abc import Callable

from lightning_elastic.launcher.service.long_poll import LongPoll, Signal
from lightning_elastic.protocol import STORE_ROUND_PREFIX, ProtocolError, StoreOp, StoreReply, StoreRequest

MAX_WAIT = 5.0  # longest a GET is held before "not found yet" (the client asks again)
MAX_KEYS = 4096  # keys of one MULTI_GET (NCCL's scalable bootstrap reads one per 128 ranks)
MAX_REMEMBERED = 16384  # workers whose last write's reply is kept for a retry (least recent dropped)
KEPT_ROUNDS = 2  # the newest round's keys and the one before (a member may still be leaving it)

_ROUND_KEY = re.compile(re.escape(STORE_ROUND_PREFIX) + r"(\d{1,18})/")


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
        # worker id -> (request id, reply) of its latest write, least recently written first
        self._answered: collections.OrderedDict[str, tuple[str, StoreReply]] = collections.OrderedDict()
        self._round_keys: dict[int, set[str]] = {}  # round -> its keys written so far
        self._newest_round = -1

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
            if request.request_id and op not in _READS:
                answered = self._answered.get(request.worker_id)
                if answered is not None and answered[0] == request.request_id:
                    return answered[1]  # a retry of a write already applied
            reply = self._apply(request)
            if request.request_id and op not in _READS:
                self._remember(request.worker_id, request.request_id, reply)
            if op in _WRITES:
                self._index_round_key(request.key)
                signal = self._written.pop(request.key, None)
                if signal is not None:
                    signal.fire()
            return reply

    def _remember(self, worker_id: str, request_id: str, reply: StoreReply) -> None:
        self._answered[worker_id] = (request_id, reply)
        self._answered.move_to_end(worker_id)
        while len(self._answered) > MAX_REMEMBERED:
            self._answered.popitem(last=False)

    def _index_round_key(self, key: str) -> None:
        """Note ``key`` under its round, and forget rounds older than the newest ``KEPT_ROUNDS``."""
        match = _ROUND_KEY.match(key)
        if match is None:
            return
        number = int(match.group(1))
        self._round_keys.setdefault(number, set()).add(key)
        if number <= self._newest_round:
            return
        self._newest_round = number
        for old in [r for r in self._round_keys if r <= number - KEPT_ROUNDS]:
            for stale in self._round_keys.pop(old):
                self._data.pop(stale, None)

    @property
    def size(self) -> int:
        """Keys held (for tests and the summary)."""
        with self._lock:
            return len(self._data)

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
            for keys in self._round_keys.values():
                keys.discard(request.key)
            return StoreReply(self._data.pop(request.key, None) is not None)
        if op == StoreOp.NUM_KEYS:
            return StoreReply(True, count=len(self._data))
        raise ProtocolError(f"StoreRequest.op: unsupported {op!r}")  # pragma: no cover - enum is closed


_READS = frozenset({StoreOp.GET, StoreOp.MULTI_GET, StoreOp.CHECK, StoreOp.NUM_KEYS})
# Operations after which a waiting GET of the key may be answered.
_WRITES = frozenset({StoreOp.SET, StoreOp.APPEND, StoreOp.ADD, StoreOp.COMPARE_SET})
