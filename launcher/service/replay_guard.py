"""Refusing a replayed request in memory proportional to the senders, not to the requests.

Every signed request carries a nonce of two halves (``protocol.sign_request``): a random
64-bit sender id, drawn once per process, and that sender's sequence number. A replay
repeats a nonce, so it is enough to remember, per sender, the highest sequence number seen
and which of the ``WINDOW`` numbers below it were seen (a bitmap): the anti-replay window
of IPsec and DTLS. Requests of one process sent by several threads may arrive slightly out
of order; one that arrives more than ``WINDOW`` sequence numbers late is refused as too old
(a worker has a handful of requests in flight, never a thousand).

A sender silent for ``forget_after`` seconds of monotonic time is forgotten: by then its
requests' timestamps are outside the driver's window, which refuses their replays. Memory
is a few hundred bytes per sender seen in that time (about 1 MB at 4,096 workers), where
remembering every nonce took ~120 MB at that size (4,096 workers over 600 s). Only
requests whose signature checked reach this table, so nobody without the secret fills it.
"""

from __future__ import annotations

import collections
import dataclasses

WINDOW = 1024  # sequence numbers remembered below a sender's highest


@dataclasses.dataclass
class _Sender:
    highest: int
    seen: int  # bit i: sequence number highest - i was seen
    last_heard: float


class ReplayGuard:
    """Which verified nonces were seen before; not thread-safe (the service's loop owns it)."""

    def __init__(self, forget_after: float) -> None:
        self._forget_after = forget_after
        # Least recently heard first: forgetting pops from the front.
        self._senders: collections.OrderedDict[str, _Sender] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._senders)

    def check(self, nonce: str, now: float) -> str | None:
        """Record ``nonce`` (32 hex digits: sender, then sequence); why it is refused, or None."""
        self._forget(now)
        sender_id, sequence = nonce[:16], int(nonce[16:], 16)
        sender = self._senders.get(sender_id)
        if sender is None:
            self._senders[sender_id] = _Sender(sequence, 1, now)
            return None
        self._senders.move_to_end(sender_id)
        sender.last_heard = now
        if sequence > sender.highest:
            shift = sequence - sender.highest
            sender.seen = ((sender.seen << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
            sender.highest = sequence
            return None
        behind = sender.highest - sequence
        if behind >= WINDOW:
            return f"replayed request (sequence number {behind} behind its sender's newest)"
        if sender.seen >> behind & 1:
            return "replayed request (nonce already seen)"
        sender.seen |= 1 << behind
        return None

    def _forget(self, now: float) -> None:
        while self._senders:
            oldest = next(iter(self._senders.values()))
            if now - oldest.last_heard < self._forget_after:
                return
            self._senders.popitem(last=False)
