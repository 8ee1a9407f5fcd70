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
import sys
from pathlib import Path

import psutil
import pytest

from tests.integration.harness import EXAMPLE, Job, assert_epochs_complete, assert_replicas_identical, wait_for
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


# A module whose import waits while a file exists (at most 60 s): the test holds the fork
# server in its preload, with clients queued on its socket.
GATED_IMPORT = """\
import os, time
deadline = time.monotonic() + 60
while os.path.exists(os.environ["GATE_FILE"]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""
# The workers' script: says which worker it is, in which process, then runs the example.
SAYS_WHO = f"""\
import os, runpy, sys
with open(os.environ["STARTED_FILE"], "a") as f:
    f.write(os.environ["LIGHTNING_ELASTIC_WORKER_ID"] + " " + str(os.getpid()) + "\\n")
sys.argv = [{str(EXAMPLE)!r}, *sys.argv[1:]]
runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
"""


def waiting_for_its_answer(pid: int) -> bool:
    """The client has sent its request and waits for the server's answer: blocked in the
    poll before its recv (its socket has a timeout), the only wait after its send (before
    it, the client sleeps between looks for the socket, and connects at once)."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    return "poll" in wchan or "unix_stream" in wchan


def requests_sent(job: Job, count: int) -> list[psutil.Process] | None:
    """The job's fork clients, once ``count`` of them wait for the server's answer."""
    assert job.proc is not None
    clients = []
    for proc in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if "fork_client" in " ".join(proc.cmdline()) and waiting_for_its_answer(proc.pid):
                clients.append(proc)
        except psutil.Error:
            continue  # ended meanwhile (a discovery run)
    return clients if len(clients) == count else None


def test_a_worker_forked_for_a_client_that_died_before_the_fork_never_runs(job: Job) -> None:
    # Issue 34, point 8: the server signalled the process group of a child that had not
    # made it yet, and the worker ran unsupervised until the server stopped.
    (job.dir / "gated_import.py").write_text(GATED_IMPORT)
    (job.dir / "says_who.py").write_text(SAYS_WHO)
    gate, started = job.dir / "gate", job.dir / "started.txt"
    gate.write_text("")
    env = {**os.environ, "GATE_FILE": str(gate), "STARTED_FILE": str(started),
           "PYTHONPATH": os.pathsep.join(p for p in (str(job.dir), os.environ.get("PYTHONPATH", "")) if p)}
    job.set_hosts(H1, H2)
    # One slot: the worker on 127.0.0.1 first, its replacement on 127.0.0.2 once it died.
    job.start(discovery_args(job, "-np", "1", "--preload", "gated_import"),
              command=[sys.executable, str(job.dir / "says_who.py"), "--events", str(job.events_dir),
                       "--epochs", "2", "--step-delay", "0.02"], env=env)
    server_pid(job)
    assert job.proc is not None
    (victim,) = wait_for(lambda: requests_sent(job, 1), 60, "the client to send its request to the importing server")
    victim_id = victim.environ()["LIGHTNING_ELASTIC_WORKER_ID"]
    assert victim_id.startswith("127.0.0.1["), victim_id
    victim.kill()  # SIGKILL: its request stays queued in the server's listen backlog
    wait_for(lambda: "was killed by SIGKILL" in job.stdout() + job.stderr(), 30, "the driver to see it die")
    wait_for(lambda: requests_sent(job, 1), 60, "the replacement's client to send its request")
    gate.unlink()  # the server accepts the dead client's request first, then the replacement's
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [1], job.stderr()[-3000:]
    ran = [line.split()[0] for line in started.read_text().splitlines()]
    assert victim_id not in ran, f"a worker ran for the dead client {victim_id}: {ran}"
    assert len(ran) == 1 and ran[0].startswith("127.0.0.2["), ran
