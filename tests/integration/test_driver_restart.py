"""--state-dir: the driver SIGKILLed mid-run, local workers training on, a restarted driver adopting them.

Real launches of the example loop on loopback hosts; the driver is killed with SIGKILL and
started again with the same command, as systemd or a Kubernetes Deployment would.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time

import psutil
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


# ----- issue 34: the state dir trusted, a late driver, a full disk, a failed take-over ------


def _keepers(job: Job) -> list[psutil.Process]:
    """The job's keepers (processes/detached.py), each the leader of its worker's group."""
    return [p for p in job.stray_processes() if "keeper.py" in " ".join(p.cmdline())]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_forged_state_naming_another_process_is_not_adopted(job: Job) -> None:
    """Issue 34, point 2: a pid and its start time are anyone's to read (/proc). A state that
    names a process of this user that is not this job's keeper (here a `sleep`) must not make
    the driver adopt it, and so never signal it; and the directory, its logs and its state
    are this user's alone."""
    job.set_hosts(H1, H2)
    args = restart_args(job, "-np", "2", "--heartbeat-timeout", "2")
    job.start(args, [*STEADY, "--epochs", "50"])
    job.wait_rounds(1)
    job.wait_steps(4)
    state = job.dir / "state"
    wait_for(lambda: (state / "state.json").exists(), 10, "the state to be saved")
    assert _mode(state) == 0o700
    assert {_mode(p) for p in [*(state / "workers").glob("*.log"), state / "state.json", state / "secret"]} == {0o600}
    kill_driver(job)
    for keeper in _keepers(job):  # the real workers gone, with no status (as a reboot leaves them)
        os.killpg(keeper.pid, signal.SIGKILL)
    wait_for(lambda: not job.stray_processes(), 10, "the workers to die")
    bystander = subprocess.Popen(["sleep", "600"])  # a process of this user, nothing of the job's
    try:
        with open(f"/proc/{bystander.pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        saved = json.loads((state / "state.json").read_text())
        forged = 0

        def forge(value):
            nonlocal forged
            if isinstance(value, dict):
                if value.get("keeper_pid"):
                    value["keeper_pid"], value["start_ticks"] = bystander.pid, ticks
                    forged += 1
                for v in value.values():
                    forge(v)
            elif isinstance(value, list):
                for v in value:
                    forge(v)

        forge(saved)
        assert forged == 2, saved
        (state / "state.json").write_text(json.dumps(saved))
        start_again(job, "restart", args, [*STEADY, "--epochs", "50"])
        job.wait(120)  # it may end either way (both workers are gone): what matters is whom it signalled
        err = job.stderr()
        assert err.count(f"process {bystander.pid} is not the keeper of worker") == 2, err[-3000:]
        assert bystander.poll() is None, "the driver signalled a process that was not its worker's keeper"
    finally:
        bystander.kill()
        bystander.wait(10)


def test_workers_that_gave_up_on_the_driver_are_not_failures(job: Job) -> None:
    """Issue 34, point 3: the driver comes back after --driver-patience. The workers that
    gave up waiting for it (exit status 75) are no failures: no host is blacklisted, and the
    new driver starts a fresh round on the same slots, from the newest snapshot."""
    job.set_hosts(H1, H2)
    snapshots = job.dir / "snapshots"
    args = restart_args(job, "-np", "2", "--driver-patience", "4", "--heartbeat-timeout", "2",
                        "--snapshot-dir", str(snapshots), "--snapshot-every", "0.2")
    example = [*STEADY, "--epochs", "20"]
    job.start(args, example)
    job.wait_rounds(1)
    job.wait_steps(6)
    first = {e["pid"] for e in job.events("start")}
    kill_driver(job)
    wait_for(lambda: not job.stray_processes(), 30, "every worker to give up on the driver")
    statuses = sorted(int(p.read_text()) for p in (job.dir / "state" / "workers").glob("*.status"))
    assert statuses == [75, 75], statuses
    assert (job.dir / "state" / "state.json").exists()
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert err.count("left the job while no driver ran (it waited --driver-patience for one, exit status 75)") == 2
    assert "failures:      0" in err and "blacklisted:   none" in err, err[-3000:]
    assert "resumed from:  " in err and "resumed from:  nothing" not in err, err[-3000:]
    again = {e["pid"] for e in job.events("start")} - first
    assert len(again) == 2  # a fresh round on both slots
    resumed = [e for e in job.events("synced") if e["pid"] in again]
    assert resumed and min(e["step"] for e in resumed) > 0, "not resumed from a snapshot"
    assert not (job.dir / "state" / "state.json").exists()


@contextlib.contextmanager
def full_tmpfs(path):
    """A tmpfs at ``path`` (mode 0700) whose inodes can all be used up, so that no file can
    be created there any more (ENOSPC) while the files already open still grow."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=64,mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def fill() -> int:
        made = 0
        while True:
            try:
                (path / f"filler-{made}").touch()
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                return made
            made += 1

    try:
        yield fill
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_full_state_dir_fails_one_start_and_the_keepers_report_real_exits(job: Job) -> None:
    """Issue 34, point 4: --state-dir on a file system with no inode left. A worker started
    for a new host cannot get its log file there: that start fails, not the job. A worker
    SIGKILLed then: its keeper cannot write its status, yet ends what the worker left (its
    child) and the driver learns the real exit (SIGKILL, not "status 1")."""
    job.set_hosts(H1, H2)
    with full_tmpfs(job.dir / "state") as fill:
        args = restart_args(job, "-np", "2", "--min-np", "1", "--max-np", "3")
        job.start(args, [*STEADY, "--epochs", "40", "--child"])
        job.wait_rounds(1)
        job.wait_steps(4)
        assert fill() > 0
        job.set_hosts(H1, H2, "127.0.0.3:1")
        wait_for(lambda: "could not be started" in job.stderr() or job._ended(), 30, "the new host's start to fail")
        victim = psutil.Process(job.worker_pid("127.0.0.2"))
        left = victim.children()
        assert left, "the worker's child did not start"
        victim.send_signal(signal.SIGKILL)
        wait_for(lambda: all(not psutil.pid_exists(c.pid) or c.status() == psutil.STATUS_ZOMBIE for c in left), 10,
                 "the killed worker's child to end with it")
        assert job.wait(180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert re.search(r"worker 127\.0\.0\.3\[0\]#\d+ was lost: could not be started: No space left on device", err), \
        err[-3000:]
    assert re.search(r"worker 127\.0\.0\.2\[0\]#\d+ was killed by SIGKILL", err), err[-3000:]
    assert "the driver failed" not in err


def test_a_driver_failing_while_it_takes_over_leaves_the_job_for_the_next(job: Job) -> None:
    """Issue 34, point 5: a driver that fails while it adopts the job (here a worker's log is
    missing) exits touching nothing: the workers train on, state.json and the secret stay,
    and the next driver adopts them."""
    job.set_hosts(H1, H2)
    args, example = restart_args(job, "-np", "2"), [*STEADY, "--epochs", "20"]
    job.start(args, example)
    job.wait_rounds(1)
    job.wait_steps(4)
    pids = {e["pid"] for e in job.events("start")}
    kill_driver(job)
    state = job.dir / "state"
    log = sorted((state / "workers").glob("*.log"))[0]
    away = log.with_name(log.name + ".away")
    log.rename(away)
    start_again(job, "failed", args, example)
    assert job.wait(60) == 1, job.stderr()[-3000:]
    failed = Line("the driver failed while taking over the job in --state-dir {path}: {error}; the job is left as "
                  "it was (its state kept, its workers running for --driver-patience {patience} s): start the same "
                  "command again", {"path": state, "error": f"FileNotFoundError: [Errno 2] No such file or directory: "
                                                            f"'{log}'", "patience": 120})
    assert job.reason() == PREFIXES["job"] + failed.text
    assert_documented(failed)
    assert all(_alive(pid) for pid in pids), "a worker was stopped by the driver that failed"
    assert (state / "state.json").exists() and (state / "secret").exists()
    away.rename(log)
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert "driver outages: 1" in job.stderr() or "driver outages: 2" in job.stderr()
    assert job.world_sizes() == [2], "the round was re-formed"
    assert {e["pid"] for e in job.events("done")} == pids
    assert_epochs_complete(job, 20)
