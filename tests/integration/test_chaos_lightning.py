"""Chaos matrix, Lightning: faults that pile up or come from unexpected places, under
``Trainer(strategy="elastic_hvd")``.

Each case is a real launch of ``examples/lightning_classifier.py`` with real signals and
injected errors (the example's "fault injection" options). Every wait has a bound; where
training continues, the tests check exactly-once epochs (from the committed history of
steps), the final optimizer and LR-schedule state, and identical replicas.
"""

from __future__ import annotations

import collections
import os
import signal

import pytest

from tests.integration.harness import Job, wait_for
from tests.integration.test_lightning import (
    GAMMA,
    LR,
    assert_exactly_once,
    assert_final_state,
    assert_replicas_identical_after_resets,
    discovery,
    pid_of,
    start,
)

pytestmark = pytest.mark.integration

H1, H2, H3, H4 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"
PREEMPTED = "(preemption notice)"


def preemptible(job: Job, *extra: str) -> list[str]:
    """Launch arguments with per-worker log files, to read what each leaver printed."""
    return discovery(job, "--log-dir", str(job.dir / "worker-logs"), *extra)


def started_pids(job: Job) -> set[int]:
    return {e["pid"] for e in job.events("start")}


def original_pids(job: Job) -> set[int]:
    """The processes of round 1 (a preempted host stays usable: a new worker may join it later)."""
    return {e["pid"] for e in job.events("synced") if e["round"] == 1}


def done_pids(job: Job) -> set[int]:
    return {e["pid"] for e in job.events("done")}


def steps_of(job: Job, round_number: int, exclude: set[int] = frozenset()) -> list[int]:
    return [e["step"] for e in job.events("step") if e["round"] == round_number and e["pid"] not in exclude]


def worker_id_of(job: Job, pid: int) -> str:
    return next(e["worker"] for e in job.events("start") if e["pid"] == pid)


def worker_log(job: Job, pid: int) -> str:
    """One worker's own output (``--log-dir``; the worker number ends its id)."""
    number = worker_id_of(job, pid).rsplit("#", 1)[1]
    (path,) = (job.dir / "worker-logs").glob(f"worker-{number}-*.log")
    return path.read_text(errors="replace")


def assert_left_gracefully(job: Job, leavers: set[int]) -> None:
    """Each leaver took the graceful path, not the plain-SIGTERM fallbacks (preemption.py).

    Only the leavers' own output counts: a worker started later on a preempted host (it
    stays usable) is stopped with SIGTERM when training ends and rightly "exits now".
    """
    for pid in leavers:
        out = worker_log(job, pid)
        assert out.count("SIGTERM received: leaving the job at the next host-update check") == 1, out[-3000:]
        assert "is no longer part of the job: leaving" in out, out[-3000:]
        assert "exiting now" not in out and "ran out before this worker could leave" not in out, out[-3000:]


def assert_no_rollback(job: Job) -> None:
    """Every round resumed at the very step the previous one stopped at; no step ran twice."""
    rounds = sorted({e["round"] for e in job.events("synced")})
    synced = {}
    for n in rounds:
        at = {e["step"] for e in job.events("synced") if e["round"] == n}
        assert len(at) == 1, f"round {n} started at different steps: {at}"
        synced[n] = at.pop()
    for n in rounds[1:]:
        stopped = max(steps_of(job, n - 1), default=synced[n - 1])
        assert synced[n] == stopped, f"round {n} resumed at step {synced[n]}, round {n - 1} stopped at {stopped}"
    rounds_of_step = collections.defaultdict(set)
    for e in job.events("step"):
        rounds_of_step[e["step"]].add(e["round"])
    redone = {s: r for s, r in rounds_of_step.items() if len(r) > 1}
    assert not redone, f"steps re-executed in a later round: {redone}"


def assert_reset_lr(job: Job, start_size: int) -> None:
    """Every reset event carries the LR scaled by ScaleLearningRate to new / start size."""
    for e in job.events("reset"):
        epochs = [s["epoch"] for s in job.events("step") if s["pid"] == e["pid"] and s["round"] == e["round"]]
        if not epochs:
            continue  # a round that resumed at the very end, or was lost before its first step
        epoch = min(epochs)
        assert e["lr"] == pytest.approx(LR * e["new"] / start_size * GAMMA**epoch), e


# ----- preemption ------------------------------------------------------------------------


def test_sigterm_to_one_of_three_leaves_without_rollback_restart_or_blacklist(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, preemptible(job, "-np", "3", "--min-np", "1"))
    job.wait_steps(7)  # mid-epoch: an epoch is 20 steps at 3 workers
    leaver = pid_of(job, "127.0.0.2")
    os.kill(leaver, signal.SIGTERM)
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert "job succeeded" in job.reason(), job.reason()
    err = job.stderr()
    assert f"Worker {worker_id_of(job, leaver)} left the job on SIGTERM {PREEMPTED}; host 127.0.0.2 stays usable." in err
    assert "Blacklisted" not in err
    assert "failures:      0" in err
    assert "preempted:     1 (left without rollback)" in err
    assert_left_gracefully(job, {leaver})
    # The host stays usable, so a new worker may join it later: only the first change is fixed.
    assert job.world_sizes()[:2] == [3, 2], job.world_sizes()
    # The leaver stopped with the others: it logged no step past their last step of round 1.
    others_last = max(steps_of(job, 1, exclude={leaver}))
    leaver_steps = [e["step"] for e in job.events("step") if e["pid"] == leaver]
    assert leaver_steps and max(leaver_steps) <= others_last, (leaver_steps, others_last)
    assert min(steps_of(job, 2)) == others_last + 1
    assert_no_rollback(job)
    assert leaver not in done_pids(job)
    survivors = original_pids(job) - {leaver}
    assert len(survivors) == 2
    assert survivors <= done_pids(job), "a survivor was restarted"
    resets = [e for e in job.events("reset") if e["round"] == 2]
    assert {e["pid"] for e in resets} == survivors
    assert all((e["old"], e["new"]) == (3, 2) for e in resets), resets
    assert_reset_lr(job, start_size=3)  # ScaleLearningRate: LR x 2/3
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=job.world_sizes()[-1])
    assert_replicas_identical_after_resets(job)


