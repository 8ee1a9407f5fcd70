"""One dead worker never takes healthy workers with it (issue 26): real launches, real SIGKILLs.

On a host with several slots (one machine, several GPUs) a failure takes out the failed
worker's slot only; a fixed host list that can no longer give the slots the job needs
fails at once instead of waiting for the elastic timeout; the README's own Lightning
command survives a lost worker.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time

import pytest

from tests.integration.harness import (REPO, Job, assert_epochs_complete, assert_replicas_identical, wait_for)
from tests.integration.test_elastic_launch import SLOW, STEADY

pytestmark = pytest.mark.integration


def pid_of_worker(job: Job, worker_id: str) -> int:
    return wait_for(lambda: next((e["pid"] for e in job.events("start") if e["worker"] == worker_id), None),
                    60, f"worker {worker_id}")


def test_a_dead_worker_on_a_three_slot_host_takes_only_its_slot(job: Job) -> None:
    job.start(["-np", "3", "--min-np", "1", "-H", "localhost:3"], [*SLOW, "--epochs", "3"])
    job.wait_rounds(1)
    job.wait_steps(4)
    victim = pid_of_worker(job, "localhost[1]#1")
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [3, 2], err[-3000:]
    assert "Blacklisted slot localhost[1] for the rest of the job: its other slots stay in use" in err
    assert "Blacklisted host" not in err and "is blacklisted" not in err
    assert "blacklisted:   localhost[1]" in err
    survivors = {e["pid"] for e in job.events("start")} - {victim}
    assert {e["pid"] for e in job.events("done")} == survivors  # the same processes went on
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


@pytest.mark.slow
def test_a_second_slot_failing_blacklists_the_host(job: Job) -> None:
    job.start(["-np", "4", "--min-np", "1", "-H", "localhost:3,127.0.0.2:1"], [*SLOW, "--epochs", "2"])
    job.wait_rounds(1)
    job.wait_steps(4)
    os.kill(pid_of_worker(job, "localhost[1]#1"), signal.SIGKILL)
    job.wait_rounds(2)
    os.kill(pid_of_worker(job, "localhost[2]#2"), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "Blacklisted host localhost for the rest of the job: another of its slots failed before" in err
    assert "Stopping worker localhost[0]#0: its host localhost is blacklisted" in err
    assert job.world_sizes()[-1] == 1, err[-3000:]


def test_np_beyond_a_fixed_host_list_is_refused_at_once(job: Job) -> None:
    started = time.monotonic()
    code = job.run(["-np", "4", "-H", "127.0.0.1:1,127.0.0.2:1"], ["--epochs", "1"], timeout=60)
    assert code == 2
    assert job.reason() == (
        "lightning-elastic: error: -np 4: the fixed host list 127.0.0.1:1,127.0.0.2:1 has 2 slot(s) and can never "
        "grow; give more hosts, a smaller -np, or a --host-discovery-script")
    # At once: about 0.2 s here (the CLI's start-up), not the elastic timeout's 600 s; the
    # bound leaves room for the other test lane sharing the two cores.
    assert time.monotonic() - started < 2


def test_a_fixed_host_list_below_min_np_fails_at_once_instead_of_waiting(job: Job) -> None:
    job.start(["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1"], [*STEADY, "--epochs", "20"])
    job.wait_rounds(1)
    job.wait_steps(3)
    os.kill(job.worker_pid("127.0.0.2"), signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait(timeout=60) == 1, job.stderr()[-3000:]
    # At once (about 0.1 s here), not after the elastic timeout: a fixed list never grows.
    assert time.monotonic() - killed < 5
    assert job.reason() == (
        "lightning-elastic: job failed: 2 slot(s) needed and 1 left in the fixed host list (127.0.0.2 blacklisted "
        "for the rest of the job), which can never grow: lower --min-np, or give hosts with --host-discovery-script")


def readme_lightning_command() -> list[str]:
    readme = (REPO / "README.md").read_text()
    line = next(m for m in re.findall(r"^lightning-elastic launch .*lightning_classifier\.py$", readme, re.M))
    return shlex.split(line)


def test_the_readmes_lightning_command_survives_a_lost_worker(job: Job) -> None:
    argv = readme_lightning_command()
    assert argv[:2] == ["lightning-elastic", "launch"] and argv[-2:] == ["python", "examples/lightning_classifier.py"]
    command = [sys.executable, str(REPO / argv[-1]), "--events", str(job.events_dir), "--log-dir",
               str(job.dir / "logs"), "--epochs", "2", "--samples", "240", "--step-delay", "0.1"]
    job.start(argv[2:-2], command=command)
    job.wait_steps(4)
    os.kill(job.worker_pid("127.0.0.2"), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 1]
    assert "job succeeded" in job.reason()
