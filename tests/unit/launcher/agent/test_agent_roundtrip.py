"""One real agent (launcher/agent/run.py, in a thread) against the real service and board:
orders reach it over the signed channel, its worker runs, the driver's side sees its
output, signals and exit (small real processes; no job, no rendezvous of workers)."""

from __future__ import annotations

import io
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from lightning_elastic.launcher.agent.run import Agent, AgentSettings
from lightning_elastic.launcher.processes.agent import AgentLauncher
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.output import OutputSink
from lightning_elastic.launcher.service.agent_board import AgentBoard
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef" * 4


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)
    return value


def start_agent(board: AgentBoard, slots: int) -> tuple[RendezvousServer, Agent, threading.Thread, list[int]]:
    """A service for ``board`` and an agent of ``slots`` on "agent-host" running against it, in
    a thread whose exit code lands in the returned list; the caller ends both."""
    server = RendezvousServer(Registry(), SECRET, agents=board)
    server.start()
    agent = Agent(AgentSettings("127.0.0.1", server.port, slots, "agent-host", SECRET, leave_timeout=5.0))
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(agent.run()), daemon=True)
    thread.start()
    return server, agent, thread, code


@pytest.fixture
def wired() -> Iterator[tuple[AgentBoard, AgentLauncher, io.StringIO, Agent, list[int]]]:
    board = AgentBoard(max_slots=4, heartbeat_timeout=5.0, poll_seconds=0.5)
    server, agent, thread, code = start_agent(board, 2)
    out = io.StringIO()
    try:
        wait_for(lambda: board.serves("agent-host"), 10, "the agent to join")
        yield board, AgentLauncher(board, None, OutputSink(out)), out, agent, code
    finally:
        agent.request_leave()
        board.close()
        thread.join(10)
        server.close()


def spec(worker_id: str, code: str) -> WorkerSpec:
    return WorkerSpec(worker_id, "agent-host", (sys.executable, "-c", code), {"JOB_VAR": "from-driver"}, SECRET,
                      cwd="/nonexistent-on-this-host")


def test_a_worker_started_through_the_agent_runs_with_the_jobs_env_and_its_output_and_exit_come_back(wired):
    board, launcher, out, _, _ = wired
    code = ("import os, sys; print('hello from', os.environ['JOB_VAR'], os.getcwd() != '/nonexistent-on-this-host'); "
            "print('secret in env:', 'LIGHTNING_ELASTIC_SECRET' in os.environ); sys.exit(3)")
    proc = launcher.start(spec("w1", code), lambda: "[0] ")
    assert wait_for(lambda: proc.poll() is not None, 20, "the worker's exit") and proc.poll() == 3
    proc.finish_output(5)
    assert "[0] hello from from-driver True\n" in out.getvalue()
    assert "[0] secret in env: False\n" in out.getvalue()
    assert proc.pid > 0 and proc.exit_detail() == "" and not proc.host_gone


def test_a_signal_from_the_driver_reaches_the_worker_through_the_agent(wired):
    board, launcher, _, _, _ = wired
    proc = launcher.start(spec("w2", "import time; print('up', flush=True); time.sleep(60)"), lambda: "")
    wait_for(lambda: proc.pid, 20, "the worker to start")
    proc.signal(signal.SIGTERM)
    assert wait_for(lambda: proc.poll() is not None, 20, "the worker's exit") and proc.poll() == -signal.SIGTERM


def test_a_graceful_leave_takes_the_host_off_and_the_agent_exits_once_its_workers_have(wired):
    board, launcher, _, agent, code = wired
    proc = launcher.start(spec("w3", "import time; time.sleep(1.5)"), lambda: "")
    wait_for(lambda: proc.pid, 20, "the worker to start")
    agent.request_leave()
    wait_for(lambda: board.hosts() == [], 10, "the host to leave the list")
    assert proc.poll() is None  # its worker leaves in its own time (here: it ends)
    wait_for(lambda: code, 20, "the agent to exit")
    assert code == [0] and proc.poll() == 0 and not board.serves("agent-host")


