"""Capacity that joins by itself: ``lightning-elastic agent`` on the namespaced hosts (issue 36).

The driver is started with ``--agents`` and no host at all; each agent runs in a network
namespace of its own (its own address and host name, see namespaces.py) and connects to the
driver itself: no sshd is used. The agents share this filesystem and PID namespace, so the
example's event files and ``os.kill`` reach them and their workers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.integration.harness import (
    LAUNCHER,
    Job,
    assert_epochs_complete,
    assert_replicas_identical,
    wait_for,
)
from tests.integration import test_lightning as lightning
from tests.integration.namespaces import NamespacedHosts
from tests.troubleshooting_rows import assert_documented
from tests.integration.test_driver_restart import kill_driver, max_step, start_again
from tests.integration.test_multi_machine import (
    first_step_at_size,
    last_step_before_round,
    synced_step,
    worker_pids,
)

pytestmark = [pytest.mark.integration, pytest.mark.remote]

HEARTBEAT_TIMEOUT = 4.0
SECRET = "4f1c2d9e8b7a6c5d4e3f2a1b0c9d8e7f"
WRONG = "0000000000000000ffffffffffffffff"
TRAIN = ["--step-delay", "0.2", "--samples", "384", "--batch-size", "8", "--commit-every", "2"]
_WITH_HOSTNAME = 'hostname "$0" && exec "$@"'


def logged(output: str, needle: str) -> str:
    """The first line of ``output`` holding ``needle``, without the log's prefix."""
    line = next(line for line in output.splitlines() if needle in line)
    return re.sub(r"^lightning-elastic (agent:? )?(\d\d:\d\d:\d\d \w+ |error: )", "", line)


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class Agents:
    """Agents started by a test, each with its output in a file; all ended at teardown."""

    def __init__(self, workdir: Path, hosts: NamespacedHosts, port: int) -> None:
        self.dir = workdir
        self.hosts = hosts
        self.driver = f"{hosts.bridge_address}:{port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.secret_file = workdir / "secret"
        self.secret_file.write_text(SECRET + "\n")
        self.wrong_file = workdir / "wrong-secret"
        self.wrong_file.write_text(WRONG + "\n")

    def start(self, name: str, *extra: str, namespace: bool = True, secret_file: Path | None = None) -> None:
        """An agent for host ``name``: in its namespace (its own host name), or here with --host-name."""
        argv = [str(LAUNCHER), "agent", "--driver", self.driver, "--secret-file",
                str(secret_file or self.secret_file), *extra]
        if namespace:
            argv = ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", _WITH_HOSTNAME, name, *argv]
        else:
            argv += ["--host-name", name]
        with open(self.dir / f"agent-{name}.err", "wb") as err:
            # exec all the way down: the Popen's pid is the agent's, and a signal reaches it.
            self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT)

    def output(self, name: str) -> str:
        path = self.dir / f"agent-{name}.err"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {name} did not exit within {timeout} s:\n{self.output(name)[-2000:]}") from None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
            proc.wait(10)


@pytest.fixture
def agents(job: Job, hosts: NamespacedHosts) -> Iterator[Agents]:
    port = free_port(hosts.bridge_address)
    a = Agents(job.dir, hosts, port)
    a.port = port  # type: ignore[attr-defined]
    yield a
    a.close()


def wait_synced(job: Job, round_number: int, size: int) -> None:
    """Until every member of ``round_number`` has synced (its "synced" event written)."""
    wait_for(lambda: len([e for e in job.events("synced") if e["round"] == round_number]) >= size, 60,
             f"round {round_number}'s {size} members to sync")


def wait_step_at_size(job: Job, size: int, after: float) -> None:
    """Until a worker took a training step at world size ``size`` after ``after`` (wall clock)."""
    wait_for(lambda: any(e["size"] == size and e["time"] > after for e in job.events("step")), 60,
             f"a step at world size {size}")


def driver_args(agents: Agents, *extra: str) -> list[str]:
    return ["--agents", "--secret-file", str(agents.secret_file), "--port", str(agents.port),  # type: ignore[attr-defined]
            "--driver-address", agents.hosts.bridge_address, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), *extra]


