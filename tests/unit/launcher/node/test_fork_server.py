"""launcher/node/fork_server.py and fork_client.py: workers forked from a warm interpreter.

Real processes: a fork server started as the driver starts it (``WarmStart``), preloading a
cheap module, and clients started as the local launcher starts workers (``spawn_worker``).
A forked worker must look to the driver exactly like one started cold: its exit status,
signals, output, secret, environment, arguments and working directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lightning_elastic.launcher.errors import StartError
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.node.fork_client import server_directory
from lightning_elastic.launcher.node.fork_rules import Program, environment_difference, parse_command
from lightning_elastic.launcher.node.fork_server import REQUEST_PATIENCE
from lightning_elastic.launcher.node.spawn import spawn_worker
from lightning_elastic.launcher.processes.warm_start import CLIENT_MODULE, SERVER_MODULE, WarmStarts
from lightning_elastic.protocol import ENV_SECRET_FD
from tests.troubleshooting_rows import documented_row
from tests.unit.proc_tools import BOUND

pytestmark = pytest.mark.timeout(60)

SECRET = "fork-secret-7"

WORKER = r"""
import json, os, random, signal, sys, time
fd = os.environ.get("LIGHTNING_ELASTIC_SECRET_FD")
print(json.dumps({
    "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
    "parent": os.getppid(), "group": os.getpgid(0), "session": os.getsid(0), "x": os.environ.get("X"),
    "rank": os.environ.get("RANK"), "preloaded": "wave" in sys.modules, "random": random.random(),
    "secret": os.read(int(fd), 100).decode() if fd else None,
}), flush=True)
mode = sys.argv[1]
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    print("ready", flush=True)
    time.sleep(60)
elif mode == "sleep":
    print("ready", flush=True)
    time.sleep(60)
elif mode == "raise":
    raise RuntimeError("boom from the script")
sys.exit(int(mode))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "worker.py"
    path.parent.mkdir()
    path.write_text(WORKER)
    return path


class Server:
    """A fork server started as ``WarmStarts`` starts one (as a worker), and its clients."""

    def __init__(self, modules: tuple[str, ...], env: dict[str, str], cwd: Path) -> None:
        self.token = secrets.token_hex(8)
        self.directory = Path(server_directory(self.token))
        command = [sys.executable, "-m", SERVER_MODULE, self.token, ",".join(modules)]
        self.process = spawn_worker(command, env, SECRET, str(cwd), subprocess.DEVNULL, ENV_SECRET_FD)
        self.pid = self.process.pid

    def client(self, command: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        wrapped = [sys.executable, "-m", CLIENT_MODULE, self.token, ENV_SECRET_FD, "--", *command]
        return spawn_worker(wrapped, env, SECRET, str(cwd), subprocess.PIPE, ENV_SECRET_FD)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(BOUND)


@pytest.fixture
def warm(tmp_path):
    started = []

    def make(modules=("wave",), env=None) -> Server:
        server = Server(modules, env or base_env(), tmp_path)
        started.append(server)
        return server

    yield make
    for server in started:
        server.process.kill()
        server.process.wait(BOUND)
        shutil.rmtree(server.directory, ignore_errors=True)


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, X="1", **extra)
    env.pop(ENV_SECRET_FD, None)
    return env


def preloading(warm, tmp_path: Path, module: str, source: str) -> tuple[Server, dict[str, str]]:
    """A server that preloads ``module`` (written from ``source`` into ``tmp_path``), and the
    environment, with ``tmp_path`` on PYTHONPATH, that its clients must use."""
    (tmp_path / f"{module}.py").write_text(source)
    env = base_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return warm((module,), env), env


def start(server: Server, script: Path, tmp_path: Path, *args: str, env=None) -> subprocess.Popen[bytes]:
    return server.client([sys.executable, str(script), *args], env or base_env(), tmp_path)


def first_line(proc: subprocess.Popen[bytes]) -> dict:
    """The worker's report (its first line of JSON)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, "no report before EOF"
        if line.startswith(b"{"):
            return json.loads(line)


def cold_start(proc: subprocess.Popen[bytes]) -> tuple[dict, str]:
    """The report of a worker that exits by itself, and the client's line before it."""
    text = output(proc)
    assert proc.wait(BOUND) == 0, text
    report = next(line for line in text.splitlines() if line.startswith("{"))
    return json.loads(report), text


def wait_line(proc: subprocess.Popen[bytes], text: bytes) -> None:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"no {text!r} before EOF"
        if line.strip() == text:
            return


def output(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    return proc.stdout.read().decode()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + BOUND
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.02)


# ----- what is forked ---------------------------------------------------------------------


