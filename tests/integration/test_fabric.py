"""``Fabric(strategy="elastic_hvd")`` with ``le.FabricState``: real launches of examples/fabric_loop.py.

Each worker logs the samples of every step (all-gathered, so every rank sees the world's)
and its parameters' checksum after every sync; the committed history of every epoch must
hold each sample exactly once, and all replicas must agree after every re-formation.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.integration.harness import REPO, Job, assert_epochs_complete, assert_replicas_identical

pytestmark = pytest.mark.integration

EXAMPLE = REPO / "examples" / "fabric_loop.py"
H1, H2, H3 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"
EPOCHS = 3


def start(job: Job, launch_args: list[str], step_delay: float = 0.1) -> None:
    command = [sys.executable, str(EXAMPLE), "--events", str(job.events_dir), "--samples", "192", "--batch-size", "8",
               "--epochs", str(EPOCHS), "--commit-every", "2", "--step-delay", str(step_delay)]
    job.start(["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2", *launch_args],
              command=command)


def synced_steps(job: Job, round_number: int) -> set[int]:
    return {e["step"] for e in job.events("synced") if e["round"] == round_number}


def test_a_killed_worker_leaves_the_others_training_from_the_last_commit(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, ["-np", "3", "--min-np", "1"])
    job.wait_steps(5)
    victim = job.worker_pid("127.0.0.2")
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    survivors = {e["pid"] for e in job.events("start")} - {victim}
    assert {e["pid"] for e in job.events("done")} == survivors  # the same processes, no restart
    (resumed,) = synced_steps(job, 2)
    assert resumed % 2 == 0  # a commit's step
    assert_epochs_complete(job, EPOCHS)
    assert_replicas_identical(job)


def test_an_added_host_joins_with_the_state_and_a_removed_one_leaves(job: Job) -> None:
    job.set_hosts(H1, H2)
    start(job, ["-np", "2", "--min-np", "1", "--max-np", "3"], step_delay=0.25)
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
    assert_epochs_complete(job, EPOCHS)
    assert_replicas_identical(job)
