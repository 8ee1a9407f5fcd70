"""Chaos matrix, plain loop: faults that pile up or come from unexpected places.

Each case is a real launch of ``examples/elastic_loop.py`` with real signals and injected
errors (the example's "fault injection" options); the table with measured times is in
docs/reliability.md. Every wait has a bound; where training continues, the tests check
exactly-once epochs and identical replicas.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psutil
import pytest

from tests.integration.harness import Job, assert_epochs_complete, assert_replicas_identical, wait_for
from tests.unit.proc_tools import is_gone

pytestmark = pytest.mark.integration

H1, H2, H3, H4 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"
STEADY = ["--step-delay", "0.05", "--samples", "192", "--batch-size", "8", "--commit-every", "2"]


def discovery_args(job: Job, *extra: str) -> list[str]:
    return ["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2", *extra]


def pids_of_round(job: Job, round_number: int) -> set[int]:
    return {e["pid"] for e in job.events("synced") if e["round"] == round_number}


def assert_no_restart(job: Job, lost: set[int]) -> None:
    """The workers that finished are the original processes, minus the ones lost."""
    started = {e["pid"] for e in job.events("start")}
    done = {e["pid"] for e in job.events("done")}
    assert done and done <= started - lost, f"finished: {done}, started: {started}, lost: {lost}"


def driver_saw(job: Job, text: str, timeout: float = 60) -> None:
    wait_for(lambda: text in job.stderr() or job.proc.poll() is not None, timeout, repr(text))
    assert text in job.stderr(), f"the driver never logged {text!r}:\n{job.stderr()[-3000:]}"


# ----- a second fault during the recovery from a first ----------------------------------


def kill_two(job: Job, *example_args: str, second_when: Callable[[int], object], what: str,
             interval: float = 0.05, start_timeout: float = 90) -> tuple[int, int]:
    """Four workers; SIGKILL 127.0.0.2's, then 127.0.0.3's once ``second_when(its pid)`` holds."""
    job.set_hosts(H1, H2, H3, H4)
    job.start(discovery_args(job, "-np", "4", "--min-np", "1"), [*STEADY, "--epochs", "3", *example_args])
    job.wait_steps(5, timeout=start_timeout)
    first, second = job.worker_pid("127.0.0.2"), job.worker_pid("127.0.0.3")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: second_when(second), 60, what, interval)
    os.kill(second, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    return first, second


def assert_recovered_without(job: Job, first: int, second: int) -> None:
    assert_no_restart(job, {first, second})
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def reset_seen(job: Job, pid: int) -> bool:
    return any(e["pid"] == pid for e in job.events("reset"))


def synced_in_round_2(job: Job, pid: int) -> bool:
    return any(e["pid"] == pid and e["round"] == 2 for e in job.events("synced"))


def test_second_worker_killed_while_the_first_recovery_re_forms(job: Job) -> None:
    # As soon as the driver has reaped the first, the survivors are re-forming.
    first, second = kill_two(job, second_when=lambda _: "was killed by SIGKILL" in job.stderr(),
                             what="the driver to reap the first victim")
    assert job.world_sizes()[0] == 4 and job.world_sizes()[-1] == 2
    assert "Blacklisted host 127.0.0.2" in job.stderr() and "Blacklisted host 127.0.0.3" in job.stderr()
    assert_recovered_without(job, first, second)


def test_second_worker_killed_inside_its_reset_callback(job: Job) -> None:
    # The callback sleeps 2 s: the kill lands inside it.
    first, second = kill_two(job, "--reset-delay", "2", second_when=lambda pid: reset_seen(job, pid),
                             what="the reset callback on 127.0.0.3")
    assert job.world_sizes() == [4, 3, 2]
    assert not synced_in_round_2(job, second)
    assert_recovered_without(job, first, second)


def test_second_worker_killed_during_the_state_broadcast(job: Job) -> None:
    # 96 MB of extra state: the broadcast, right after the reset callback, takes a while.
    first, second = kill_two(job, "--ballast-mb", "96", second_when=lambda pid: reset_seen(job, pid),
                             what="the reset on 127.0.0.3", interval=0.01, start_timeout=120)
    assert job.world_sizes() == [4, 3, 2]
    assert not synced_in_round_2(job, second), "it finished the broadcast"
    assert_recovered_without(job, first, second)


# ----- preemption ------------------------------------------------------------------------


def test_sigterm_is_a_graceful_leave_without_rollback_or_blacklist(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    job.start(discovery_args(job, "-np", "3", "--min-np", "1"), [*STEADY, "--epochs", "3"])
    job.wait_steps(5)
    leaver = job.worker_pid("127.0.0.2")
    os.kill(leaver, signal.SIGTERM)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "left the job on SIGTERM (preemption notice); host 127.0.0.2 stays usable" in err
    assert "Blacklisted" not in err and "failures:      0" in err
    assert "preempted:     1 (left without rollback)" in err
    assert job.world_sizes()[:2] == [3, 2]
    # Nothing re-executed: round 2 starts at the very step round 1 stopped at.
    last_of_round_1 = max(e["step"] for e in job.events("step") if e["size"] == 3 and e["pid"] != leaver)
    assert {e["step"] for e in job.events("synced") if e["round"] == 2} == {last_of_round_1}
    assert {e["step"] for e in job.events("step") if e["pid"] == leaver} <= set(range(1, last_of_round_1 + 1))
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_a_preempted_worker_that_cannot_leave_in_its_grace_falls_back_to_a_failure(job: Job) -> None:
    # Steps of 2 s and a grace of 1 s: the next check comes too late (SIGTERM lands just
    # after a step was logged).
    job.set_hosts(H1, H2, H3)
    job.start(discovery_args(job, "-np", "3", "--min-np", "1", "--preemption-grace", "1"),
              ["--step-delay", "2", "--samples", "48", "--batch-size", "8", "--commit-every", "1", "--epochs", "2"])
    job.wait_steps(2)
    leaver = job.worker_pid("127.0.0.2")
    os.kill(leaver, signal.SIGTERM)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "before it could leave on SIGTERM (preemption notice)" in err
    assert "Blacklisted host 127.0.0.2" in err
    assert job.world_sizes()[:2] == [3, 2]
    assert_epochs_complete(job, 2)
    assert_replicas_identical(job)


# ----- honest success ------------------------------------------------------------------


def test_a_worker_exiting_3_after_training_returned_fails_the_job(job: Job) -> None:
    code = job.run(["-np", "2", "-H", f"{H1},{H2}"], [*STEADY, "--epochs", "1", "--exit-code", "3",
                                                       "--exit-on-host", "127.0.0.2"])
    assert code == 1, job.stderr()[-3000:]
    assert "not every worker finished cleanly" in job.reason()
    assert "exited with status 3 after training returned" in job.reason()
    assert len(job.events("done")) == 2


def test_a_done_worker_that_never_exits_is_stopped_within_the_exit_timeout(job: Job) -> None:
    # 8 s: the worker that does exit must not be taken for hung on a loaded machine (3 s was
    # seen too short in a full run: both were killed).
    code = job.run(["-np", "2", "-H", f"{H1},{H2}", "--exit-timeout", "8"],
                   [*STEADY, "--epochs", "1", "--hang-after-done-on-host", "127.0.0.2"], timeout=120)
    assert code == 1, job.stderr()[-3000:]
    assert "worker 127.0.0.2[0]#1 was killed by SIGKILL after training returned: it reported done but did not exit within 8 s" in job.reason()
    assert job.events("hanging")


def test_workers_slow_to_exit_after_they_reported_are_not_taken_for_wedged(job: Job) -> None:
    # Every worker leaves the job and then takes 4 s to end (a busy machine's teardown),
    # with no heartbeat, past a heartbeat timeout of 2 s: it reported, --exit-timeout bounds it.
    code = job.run(["-np", "2", "-H", f"{H1},{H2}", "--heartbeat-timeout", "2"],
                   [*STEADY, "--epochs", "1", "--slow-exit", "4"], timeout=120)
    assert code == 0, job.stderr()[-3000:]
    assert "no heartbeat" not in job.stderr()
    assert len(job.events("done")) == 2


def test_a_driver_stopped_longer_than_the_heartbeat_timeout_kills_nobody_when_it_continues(job: Job) -> None:
    # Ctrl-Z on the launch and `fg` (or a suspended machine): meanwhile every heartbeat
    # waits unanswered in the driver's socket, and the workers train on.
    job.start(["-np", "2", "-H", f"{H1},{H2}", "--heartbeat-timeout", "3"], [*STEADY, "--epochs", "16"])
    job.wait_rounds(1)
    job.wait_steps(3)
    assert job.proc is not None
    os.kill(job.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(4.5)  # the fault itself: stopped 1.5 s past the heartbeat timeout
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "no heartbeat" not in err
    assert "The driver did not run for" in err
    assert job.world_sizes() == [2]
    assert_epochs_complete(job, 16)
    assert_replicas_identical(job)


def test_what_a_worker_started_ends_with_it_whether_it_exits_or_is_killed(job: Job) -> None:
    # Each worker starts a child that would sleep for an hour (a data loader's worker, a
    # tool). One worker alone is SIGKILLed, not its group (as the kernel's OOM killer does);
    # the other finishes training and exits.
    job.start(["-np", "2", "--min-np", "1", "-H", f"{H1},{H2}"], [*STEADY, "--epochs", "6", "--child"])
    job.wait_rounds(1)
    job.wait_steps(3)
    victim = psutil.Process(job.worker_pid("127.0.0.2"))
    left = victim.children()
    assert left, "the worker's child did not start"
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: all(is_gone(c.pid) for c in left), 10, "the killed worker's child to end with it")
    survivor = psutil.Process(job.worker_pid("127.0.0.1")).children()
    assert survivor
    assert job.wait() == 0, job.stderr()[-3000:]
    wait_for(lambda: all(is_gone(c.pid) for c in survivor), 10, "the finished worker's child to end with it")
    assert not job.stray_processes()


# ----- collective errors -----------------------------------------------------------------


def test_a_deterministic_collective_error_ends_the_job_within_the_limit(job: Job) -> None:
    code = job.run(["-np", "2", "-H", f"{H1},{H2}", "--repeated-error-limit", "3"],
                   [*STEADY, "--epochs", "2", "--dist-error-at-step", "5"], timeout=120)
    assert code == 1, job.stderr()[-3000:]
    reason = job.reason()
    assert "the same collective error ended 3 consecutive rounds" in reason
    assert "injected collective error at step 5" in reason
    assert len(job.rounds_formed()) <= 4


def test_one_rank_raising_a_dist_error_alone_makes_everyone_recover(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    code = job.run(discovery_args(job, "-np", "3"),
                   [*STEADY, "--epochs", "2", "--dist-error-at-step", "5", "--dist-error-on-host", "127.0.0.2",
                    "--dist-error-once"])
    assert code == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "Round 1 is broken: worker 127.0.0.2[0]#1 left round 1 after a collective error: " \
        "torch.distributed.DistError: injected collective error at step 5" in err
    assert "Blacklisted" not in err
    assert job.world_sizes() == [3, 3]
    assert len(job.events("dist_error")) == 1
    assert_no_restart(job, set())
    assert_epochs_complete(job, 2)
    assert_replicas_identical(job)


# ----- discovery misbehaving mid-run ----------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "logged"),
    [
        ("sleep 600", "did not finish within"),
        ("echo broken >&2; exit 1", "exited with status 1: broken"),
        ("echo 'not a host entry!'", "invalid host entry"),
    ],
    ids=["hangs", "fails", "garbage"],
)
def test_discovery_misbehaving_mid_run_leaves_training_at_the_same_size(job: Job, fault: str, logged: str) -> None:
    job.set_hosts(H1, H2)
    trigger = job.dir / "misbehave"
    body = f"#!/bin/sh\nif [ -e {trigger} ]; then {fault}; fi\ncat {job.hosts_file}\n"
    job.start(["--host-discovery-script", str(job.discovery_script(body)), "--discovery-interval", "0.2",
               "-np", "2"], [*STEADY, "--epochs", "4" if fault.startswith("sleep") else "2"])
    job.wait_steps(3)
    trigger.touch()
    if not fault.startswith("sleep"):
        driver_saw(job, logged)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2]
    assert_epochs_complete(job, 4 if fault.startswith("sleep") else 2)
    assert_replicas_identical(job)
