"""Workers on other machines: real hosts (network namespaces with their own address, host
name and sshd, see namespaces.py) reached over ssh, with real faults: SIGKILL, a link that
goes down, a host whose every process dies, a host without sshd, a driver SIGKILLed.

The hosts share this filesystem and PID namespace (as a shared-filesystem cluster shares
paths), so the example's event files and ``psutil`` see every host's workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest
import requests

from lightning_elastic import protocol as p
from lightning_elastic.launcher.node.fork_client import server_directory
from lightning_elastic.launcher.processes.warm_start import SERVER_MODULE
from tests.integration.harness import (
    Job,
    assert_epochs_complete,
    assert_replicas_identical,
    wait_for,
)
from tests.integration import test_lightning as lightning
from tests.integration.namespaces import NamespacedHosts

pytestmark = [pytest.mark.integration, pytest.mark.remote]

STEADY = ["--step-delay", "0.05", "--samples", "192", "--batch-size", "8", "--commit-every", "2"]
SLOW = ["--step-delay", "0.25", *STEADY[2:]]
HEARTBEAT_TIMEOUT = 4.0  # short, so partition tests end sooner; the default is 10 s


def launch_args(hosts: NamespacedHosts, *extra: str) -> list[str]:
    return [*hosts.ssh_args, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), *extra]


def discovery_args(job: Job, hosts: NamespacedHosts, *extra: str) -> list[str]:
    return launch_args(hosts, "--host-discovery-script", str(job.discovery_script()),
                       "--discovery-interval", "0.2", *extra)


def worker_pids(job: Job, host: str) -> set[int]:
    return {e["pid"] for e in job.events("start") if e["worker"].startswith(f"{host}[")}


def first_step_at_size(job: Job, size: int, after: float) -> float:
    """Wall-clock time of the first step any worker took at world size ``size`` after ``after``."""
    times = [e["time"] for e in job.events("step") if e["size"] == size and e["time"] > after]
    assert times, f"no step at world size {size}"
    return min(times)


def synced_step(job: Job, round_number: int) -> int:
    steps = {e["step"] for e in job.events("synced") if e["round"] == round_number}
    assert len(steps) == 1, f"ranks disagree on the step after round {round_number}: {steps}"
    return steps.pop()


def last_step_before_round(job: Job, round_number: int) -> int:
    """The last step any worker took before ``round_number`` synced."""
    synced_at = min(e["time"] for e in job.events("synced") if e["round"] == round_number)
    return max(e["step"] for e in job.events("step") if e["time"] < synced_at)


def test_job_on_three_remote_hosts_trains_to_the_end(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = hosts.names
    # --child: what each worker starts ends with it (through its supervisor)
    code = job.run(launch_args(hosts, "-np", "4", "-H", f"{h1}:2,{h2}:1,{h3}:1"), [*STEADY, "--epochs", "2", "--child"])
    assert code == 0, job.stderr()[-3000:]
    starts = sorted(job.events("start"), key=lambda e: e["rank"])
    # Each worker ran on its own machine (its own host name), with the planned slot.
    seen = [(e["host"], e["rank"], e["local_rank"], e["local_size"], e["cross_rank"], e["cross_size"])
            for e in starts]
    assert seen == [(h1, 0, 0, 2, 0, 3), (h1, 1, 1, 2, 0, 1), (h2, 2, 0, 1, 1, 3), (h3, 3, 0, 1, 2, 3)]
    # Served on the address that reaches the hosts; nothing they are told says loopback.
    assert f"Rendezvous service and process-group store at http://{hosts.bridge_address}:" in job.stderr()
    assert {e["master_addr"] for e in starts} == {hosts.bridge_address}
    out = job.stdout()
    assert re.search(r"^\[0\] training finished: \d+ steps, world size 4$", out, re.M), out[-2000:]
    assert "job succeeded" in job.reason()
    assert_epochs_complete(job, 2)
    assert_replicas_identical(job)


def start_on_three_hosts(job: Job, hosts: NamespacedHosts) -> tuple[str, str, str]:
    """A 3-epoch job with one worker on each remote host, once it trains at world size 3."""
    h1, h2, h3 = hosts.names
    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1"),
              [*STEADY, "--epochs", "3"])
    job.wait_rounds(1)
    job.wait_steps(5)
    return h1, h2, h3


def test_remote_worker_sigkilled_survivors_go_on_in_the_same_processes(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = start_on_three_hosts(job, hosts)
    before = {h: worker_pids(job, h) for h in (h1, h3)}
    os.kill(job.worker_pid(h2), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert f"worker {h2}[0]#1 was killed by SIGKILL" in err
    assert f"blacklisted:   {h2}" in err
    assert job.world_sizes() == [3, 2]
    assert {h: worker_pids(job, h) for h in (h1, h3)} == before  # no restart
    assert {e["pid"] for e in job.events("done")} == before[h1] | before[h3]
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_a_dead_worker_on_a_two_slot_remote_host_leaves_its_sibling_training(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, _ = hosts.names
    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:2,{h2}:1"), [*SLOW, "--epochs", "3"])
    job.wait_rounds(1)
    job.wait_steps(4)
    victim = next(e["pid"] for e in job.events("start") if e["worker"] == f"{h1}[1]#1")
    before = worker_pids(job, h1) - {victim}
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert f"Blacklisted slot {h1}[1] for the rest of the job: its other slots stay in use" in err
    assert f"blacklisted:   {h1}[1]" in err
    assert job.world_sizes() == [3, 2]
    assert before and before <= {e["pid"] for e in job.events("done")}  # its sibling went on, same process
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_remote_worker_sigterm_is_a_graceful_leave(job: Job, hosts: NamespacedHosts) -> None:
    # The machine's own orchestrator announces a preemption: the worker asks the driver, over
    # the network, to leave; nothing is rolled back and the host is not blacklisted.
    h1, h2, h3 = start_on_three_hosts(job, hosts)
    os.kill(job.worker_pid(h2), signal.SIGTERM)
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert f"Worker {h2}[0]#1 left the job on SIGTERM (preemption notice); host {h2} stays usable." in err
    assert "Blacklisted" not in err and "failures:      0" in err
    assert job.world_sizes()[:2] == [3, 2]
    assert synced_step(job, 2) == last_step_before_round(job, 2)  # nothing re-executed
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_remote_host_added_joins_and_removed_host_leaves_without_rollback(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = hosts.names
    job.set_hosts(f"{h1}:1", f"{h2}:1")
    job.start(discovery_args(job, hosts, "-np", "2", "--min-np", "1", "--max-np", "3"), [*SLOW, "--epochs", "5"])
    job.wait_rounds(1)
    job.wait_steps(3)
    job.set_hosts(f"{h1}:1", f"{h2}:1", f"{h3}:1")
    job.wait_rounds(2)
    wait_for(lambda: len([e for e in job.events("synced") if e["round"] == 2]) == 3, 60, "round 2 to sync")
    job.wait_steps(synced_step(job, 2) + 3)
    job.set_hosts(f"{h1}:1", f"{h3}:1")
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [2, 3, 2]
    assert "failures:      0" in err
    assert f"Worker {h2}[0]#1 left the job" in err
    # Host changes keep live state: each new round starts where the previous one stopped.
    assert synced_step(job, 2) == last_step_before_round(job, 2)
    assert synced_step(job, 3) == last_step_before_round(job, 3)
    joiner = [e for e in job.events("synced") if e["worker"].startswith(h3)]
    assert joiner and joiner[0]["round"] == 2
    assert_epochs_complete(job, 5)
    assert_replicas_identical(job)


@pytest.mark.slow
def test_a_rolling_move_across_remote_hosts_keeps_the_state(job: Job, hosts: NamespacedHosts) -> None:
    # H1 -> H1,H2 -> H2,H3 -> H3 over ssh, H2 removed before H3's worker joined: H2 stays
    # until the round with H3 has given H3 the state (chaos matrix row 61).
    h1, h2, h3 = hosts.names
    job.set_hosts(f"{h1}:1")
    job.start(discovery_args(job, hosts, "-np", "1", "--min-np", "1", "--max-np", "2"), [*SLOW, "--epochs", "6"])
    job.wait_rounds(1)
    job.set_hosts(f"{h1}:1", f"{h2}:1")
    job.wait_rounds(2)
    job.set_hosts(f"{h2}:1", f"{h3}:1")
    wait_for(lambda: f"removed ['{h1}']" in job.stderr(), 30, "the driver to see the first host removed")
    job.set_hosts(f"{h3}:1")
    assert job.wait() == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert "failures:      0" in err
    formed = re.findall(r"Round \d+ formed with \d+ worker\(s\): (.*)\.", err)
    assert formed[-1].startswith(f"rank 0={h3}[0]#") and "," not in formed[-1], formed
    assert_epochs_complete(job, 6)


def _lose_host_mid_training(job: Job, hosts: NamespacedHosts, lose) -> float:
    """Train on three hosts, lose the second with ``lose(name)``; returns fault -> first step."""
    h1, h2, h3 = hosts.names
    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1"),
              [*STEADY, "--epochs", "6"])
    job.wait_rounds(1)
    job.wait_steps(5)
    survivors = worker_pids(job, h1) | worker_pids(job, h3)
    at = time.time()
    lose(h2)
    assert job.wait(120) == 0, job.stderr()[-3000:]
    recovery = first_step_at_size(job, 2, at) - at
    print(f"\n{lose.__name__} of {h2}: first step at world size 2 after {recovery:.2f} s")
    assert job.world_sizes() == [3, 2]
    assert f"blacklisted:   {h2}" in job.stderr()
    assert {e["pid"] for e in job.events("done")} == survivors
    assert_epochs_complete(job, 6)
    assert_replicas_identical(job)
    return recovery


def test_partitioned_host_is_lost_and_its_worker_exits_on_its_own(job: Job, hosts: NamespacedHosts) -> None:
    _lose_host_mid_training(job, hosts, hosts.partition)
    h2 = hosts.names[1]
    assert f"Killing worker {h2}[0]#1: it sent no heartbeat for {HEARTBEAT_TIMEOUT:g} s" in job.stderr()
    # Cut off from its driver, the worker leaves after two heartbeat timeouts: nothing is left.
    wait_for(lambda: not _our_processes(hosts, h2, job), 4 * HEARTBEAT_TIMEOUT + 10,
             f"the partitioned worker on {h2} to exit")


def test_host_whose_every_process_dies_is_lost(job: Job, hosts: NamespacedHosts) -> None:
    _lose_host_mid_training(job, hosts, hosts.kill_all)


def test_ssh_connection_dropped_takes_the_remote_worker_down(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = hosts.names

    def drop_connection(name: str) -> None:
        (ssh,) = [c for c in psutil.Process(job.proc.pid).children()
                  if c.name() == "ssh" and name in c.cmdline()]
        ssh.kill()

    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1"),
              [*STEADY, "--epochs", "6"])
    job.wait_rounds(1)
    job.wait_steps(5)
    remote = job.worker_pid(h2)
    drop_connection(h2)
    wait_for(lambda: not psutil.pid_exists(remote) or psutil.Process(remote).status() == "zombie", 5,
             f"the worker on {h2} to die with its ssh connection")
    assert job.wait(120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    assert_epochs_complete(job, 6)


def test_unreachable_host_is_blacklisted_with_the_ssh_error(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, _ = hosts.names
    bad = hosts.unreachable
    code = job.run(launch_args(hosts, "-np", "2", "--max-np", "3", "-H", f"{h1}:1,{bad}:1,{h2}:1"),
                   [*STEADY, "--epochs", "2"])
    assert code == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert re.search(rf"worker {bad}\[0\]#\d was lost: ssh to {bad} failed: .*Connection refused", err), err[-3000:]
    assert f"blacklisted:   {bad}" in err
    assert job.world_sizes() == [2]
    assert_epochs_complete(job, 2)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_driver_killed_or_stopped_leaves_no_worker_on_any_host(
    job: Job, hosts: NamespacedHosts, sig: signal.Signals
) -> None:
    h1, h2, h3 = hosts.names
    job.start(launch_args(hosts, "-np", "4", "-H", f"{h1}:2,{h2}:1,{h3}:1"), [*STEADY, "--epochs", "50"])
    job.wait_rounds(1)
    job.wait_steps(2)
    job.proc.send_signal(sig)
    assert job.wait(30) != 0
    if sig == signal.SIGTERM:  # stopped by the driver itself: SIGTERM, then SIGKILL after the grace
        assert "job failed: interrupted by SIGTERM: stopped every worker" in job.reason()
    wait_for(lambda: not any(_our_processes(hosts, h, job) for h in hosts.names), 10,
             "every remote worker and supervisor to exit")


def test_secret_never_shown_and_store_refuses_an_intruder(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = hosts.names
    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1"),
              [*SLOW, "--epochs", "3"], capture_secret=True)
    job.wait_rounds(1)
    job.wait_steps(3)
    secret = job.secret()
    for name in hosts.names:  # command lines and environments of every process, on every host
        listing = hosts.exec(name, ["ps", "auxwwe"]).stdout
        assert "LIGHTNING_ELASTIC_WORKER_ID" in listing  # the workers are there (ps can see them)
        assert secret not in listing, f"the job secret is visible in ps on {name}"
    assert secret not in subprocess.run(["ps", "auxwwe"], capture_output=True, text=True).stdout

    # The driver listens on one port, on the job's address only: the signed rendezvous
    # service, which also serves the process-group store.
    url = re.search(r"Rendezvous service and process-group store at (\S+)\.", job.stderr()).group(1)
    listening = [c.laddr for c in psutil.Process(job.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
    assert [(a.ip, a.port) for a in listening] == [(hosts.bridge_address, int(url.rsplit(":", 1)[1]))]
    # An intruder on the job's network tries to plant the next rounds' bootstrap keys.
    for number in range(1, 6):
        for rank in range(3):
            plant = json.dumps({"worker_id": f"{h1}[0]#0", "op": "set", "value": "AA==",
                                "key": f"lightning_elastic/round/{number}/0/{rank}"}).encode()
            unsigned = requests.post(f"{url}{p.PATH_STORE}", data=plant, timeout=10)
            forged = requests.post(f"{url}{p.PATH_STORE}", data=plant, timeout=10,
                                   headers=p.sign_request("not-the-secret", "POST", p.PATH_STORE, plant))
            assert (unsigned.status_code, forged.status_code) == (401, 401)
    # With the secret the store answers: it does hold the bootstrap keys.
    count = json.dumps({"worker_id": f"{h1}[0]#0", "op": "num_keys"}).encode()
    reply = requests.post(f"{url}{p.PATH_STORE}", data=count, timeout=10,
                          headers=p.sign_request(secret, "POST", p.PATH_STORE, count))
    assert reply.status_code == 200 and reply.json()["count"] > 0
    # A lost worker makes the next round form: it must not read the planted keys.
    os.kill(job.worker_pid(h2), signal.SIGKILL)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    assert_epochs_complete(job, 3)
    assert_replicas_identical(job)


def test_lightning_example_with_a_remote_worker_killed(job: Job, hosts: NamespacedHosts) -> None:
    h1, h2, h3 = hosts.names
    lightning.start(job, launch_args(hosts, "-np", "3", "--min-np", "1", "-H", f"{h1}:1,{h2}:1,{h3}:1"))
    job.wait_steps(7)
    victim = lightning.pid_of(job, h2)
    os.kill(victim, signal.SIGKILL)
    assert job.wait(180) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2]
    assert f"blacklisted:   {h2}" in job.stderr()
    survivors = {e["pid"] for e in job.events("start")} - {victim}
    assert {e["pid"] for e in job.events("done")} == survivors  # same processes, no restart
    history = lightning.assert_exactly_once(job)
    lightning.assert_final_state(job, history, start_size=3, end_size=2)
    lightning.assert_replicas_identical_after_resets(job)


def _our_processes(hosts: NamespacedHosts, name: str, job: Job) -> list[int]:
    """This job's workers and supervisors still running in host ``name``'s namespace."""
    found = []
    for pid in hosts.pids(name):
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if str(job.events_dir) in cmdline or "lightning_elastic.launcher.node.supervisor" in cmdline:
            found.append(pid)
    return found


def test_preloaded_workers_fork_from_their_own_hosts_server_and_a_spare_is_warm(
        job: Job, hosts: NamespacedHosts) -> None:
    # --preload on machines of their own: one fork server per host, started through ssh like
    # a worker (h3, a listed spare, gets its server before any worker needs it); a worker
    # SIGKILLed on h2 is replaced on h3 by a fork of h3's server.
    h1, h2, h3 = hosts.names
    job.start(launch_args(hosts, "-np", "3", "--min-np", "1", "--max-np", "3", "-H", f"{h1}:2,{h2}:1,{h3}:1",
                          "--preload", "torch"), [*STEADY, "--epochs", "4", "--child"])
    servers = wait_for(lambda: set(re.findall(r"Workers on (\S+) fork from a server", job.stderr())) == {h1, h2, h3},
                       60, "a fork server on each of the three hosts")
    assert servers
    job.wait_steps(5)
    parents = {h: {psutil.Process(pid).ppid() for pid in worker_pids(job, h)} for h in (h1, h2)}
    assert len(parents[h1]) == 1 and len(parents[h2]) == 1 and parents[h1] != parents[h2]  # one per machine
    for host, (parent,) in parents.items():
        assert parent in hosts.pids(host)  # the server runs on the worker's own host
    os.kill(job.worker_pid(h2), signal.SIGKILL)
    replacement = wait_for(lambda: worker_pids(job, h3), 60, f"the replacement on {h3}")
    (spare_server,) = {psutil.Process(pid).ppid() for pid in replacement}
    assert spare_server in hosts.pids(h3)
    directories = {server_directory(server_token(pid), {}) for pid in (*parents[h1], *parents[h2], spare_server)}
    assert len(directories) == 3 and all(os.path.isdir(d) for d in directories)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert f"worker {h2}[0]#2 was killed by SIGKILL" in job.stderr()
    assert job.world_sizes() == [3, 2, 3]
    assert "starting cold" not in job.stdout() + job.stderr()
    assert_epochs_complete(job, 4)
    assert_replicas_identical(job)
    for name in hosts.names:
        assert wait_for(lambda: not _our_processes(hosts, name, job), 10, f"nothing left on {name}")
    # Each server removed its own directory (named by its token: other tests' servers, in
    # the other lane, come and go in the same /tmp meanwhile).
    assert not [d for d in directories if os.path.exists(d)]


def server_token(pid: int) -> str:
    """The token a fork server was started with (its command line: ``-m MODULE TOKEN ...``)."""
    cmdline = psutil.Process(pid).cmdline()
    return cmdline[cmdline.index(SERVER_MODULE) + 1]
