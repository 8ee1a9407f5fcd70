"""BoundedHistory and the summary of a long job: first and newest entries, the rest counted."""

from __future__ import annotations

from lightning_elastic.launcher.driver.result import JobResult
from lightning_elastic.launcher.job.history import BoundedHistory


def test_a_history_keeps_its_first_and_newest_entries_and_counts_every_one() -> None:
    history: BoundedHistory[int] = BoundedHistory(first=3, newest=2)
    for n in range(1000):
        history.append(n)
    assert list(history) == [0, 1, 2, 998, 999]
    assert len(history) == history.total == 1000 and history.omitted == 995
    assert history.last == 999
    short: BoundedHistory[int] = BoundedHistory(first=3, newest=2)
    short.append(7)
    assert list(short) == [7] and short.omitted == 0 and short.last == 7


def test_the_summary_of_a_long_job_says_how_many_it_leaves_out() -> None:
    failures: BoundedHistory[str] = BoundedHistory()
    rounds: BoundedHistory[int] = BoundedHistory()
    for n in range(10_000):
        failures.append(f"worker h[0]#{n} was killed by SIGKILL")
        rounds.append(2 + n % 2)
    result = JobResult(success=True, reason="training finished", rounds=tuple(rounds), failures=tuple(failures),
                       blacklisted=(), duration=1.0, rejected_requests=0, rounds_omitted=rounds.omitted,
                       failures_omitted=failures.omitted)
    text = result.summary()
    assert "  rounds:        10000 (world sizes: 2 -> 3" in text and "-> (9900 more) ->" in text
    assert "  failures:      10000" in text
    lines = text.splitlines()
    listed = [line for line in lines if line.startswith("    - worker")]
    assert len(listed) == 100 and listed[0].endswith("#0 was killed by SIGKILL") and listed[-1].endswith("#9999 was killed by SIGKILL")
    gap = lines.index("    ... 9900 more (events.jsonl in --log-dir has every one)")
    assert lines[gap - 1].endswith("#19 was killed by SIGKILL") and lines[gap + 1].endswith("#9920 was killed by SIGKILL")
    assert len(text) < 10_000


def test_a_log_listing_names_sixteen_and_counts_the_rest() -> None:
    from lightning_elastic.launcher.job.wording import listing

    shown = []
    text = listing(range(4096), lambda n: shown.append(n) or f"rank {n}")
    assert text == ", ".join(f"rank {n}" for n in range(16)) + ", ... (4080 more)"
    assert shown == list(range(16))  # the rest is counted, not formatted
    assert listing(["a", "b"]) == "a, b" and listing([]) == ""
