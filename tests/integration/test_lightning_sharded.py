"""``strategy="elastic_fsdp"`` end to end: real launches of a ``configure_model`` +
``fully_shard`` LightningModule (examples/lightning_sharded.py), and of a Fabric loop with a
``parallelize_fn`` (examples/fabric_sharded.py).

The examples log every training step's sample indices, and a digest of the whole model and
optimizer state (gathered from the shards) after every commit and at every (re)start of
training. A step lost to a failure is redone, and logged again, in a later round; the
committed history is the newest round's record of each step.
"""

from __future__ import annotations

import collections
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import REPO, Job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXAMPLE = REPO / "examples" / "lightning_sharded.py"
FABRIC_EXAMPLE = REPO / "examples" / "fabric_sharded.py"
SAMPLES, BATCH, EPOCHS, LR, GAMMA, COMMIT_EVERY = 384, 4, 2, 1e-3, 0.5, 4
HOSTS = "127.0.0.1:2,127.0.0.2:2"  # ranks 0, 1 on the first host; each rank's copy on the other


def start(job: Job, launch_args: list[str], *extra: str) -> None:
    command = [sys.executable, str(EXAMPLE), "--events", str(job.events_dir), "--log-dir", str(job.dir / "logs"),
               "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--lr", str(LR),
               "--commit-every", str(COMMIT_EVERY), "--digests", *extra]
    job.start(launch_args, command=command)


def committed_history(steps: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """For each global step, the records (one per rank) of the newest round that ran it."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in steps:
        by_step[e["step"]][e["round"]].append(e)
    return {step: rounds[max(rounds)] for step, rounds in sorted(by_step.items())}


def assert_exactly_once(job: Job, samples: int = SAMPLES, epochs: int = EPOCHS,
                        steps: list[dict[str, Any]] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Every sample once per epoch in the committed history of ``steps`` (default: the job's)."""
    history = committed_history(job.events("step") if steps is None else steps)
    assert list(history) == list(range(1, len(history) + 1)), f"steps missing: {sorted(history)}"
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for step, records in history.items():
        assert len(records) == records[0]["size"], f"step {step}: {len(records)} ranks logged, world {records[0]['size']}"
        for r in records:
            per_epoch[r["epoch"]].update(r["indices"])
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, counts in per_epoch.items():
        repeated = {i: c for i, c in counts.items() if c != 1}
        missing = set(range(samples)) - set(counts)
        assert not repeated and not missing, f"epoch {epoch}: repeated {repeated}, missing {sorted(missing)[:20]}"
    return history


def newest_snapshot_step(directory: Path) -> int:
    """The step of the newest published sharded snapshot in ``directory`` (by its manifest)."""
    published = [json.loads(p.read_text()) for p in directory.glob("snapshot-*-step-*.json")]
    assert published, sorted(p.name for p in directory.iterdir()) if directory.exists() else "no snapshot directory"
    newest = max(published, key=lambda m: m["sequence"])
    assert newest["kind"] == "sharded" and (directory / newest["data"] / ".metadata").is_file(), newest
    return int(newest["step"])


def test_a_worker_killed_mid_epoch_the_survivors_reshard_the_commit_and_finish_in_the_same_processes(job: Job) -> None:
    # Rank 1 kills itself after step 10 (of 24 in the first epoch at world 4); the last
    # commit is step 8's. Its rows live on as rank 3's copy, on the other host.
    start(job, ["-np", "4", "--min-np", "2", "-H", HOSTS], "--sigkill-at-step", "10", "--sigkill-rank", "1")
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [4, 3]
    assert "job succeeded" in job.reason()
    killed = job.events("sigkill")
    assert [(e["rank"], e["step"]) for e in killed] == [(1, 10)]
    survivors = {e["pid"] for e in job.events("start")} - {killed[0]["pid"]}
    done = job.events("done")
    assert {e["pid"] for e in done} == survivors  # the same processes, none restarted

    # The new world restored the newest commit, bit for bit, into the model rebuilt on its mesh.
    commits = {e["step"]: e["digest"] for e in job.events("commit") if e["round"] == 1}
    assert sorted(commits) == [4, 8], commits
    synced = [e for e in job.events("synced") if e["round"] == 2]
    assert {e["pid"] for e in synced} == survivors
    assert {(e["step"], e["digest"]) for e in synced} == {(8, commits[8])}
    assert {tuple(e["optimizer_steps"]) for e in synced} == {(8.0,)}

    # Every sample once per epoch in the committed history; the fit ends at world 3.
    history = assert_exactly_once(job)
    steps = len(history)
    assert {(d["size"], d["step"]) for d in done} == {(3, steps)}
    assert all(d["optimizer_steps"] == [float(steps)] for d in done), done  # every parameter, every rank
    assert len({d["digest"] for d in done}) == 1
    assert all(d["scheduler_epoch"] == EPOCHS for d in done)  # StepLR stepped once per epoch

    # ScaleLearningRate: the LR rescaled by 3/4 at the reset, on every survivor.
    resets = job.events("reset")
    assert {e["pid"] for e in resets} == survivors
    assert all((e["old"], e["new"], e["round"]) == (4, 3, 2) for e in resets)
    assert all(e["lr"] == pytest.approx(LR * 3 / 4) for e in resets)
    assert all(d["lr"] == pytest.approx(LR * 3 / 4 * GAMMA**EPOCHS) for d in done)

    # metrics.csv is the committed history (a row every 5 steps): the row of step 9, logged
    # before the kill and flushed at the reset, is dropped with the steps redone after the
    # commit of step 8, and logged again once; the rows before the commit stay.
    with (job.dir / "logs" / "sharded" / "version_0" / "metrics.csv").open(newline="") as f:
        logged = [int(row["step"]) for row in csv.DictReader(f) if row.get("train_loss")]
    assert logged == sorted(set(logged)) and logged[:2] == [4, 9], logged


def test_a_host_added_then_removed_reshards_the_live_state_without_rollback(job: Job) -> None:
    job.set_hosts("127.0.0.1:2")
    # Slow steps: the joiners take seconds to import torch and Lightning.
    start(job, ["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2",
                "-np", "2", "--min-np", "2", "--max-np", "4"], "--step-delay", "0.1")
    job.wait_steps(3)
    job.set_hosts("127.0.0.1:2", "127.0.0.2:2")
    wait_for(lambda: any(e["round"] == 2 for e in job.events("step")), 90, "steps in round 2")
    job.wait_steps(max(e["step"] for e in job.events("step")) + 4)
    job.set_hosts("127.0.0.1:2")  # the joiners leave: their rows come from their copies on the first host
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 4, 2]
    # Announced changes keep the live state: each round starts right after the previous one's
    # last step, from the state committed there.
    for number in (2, 3):
        before = max(e["step"] for e in job.events("step") if e["round"] == number - 1)
        first = min(e["step"] for e in job.events("step") if e["round"] == number)
        assert first == before + 1, f"round {number} redid or skipped steps: {before} -> {first}"
        synced = [e for e in job.events("synced") if e["round"] == number]
        assert {e["step"] for e in synced} == {before} and len({e["digest"] for e in synced}) == 1
    history = assert_exactly_once(job)
    done = job.events("done")
    assert {(d["size"], d["step"]) for d in done} == {(2, len(history))}
    assert all(d["optimizer_steps"] == [float(len(history))] for d in done), done
    resets = collections.Counter((e["round"], e["old"], e["new"]) for e in job.events("reset"))
    assert resets == {(2, 2, 4): 4, (3, 4, 2): 2}, resets
    assert all(d["lr"] == pytest.approx(LR * GAMMA**EPOCHS) for d in done)  # x 4/2, then x 2/4