def say(capsys: pytest.CaptureFixture[str], **measured: float) -> None:
    """Measurements for the README, shown in the test's output (never asserted: no timed assertions)."""
    with capsys.disabled():
        print(f"\nmeasured: {json.dumps({k: round(v, 2) for k, v in measured.items()})}")


def driver_events(job: Job, kind: str) -> list[dict]:
    path = job.dir / "logs" / "events.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event["kind"] == kind:
            found.append(event)
    return found


def test_agents_join_grow_leave_gracefully_and_are_lost_and_the_job_goes_on(job: Job, agents: Agents,
                                                                              hosts: NamespacedHosts,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    h1, h2, h3 = hosts.names
    h4 = hosts.unreachable  # no sshd there: nothing but the agent
    # The agents come first: they wait for the driver, saying so, and join once it serves.
    for name in (h1, h2, h3):
        agents.start(name)
    wait_for(lambda: all("not reachable yet" in agents.output(n) for n in (h1, h2, h3)), 30,
             "the agents to say the driver is not up yet")
    assert_documented(logged(agents.output(h1), "not reachable yet"))
    job.start(driver_args(agents, "-np", "3", "--min-np", "1", "--max-np", "4"), [*TRAIN, "--epochs", "12"])
    job.wait_rounds(1, timeout=60)
    assert job.rounds_formed() == [3]
    job.wait_steps(4)
    before = {h: worker_pids(job, h) for h in (h1, h2, h3)}
    assert all(len(pids) == 1 for pids in before.values()), before

    # A 4th agent: a host added, a joiner, no rollback.
    agents.start(h4)
    job.wait_rounds(2, timeout=60)
    assert job.rounds_formed()[1] == 4
    wait_synced(job, 2, 4)
    assert synced_step(job, 2) == last_step_before_round(job, 2)
    job.wait_steps(synced_step(job, 2) + 3)

    # SIGTERM to an agent (a pod deleted): its host leaves gracefully, nothing re-executed.
    agents.procs[h2].send_signal(signal.SIGTERM)
    job.wait_rounds(3, timeout=60)
    assert job.rounds_formed()[2] == 3
    wait_synced(job, 3, 3)
    assert synced_step(job, 3) == last_step_before_round(job, 3)
    assert agents.wait(h2, 30) == 0
    assert "Left the job: every worker has ended." in agents.output(h2)
    job.wait_steps(synced_step(job, 3) + 3)

    # SIGKILL to an agent: its worker dies with it; the driver loses the host once the
    # agent's connection closed and it did not come back, and the survivors recover in the
    # same processes.
    victim = next(iter(before[h3]))
    killed_at = time.time()
    agents.procs[h3].send_signal(signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{victim}"), 10, "the killed agent's worker to die with it")
    job.wait_rounds(4, timeout=60)
    assert job.rounds_formed()[3] == 2
    wait_synced(job, 4, 2)
    wait_step_at_size(job, 2, killed_at)
    say(capsys, sigkilled_agent_to_first_step_at_2=first_step_at_size(job, 2, killed_at) - killed_at)

    assert job.wait(timeout=120) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [3, 4, 3, 2]
    for name in (h1, h2, h3, h4):
        assert f"Agent on {name} joined with 1 slot(s)." in err
    assert f"Agent on {h2} is leaving (SIGTERM)" in err and f"Agent on {h2} left the job." in err
    # Its polls' connection closed with it: lost at once, not after the heartbeat timeout.
    assert_documented(logged(err, f"Agent on {h3} lost: its connection closed"))
    assert "Blacklisted" not in err and "blacklisted:   none" in err  # neither the host that left nor the one lost
    # Survivors went on in the processes they started in: no worker was started again.
    done = {e["pid"] for e in job.events("done")}
    assert done == before[h1] | worker_pids(job, h4)
    assert len({e["pid"] for e in job.events("start")}) == 4
    assert_epochs_complete(job, 12)
    assert_replicas_identical(job)
    for name in (h1, h4):  # the job's end ends its agents
        assert agents.wait(name, 30) == 0
        assert "The job ended: exiting." in agents.output(name)


def test_agents_refused_each_in_one_line_and_no_secret_printed(job: Job, agents: Agents) -> None:
    job.start(driver_args(agents, "-np", "2", "--max-np", "2"), ["--epochs", "1"])
    agents.start("intruder", namespace=False, secret_file=agents.wrong_file)
    assert agents.wait("intruder", 30) == 2
    line = "lightning-elastic agent: error: cannot trust"
    assert line in agents.output("intruder")
    assert "did not accept this agent's signature: wrong job secret" in agents.output("intruder")

    agents.start("greedy", "--slots", "3", namespace=False)
    assert agents.wait("greedy", 30) == 2
    assert "refused this agent: --slots 3 is more than the job's --max-np 2" in agents.output("greedy")

    agents.start("twin", namespace=False)
    wait_for(lambda: "Joined the job" in agents.output("twin"), 30, "the first agent named twin to join")
    agents.procs["twin-2"] = agents.procs.pop("twin")  # (the second's output goes to agent-twin.err)
    os.rename(job.dir / "agent-twin.err", job.dir / "agent-twin-first.err")
    agents.start("twin", namespace=False)
    assert agents.wait("twin", 30) == 2
    assert "another agent is connected for host twin" in agents.output("twin")

    job.kill()  # SIGTERM to the driver: the job ends, and so does its agent
    assert agents.procs["twin-2"].wait(30) == 0
    for name in ("intruder", "greedy", "twin"):
        said = [line for line in agents.output(name).splitlines() if "error" in line]
        assert len(said) == 1, said  # one line each
        assert_documented(logged(said[0], "error"))
    everything = job.stderr() + "".join(agents.output(n) for n in ("intruder", "greedy", "twin", "twin-first"))
    assert SECRET not in everything and WRONG not in everything
    assert "Rendezvous service rejected" in job.stderr()


@pytest.mark.slow
def test_an_agent_cut_off_is_lost_its_worker_stopped_and_it_joins_again_once_healed(
        job: Job, agents: Agents, hosts: NamespacedHosts, capsys: pytest.CaptureFixture[str]) -> None:
    h1, h2, h3 = hosts.names
    job.start(driver_args(agents, "-np", "3", "--min-np", "1", "--log-dir", str(job.dir / "logs")),
              [*TRAIN, "--epochs", "8"])
    for name in (h1, h2, h3):
        agents.start(name)
    job.wait_rounds(1, timeout=60)
    job.wait_steps(4)
    [cut_off] = worker_pids(job, h3)
    cut = time.time()
    hosts.partition(h3)  # its agent and worker run on, unheard
    job.wait_rounds(2, timeout=60)
    assert job.rounds_formed()[1] == 2
    wait_for(lambda: "stopping 1 worker(s)" in agents.output(h3), 30, "the cut-off agent to stop its worker")
    assert_documented(logged(agents.output(h3), "stopping 1 worker(s)"))
    wait_for(lambda: not os.path.exists(f"/proc/{cut_off}"), 10, "its worker to end")
    [lost] = [e for e in driver_events(job, "worker_failed") if e["host"] == h3]
    assert "its agent on le-h3 was lost" in lost["reason"]
    wait_step_at_size(job, 2, cut)
    recovered = first_step_at_size(job, 2, cut)
    hosts.heal(h3)  # the agent joins again: a host added, a joiner (no rollback)
    job.wait_rounds(3, timeout=60)
    assert job.rounds_formed()[2] == 3
    wait_synced(job, 3, 3)
    assert synced_step(job, 3) == last_step_before_round(job, 3)
    assert job.wait(timeout=120) == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [3, 2, 3]
    assert "Blacklisted" not in job.stderr()
    assert_epochs_complete(job, 8)
    assert_replicas_identical(job)
    say(capsys, cut_to_host_lost=lost["time"] - cut, cut_to_first_step_at_2=recovered - cut,
        heartbeat_timeout=HEARTBEAT_TIMEOUT)


@pytest.mark.slow
def test_a_rolling_replacement_of_every_agent_never_loses_the_state(job: Job, agents: Agents,
                                                                     hosts: NamespacedHosts) -> None:
    # As a Deployment's rolling update does: new pods first, then each old one deleted
    # (SIGTERM) as soon as the new ones are connected, not once they train.
    h1, h2, h3 = hosts.names
    h4 = hosts.unreachable
    job.start(driver_args(agents, "-np", "2", "--min-np", "1", "--max-np", "4"), [*TRAIN, "--epochs", "6"])
    for name in (h1, h2):
        agents.start(name)
    job.wait_rounds(1, timeout=60)
    job.wait_steps(4)
    old = worker_pids(job, h1) | worker_pids(job, h2)
    for name in (h3, h4):
        agents.start(name)
    wait_for(lambda: all(f"Agent on {n} joined" in job.stderr() for n in (h3, h4)), 30, "the new agents to join")
    for name in (h1, h2):
        agents.procs[name].send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 0, job.stderr()[-3000:]
    for name in (h1, h2):
        assert agents.wait(name, 30) == 0
    err = job.stderr()
    assert "failures:      0" in err and "Blacklisted" not in err
    # Every re-formation kept the live state: each round starts where the previous stopped.
    for number in range(2, len(job.rounds_formed()) + 1):
        assert synced_step(job, number) == last_step_before_round(job, number), f"round {number} rolled back"
    assert {e["pid"] for e in job.events("done")} == worker_pids(job, h3) | worker_pids(job, h4)
    assert not old & {e["pid"] for e in job.events("done")}
    assert_epochs_complete(job, 6)
    assert_replicas_identical(job)


def test_lightning_under_agents_trains_at_2_and_recovers_an_agent_sigkilled(job: Job, agents: Agents,
                                                                             hosts: NamespacedHosts) -> None:
    # Trainer(strategy="elastic_hvd") + ElasticCallback (examples/lightning_classifier.py)
    # on two agents' hosts: one agent SIGKILLed with its worker, the survivor goes on in its
    # own process, every epoch exactly once.
    h1, h2, _ = hosts.names
    lightning.start(job, driver_args(agents, "-np", "2", "--min-np", "1"), step_delay=0.2)
    for name in (h1, h2):
        agents.start(name)
    job.wait_rounds(1, timeout=60)
    assert job.rounds_formed() == [2]
    job.wait_steps(5)
    # Rank 0's host (the logger's writer moves to the survivor).
    [rank0] = [e for e in job.events("start") if e["rank"] == 0]
    lost = next(h for h in (h1, h2) if rank0["worker"].startswith(f"{h}["))
    kept = h2 if lost == h1 else h1
    [survivor] = worker_pids(job, kept)
    agents.procs[lost].send_signal(signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{rank0['pid']}"), 10, "the killed agent's worker to die with it")
    assert job.wait(timeout=180) == 0, job.stderr()[-3000:]
    err = job.stderr()
    assert job.world_sizes() == [2, 1]
    assert f"Agent on {lost} lost: its connection closed" in err
    assert "Blacklisted" not in err
    assert {e["pid"] for e in job.events("done")} == {survivor}  # the same process, not restarted
    history = lightning.assert_exactly_once(job)
    lightning.assert_final_state(job, history, start_size=2, end_size=1)
    lightning.assert_replicas_identical_after_resets(job)
    assert agents.wait(kept, 30) == 0
    assert "The job ended: exiting." in agents.output(kept)


def fork_server_of(pid: int) -> int:
    """The fork server a worker was forked from (its parent), checked to be one (--preload)."""
    parent = psutil.Process(pid).parent()
    assert parent is not None and "lightning_elastic.launcher.node.fork_server" in parent.cmdline(), parent
    return parent.pid


def test_preload_on_agents_forks_workers_from_each_hosts_server_which_ends_with_its_agent(job: Job, agents: Agents,
                                                                                          hosts: NamespacedHosts) -> None:
    job.start(driver_args(agents, "-np", "2", "--min-np", "1", "--max-np", "2", "--preload", "torch"),
              [*TRAIN, "--epochs", "4"])
    for name in hosts.names:
        agents.start(name)
    job.wait_rounds(1, timeout=60)
    job.wait_steps(4)
    # Two of them train (the first two to join); the third is a spare, its server started
    # before it has a worker.
    h1, h2 = sorted(h for h in hosts.names if worker_pids(job, h))
    [h3] = [h for h in hosts.names if h not in (h1, h2)]
    wait_for(lambda: len(re.findall("fork from a server that preloads torch", job.stderr())) == 3, 60,
             "a fork server on each agent's host")
    assert "started by its agent" in job.stderr()
    [victim] = worker_pids(job, h1)
    servers = {h1: fork_server_of(victim), h2: fork_server_of(next(iter(worker_pids(job, h2))))}
    assert servers[h1] != servers[h2]
    os.kill(victim, signal.SIGKILL)  # the worker, not its agent: the spare's replacement is forked warm
    replacement = wait_for(lambda: next(iter(worker_pids(job, h3)), None), 60, "the replacement on the spare")
    servers[h3] = fork_server_of(replacement)
    assert len(set(servers.values())) == 3
    job.wait_steps(max(e["step"] for e in job.events("step")) + 3)

    agents.procs[h2].send_signal(signal.SIGTERM)  # a graceful leave ends its host's server too
    assert agents.wait(h2, 30) == 0
    assert "Left the job: every worker has ended." in agents.output(h2)
    assert "Workers still running" not in agents.output(h2)  # not stopped at the leave timeout
    wait_for(lambda: not psutil.pid_exists(servers[h2]) or psutil.Process(servers[h2]).status() == psutil.STATUS_ZOMBIE,
             10, "the leaving agent's fork server to end")

    assert job.wait(timeout=120) == 0, job.stderr()[-3000:]
    assert "starting cold" not in job.stdout() + job.stderr()
    for name in (h1, h3):
        assert agents.wait(name, 30) == 0
    for pid in servers.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_epochs_complete(job, 4)
    assert_replicas_identical(job)


def test_the_driver_sigkilled_and_restarted_with_its_state_dir_adopts_the_agents_workers(job: Job, agents: Agents,
                                                                                         hosts: NamespacedHosts) -> None:
    """Two agents training; the driver SIGKILLed; the same command again (--state-dir): the
    agents keep their workers, join the new driver on the same address and list them; it
    adopts them (the same processes, the round not re-formed) and the job ends once."""
    h1, h2 = hosts.names[:2]
    args = driver_args(agents, "-np", "2", "--state-dir", str(job.dir / "state"), "--log-dir", str(job.dir / "logs"))
    example = [*TRAIN, "--epochs", "6"]
    for name in (h1, h2):
        agents.start(name)
    job.start(args, example)
    job.wait_rounds(1, timeout=60)
    job.wait_steps(4)
    pids = {e["pid"] for e in job.events("start")}
    assert len(pids) == 2

    kill_driver(job)
    killed_at = max_step(job)
    # The workers train on without a driver (collectives are peer to peer), their agents
    # keep them past the heartbeat timeout: within the driver's patience.
    wait_for(lambda: max_step(job) >= killed_at + 5, 30, "steps while no driver runs")
    start_again(job, "restart", args, example)
    assert job.wait(180) == 0, job.stderr()[-3000:]

    err = job.stderr()
    assert "Adopting the job in" in err and "driver outages: 1" in err
    for name in (h1, h2):
        assert f"Agent on {name} joined again with 1 slot(s): 1 of its 1 worker(s) adopted." in err
        assert "The restarted driver adopted 1 of the 1 worker(s) kept for it." in agents.output(name)
        assert agents.wait(name, 30) == 0 and "The job ended: exiting." in agents.output(name)
    assert job.world_sizes() == [2], "the round was re-formed"
    assert len({e["pid"] for e in job.events("start")}) == 2  # nothing started again
    assert {e["pid"] for e in job.events("done")} == pids  # the same worker processes finished
    for pid in pids:  # no step ran twice in a worker
        steps = [e["step"] for e in job.events("step") if e["pid"] == pid]
        assert len(steps) == len(set(steps)) and steps == sorted(steps)
    assert_epochs_complete(job, 6)
    assert_replicas_identical(job)
    restarted = driver_events(job, "driver_restarted")
    assert len(restarted) == 1 and restarted[0]["adopted"] == 2
    assert not (job.dir / "state" / "state.json").exists(), "the ended job left a state to adopt"
    for pid in pids:  # no stray process
        wait_for(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 10, f"worker {pid} to be gone")