def test_an_agent_that_loses_its_driver_stops_its_workers_and_joins_the_next_one():
    # The driver's pod restarted: the old service is gone, a new one serves on the same
    # port (the same Service) with the same secret.
    first = AgentBoard(max_slots=4, heartbeat_timeout=1.0, poll_seconds=0.25)
    server, agent, thread, code = start_agent(first, 1)
    port = server.port
    second = AgentBoard(max_slots=4, heartbeat_timeout=1.0, poll_seconds=0.25)
    restarted = RendezvousServer(Registry(), SECRET, agents=second, port=port)
    try:
        wait_for(lambda: first.serves("agent-host"), 10, "the agent to join the first driver")
        proc = AgentLauncher(first, None, OutputSink(io.StringIO())).start(
            spec("old-worker", "import time; time.sleep(60)"), lambda: "")
        pid = wait_for(lambda: proc.pid, 20, "the worker to start")
        server.close()  # the driver is gone (its agents' connections with it)
        restarted.start()
        wait_for(lambda: second.serves("agent-host"), 20, "the agent to join the restarted driver")
        assert wait_for(lambda: not _alive(pid), 10, "the old driver's worker to be stopped")
    finally:
        agent.request_leave()
        second.close()
        thread.join(10)
        restarted.close()
    assert code == [0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_preload_on_an_agents_host_forks_its_workers_from_a_server_the_agent_ends_at_its_leave(wired, tmp_path,
                                                                                                 caplog):
    # --preload with agents: the driver starts the host's fork server through its agent (as
    # through ssh), its workers are forks of it; at a graceful leave the agent ends the
    # server once the workers have ended (SIGTERM: it removes its directory), and exits.
    import os

    from lightning_elastic.launcher.node.fork_client import server_directory
    from lightning_elastic.launcher.processes.warm_start import WarmStarts
    from lightning_elastic.protocol import ENV_SECRET_FD

    board, launcher, out, agent, code = wired
    caplog.set_level(logging.INFO)
    warm = WarmStarts(launcher, ("json",), lambda host: False, ENV_SECRET_FD)
    script = tmp_path / "worker.py"
    script.write_text("import os, time\nprint('parent', os.getppid(), flush=True)\ntime.sleep(1.0)\n")
    proc = warm.start(WorkerSpec("w5", "agent-host", (sys.executable, str(script)), {}, SECRET, cwd=str(tmp_path)),
                      lambda: "[w5] ")
    [server] = warm._servers.values()
    server_pid = wait_for(lambda: server.process.pid, 20, "the fork server to start")
    assert "Workers on agent-host fork from a server that preloads json (started by its agent)." in caplog.text
    assert wait_for(lambda: proc.poll() is not None, 30, "the worker's exit")
    proc.finish_output(5)
    assert proc.poll() == 0, out.getvalue()
    assert f"[w5] parent {server_pid}\n" in out.getvalue(), out.getvalue()  # forked by the server
    assert os.path.isdir(server_directory(server.token))
    agent.request_leave()
    wait_for(lambda: code, 20, "the agent to exit")
    assert code == [0]
    assert not _alive(server_pid) and not os.path.exists(server_directory(server.token))
    assert "Workers still running" not in caplog.text  # not stopped at the leave timeout: ended at once


def test_an_agent_that_loses_its_driver_kills_its_workers_and_ends_its_fork_server_cleanly(tmp_path):
    # The host is lost to the job: its workers are SIGKILLed, its fork server (no state to
    # lose) gets SIGTERM and removes its directory, leaving nothing on the machine.
    import os

    from lightning_elastic.launcher.node.fork_client import server_directory
    from lightning_elastic.launcher.processes.warm_start import WarmStarts
    from lightning_elastic.protocol import ENV_SECRET_FD

    board = AgentBoard(max_slots=4, heartbeat_timeout=1.0, poll_seconds=0.25)
    server, agent, thread, code = start_agent(board, 1)
    try:
        wait_for(lambda: board.serves("agent-host"), 10, "the agent to join")
        warm = WarmStarts(AgentLauncher(board, None, OutputSink(io.StringIO())), ("json",), lambda host: False,
                          ENV_SECRET_FD)
        script = tmp_path / "worker.py"
        script.write_text("import time\ntime.sleep(60)\n")
        proc = warm.start(WorkerSpec("w1", "agent-host", (sys.executable, str(script)), {}, SECRET,
                                     cwd=str(tmp_path)), lambda: "")
        [fork_server] = warm._servers.values()
        server_pid = wait_for(lambda: fork_server.process.pid, 20, "the fork server to start")
        client = wait_for(lambda: proc.pid, 20, "the worker to start")
        directory = server_directory(fork_server.token)
        wait_for(lambda: os.path.isdir(directory), 20, "the fork server to listen")
        server.close()  # the driver is gone
        wait_for(lambda: not _alive(client) and not _alive(server_pid), 20, "the agent to end its workers")
        assert not os.path.exists(directory)  # ended by SIGTERM, not SIGKILL
    finally:
        agent.request_leave()
        thread.join(10)
        server.close()
    assert code == [0]


def _record(worker_id: str, local_rank: int, pid: int):
    from lightning_elastic.launcher.job.slots import SlotKey  # noqa: PLC0415
    from lightning_elastic.launcher.job.state import WorkerRecord  # noqa: PLC0415

    return WorkerRecord(worker_id, SlotKey("agent-host", local_rank), 0.0, keeper_pid=pid, via_agent=True)


def test_with_a_patience_an_agent_keeps_its_workers_for_the_restarted_driver_which_adopts_the_saved_ones():
    """--state-dir: the driver killed, a new one on the same port whose saved state has
    "kept" (its pid) and not "unsaved": the agent joins it listing both; "kept" is adopted,
    the same process, its output and signals through the new driver; "unsaved" is killed."""
    first = AgentBoard(max_slots=4, heartbeat_timeout=1.0, poll_seconds=0.25, patience=30.0)
    server, agent, thread, code = start_agent(first, 2)
    port = server.port
    second = AgentBoard(max_slots=4, heartbeat_timeout=5.0, poll_seconds=0.25, patience=30.0)
    restarted = RendezvousServer(Registry(), SECRET, agents=second, port=port)
    try:
        wait_for(lambda: first.serves("agent-host"), 10, "the agent to join the first driver")
        old = AgentLauncher(first, None, OutputSink(io.StringIO()))
        looping = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                   "for i in range(600):\n    print('tick', i, flush=True); time.sleep(0.1)")
        kept = old.start(spec("kept", looping), lambda: "")
        unsaved = old.start(spec("unsaved", "import time; time.sleep(60)"), lambda: "")
        kept_pid = wait_for(lambda: kept.pid, 20, "the kept worker to start")
        unsaved_pid = wait_for(lambda: unsaved.pid, 20, "the unsaved worker to start")
        server.close()  # the driver SIGKILLed: its connections gone
        # (The restarted driver comes when it comes: before or after the agent's heartbeat
        # timeout, the agent keeps its workers for it.)
        out = io.StringIO()
        new = AgentLauncher(second, None, OutputSink(out))
        adopted = new.adopt(_record("kept", 0, kept_pid), lambda: "[kept] ")
        restarted.start()
        wait_for(lambda: second.serves("agent-host") and adopted.pid == kept_pid and "[kept] tick" in out.getvalue(),
                 20, "the agent to join the restarted driver and its worker's output to come")
        assert _alive(kept_pid) and adopted.poll() is None
        assert wait_for(lambda: not _alive(unsaved_pid), 10, "the unsaved worker to be stopped")
        adopted.signal(signal.SIGTERM)
        assert wait_for(lambda: adopted.poll() is not None, 20, "the adopted worker's exit") and adopted.poll() == 7
    finally:
        agent.request_leave()
        second.close()
        thread.join(10)
        restarted.close()
    assert code == [0]


def test_an_agent_stops_the_workers_it_kept_once_its_patience_has_passed_with_no_driver():
    first = AgentBoard(max_slots=4, heartbeat_timeout=1.0, poll_seconds=0.25, patience=2.0)
    server, agent, thread, code = start_agent(first, 1)
    try:
        wait_for(lambda: first.serves("agent-host"), 10, "the agent to join")
        proc = AgentLauncher(first, None, OutputSink(io.StringIO())).start(
            spec("w", "import time; time.sleep(60)"), lambda: "")
        pid = wait_for(lambda: proc.pid, 20, "the worker to start")
        server.close()
        assert wait_for(lambda: not _alive(pid), 20, "the kept worker to be stopped after the patience")
    finally:
        agent.request_leave()
        thread.join(10)
    assert code == [0]
