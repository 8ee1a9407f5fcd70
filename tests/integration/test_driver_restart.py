"""--state-dir: the driver SIGKILLed mid-run, local workers training on, a restarted driver adopting them.

Real launches of the example loop on loopback hosts; the driver is killed with SIGKILL and
started again with the same command, as systemd or a Kubernetes Deployment would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.integration.harness import Job, assert_epochs_complete, assert_replicas_identical, wait_for
from tests.integration.test_bad_inputs import PREFIXES, Line, assert_documented

pytestmark = pytest.mark.integration

H1, H2 = "127.0.0.1:1", "127.0.0.2:1"
STEADY = ["--step-delay", "0.05", "--samples", "192", "--batch-size", "8", "--commit-every", "2"]


def restart_args(job: Job, *extra: str) -> list[str]:
    return ["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2",
            "--state-dir", str(job.dir / "state"), "--log-dir", str(job.dir / "logs"), *extra]


def kill_driver(job: Job) -> None:
    """SIGKILL the driver alone (its workers are in sessions of their own)."""
    assert job.proc is not None
    job.proc.kill()
    job.proc.wait(30)


def start_again(job: Job, name: str, launch_args: list[str], example_args: list[str]) -> None:
    """The same command once more, its output in files of its own."""
    job.stdout_path = job.dir / f"{name}.out"
    job.stderr_path = job.dir / f"{name}.err"
    job.start(launch_args, example_args)


def start_over_ssh(job: Job, hosts, epochs: int) -> tuple[list[str], list[str], set[int]]:
    """Two workers on two namespaced ssh hosts with a state dir, past their fourth step:
    the launch's arguments, the example's, and the workers' pids."""
    h1, h2 = hosts.names[:2]
    args = [*hosts.ssh_args, "-H", f"{h1}:1,{h2}:1", "-np", "2", "--state-dir", str(job.dir / "state"),
            "--log-dir", str(job.dir / "logs")]
    example = [*STEADY, "--epochs", str(epochs)]
    job.start(args, example)
    job.wait_rounds(1)
    job.wait_steps(4)
    return args, example, {e["pid"] for e in job.events("start")}


def max_step(job: Job) -> int:
    return max((e["step"] for e in job.events("step")), default=0)