def test_a_script_or_a_module_of_this_interpreter_is_forked(tmp_path):
    env = {"PATH": os.environ["PATH"]}
    assert parse_command([sys.executable, "train.py", "--n", "3"], env, str(tmp_path)) == \
        Program(str(tmp_path / "train.py"), None, ("--n", "3"), False, "train.py")
    assert parse_command([sys.executable, "-u", "-m", "pkg.train", "-x"], env, "/") == \
        Program(None, "pkg.train", ("-x",), True)


@pytest.mark.parametrize("command, why", [
    (["/bin/sh", "train.sh"], "is not this fork server's interpreter"),
    ([sys.executable, "-X", "importtime", "train.py"], "only 'python [-u] SCRIPT ...'"),
    ([sys.executable, "-c", "print(1)"], "only 'python [-u] SCRIPT ...'"),
    ([sys.executable], "only 'python [-u] SCRIPT ...'"),
])
def test_anything_else_is_started_cold_with_the_reason(command, why, tmp_path):
    answer = parse_command(command, {"PATH": os.environ["PATH"]}, str(tmp_path))
    assert isinstance(answer, str) and why in answer


def test_another_venv_on_the_same_base_interpreter_is_not_this_one(tmp_path):
    other = tmp_path / "venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    answer = parse_command([str(other / "python"), "train.py"], {}, str(tmp_path))
    assert isinstance(answer, str) and "is not this fork server's interpreter" in answer


def test_only_variables_read_after_start_up_may_differ():
    ours = {"PATH": "/bin", "PYTHONPATH": "a", "RANK": "0", "LIGHTNING_ELASTIC_WORKER_ID": "h[0]#0"}
    theirs = {"PATH": "/bin", "PYTHONPATH": "b", "RANK": "3", "LIGHTNING_ELASTIC_WORKER_ID": "h[1]#4",
              "CUDA_VISIBLE_DEVICES": "1", "TORCH_LOGS": "+dynamo", "SSH_CONNECTION": "10.0.0.1 51234 10.0.0.2 22"}
    assert environment_difference(ours, theirs) == ["PYTHONPATH", "TORCH_LOGS"]


# ----- a forked worker, as the driver sees it ---------------------------------------------


def test_a_forked_worker_has_the_clients_arguments_environment_secret_and_session(warm, script, tmp_path):
    w = warm()
    proc = start(w, script, tmp_path, "7", env=base_env(RANK="5"))
    seen = first_line(proc)
    assert proc.wait(BOUND) == 7
    assert seen["parent"] == w.pid  # forked, not started cold
    assert seen["preloaded"]
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script), "7"]
    assert seen["cwd"] == str(tmp_path)
    assert seen["path0"] == str(script.parent)
    assert (seen["x"], seen["rank"], seen["secret"]) == ("1", "5", SECRET)
    assert seen["group"] == seen["pid"] == seen["session"]  # a session of its own, as a cold start


def test_two_forked_workers_draw_different_random_numbers(warm, script, tmp_path):
    w = warm()
    a, b = start(w, script, tmp_path, "0"), start(w, script, tmp_path, "0")
    assert first_line(a)["random"] != first_line(b)["random"]
    assert (a.wait(BOUND), b.wait(BOUND)) == (0, 0)


def test_an_uncaught_exception_exits_1_with_the_scripts_own_traceback(warm, script, tmp_path):
    proc = start(warm(), script, tmp_path, "raise")
    first_line(proc)
    text = output(proc)
    assert proc.wait(BOUND) == 1
    assert "RuntimeError: boom from the script" in text
    assert "fork_server" not in text and "runpy" not in text, text  # as a cold start shows it


def test_sigterm_to_the_clients_group_reaches_the_worker(warm, script, tmp_path):
    proc = start(warm(), script, tmp_path, "term")
    first_line(proc)
    wait_line(proc, b"ready")
    os.killpg(proc.pid, signal.SIGTERM)  # as the driver's stop: the client's process group
    assert proc.wait(BOUND) == 42


def test_a_worker_killed_by_a_signal_makes_its_client_end_by_that_signal(warm, script, tmp_path):
    proc = start(warm(), script, tmp_path, "sleep")
    worker = first_line(proc)["pid"]
    wait_line(proc, b"ready")
    os.kill(worker, signal.SIGKILL)  # a test or the OOM killer: the worker itself
    assert proc.wait(BOUND) == -signal.SIGKILL


def test_sigkill_of_the_clients_group_kills_the_worker_too(warm, script, tmp_path):
    proc = start(warm(), script, tmp_path, "sleep")
    worker = first_line(proc)["pid"]
    wait_line(proc, b"ready")
    os.killpg(proc.pid, signal.SIGKILL)  # cannot be forwarded: the server sees the client go
    assert proc.wait(BOUND) == -signal.SIGKILL
    wait_gone(worker)