def test_preemption_wave_two_of_three_leave_at_once(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, preemptible(job, "-np", "3", "--min-np", "1"))
    job.wait_steps(7)
    leavers = {pid_of(job, "127.0.0.2"), pid_of(job, "127.0.0.3")}
    for pid in leavers:
        os.kill(pid, signal.SIGTERM)
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert "job succeeded" in job.reason(), job.reason()
    err = job.stderr()
    for pid, host in zip(sorted(leavers, key=lambda p: worker_id_of(job, p)), ("127.0.0.2", "127.0.0.3")):
        assert f"Worker {worker_id_of(job, pid)} left the job on SIGTERM {PREEMPTED}; host {host} stays usable." in err
    assert "Blacklisted" not in err
    assert "failures:      0" in err
    assert "preempted:     2 (left without rollback)" in err
    assert_left_gracefully(job, leavers)
    sizes = job.world_sizes()
    assert sizes[0] == 3 and 1 in sizes and sizes.index(1) <= 2, sizes  # [3, 1] or [3, 2, 1] (+ joiners later)
    assert_no_rollback(job)
    assert not leavers & done_pids(job)
    survivor = original_pids(job) - leavers
    assert len(survivor) == 1 and survivor <= done_pids(job), "the survivor was restarted"
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=sizes[-1])
    assert_replicas_identical_after_resets(job)


# ----- a second fault during the recovery from a first ----------------------------------


def test_second_worker_killed_inside_on_elastic_reset(job: Job) -> None:
    job.set_hosts(H1, H2, H3, H4)
    start(job, discovery(job, "-np", "4", "--min-np", "1"), "--reset-delay", "2")
    job.wait_steps(5)
    first, second = pid_of(job, "127.0.0.2"), pid_of(job, "127.0.0.3")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: any(e["pid"] == second for e in job.events("reset")) or job.proc.poll() is not None,
             60, "on_elastic_reset on 127.0.0.3")
    assert any(e["pid"] == second for e in job.events("reset")), job.stderr()[-3000:]
    os.kill(second, signal.SIGKILL)  # the hook sleeps 2 s: it is inside it
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert "job succeeded" in job.reason(), job.reason()
    assert job.world_sizes() == [4, 3, 2]
    err = job.stderr()
    assert "Blacklisted host 127.0.0.2" in err and "Blacklisted host 127.0.0.3" in err
    # It died in the hook (which runs after on_train_start, hence after its "synced" event).
    theirs = [e for e in job.events() if e["pid"] == second]
    assert theirs[-1]["kind"] == "reset" and theirs[-1]["round"] == 2, theirs[-1]
    survivors = started_pids(job) - {first, second}
    assert len(survivors) == 2 and done_pids(job) == survivors, "the survivors were restarted"
    resets = collections.Counter((e["round"], e["old"], e["new"]) for e in job.events("reset"))
    assert resets == {(2, 4, 3): 3, (3, 4, 2): 2}, resets  # round 3 resumes the commit of round 1
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=4, end_size=2)
    assert_replicas_identical_after_resets(job)


# ----- honest success ------------------------------------------------------------------


def test_a_worker_exiting_3_after_fit_returned_fails_the_job(job: Job) -> None:
    job.set_hosts(H1, H2)
    start(job, discovery(job, "-np", "2"), "--exit-code", "3", "--exit-rank", "1")
    assert job.wait(120) == 1, job.stderr()[-3000:]
    reason = job.reason()
    assert "job failed" in reason, reason
    assert "training returned in round 1 but not every worker finished cleanly" in reason, reason
    assert "exited with status 3 after training returned" in reason, reason
    exiting = job.events("exiting")
    assert [(e["rank"], e["code"]) for e in exiting] == [(1, 3)], exiting
    assert exiting[0]["worker"] in reason, reason
    assert len(job.events("done")) == 2  # training itself completed on both
    assert job.world_sizes() == [2]


# ----- collective errors -----------------------------------------------------------------


def test_one_rank_raising_dist_error_alone_makes_everyone_recover(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, discovery(job, "-np", "3"), "--dist-error-at-step", "5", "--dist-error-rank", "1")
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert "job succeeded" in job.reason(), job.reason()
    raised = job.events("dist_error")
    assert [(e["rank"], e["round"], e["step"]) for e in raised] == [(1, 1, 5)], raised
    err = job.stderr()
    assert (f"Round 1 is broken: worker {raised[0]['worker']} left round 1 after a collective error: "
            "torch.distributed.DistError: injected collective error at step 5") in err, err[-3000:]
    assert "Blacklisted" not in err
    assert "failures:      0" in err
    assert job.world_sizes() == [3, 3]
    assert done_pids(job) == started_pids(job) and len(started_pids(job)) == 3, "a worker was restarted"
    # Back to the last commit (every 2 steps): round 2 resumes at step 4, before the error.
    assert {e["step"] for e in job.events("synced") if e["round"] == 2} == {4}
    resets = collections.Counter((e["round"], e["old"], e["new"]) for e in job.events("reset"))
    assert resets == {(2, 3, 3): 3}, resets
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=3)
    assert_replicas_identical_after_resets(job)
