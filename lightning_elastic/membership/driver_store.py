"""The process-group store as a ``torch.distributed.Store``, served by the driver.

``init_process_group`` exchanges the round's bootstrap data (gloo peer addresses, the NCCL
unique id) through a store. This one sends every operation over the driver's signed
rendezvous channel (``protocol.StoreRequest``), so the bootstrap cannot be read or poisoned
by anyone without the job's secret — unlike a torch ``TCPStore``, which anyone who reaches
its port may list and rewrite.

It has its own HTTP client: torch may call it while the heartbeat thread uses the worker's.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import secrets
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.membership.client import DriverClient
from lightning_elastic.errors import CollectiveError

POLL = 2.0  # longest the driver holds one GET; the store asks again until its timeout
_READS = frozenset({p.StoreOp.GET, p.StoreOp.MULTI_GET, p.StoreOp.CHECK, p.StoreOp.NUM_KEYS})


def _b64(value: bytes | str) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


class DriverStore(dist.Store):
    def __init__(
        self, client: DriverClient, timeout: datetime.timedelta,
        interrupted: Callable[[], str | None] = lambda: None,
    ) -> None:
        super().__init__()
        self._client = client
        self._timeout = timeout
        # Why waiting is pointless now (the round lost a member), or None: a peer that died
        # during group formation must not keep the others waiting for the store timeout.
        self._interrupted = interrupted
        self._lock = threading.Lock()  # one request at a time on the client's session
        self._recorded: list[bytes] | None = None  # see recording()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[bytes]]:
        """Collect every value written or read meanwhile: what a group formation exchanged
        (gloo's peers' listening addresses, for ``group_sockets.published_by``)."""
        self._recorded = recorded = []
        try:
            yield recorded
        finally:
            self._recorded = None

    def _record(self, values: list[bytes]) -> list[bytes]:
        if self._recorded is not None:
            self._recorded.extend(values)
        return values

    def _call(self, op: p.StoreOp, key: str = "", **fields: object) -> p.StoreReply:
        if op not in _READS:
            # One id for every attempt the client makes of this write: a retry after a lost
            # reply is answered by the driver, not applied again (an ADD counted twice).
            fields["request_id"] = secrets.token_hex(8)
        request = p.StoreRequest(self._client.worker_id, op, key, **fields)  # type: ignore[arg-type]
        with self._lock:
            return self._client.store(request)

    # ----- torch.distributed.Store ----------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._record([value.encode() if isinstance(value, str) else bytes(value)])
        self._call(p.StoreOp.SET, key, value=_b64(value))

    def append(self, key: str, value: bytes | str) -> None:
        self._call(p.StoreOp.APPEND, key, value=_b64(value))

    def get(self, key: str) -> bytes:
        return self._wait_for(p.StoreOp.GET, (key,), self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """All of ``keys`` in one request (NCCL's bootstrap beyond 128 ranks reads one id per
        128 ranks: one request instead of one per key)."""
        return self._wait_for(p.StoreOp.MULTI_GET, tuple(keys), self._timeout) if keys else []

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if keys:
            self._wait_for(p.StoreOp.MULTI_GET, tuple(keys), timeout or self._timeout)

    def _wait_for(self, op: p.StoreOp, keys: tuple[str, ...], timeout: datetime.timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        what = f"store key {keys[0]!r}" if len(keys) == 1 else f"store keys {', '.join(map(repr, keys[:3]))}..."
        while True:
            remaining = deadline - time.monotonic()
            wait = max(0.0, min(POLL, remaining))
            if op == p.StoreOp.GET:
                reply = self._call(op, keys[0], wait_seconds=wait)
            else:
                reply = self._call(op, keys=keys, wait_seconds=wait)
            if reply.found:
                values = (reply.value,) if op == p.StoreOp.GET else reply.values
                return self._record([base64.b64decode(v) for v in values])
            why = self._interrupted()
            if why is not None:
                raise CollectiveError(f"{why} while its process group was forming ({what})")
            if remaining <= 0:
                # A peer of the forming round did not publish in time: the formation failed,
                # as a collective fails, so the round is re-formed (the driver bounds repeats)
                # and the worker lives on (docs/reliability.md).
                raise CollectiveError(f"{what} did not appear within {timeout.total_seconds():g} s")

    def add(self, key: str, amount: int) -> int:
        return int(base64.b64decode(self._call(p.StoreOp.ADD, key, amount=str(int(amount))).value))

    def check(self, keys: list[str]) -> bool:
        return all(self._call(p.StoreOp.CHECK, key).found for key in keys)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        reply = self._call(p.StoreOp.COMPARE_SET, key, expected=_b64(expected), value=_b64(desired))
        return base64.b64decode(reply.value)

    def delete_key(self, key: str) -> bool:
        return self._call(p.StoreOp.DELETE, key).found

    def num_keys(self) -> int:
        return self._call(p.StoreOp.NUM_KEYS).count

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._client.close()