def test_sigterm_stops_the_server_its_workers_and_removes_its_directory(warm, script, tmp_path):
    w = warm()
    proc = start(w, script, tmp_path, "sleep")
    worker = first_line(proc)["pid"]
    assert stat.S_IMODE(w.directory.stat().st_mode) == 0o700  # only its user may connect
    w.stop()
    wait_gone(worker)
    assert proc.wait(BOUND) != 0
    assert not w.directory.exists()


# ----- starting cold ----------------------------------------------------------------------


def test_a_different_environment_starts_cold_and_says_why(warm, script, tmp_path):
    w = warm()
    start(w, script, tmp_path, "0").wait(BOUND)  # the server took the first worker's environment
    seen, text = cold_start(start(w, script, tmp_path, "0", env=base_env(PYTHONHASHSEED="3")))
    assert seen["parent"] != w.pid and seen["secret"] == SECRET
    line = text.splitlines()[0]
    assert line == "lightning-elastic: --preload: the environment differs from the fork server's in PYTHONHASHSEED: " \
                   "starting cold"
    assert documented_row(line), "docs/troubleshooting.md has no row for it"


def test_a_module_that_cannot_be_imported_leaves_every_worker_cold(warm, script, tmp_path):
    seen, text = cold_start(start(warm(("no_such_module_here",)), script, tmp_path, "0"))
    assert not seen["preloaded"] and seen["secret"] == SECRET
    assert text.splitlines()[0] == ("lightning-elastic: --preload: the fork server cannot import 'no_such_module_here' "
                                    "(ModuleNotFoundError: No module named 'no_such_module_here'): starting cold")


def test_a_server_with_a_second_thread_is_not_forked(warm, script, tmp_path):
    w, env = preloading(warm, tmp_path, "starts_a_thread",
                        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    seen, text = cold_start(start(w, script, tmp_path, "0", env=env))
    assert seen["parent"] != w.pid
    assert "the fork server runs 2 threads" in text


def test_variables_a_preloaded_module_sets_at_import_are_the_workers_too(warm, script, tmp_path):
    # As Lightning sets torch's PYTORCH_NVML_BASED_CUDA_CHECK when imported: a worker started
    # cold would have it from its own import, and must not be refused for it either.
    (tmp_path / "scripts" / "reads.py").write_text(
        "import os, sys\nprint(os.environ.get('SET_AT_IMPORT'), os.getppid(), flush=True)\n")
    w, env = preloading(warm, tmp_path, "sets_a_variable", "import os\nos.environ['SET_AT_IMPORT'] = 'yes'\n")
    proc = start(w, tmp_path / "scripts" / "reads.py", tmp_path, env=env)
    text = output(proc)
    assert proc.wait(BOUND) == 0
    assert text.split() == ["yes", str(w.pid)], text


def test_a_server_with_cuda_initialised_is_not_forked(warm, script, tmp_path):
    # No GPU here: a preloaded module stands in for a torch whose CUDA context exists (a
    # preloaded module that touched a GPU); the decision is what is tested.
    w, env = preloading(warm, tmp_path, "fake_cuda_torch",
                        "import sys, types\n"
                        "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))\n")
    seen, text = cold_start(start(w, script, tmp_path, "0", env=env))
    assert seen["parent"] != w.pid
    assert "initialised CUDA in the fork server" in text


def test_a_server_directory_other_users_could_enter_is_refused(script, tmp_path):
    token = secrets.token_hex(8)
    directory = Path(server_directory(token))
    directory.mkdir(mode=0o755)  # as someone who read the token in ps could have made it first
    directory.chmod(0o755)
    try:
        client = [sys.executable, "-m", CLIENT_MODULE, token, ENV_SECRET_FD, "--", sys.executable, str(script), "0"]
        seen, text = cold_start(spawn_worker(client, base_env(), SECRET, str(tmp_path), subprocess.PIPE, ENV_SECRET_FD))
    finally:
        directory.rmdir()
    assert seen["secret"] == SECRET  # the descriptors and the secret went to nobody else
    assert f"--preload: {directory} is not a directory of this user's alone: starting cold" in text


# ----- WarmStarts: which server a worker is forked from -----------------------------------


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status: int | None = None
        self.signals: list[int] = []

    def poll(self):
        return self.status

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.status = -sig

    def wait(self, timeout: float):
        return self.status

    def finish_output(self, timeout: float = 5.0) -> None:
        pass


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[tuple[WorkerSpec, FakeProcess]] = []
        self.refuse: set[str] = set()

    def start(self, spec: WorkerSpec, prefix) -> FakeProcess:
        if spec.host in self.refuse:
            raise StartError(f"cannot run ssh to start a worker on {spec.host}")
        proc = FakeProcess(1000 + len(self.started))
        self.started.append((spec, proc))
        return proc


def spec_on(host: str) -> WorkerSpec:
    return WorkerSpec(worker_id=f"{host}[0]#0", host=host, command=("python", "train.py"), env={"A": "1"},
                      secret=SECRET, cwd="/work")


def test_local_hosts_share_one_server_and_every_other_host_has_its_own():
    inner = FakeLauncher()
    warm = WarmStarts(inner, ("torch", "lightning.pytorch"), lambda host: host.startswith("127."), ENV_SECRET_FD)
    for host in ("127.0.0.1", "127.0.0.2", "node-a", "node-a", "node-b"):
        warm.start(spec_on(host), lambda: "[0] ")
    servers = [spec for spec, _ in inner.started if spec.command[2] == SERVER_MODULE]
    assert [s.host for s in servers] == ["127.0.0.1", "node-a", "node-b"]
    server = servers[0]
    token = server.command[3]
    assert server.command == ("python", "-m", SERVER_MODULE, token, "torch,lightning.pytorch", "--", "python", "train.py")
    assert server.env == {"A": "1"}  # the worker's own environment, as the server must import under it
    workers = [spec for spec, _ in inner.started if spec.command[2] == CLIENT_MODULE]
    assert workers[1].command == ("python", "-m", CLIENT_MODULE, token, ENV_SECRET_FD, "--", "python", "train.py")
    assert workers[0].command[3] == workers[1].command[3] != workers[2].command[3] == workers[3].command[3]


def test_a_server_that_ended_is_started_again_and_one_that_cannot_start_leaves_workers_cold():
    inner = FakeLauncher()
    warm = WarmStarts(inner, ("torch",), lambda host: False, ENV_SECRET_FD)
    warm.prepare(spec_on("node-a"))  # a listed spare: its server before any worker
    first = inner.started[0][1]
    first.status = -9  # its host was lost
    warm.start(spec_on("node-a"), lambda: "[0] ")
    assert [spec.command[2] for spec, _ in inner.started] == [SERVER_MODULE, SERVER_MODULE, CLIENT_MODULE]
    inner.refuse.add("node-b")
    with pytest.raises(StartError):
        warm.start(spec_on("node-b"), lambda: "[1] ")  # the worker's own start fails the same way, and says so
    warm.close()
    assert inner.started[1][1].signals == [signal.SIGTERM]  # so that it removes its directory


def test_a_directory_left_by_a_sigkilled_server_is_removed_by_the_next_one(warm, tmp_path):
    dead = warm()
    wait_for_path(dead.directory / "socket")
    dead.process.kill()  # SIGKILLed with its driver: no clean-up of its own
    dead.process.wait(BOUND)
    assert dead.directory.exists()
    live = warm()
    wait_for_path(live.directory / "socket")
    assert not dead.directory.exists()
    survivor = warm()  # a live server's directory is never touched
    wait_for_path(survivor.directory / "socket")
    assert live.directory.exists()


def wait_for_path(path: Path) -> None:
    deadline = time.monotonic() + BOUND
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.02)