def driver_events(job: Job) -> list[dict]:
    path = job.dir / "logs" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_restarted_driver_adopts_the_running_workers(job: Job) -> None:
    job.set_hosts(H1, H2)
    args, example = restart_args(job, "-np", "2"), [*STEADY, "--epochs", "10"]
    job.start(args, example)
    job.wait_rounds(1)
    job.wait_steps(4)
    pids = {e["pid"] for e in job.events("start")}
    assert len(pids) == 2

    # A second driver on the same state dir refuses, in one line, and changes nothing.
    second = subprocess.run([str(job.launcher), "launch", *args, "true"], cwd=job.dir, capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    refusal = Line("--state-dir {path}: another driver (pid {pid}) runs this job; it must exit before another "
                   "can take over", {"path": job.dir / "state", "pid": job.proc.pid})
    assert second.stderr.strip().splitlines() == [PREFIXES["error"] + refusal.text]
    assert_documented(refusal)

    kill_driver(job)
    killed_at = max_step(job)
    # The workers train on without a driver: collectives are peer to peer.
    wait_for(lambda: max_step(job) >= killed_at + 10, 30, "steps while no driver runs")
    assert all(_alive(pid) for pid in pids), "a worker died with its driver"
    time.sleep(3)  # a restart delay, as systemd's RestartSec: the outage is the subject here
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]

    err = job.stderr()
    assert "Adopting the job in" in err
    assert "driver outages: 1" in err
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids  # the same worker processes finished
    for pid in pids:  # no step ran twice in a worker
        steps = [e["step"] for e in job.events("step") if e["pid"] == pid]
        assert len(steps) == len(set(steps)) and steps == sorted(steps)
    assert_epochs_complete(job, 10)
    assert_replicas_identical(job)
    restarted = [e for e in driver_events(job) if e["kind"] == "driver_restarted"]
    assert len(restarted) == 1 and restarted[0]["adopted"] == 2 and restarted[0]["outage_s"] >= 3
    assert [e["kind"] for e in driver_events(job)].count("job_started") == 1
    assert not (job.dir / "state" / "state.json").exists(), "the ended job left a state to adopt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_hands_the_job_over_to_the_next_driver(job: Job) -> None:
    """A Kubernetes rolling restart or `systemctl restart`: SIGTERM ends the driver alone,
    quickly and with status 0. The next driver serves elsewhere, as a new pod would (here on
    another port): it writes its URL into --state-dir and the workers follow it there."""
    job.set_hosts(H1, H2)
    first, second = free_port(), free_port()
    example = [*STEADY, "--epochs", "4"]
    job.start(restart_args(job, "-np", "2", "--port", str(first)), example)
    job.wait_rounds(1)
    job.wait_steps(4)
    pids = {e["pid"] for e in job.events("start")}
    assert (job.dir / "state" / "driver-url").read_text() == f"http://127.0.0.1:{first}\n"
    assert job.proc is not None
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(30) == 0, job.stderr()[-3000:]
    took = time.monotonic() - sent
    print(f"SIGTERM to the driver's exit: {took:.2f} s")
    assert took < 5, f"the hand-over took {took:.1f} s"  # Kubernetes' default grace: 30 s
    handed = Line("SIGTERM: the driver exited and left {n} worker(s) running; the next driver started with "
                  "--state-dir {path} adopts them (they wait --driver-patience {patience} s for it)",
                  {"n": 2, "path": job.dir / "state", "patience": 120})
    assert job.stderr().strip().splitlines()[-1] == "lightning-elastic: job handed over: " + handed.text
    assert_documented(handed)
    assert all(_alive(pid) for pid in pids), "a worker was stopped with its driver"
    assert (job.dir / "state" / "state.json").exists()
    assert driver_events(job)[-1]["kind"] == "driver_handed_over"

    start_again(job, "restart", restart_args(job, "-np", "2", "--port", str(second)), example)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert "driver outages: 1" in job.stderr()
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids  # the same workers, at the new address
    said = f"says it serves at http://127.0.0.1:{second} now: following it"
    assert job.stdout().count(said) == 2, job.stdout()[-3000:]
    assert_epochs_complete(job, 4)


def test_worker_lost_during_the_outage_is_recovered_from_once_the_driver_is_back(job: Job) -> None:
    job.set_hosts(H1, H2)
    args, example = restart_args(job, "-np", "2", "--min-np", "1"), [*STEADY, "--epochs", "4", "--child"]  # ended by keepers
    job.start(args, example)
    job.wait_rounds(1)
    job.wait_steps(4)
    kill_driver(job)
    os.kill(job.worker_pid("127.0.0.2"), signal.SIGKILL)
    # Its keeper, which no driver watches now, records how it ended.
    wait_for(lambda: list((job.dir / "state" / "workers").glob("*.status")), 10, "the lost worker's status")
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "was killed by SIGKILL" in err
    assert job.world_sizes() == [2, 1]
    breaks = [e for e in driver_events(job) if e["kind"] == "round_broken"]
    assert len(breaks) == 1, breaks
    restarted = [e for e in driver_events(job) if e["kind"] == "driver_restarted"]
    assert [(e["adopted"], e["ended"]) for e in restarted] == [(1, 1)]
    synced = [e for e in job.events("synced") if e["round"] == 2]
    assert len(synced) == 1 and synced[0]["step"] % 2 == 0  # restored from a commit
    assert_epochs_complete(job, 4)


