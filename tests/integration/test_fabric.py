"""``Fabric(strategy="elastic_hvd")`` with ``le.FabricState``: real launches of examples/fabric_loop.py.

Each worker logs the samples of every step (all-gathered, so every rank sees the world's)
and its parameters' checksum after every sync; the committed history of every epoch must
hold each sample exactly once, and all replicas must agree after every re-formation.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from tests.integration.harness import REPO, Job, assert_epochs_complete, assert_replicas_identical, wait_for

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples" / "fabric_loop.py"
H1, H2, H3 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"
EPOCHS = 3


def start(job: Job, launch_args: list[str], step_delay: float = 0.1, example_args: tuple[str, ...] = ()) -> None:
    command = [sys.executable, str(EXAMPLE), "--events", str(job.events_dir), "--samples", "192", "--batch-size", "8",
               "--epochs", str(EPOCHS), "--commit-every", "2", "--step-delay", str(step_delay), *example_args]
    job.start(["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2", *launch_args],
              command=command)


def synced_steps(job: Job, round_number: int) -> set[int]:
    return {e["step"] for e in job.events("synced") if e["round"] == round_number}


def test_a_killed_rank_0_leaves_the_others_training_from_the_last_commit(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    csv = job.dir / "csv"
    start(job, ["-np", "3", "--min-np", "1"], example_args=("--eval", "--csv-dir", str(csv)))
    wait_for(lambda: job.events("eval") or job.proc.poll() is not None, 60, "the first evaluation")
    victim = job.worker_pid("127.0.0.1")
    assert next(e["rank"] for e in job.events("start") if e["pid"] == victim) == 0
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    survivors = {e["pid"] for e in job.events("start")} - {victim}
    assert {e["pid"] for e in job.events("done")} == survivors  # the same processes, no restart
    (resumed,) = synced_steps(job, 2)
    assert resumed % 2 == 0  # a commit's step
    assert_epochs_complete(job, EPOCHS)
    assert_replicas_identical(job)
    # setup_dataloaders(use_distributed_sampler=False): the whole dataset on every rank, in
    # either world (it was sharded by the elastic sampler: 64 samples each of 3, 96 of 2).
    evals = job.events("eval")
    assert {(e["round"], e["size"]) for e in evals} == {(1, 3), (2, 2)}, evals
    assert all(e["whole"] and e["samples"] == 192 for e in evals), evals
    # fabric.log: one logger version (run) for the job, written on by the new rank 0 after
    # the reset (it was a second one, version_1). As with the Trainer, the CSV logger of
    # the new rank 0 starts metrics.csv anew (Lightning's CSVLogger does so in a folder
    # that exists): the rows of the lost rank 0 are gone.
    versions = sorted(d.name for d in (csv / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    rows = (csv / "lightning_logs" / "version_0" / "metrics.csv").read_text().split()
    logged = [int(line.split(",")[rows[0].split(",").index("step")]) for line in rows[1:]]
    assert max(logged) == max(e["step"] for e in job.events("step")), logged


def test_an_added_host_joins_with_the_state_and_a_removed_one_leaves(job: Job) -> None:
    # Twice the usual epochs: the joiner's start-up (Fabric's imports, 3-7 s on a loaded
    # machine) is spent training at 2, and with 3 epochs the job once ran out of steps
    # before the removal below could be announced (world sizes [2, 3]).
    epochs = 2 * EPOCHS
    job.set_hosts(H1, H2)
    start(job, ["-np", "2", "--min-np", "1", "--max-np", "3"], step_delay=0.25, example_args=("--epochs", str(epochs)))
    job.wait_steps(3)
    job.set_hosts(H1, H2, H3)
    job.wait_rounds(2)
    job.wait_steps(max(e["step"] for e in job.events("step")) + 3)
    job.set_hosts(H1, H3)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 3, 2]
    joiner = [e for e in job.events("synced") if e["worker"].startswith("127.0.0.3")]
    assert joiner and joiner[0]["round"] == 2
    # A host change keeps the live state: each new round starts where the last one stopped.
    for number in (2, 3):
        (resumed,) = synced_steps(job, number)
        assert resumed == max(e["step"] for e in job.events("step") if e["size"] == (2 if number == 2 else 3)
                              and e["time"] < min(s["time"] for s in job.events("synced") if s["round"] == number))
    assert "Blacklisted" not in job.stderr()
    resets = job.events("reset")
    assert {(e["round"], e["size"]) for e in resets} >= {(2, 3), (3, 2)}
    assert_epochs_complete(job, epochs)
    assert_replicas_identical(job)


def test_a_fabric_script_without_the_import_trains_and_its_job_succeeds(job: Job) -> None:
    # Launched as a user writes it: the script's own --n, --e and --d (prefixes of several
    # launch options) are the script's, and it neither imports lightning_elastic nor uses
    # @le.run: its clean end is training returned, not a failure.
    script = REPO / "tests" / "integration" / "fabric_no_import.py"
    job.start(["-np", "2", "-H", f"{H1},{H2}"],
              command=[sys.executable, str(script), "--n", "96", "--e", "2", "--d", str(job.events_dir)])
    assert job.wait() == 0, job.stderr()[-3000:]
    assert "job succeeded" in job.reason(), job.reason()
    assert "Blacklisted" not in job.stderr()
    records = [json.loads(p.read_text()) for p in sorted(job.events_dir.glob("rank*.json"))]
    assert sorted(r["rank"] for r in records) == [0, 1] and {r["size"] for r in records} == {2}
    assert all(r["argv"] == {"n": 96, "e": 2, "d": str(job.events_dir)} for r in records)
    for epoch in range(2):  # the elastic sampler: each sample once per epoch across the ranks
        assert sorted(i for r in records for i in r["orders"][epoch]) == list(range(96))
    # Fabric sets the sampler's epoch at every pass: a new order each epoch.
    assert all(r["orders"][0] != r["orders"][1] for r in records)