def test_a_stalled_or_garbled_client_costs_the_server_a_bounded_wait_and_nothing_else(warm, script, tmp_path):
    # Hostile peers (of this user: the directory admits no other): one connects and sends
    # nothing, one sends a line that is not a request. Each is dropped (the stalled one after
    # REQUEST_PATIENCE), and the next worker is still forked.
    w = warm()
    wait_for_path(w.directory / "socket")
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(str(w.directory / "socket"))
    garbled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbled.connect(str(w.directory / "socket"))
    garbled.sendall(b"[1, 2, 3]\n")
    try:
        seen = first_line(proc := start(w, script, tmp_path, "0"))
        assert proc.wait(BOUND + REQUEST_PATIENCE) == 0
        assert seen["parent"] == w.pid
        assert stalled.recv(1) == b"" and garbled.recv(1) == b""  # both dropped, no answer
    finally:
        stalled.close()
        garbled.close()


def test_a_child_that_has_not_made_its_session_yet_is_killed_by_its_pid():
    # Issue 34, point 8: a worker forked for a client that died at once was signalled by
    # process group alone; before its setsid it has none, and it ran on unsupervised.
    from lightning_elastic.launcher.node.fork_server import _kill_group  # noqa: PLC0415

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in our group, no session
    try:
        assert os.getpgid(child.pid) != child.pid
        _kill_group(child.pid)
        assert child.wait(BOUND) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(BOUND)


def test_a_child_in_its_own_session_is_killed_with_what_it_started(tmp_path):
    from lightning_elastic.launcher.node.fork_server import _kill_group  # noqa: PLC0415

    pid_file = tmp_path / "grandchild"
    child = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")], start_new_session=True)
    try:
        deadline = time.monotonic() + BOUND
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        grandchild = psutil.Process(int(pid_file.read_text()))
        _kill_group(child.pid)
        assert child.wait(BOUND) == -signal.SIGKILL
        grandchild.wait(BOUND)  # (reaped by init once its parent is gone)
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        child.wait(BOUND)