def test_workers_exit_when_no_driver_comes_back_within_the_patience(job: Job) -> None:
    job.set_hosts(H1, H2)
    # Without --state-dir a worker would give up after 2 x --heartbeat-timeout: 4 s.
    job.start(restart_args(job, "-np", "2", "--driver-patience", "6", "--heartbeat-timeout", "2"),
              [*STEADY, "--epochs", "50"])
    job.wait_rounds(1)
    job.wait_steps(2)
    kill_driver(job)
    gone_at = time.monotonic()
    wait_for(lambda: not job.stray_processes(), 30, "every worker (and its keeper) to exit")
    assert time.monotonic() - gone_at >= 5, "the workers did not wait for the patience"
    logs = "".join(p.read_text() for p in (job.dir / "state" / "workers").glob("*.log"))
    assert logs.count("driver unreachable for 6 s: exiting") == 2


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.remote
def test_restarted_driver_reattaches_to_workers_on_other_machines(job: Job, hosts) -> None:
    """Over ssh, a SIGTERM hand-over (a Kubernetes pod replaced): the driver closes its ssh
    connections and exits 0 at once, the supervisors leave their workers running, and the
    next driver re-attaches (output, signals, exit status). The SIGKILL case over ssh is the
    test below (the driver restarted on another machine)."""
    args, example, pids = start_over_ssh(job, hosts, epochs=8)
    assert job.proc is not None
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(30) == 0, job.stderr()[-3000:]
    assert time.monotonic() - sent < 5, "the hand-over took too long"
    assert "lightning-elastic: job handed over: SIGTERM: the driver exited and left 2 worker(s) running" \
        in job.stderr()
    assert driver_events(job)[-1]["kind"] == "driver_handed_over"
    killed_at = max_step(job)
    wait_for(lambda: max_step(job) >= killed_at + 10, 30, "steps while no driver runs")
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert "driver outages: 1" in job.stderr()
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids
    for pid in pids:
        steps = [e["step"] for e in job.events("step") if e["pid"] == pid]
        assert len(steps) == len(set(steps))
    assert_epochs_complete(job, 8)
    # The output each worker wrote while no driver ran reached the new driver's stdout.
    assert "training finished" in (job.dir / "restart.out").read_text()


def test_lightning_fit_survives_a_driver_restart(job: Job) -> None:
    """The Lightning strategy needs the driver no more than the plain loop does: the fit goes
    on through the outage, in the same processes, and ends with every sample once."""
    from tests.integration import test_lightning as lightning

    job.set_hosts(H1, H2)
    args = restart_args(job, "-np", "2")
    lightning.start(job, args, step_delay=0.1)
    job.wait_steps(5)
    pids = {e["pid"] for e in job.events("start")}
    kill_driver(job)
    killed_at = max_step(job)
    wait_for(lambda: max_step(job) >= killed_at + 5, 60, "fit steps while no driver runs")
    job.stdout_path, job.stderr_path = job.dir / "restart.out", job.dir / "restart.err"
    lightning.start(job, args, step_delay=0.1)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert "driver outages: 1" in job.stderr()
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids
    history = lightning.assert_exactly_once(job)
    lightning.assert_final_state(job, history, start_size=2, end_size=2)


@pytest.mark.remote
def test_a_driver_restarted_on_another_machine_is_found_through_the_shared_state_dir(job: Job, hosts) -> None:
    """The first driver on this machine, SIGKILLed; the next one in namespace le-h3, another
    machine with another address sharing the filesystem (so the state dir): it re-attaches
    to the ssh workers and they, their driver gone, follow the address it wrote there."""
    elsewhere = hosts.names[2]
    args, example, pids = start_over_ssh(job, hosts, epochs=4)
    first_url = (job.dir / "state" / "driver-url").read_text().strip()
    kill_driver(job)
    # The same command on the other machine: `ip netns exec` execs it, so job.proc is the driver.
    there = job.dir / "elsewhere.sh"
    there.write_text(f'#!/bin/sh\nexec ip netns exec {elsewhere} {job.launcher} "$@"\n')
    there.chmod(0o755)
    launcher, job.launcher = job.launcher, there
    try:
        start_again(job, "restart", args, example)
    finally:
        job.launcher = launcher
    assert job.wait(180) == 0, job.stderr()[-3000:]
    address = hosts.address(elsewhere)
    assert f"Serving on {address}: the previous driver's address" in job.stderr(), job.stderr()[-3000:]
    assert "driver outages: 1" in job.stderr()
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids  # the same processes, found again
    out = job.stdout()
    assert out.count(f"cannot be reached; {job.dir / 'state' / 'driver-url'} says it serves at http://{address}:") == 2, \
        out[-3000:]
    assert f"//{address}:" not in first_url  # it did come back elsewhere
    assert_epochs_complete(job, 4)
