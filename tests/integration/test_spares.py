"""A fault never waits for a replacement to start (issue 24): real launches, real SIGKILLs.

A spare host is listed beyond ``--max-np`` (or kept warm with ``--spares``). When a worker
dies the survivors must re-form at once with whoever is ready, and a replacement still
starting joins later through the host-change path: live state, no rollback. The spare's
start-up is made slow on purpose (``--start-delay``, as imports, data and GPU set-up are
on a real fleet), so that a driver waiting for it would show in the world sizes.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.integration.harness import Job, assert_epochs_complete, assert_replicas_identical
from tests.integration.test_elastic_launch import SLOW, discovery_args, last_step_of_round, synced_step
from tests.integration.test_lightning import (
    assert_exactly_once,
    assert_final_state,
    assert_replicas_identical_after_resets,
    discovery,
    pid_of,
    start,
)

pytestmark = pytest.mark.integration

H1, H2, H3, H4 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"
SPARE = "127.0.0.4"


def first_step_time(job: Job, **match: object) -> float:
    times = [e["time"] for e in job.events("step") if all(e.get(k) == v for k, v in match.items())]
    assert times, f"no step logged with {match}"
    return min(times)


def started_workers(job: Job) -> list[str]:
    return re.findall(r"Started worker (\S+)", job.stderr())


def test_survivors_resume_before_a_slow_spare_starts_and_it_joins_without_rollback(job: Job) -> None:
    job.set_hosts(H1, H2, H3, H4)  # 127.0.0.4 is a spare: --max-np 3
    job.start(discovery_args(job, "-np", "3", "--min-np", "1", "--max-np", "3"),
              [*SLOW, "--epochs", "5", "--start-delay", "5", "--start-delay-on-host", SPARE])
    job.wait_rounds(1)
    job.wait_steps(5)
    os.kill(job.worker_pid("127.0.0.2"), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    # Round 2: the two survivors, at once; round 3: the spare, once it had started.
    assert job.world_sizes() == [3, 2, 3], job.stderr()[-3000:]
    assert "1 more still starting will join the next round" in job.stderr()
    spare_first_step = first_step_time(job, worker=f"{SPARE}[0]#3")
    assert first_step_time(job, size=2) < spare_first_step
    # The fault restored the last commit; the spare's arrival kept the live state.
    assert synced_step(job, 2) % 2 == 0
    assert synced_step(job, 3) == last_step_of_round(job, 2)
    joiner = [e for e in job.events("synced") if e["worker"].startswith(SPARE)]
    assert joiner and joiner[0]["round"] == 3
    assert_epochs_complete(job, 5)
    assert_replicas_identical(job)


def test_with_a_hot_spare_a_kill_is_replaced_in_one_re_formation(job: Job) -> None:
    job.set_hosts(H1, H2, H3, H4)
    job.start(discovery_args(job, "-np", "3", "--min-np", "1", "--max-np", "3", "--spares", "1"),
              [*SLOW, "--epochs", "4", "--start-delay", "3", "--start-delay-on-host", SPARE])
    job.wait_rounds(1)
    job.wait_steps(5)
    assert started_workers(job) == ["127.0.0.1[0]#0", "127.0.0.2[0]#1", "127.0.0.3[0]#2", f"{SPARE}[0]#3"]
    os.kill(job.worker_pid("127.0.0.2"), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 3], job.stderr()[-3000:]  # never below full size
    assert len(started_workers(job)) == 4  # the spare replaced the lost worker: nothing started after
    joiner = [e for e in job.events("synced") if e["worker"].startswith(SPARE)]
    assert [e["round"] for e in joiner] == [2]
    assert synced_step(job, 2) % 2 == 0  # a fault: the last commit, broadcast to the spare too
    assert_epochs_complete(job, 4)
    assert_replicas_identical(job)


def test_lightning_survivors_go_on_while_a_slow_spare_starts(job: Job) -> None:
    job.set_hosts(H1, H2, H3, H4)
    start(job, discovery(job, "-np", "3", "--min-np", "1", "--max-np", "3"),
          "--start-delay", "6", "--start-delay-on-host", SPARE, step_delay=0.5)  # training outlasts a loaded start
    job.wait_steps(7)
    victim = pid_of(job, "127.0.0.2")
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2, 3], job.stderr()[-3000:]
    spare_steps = [e for e in job.events("step") if e["worker"].startswith(SPARE)]
    assert spare_steps and min(e["round"] for e in spare_steps) == 3
    assert first_step_time(job, size=2) < min(e["time"] for e in spare_steps)
    survivors = {e["pid"] for e in job.events("start") if not e["worker"].startswith(SPARE)} - {victim}
    assert survivors <= {e["pid"] for e in job.events("done")}  # the same processes, no restart
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=3)
    assert_replicas_identical_after_resets(job)
