"""``launch --preload``: local workers forked from a warm interpreter, real launches, real SIGKILLs.

The driver starts one fork server for its machine, which imports the preloaded modules
once; every local worker, a replacement included, is a fork of it. The job must behave
exactly as with cold starts (the same recovery, the same state, a SIGKILL reported as
such) and leave nothing behind: neither the server nor a forked worker.
"""

from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from tests.integration.harness import Job, assert_epochs_complete, assert_replicas_identical, wait_for
from tests.integration.test_elastic_launch import discovery_args
from tests.integration.test_lightning import (
    assert_exactly_once,
    assert_final_state,
    assert_replicas_identical_after_resets,
    discovery,
    pid_of,
    start,
)

pytestmark = pytest.mark.integration

H1, H2, H3 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"


def server_pid(job: Job) -> int:
    found = wait_for(lambda: re.search(r"fork from a server that preloads .* \(pid (\d+)\)", job.stderr()), 30,
                     "the fork server's start")
    return int(found.group(1))


def forked_by(pid: int) -> int:
    return psutil.Process(pid).ppid()


def assert_nothing_left(job: Job, server: int) -> None:
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    assert not job.stray_processes()  # forked workers show the server's command line, with the job's
    assert "starting cold" not in job.stdout() + job.stderr()


def test_a_replacement_is_forked_from_the_warm_server_and_joins_without_rollback(job: Job) -> None:
    job.set_hosts(H1, H2, H3)  # 127.0.0.3 is a spare: --max-np 2
    job.start(discovery_args(job, "-np", "2", "--min-np", "1", "--max-np", "2", "--preload", "torch"),
              ["--epochs", "6", "--step-delay", "0.05", "--child"])  # a child of each worker ends with it
    server = server_pid(job)
    job.wait_steps(5)
    victim = job.worker_pid("127.0.0.1")
    assert forked_by(victim) == forked_by(job.worker_pid("127.0.0.2")) == server
    os.kill(victim, signal.SIGKILL)
    replacement = wait_for(lambda: next((e["pid"] for e in job.events("start") if e["worker"].startswith("127.0.0.3[")),
                                        None), 60, "the replacement's start")
    assert forked_by(replacement) == server
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 1, 2], job.stderr()[-3000:]
    # The worker's own death, through its client: as a cold start reports it.
    assert "worker 127.0.0.1[0]#0 was killed by SIGKILL" in job.stdout() + job.stderr()
    joiner = [e for e in job.events("synced") if e["worker"].startswith("127.0.0.3")]
    assert [e["round"] for e in joiner] == [3]
    assert_epochs_complete(job, 6)
    assert_replicas_identical(job)
    assert_nothing_left(job, server)


def test_lightning_fit_with_preloaded_lightning_survives_a_sigkill(job: Job) -> None:
    job.set_hosts(H1, H2, H3)
    start(job, discovery(job, "-np", "3", "--min-np", "1", "--preload", "lightning.pytorch"))
    server = server_pid(job)
    job.wait_steps(7)
    victim = pid_of(job, "127.0.0.2")
    assert forked_by(victim) == server
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    history = assert_exactly_once(job)
    assert_final_state(job, history, start_size=3, end_size=2)
    assert_replicas_identical_after_resets(job)
    assert_nothing_left(job, server)
