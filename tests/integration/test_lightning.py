"""``Trainer(strategy="elastic_hvd")`` end to end: real launches of the Lightning example.

The example logs every training step's sample indices before the optimizer step. A step
lost to a failure is redone, and logged again, in a later round; the committed history is
therefore the newest round's record of each step. From it the tests check exactly-once
epochs, step counts, the LR schedule and scaling, and identical replicas.
"""

from __future__ import annotations

import collections
import csv
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import REPO, Job, wait_for

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples" / "lightning_classifier.py"
CLI_EXAMPLE = REPO / "examples" / "lightning_cli.py"
SAMPLES, BATCH, EPOCHS, LR, GAMMA = 480, 8, 2, 0.02, 0.5
H1, H2, H3 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"


def start(job: Job, launch_args: list[str], *extra: str, step_delay: float = 0.03) -> None:
    command = [sys.executable, str(EXAMPLE), "--events", str(job.events_dir), "--log-dir", str(job.dir / "logs"),
               "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
               "--lr", str(LR), "--commit-every", "2", "--step-delay", str(step_delay), *extra]
    job.start(launch_args, command=command)


def discovery(job: Job, *extra: str) -> list[str]:
    return ["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2", *extra]


def committed_history(job: Job) -> dict[int, list[dict[str, Any]]]:
    """For each global step, the records (one per rank) of the newest round that ran it."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in job.events("step"):
        by_step[e["step"]][e["round"]].append(e)
    return {step: rounds[max(rounds)] for step, rounds in sorted(by_step.items())}


def assert_exactly_once(job: Job) -> dict[int, list[dict[str, Any]]]:
    history = committed_history(job)
    assert list(history) == list(range(1, len(history) + 1)), f"steps missing: {sorted(history)}"
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for step, records in history.items():
        assert len(records) == records[0]["size"], f"step {step}: {len(records)} ranks logged, world {records[0]['size']}"
        for r in records:
            per_epoch[r["epoch"]].update(r["indices"])
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, counts in per_epoch.items():
        repeated = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(SAMPLES)) - set(counts)
        assert not repeated and not missing, f"epoch {epoch}: repeated {repeated}, missing {sorted(missing)[:20]}"
    return history


def assert_final_state(job: Job, history: dict[int, list[dict[str, Any]]], start_size: int, end_size: int) -> None:
    done = job.events("done")
    assert len(done) == end_size
    steps = len(history)
    for d in done:
        assert d["step"] == steps, f"global_step {d['step']} != {steps} committed steps"
        assert d["optimizer_steps"] == steps
        assert d["scheduler_epoch"] == EPOCHS  # StepLR stepped once per epoch
        assert d["lr"] == pytest.approx(LR * end_size / start_size * GAMMA**EPOCHS)
    assert len({d["checksum"] for d in done}) == 1, "final replicas differ"


def assert_replicas_identical_after_resets(job: Job) -> None:
    by_round: dict[int, set[float]] = collections.defaultdict(set)
    for e in job.events("synced"):
        by_round[e["round"]].add(e["checksum"])
    assert len(by_round) >= 2, f"no reset seen: {dict(by_round)}"
    for number, checksums in by_round.items():
        assert len(checksums) == 1, f"round {number}: replicas differ: {checksums}"


def pid_of(job: Job, host: str) -> int:
    return wait_for(lambda: next((e["pid"] for e in job.events("start") if e["worker"].startswith(f"{host}[")), None),
                    60, f"the worker on {host}")


def test_sigkill_of_rank0_fit_completes_in_surviving_processes(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, discovery(job, "-np", "3", "--min-np", "1"))
    job.wait_steps(7)
    victim = pid_of(job, "127.0.0.1")  # rank 0: the logger's writer moves to another process
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    assert "Blacklisted host 127.0.0.1" in job.stderr()
    survivors = {e["pid"] for e in job.events("start")} - {victim}
    assert {e["pid"] for e in job.events("done")} == survivors  # same processes, no restart
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=2)
    assert_replicas_identical_after_resets(job)
    resets = job.events("reset")
    assert {e["pid"] for e in resets} == survivors
    assert all((e["old"], e["new"]) == (3, 2) for e in resets)
    # One logger run for the whole job, written on by the new rank 0 after the reset.
    versions = sorted(p.name for p in (job.dir / "logs" / "spirals").iterdir())
    assert versions == ["version_0"], versions
    assert {Path(d["log_dir"]).name for d in job.events("done")} == {"version_0"}
    metrics = (job.dir / "logs" / "spirals" / "version_0" / "metrics.csv").read_text().splitlines()
    last_logged_step = max(int(line.split(",")[metrics[0].split(",").index("step")]) for line in metrics[1:])
    assert last_logged_step > max(e["step"] for e in job.events("step") if e["round"] == 1)
    # The elastic metrics, once per fit attempt, from rank 0: world 2 after one reset, and
    # the reset's duration (the first attempt's row went down with the killed rank 0's
    # unflushed CSV logger, or is there with world 3 and no reset).
    rows = list(csv.DictReader(metrics))
    elastic = [(float(r["elastic/world_size"]), float(r["elastic/resets"]), r["elastic/last_recovery_s"])
               for r in rows if r.get("elastic/world_size")]
    assert elastic and elastic[-1][:2] == (2.0, 1.0) and 0 < float(elastic[-1][2]) < 60, elastic
    assert all(row[:2] == (3.0, 0.0) for row in elastic[:-1]), elastic
    # The progress bar's metrics carry the world size.
    assert {e["progress_bar_world_size"] for e in job.events("step") if e["round"] == 2} - {None} == {2.0}
    assert "job succeeded" in job.reason()


def test_host_added_then_removed_mid_epoch(job: Job) -> None:
    job.set_hosts(H1, H2)
    # Slow steps: a joiner takes seconds to import torch and Lightning.
    start(job, discovery(job, "-np", "2", "--min-np", "1", "--max-np", "3"), step_delay=0.2)
    job.wait_steps(5)
    job.set_hosts(H1, H2, H3)
    wait_for(lambda: any(e["round"] == 2 for e in job.events("step")), 90, "steps in round 2")
    job.wait_steps(max(e["step"] for e in job.events("step")) + 4)
    job.set_hosts(H1, H3)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 3, 2]
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=2, end_size=2)
    assert_replicas_identical_after_resets(job)
    # Announced changes keep the live state: each round starts right after the previous one's last step.
    for number in (2, 3):
        before = max(e["step"] for e in job.events("step") if e["round"] == number - 1)
        first = min(e["step"] for e in job.events("step") if e["round"] == number)
        assert first == before + 1, f"round {number} redid or skipped steps: {before} -> {first}"
    resets = collections.Counter((e["round"], e["old"], e["new"]) for e in job.events("reset"))
    assert resets == {(2, 2, 3): 3, (3, 3, 2): 2}, resets
    for e in job.events("reset"):  # LR scaled by new/old on every rank, joiner included
        expected = LR * e["new"] / 2 * GAMMA ** next(s["epoch"] for s in job.events("step") if s["pid"] == e["pid"] and s["round"] == e["round"])
        assert e["lr"] == pytest.approx(expected), e


def test_a_host_added_during_a_long_validation_joins_before_it_ends_then_one_removed(job: Job) -> None:
    # Validation of 8 batches per rank at 3 s each in the first round: 24 s. Before, a
    # change was acted on only at the next training batch end, after the whole pass.
    job.set_hosts(H1, H2)
    start(job, discovery(job, "-np", "2", "--min-np", "1", "--max-np", "3"), "--val-delay", "3")
    wait_for(lambda: job.events("val_step"), 90, "the first validation pass")
    job.set_hosts(H1, H2, H3)
    # Then a host removed in the next epoch: its commit must resume mid-epoch (a resume of
    # the epoch-end commit once left that epoch uncounted: it ended short, its LR step lost).
    wait_for(lambda: any(e["round"] == 2 for e in job.events("step")), 90, "steps in round 2")
    job.wait_steps(max(e["step"] for e in job.events("step")) + 6)
    job.set_hosts(H1, H3)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 3, 2]
    round_1 = [e for e in job.events("val_step") if e["round"] == 1]
    per_rank = collections.Counter(e["rank"] for e in round_1)
    assert per_rank and max(per_rank.values()) < 8, f"the first validation pass ran to its end: {per_rank}"
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=2, end_size=2)
    assert_replicas_identical_after_resets(job)
    # No rollback: round 2 starts right after round 1's last step.
    before = max(e["step"] for e in job.events("step") if e["round"] == 1)
    first = min(e["step"] for e in job.events("step") if e["round"] == 2)
    assert first == before + 1, f"round 2 redid or skipped steps: {before} -> {first}"


def test_user_exception_on_every_rank_fails_promptly(job: Job) -> None:
    job.set_hosts(H1, H2)
    start(job, discovery(job, "-np", "2"), "--fail-at-step", "5")
    assert job.wait(120) != 0
    output = job.stdout() + job.stderr()  # worker output is relayed, rank-prefixed
    assert "ValueError: bug in the model at step 5" in output
    assert "Traceback" in output and "in training_step" in output
    assert job.world_sizes() == [2], "a user error must not re-form the world"
    assert "job failed" in job.reason()


def test_user_exception_on_one_rank_that_worker_fails_others_go_on(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, discovery(job, "-np", "3", "--min-np", "1"), "--fail-at-step", "5", "--fail-rank", "1")
    assert job.wait() == 0, job.stderr()[-3000:]
    assert "ValueError: bug in the model at step 5 (rank 1)" in job.stderr()
    assert job.world_sizes() == [3, 2]
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=2)


def test_lightning_cli_script_runs_unchanged(job: Job) -> None:
    job.set_hosts(H1, H2)
    command = [sys.executable, str(CLI_EXAMPLE), "fit", "--trainer.strategy", "elastic_hvd",
               "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
               "--trainer.default_root_dir", str(job.dir / "cli"), "--model.events_dir", str(job.events_dir)]
    job.start(discovery(job, "-np", "2"), command=command)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert {e["size"] for e in job.events("step")} == {2}
    assert "job succeeded" in job.reason()


def ddp_ended_well(result: subprocess.CompletedProcess[str]) -> bool:
    """Exit status 0, or the abort Lightning's plain ddp itself (torch 2.13, gloo) makes now
    and then at interpreter exit, after the fit: 1 of 6 runs of the example with ``--strategy
    ddp`` without lightning_elastic imported. Callers check first that both ranks finished."""
    exit_abort = result.returncode == -6 and result.stderr.rstrip().endswith("terminate called without an active exception")
    return result.returncode == 0 or exit_abort
