"""ReplayGuard: replays refused per sender with a sliding window, memory per sender."""

from __future__ import annotations

import random

from lightning_elastic import protocol as p
from lightning_elastic.launcher.service.replay_guard import WINDOW, ReplayGuard


def nonce(sender: str, sequence: int) -> str:
    return f"{sender}{sequence:016x}"


A, B = "a" * 16, "b" * 16


def test_every_nonce_once_in_any_order_within_the_window() -> None:
    guard = ReplayGuard(forget_after=600)
    numbers = list(range(3 * WINDOW))
    # Out of order by up to a few hundred, as concurrent threads of one sender deliver them.
    shuffled = sorted(numbers, key=lambda n: n + random.Random(n).randrange(300))
    for n in shuffled:
        assert guard.check(nonce(A, n), now=0) is None, n
    for n in numbers[-WINDOW:]:
        assert guard.check(nonce(A, n), now=0) == "replayed request (nonce already seen)"
    assert guard.check(nonce(A, 0), now=0).startswith("replayed request (sequence number")  # behind the window
    assert len(guard) == 1


def test_senders_are_independent_and_a_jump_forward_clears_the_window() -> None:
    guard = ReplayGuard(forget_after=600)
    assert guard.check(nonce(A, 5), 0) is None
    assert guard.check(nonce(B, 5), 0) is None  # the same number from another sender
    assert guard.check(nonce(A, 5 + 10 * WINDOW), 0) is None
    assert guard.check(nonce(A, 5 + 10 * WINDOW - 1), 0) is None  # unseen, just below the newest
    assert guard.check(nonce(A, 5), 0) is not None  # far behind: refused as too old


def test_a_sender_is_forgotten_only_after_its_silence() -> None:
    guard = ReplayGuard(forget_after=600)
    guard.check(nonce(A, 1), now=0)
    guard.check(nonce(B, 1), now=500)
    guard.check(nonce(A, 2), now=550)  # heard again: its forgetting starts over
    assert guard.check(nonce("c" * 16, 1), now=1100) is None
    assert len(guard) == 2  # B (last heard at 500) is forgotten; A (550) and the newcomer remain
    assert guard.check(nonce(A, 2), now=1100) is not None


def test_a_clients_nonces_share_one_sender_and_a_fork_draws_another(monkeypatch) -> None:
    sequence = p.NonceSequence()
    first, second = sequence.next(), sequence.next()
    assert first[:16] == second[:16] and int(second[16:], 16) == int(first[16:], 16) + 1
    assert all(p._NONCE.fullmatch(n) for n in (first, second))
    monkeypatch.setattr("os.getpid", lambda: -42)  # as in a forked child
    child = sequence.next()
    assert child[:16] != first[:16] and int(child[16:], 16) == 0