@pytest.mark.timeout(240)
def test_a_rank_lost_with_its_copy_resumes_from_a_snapshot_and_a_new_launch_at_another_size_goes_on(job: Job) -> None:
    # Two hosts of two: ranks 0 and 2 hold each other's copies and die together after step
    # 10; the survivors resume from the newest snapshot in the same processes and end at
    # max_steps, mid-epoch. A new launch at 3 resumes from the newest snapshot the 2 wrote.
    samples, snapshots = 192, job.dir / "snapshots"
    common = ["--snapshot-dir", str(snapshots), "--snapshot-every", "0.01", "--snapshot-keep", "20"]
    start(job, ["-np", "4", "--min-np", "2", "-H", HOSTS, *common], "--samples", str(samples), "--max-steps", "16",
          "--sigkill-at-step", "10", "--sigkill-rank", "0", "--sigkill-rank", "2")
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [4, 2]
    lost = [line for line in job.stdout().splitlines() if "Sharded state lost from memory" in line]
    assert len(lost) == 1 and "rank(s) 0, 2" in lost[0] and "resuming from snapshot" in lost[0], job.stdout()[-3000:]
    lost_at = int(re.search(r"\(step (\d+)\)", lost[0]).group(1))
    commits = {(e["round"], e["step"]): e["digest"] for e in job.events("commit")}
    synced = [e for e in job.events("synced") if e["round"] == 2]
    assert {(e["size"], e["step"], e["digest"]) for e in synced} == {(2, lost_at, commits[1, lost_at])}
    first = {e["pid"] for e in job.events("start")}
    resumed_at = newest_snapshot_step(snapshots)
    assert (2, resumed_at) in commits and lost_at < resumed_at <= 16, (resumed_at, sorted(commits))

    again = Job(job.dir)
    again.stdout_path, again.stderr_path = job.dir / "again.out", job.dir / "again.err"
    # Without the first launch's --max-steps and kills: another command, resumed on purpose.
    start(again, ["-np", "3", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", *common, "--resume-other-command"],
          "--samples", str(samples))
    assert again.wait(120) == 0, again.stderr()[-3000:]
    assert f"step {resumed_at}, written at world size 2 (now 3)" in again.stdout(), again.stdout()[-3000:]
    synced = [e for e in again.events("synced") if e["pid"] not in first]
    assert {(e["size"], e["step"], e["digest"]) for e in synced} == {(3, resumed_at, commits[2, resumed_at])}
    assert {tuple(e["optimizer_steps"]) for e in synced} == {(float(resumed_at),)}
    # The steps go on from the snapshot's: the first launch's up to it, then the second's.
    steps = [e for e in again.events("step") if (e["pid"] in first) == (e["step"] <= resumed_at)]
    assert min(e["step"] for e in steps if e["pid"] not in first) == resumed_at + 1
    history = assert_exactly_once(again, samples=samples, steps=steps)
    done = [d for d in again.events("done") if d["pid"] not in first]
    assert {(d["size"], d["step"]) for d in done} == {(3, len(history))}
    assert all(d["optimizer_steps"] == [float(len(history))] for d in done), done


def test_fabric_a_killed_rank_is_resharded_in_process_and_a_new_launch_resumes_from_a_snapshot(job: Job) -> None:
    # Four hosts of one rank: each rank's copy on another host. Rank 1 kills itself after
    # step 10; the last commit is step 8's. Snapshots are written in the background meanwhile.
    samples, snapshots = 384, job.dir / "snapshots"
    command = [sys.executable, str(FABRIC_EXAMPLE), "--events", str(job.events_dir), "--samples", str(samples),
               "--batch-size", str(BATCH), "--commit-every", str(COMMIT_EVERY), "--digests"]
    hosts = ",".join(f"127.0.0.{i}:1" for i in range(1, 5))
    snapshot_args = ["--snapshot-dir", str(snapshots), "--snapshot-every", "0.01", "--snapshot-keep", "3"]
    job.start(["-np", "4", "--min-np", "2", "-H", hosts, *snapshot_args],
              command=[*command, "--epochs", str(EPOCHS), "--sigkill-at-step", "10", "--sigkill-rank", "1"])
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [4, 3]
    killed = job.events("sigkill")
    assert [(e["rank"], e["step"]) for e in killed] == [(1, 10)]
    survivors = {e["pid"] for e in job.events("start")} - {killed[0]["pid"]}
    done = job.events("done")
    assert {e["pid"] for e in done} == survivors  # the same processes, none restarted

    # The new world restored the newest commit, bit for bit, into the model rebuilt on its mesh.
    commits = {e["step"]: e["digest"] for e in job.events("commit") if e["round"] == 1}
    assert sorted(commits) == [4, 8], commits
    synced = [e for e in job.events("synced") if e["round"] == 2]
    assert {e["pid"] for e in synced} == survivors
    assert {(e["step"], e["digest"]) for e in synced} == {(8, commits[8])}
    assert {tuple(e["optimizer_steps"]) for e in synced} == {(8.0,)}
    resets = job.events("reset")
    assert {e["pid"] for e in resets} == survivors and {e["round"] for e in resets} == {2}

    # Every sample once per epoch in the committed history; every rank ends on the same state.
    history = assert_exactly_once(job, samples=samples)
    assert {(d["size"], d["step"]) for d in done} == {(3, len(history))}
    assert all(d["optimizer_steps"] == [float(len(history))] for d in done), done
    assert len({d["digest"] for d in done}) == 1

    # The state's commits were written as DCP snapshots: a new launch at 2 resumes from the
    # newest (the end of the last epoch, unless that one was still being written) and trains
    # one epoch more.
    last, resumed_at = len(history), newest_snapshot_step(snapshots)
    digests = {**{e["step"]: e["digest"] for e in job.events("commit") if e["round"] == 2}, last: done[0]["digest"]}
    assert resumed_at in digests, (resumed_at, sorted(digests))
    first = {e["pid"] for e in job.events("start")}
    again = Job(job.dir)
    again.stdout_path, again.stderr_path = job.dir / "again.out", job.dir / "again.err"
    again.start(["-np", "2", "-H", hosts, *snapshot_args, "--resume-other-command"],  # one epoch more, no kill
                command=[*command, "--epochs", str(EPOCHS + 1)])
    assert again.wait(120) == 0, again.stderr()[-3000:]
    synced = [e for e in again.events("synced") if e["pid"] not in first]
    assert {(e["size"], e["step"], e["digest"]) for e in synced} == {(2, resumed_at, digests[resumed_at])}
    assert min(e["step"] for e in again.events("step") if e["pid"] not in first) == resumed_at + 1
    ends = [e for e in again.events("epoch_end") if e["pid"] not in first]
    assert {e["epoch"] for e in ends} == ({EPOCHS} if resumed_at == last else {EPOCHS - 1, EPOCHS}), ends
    assert all(e["complete"] for e in ends), ends
