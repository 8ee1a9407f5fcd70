"""Every bad input gets its one line (issue 26, items 3, 4 and 7), through the real CLI.

Each case runs ``lightning-elastic`` as a user would, in a directory of its own, and checks
the exit status and the exact line the input gets: an invalid option is the only line on
stderr, with exit status 2 and nothing started; a job that ends says it in its last line; a
warning the driver logs is one line among the others. Then ``docs/troubleshooting.md`` must
have a table row for that line, its values written as NAMES (``{path}`` becomes ``PATH``),
so the documentation and the behaviour cannot drift apart. A few cases run real workers:
the driver's own behaviour (a ``.py`` command without ``python``, a host whose name does not
resolve beside one that does, a ``--log-dir`` used twice, a script that never joins).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lightning_elastic.launcher.hosts.network import local_addresses
from tests.integration.harness import LAUNCHER, REPO, processes_running, wait_for

pytestmark = pytest.mark.integration

TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
PYTHON = sys.executable
# The driver's own interpreter, which runs a .py command: the one the launcher's script names.
DRIVER_PYTHON = LAUNCHER.read_text().splitlines()[0].removeprefix("#!").strip()
UNRESOLVABLE = "nosuch-host.invalid"  # RFC 6761: a name under .invalid never resolves
FOREIGN = "198.51.100.7"  # TEST-NET-2: never an address of this machine

# A script that joins the job, trains one step and says which port the driver serves on.
JOINS = """\
import os
import lightning_elastic as le

le.init()
print("MASTER_PORT", os.environ["MASTER_PORT"], flush=True)
state = le.ObjectState(step=0)


@le.run
def train(state):
    state.step += 1
    state.commit()


train(state)
"""

PREFIXES = {
    "error": "lightning-elastic: error: ",  # an invalid input: the only line, exit status 2
    "job": "lightning-elastic: job failed: ",  # how the job ended: the last line
}


@dataclasses.dataclass(frozen=True)
class Line:
    """A line the CLI prints: its template, and the values this run fills in."""

    template: str
    values: dict[str, object]

    @property
    def text(self) -> str:
        return self.template.format(**self.values)

    @property
    def documented(self) -> str:
        """As docs/troubleshooting.md writes it: each value as its NAME."""
        return self.template.format(**{name: name.upper() for name in self.values})


@dataclasses.dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The case's own directory; afterwards no process started from it may be left running."""
    yield tmp_path
    try:
        wait_for(lambda: not processes_running(str(tmp_path)), 15, "the job's processes to exit")
    except AssertionError:
        stray = processes_running(str(tmp_path))
        for proc in stray:
            proc.kill()
        pytest.fail(f"processes left behind: {[p.pid for p in stray]}")


def cli(workdir: Path, *argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> Run:
    """``lightning-elastic ARGV`` run in ``workdir`` (bounded: killed after ``timeout``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ELASTIC_")}
    environ.update(env or {})
    done = subprocess.run([str(LAUNCHER), *argv], cwd=workdir, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    return Run(done.returncode, done.stdout, done.stderr)


def documented_lines() -> set[str]:
    """The message cell (the first, in backticks) of every table row of the troubleshooting page."""
    rows = set()
    for line in TROUBLESHOOTING.read_text().splitlines():
        match = re.match(r"\| `(.+?)` \|", line)
        if match:
            rows.add(match.group(1))
    return rows


def assert_documented(line: Line) -> None:
    assert line.documented in documented_lines(), (
        f"docs/troubleshooting.md has no row for `{line.documented}`: add one, its message cell in backticks"
    )


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def interfaces() -> str:
    return ", ".join(sorted(set(local_addresses().values())))


# ----- invalid inputs: the only line on stderr, exit status 2 --------------------------------
#
# Each case: (what to set up in the directory) -> (argv, environment, the line).

Case = Callable[[Path], tuple[list[str], dict[str, str], Line]]


def command_not_on_path(d: Path):
    return ["launch", "-np", "1", "nosuch-program-xyz"], {}, Line(
        "COMMAND: {name}: no such program on PATH", {"name": "nosuch-program-xyz"})


def command_here_but_not_on_path(d: Path):
    executable(d / "run.sh")
    return ["launch", "-np", "1", "run.sh"], {}, Line(
        "COMMAND: {name}: no such program on PATH (to run the file here, write ./{name})", {"name": "run.sh"})


def command_file_missing(d: Path):
    return ["launch", "-np", "1", "./nope.sh"], {}, Line("COMMAND: {path}: no such file", {"path": "./nope.sh"})


def py_command_missing(d: Path):
    return ["launch", "-np", "1", "missing.py"], {}, Line("COMMAND: {path}: no such file", {"path": "missing.py"})


def command_not_executable(d: Path):
    (d / "run.sh").write_text("echo hi\n")
    return ["launch", "-np", "1", "./run.sh"], {}, Line(
        "COMMAND: {path}: not executable (chmod +x it, or name its interpreter first)", {"path": "./run.sh"})


def command_is_a_directory(d: Path):
    (d / "tools").mkdir()
    return ["launch", "-np", "1", "./tools"], {}, Line(
        "COMMAND: {path}: is a directory, expected a program or a script", {"path": "./tools"})


def command_name_too_long(d: Path):  # stat fails with ENAMETOOLONG: was a traceback (issue 34, point 11)
    program = "./" + "x" * 300
    return ["launch", "-np", "1", program], {}, Line(
        "COMMAND: {path}: cannot be examined ({reason}), expected a program or a script this user can reach",
        {"path": program, "reason": "File name too long"})


def py_command_name_too_long(d: Path):
    script = "y" * 300 + ".py"
    return ["launch", "-np", "1", script], {}, Line(
        "COMMAND: {path}: cannot be examined ({reason}), expected a program or a script this user can reach",
        {"path": script, "reason": "File name too long"})


def command_in_a_symlink_loop(d: Path):  # ELOOP: was "no such file", which it is not
    (d / "a").symlink_to("b")
    (d / "b").symlink_to("a")
    return ["launch", "-np", "1", "./a"], {}, Line(
        "COMMAND: {path}: cannot be examined ({reason}), expected a program or a script this user can reach",
        {"path": "./a", "reason": "Too many levels of symbolic links"})


def command_under_an_unsearchable_directory(d: Path):  # EACCES: root searches any directory
    if os.geteuid() == 0:
        pytest.skip("root may search any directory")
    (d / "closed").mkdir()
    executable(d / "closed" / "run.sh")
    (d / "closed").chmod(0o600)
    return ["launch", "-np", "1", "./closed/run.sh"], {}, Line(
        "COMMAND: {path}: cannot be examined ({reason}), expected a program or a script this user can reach",
        {"path": "./closed/run.sh", "reason": "Permission denied"})


def log_dir_is_a_file(d: Path):
    (d / "logs").write_text("")
    return ["launch", "--log-dir", str(d / "logs"), PYTHON, "-c", "pass"], {}, Line(
        "--log-dir: {path} is a file, expected a directory", {"path": d / "logs"})


def log_dir_under_a_file(d: Path):
    (d / "logs").write_text("")
    return ["launch", "--log-dir", str(d / "logs" / "job"), PYTHON, "-c", "pass"], {}, Line(
        "--log-dir: cannot create {path}: {reason}", {"path": d / "logs" / "job", "reason": "Not a directory"})


def state_dir_is_a_file(d: Path):
    (d / "state").write_text("")
    return ["launch", "--state-dir", str(d / "state"), PYTHON, "-c", "pass"], {}, Line(
        "--state-dir: {path} is a file, expected a directory", {"path": d / "state"})


def state_dir_of_another_user(d: Path):
    (d / "state").mkdir(mode=0o700)
    os.chown(d / "state", 65534, 65534)  # nobody's (the tests run as root, which may chown)
    return ["launch", "--state-dir", str(d / "state"), PYTHON, "-c", "pass"], {}, Line(
        "--state-dir: {path} is owned by uid {uid}, not by this user (uid {me}): expected a directory of your own "
        "(a new one is created with mode 0700)", {"path": d / "state", "uid": 65534, "me": os.geteuid()})


def state_dir_writable_by_others(d: Path):
    (d / "state").mkdir()
    (d / "state").chmod(0o777)  # as a directory made in /tmp for everyone
    return ["launch", "--state-dir", str(d / "state"), PYTHON, "-c", "pass"], {}, Line(
        "--state-dir: {path} is writable by group or others (mode {mode}): expected a directory only its owner "
        "can write (chmod 700 {path})", {"path": d / "state", "mode": 777})


def state_dir_with_slurm(d: Path):
    return ["launch", "--slurm", "-np", "2", "--state-dir", str(d / "state"), PYTHON, "-c", "pass"], {}, Line(
        "--state-dir: not supported with --slurm (driver restart needs workers started here or over ssh: -H, "
        "--hostfile or --host-discovery-script)", {})


def driver_patience_not_positive(d: Path):
    return ["launch", "--driver-patience", "0", PYTHON, "-c", "pass"], {}, Line(
        "--driver-patience: expected a positive number of seconds, got {value}", {"value": 0.0})


def driver_address_foreign(d: Path):
    return ["launch", "--driver-address", FOREIGN, PYTHON, "-c", "pass"], {}, Line(
        "--driver-address: {address} is not an address of this machine", {"address": FOREIGN})


def driver_address_not_ipv4(d: Path):
    return ["launch", "--driver-address", "driver.example", PYTHON, "-c", "pass"], {}, Line(
        "--driver-address: expected an IPv4 address, got '{value}'", {"value": "driver.example"})


def network_interface_unknown(d: Path):
    return ["launch", "--network-interface", "nosuch0", PYTHON, "-c", "pass"], {}, Line(
        "--network-interface: '{name}' has no IPv4 address here (interfaces: {interfaces})",
        {"name": "nosuch0", "interfaces": interfaces()})


def discovery_script_is_a_directory(d: Path):
    return ["launch", "-np", "1", "--host-discovery-script", str(d), PYTHON, "-c", "pass"], {}, Line(
        "--host-discovery-script: {path} is not an executable file", {"path": d})


def hostfile_missing(d: Path):
    return ["launch", "--hostfile", str(d / "hosts"), PYTHON, "-c", "pass"], {}, Line(
        "--hostfile: {path}: {reason}", {"path": d / "hosts", "reason": "No such file or directory"})


def hostfile_bad_line(d: Path):
    (d / "hosts").write_text("node1 slots=2\nnode2 slots 2\n")
    return ["launch", "--hostfile", str(d / "hosts"), PYTHON, "-c", "pass"], {}, Line(
        "--hostfile {path} line {n}: invalid entry '{entry}', expected HOST slots=N or HOST:SLOTS",
        {"path": d / "hosts", "n": 2, "entry": "node2 slots 2"})


def hostfile_empty(d: Path):
    (d / "hosts").write_text("# no host yet\n")
    return ["launch", "--hostfile", str(d / "hosts"), PYTHON, "-c", "pass"], {}, Line(
        "--hostfile {path}: lists no host, expected one HOST slots=N (or HOST:SLOTS) a line", {"path": d / "hosts"})


def port_out_of_range(d: Path):
    return ["launch", "--port", "0", PYTHON, "-c", "pass"], {}, Line(
        "--port: expected a port number 1..65535, got {port}", {"port": 0})


def stop_grace_not_positive(d: Path):
    return ["launch", "--stop-grace", "0", PYTHON, "-c", "pass"], {}, Line(
        "{option}: expected a positive, finite number of seconds, got {value}",
        {"option": "--stop-grace", "value": 0.0})


def discovery_timeout_not_finite(d: Path):
    return ["launch", "--discovery-timeout", "inf", PYTHON, "-c", "pass"], {}, Line(
        "{option}: expected a positive, finite number of seconds, got {value}",
        {"option": "--discovery-timeout", "value": "inf"})


def variable_not_an_int(d: Path):
    return ["launch", PYTHON, "-c", "pass"], {"LIGHTNING_ELASTIC_MIN_NP": "two"}, Line(
        "{name} ({option}): invalid {kind} value: '{value}'",
        {"name": "LIGHTNING_ELASTIC_MIN_NP", "option": "--min-np", "kind": "int", "value": "two"})


def variable_not_a_flag(d: Path):
    return ["launch", PYTHON, "-c", "pass"], {"LIGHTNING_ELASTIC_VERBOSE": "maybe"}, Line(
        "{name} ({option}): expected 1, true, yes or on (0, false, no or off), got '{value}'",
        {"name": "LIGHTNING_ELASTIC_VERBOSE", "option": "--verbose", "value": "maybe"})


def variables_give_two_host_sources(d: Path):
    env = {"LIGHTNING_ELASTIC_HOSTS": "localhost:1", "LIGHTNING_ELASTIC_RAY": "auto"}
    return ["launch", PYTHON, "-c", "pass"], env, Line(
        "{names}: give exactly one host source: -H/--hosts, --hostfile, --host-discovery-script, --ray or --slurm",
        {"names": "LIGHTNING_ELASTIC_HOSTS, LIGHTNING_ELASTIC_RAY"})


def slurm_outside_an_allocation(d: Path):
    return ["launch", "--slurm", "-np", "2", PYTHON, "-c", "pass"], {"SLURM_JOB_ID": ""}, Line(
        "--slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set): run it in an sbatch script or under "
        "salloc", {})


def only_host_does_not_resolve(d: Path):  # found by the driver, before any worker started
    return ["launch", "-H", f"{UNRESOLVABLE}:1", PYTHON, "-c", "pass"], {}, Line(
        "no host name resolves ({hosts}): check the names, DNS or /etc/hosts (for an ssh config alias pass "
        "--driver-address or --network-interface)", {"hosts": UNRESOLVABLE})


def hosts_separated_by_semicolons(d: Path):  # issue 37, item 10: was one host named "a:1;b"
    return ["launch", "-H", "localhost:1;127.0.0.2:1", PYTHON, "-c", "pass"], {}, Line(
        "-H/--hosts: {text!r} separates hosts with {separator!r}: expected commas, HOST:SLOTS[,HOST:SLOTS...] "
        "(-H {commas})", {"text": "localhost:1;127.0.0.2:1", "separator": ";", "commas": "localhost:1,127.0.0.2:1"})


def preload_not_a_module_name(d: Path):
    return ["launch", "--preload", "torch,lightning-pytorch", PYTHON, "-c", "pass"], {}, Line(
        "--preload: {name!r} is not a module name, expected e.g. lightning.pytorch", {"name": "lightning-pytorch"})


def preload_with_state_dir(d: Path):
    return ["launch", "--preload", "torch", "--state-dir", str(d / "state"), PYTHON, "-c", "pass"], {}, Line(
        "--preload: not supported with --state-dir yet (workers that outlive the driver cannot be forked from a "
        "server that dies with it)", {})


def preload_without_python(d: Path):
    return ["launch", "--preload", "torch", "/bin/sh", "-c", "true"], {}, Line(
        "--preload: COMMAND must start with a Python interpreter (python, python3, ...) to fork from, got "
        "{program!r}", {"program": "/bin/sh"})


INVALID: list[Case] = [
    command_not_on_path, command_here_but_not_on_path, command_file_missing, py_command_missing,
    command_not_executable, command_is_a_directory, command_name_too_long, py_command_name_too_long,
    command_in_a_symlink_loop, command_under_an_unsearchable_directory, log_dir_is_a_file, log_dir_under_a_file,
    state_dir_is_a_file, state_dir_of_another_user, state_dir_writable_by_others, state_dir_with_slurm,
    driver_patience_not_positive, driver_address_foreign, driver_address_not_ipv4, network_interface_unknown,
    discovery_script_is_a_directory,
    hostfile_missing, hostfile_bad_line, hostfile_empty, port_out_of_range, stop_grace_not_positive,
    discovery_timeout_not_finite, variable_not_an_int, variable_not_a_flag, variables_give_two_host_sources,
    slurm_outside_an_allocation, only_host_does_not_resolve, preload_not_a_module_name, preload_with_state_dir,
    preload_without_python, hosts_separated_by_semicolons,
]


@pytest.mark.parametrize("case", INVALID, ids=[c.__name__ for c in INVALID])
def test_an_invalid_input_is_one_documented_line_with_exit_status_2(workdir: Path, case: Case) -> None:
    argv, env, line = case(workdir)
    run = cli(workdir, *argv, env=env, timeout=60)
    assert (run.code, run.lines) == (2, [PREFIXES["error"] + line.text]), run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert_documented(line)


def test_a_port_in_use_is_one_documented_line_with_exit_status_2(workdir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = cli(workdir, "launch", "--port", str(port), PYTHON, "-c", "pass", timeout=60)
    line = Line("--port: cannot serve on {address}:{port}: {reason}",
                {"address": "127.0.0.1", "port": port, "reason": "Address already in use"})
    assert (run.code, run.lines) == (2, [PREFIXES["error"] + line.text]), run.stderr
    assert_documented(line)


def test_two_host_sources_on_the_command_line_are_refused_by_the_parser(workdir: Path) -> None:
    # argparse's own refusal: its usage, then one error line. The configuration's "give exactly
    # one host source" is never what the command line prints (issue 26 item 8).
    run = cli(workdir, "launch", "-H", "localhost:1", "--hostfile", "hosts", PYTHON, "-c", "pass", timeout=60)
    line = Line("lightning-elastic launch: error: argument {option}: not allowed with argument {other}",
                {"option": "--hostfile", "other": "-H/--hosts"})
    assert (run.code, run.lines[0].startswith("usage: "), run.lines[-1]) == (2, True, line.text), run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert_documented(line)


def test_a_mistyped_option_is_refused_by_launch_with_the_option_it_may_mean(workdir: Path) -> None:
    # Issue 37, item 10: refused under the top-level usage, with no word of -np.
    run = cli(workdir, "launch", "--np", "2", PYTHON, "-c", "pass", timeout=60)
    line = Line("lightning-elastic launch: error: unrecognized arguments: {given} (did you mean {meant}?)",
                {"given": "--np", "meant": "-np"})
    assert (run.code, run.lines[0].startswith("usage: lightning-elastic launch "), run.lines[-1]) == (2, True, line.text)
    assert "Traceback" not in run.stderr + run.stdout
    assert_documented(line)


def test_version() -> None:
    done = subprocess.run([str(LAUNCHER), "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "lightning-elastic 0.1.0\n", "")


# ----- the driver's behaviour, with real workers ------------------------------------------


def logged(run: Run, line: Line, level: str) -> list[str]:
    """The driver's log lines that are ``line`` at ``level`` (after the time stamp)."""
    pattern = re.compile(rf"^lightning-elastic \d\d:\d\d:\d\d {level} (.*)$")
    return [m.group(1) for m in map(pattern.match, run.lines) if m and m.group(1) == line.text]


def test_a_py_command_without_python_runs_with_the_drivers_python_on_a_fixed_port(workdir: Path) -> None:
    (workdir / "train.py").write_text(JOINS)  # not executable, no shebang: torchrun's habit
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = cli(workdir, "launch", "-np", "1", "--port", str(port), "train.py")
    assert run.code == 0, run.stderr[-3000:]
    line = Line("Running {script} with this Python, as torchrun does: {python} {script}.",
                {"script": "train.py", "python": DRIVER_PYTHON})
    assert logged(run, line, "INFO") == [line.text]
    assert_documented(line)
    assert re.search(rf"^\[[0-]\] MASTER_PORT {port}$", run.stdout, re.M), run.stdout  # served on --port


def test_a_script_that_never_joins_the_job_fails_saying_how_to_join(workdir: Path) -> None:
    (workdir / "nojoin.py").write_text("print('trained, in a way')\n")
    run = cli(workdir, "launch", "-np", "2", PYTHON, "nojoin.py")
    template = ("worker {worker} exited with status 0 without ever joining the job; the script must join it: "
                'call lightning_elastic.init() (before @le.run), or build Trainer(strategy="elastic_hvd") or '
                'Fabric(strategy="elastic_hvd")')
    # Whichever worker exited first is named, and the job ends at once: no worker ever joined.
    lines = [Line(template, {"worker": worker}) for worker in ("localhost[0]#0", "localhost[1]#1")]
    assert run.code == 1, run.stderr[-3000:]
    assert run.lines[-1] in [PREFIXES["job"] + line.text for line in lines], run.stderr[-3000:]
    assert_documented(lines[0])


def test_a_host_whose_name_does_not_resolve_is_refused_alone(workdir: Path) -> None:
    (workdir / "train.py").write_text(JOINS)
    run = cli(workdir, "launch", "-H", f"localhost:1,{UNRESOLVABLE}:1", "-np", "1", "--max-np", "2",
              "--discovery-interval", "0.2", PYTHON, "train.py")
    assert run.code == 0, run.stderr[-3000:]
    line = Line("Ignoring host {host}: its name does not resolve (check it, DNS or /etc/hosts; for an ssh config "
                "alias pass --driver-address or --network-interface); the job goes on with the other hosts.",
                {"host": UNRESOLVABLE})
    assert logged(run, line, "ERROR") == [line.text]  # once, though the host list is read again and again
    assert "world sizes: 1)" in run.stderr
    assert_documented(line)


def test_a_log_dir_used_again_keeps_both_jobs(workdir: Path) -> None:
    (workdir / "train.py").write_text(JOINS)
    logs = workdir / "logs"
    first = cli(workdir, "launch", "-np", "1", "--log-dir", str(logs), PYTHON, "train.py")
    assert first.code == 0, first.stderr[-3000:]
    first_events = (logs / "events.jsonl").read_text()
    started = json.loads(first_events.splitlines()[0])["time"]
    time.sleep(1.1)  # the second job starts in another second: its directory name differs from the first's
    # The second time through the environment: LIGHTNING_ELASTIC_LOG_DIR is --log-dir.
    second = cli(workdir, "launch", "-np", "1", PYTHON, "train.py", env={"LIGHTNING_ELASTIC_LOG_DIR": str(logs)})
    assert second.code == 0, second.stderr[-3000:]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    line = Line("--log-dir {dir} held a job started at {when}: moved its {n} file(s) to {dir}/job-{start} "
                "(lightning-elastic timeline {dir}/job-{start} draws it).",
                {"dir": logs, "when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "n": 2,
                 "start": stamp})
    assert logged(second, line, "INFO") == [line.text]
    assert_documented(line)
    moved = logs / f"job-{stamp}"
    assert (moved / "events.jsonl").read_text() == first_events  # the first job, whole
    assert (moved / "worker-0-localhost-0.log").exists() and (logs / "worker-0-localhost-0.log").exists()
    kinds = [json.loads(e)["kind"] for e in (logs / "events.jsonl").read_text().splitlines()]
    assert kinds.count("job_started") == 1 and kinds[-1] == "job_ended"  # the second job alone
    drawn = subprocess.run([str(LAUNCHER), "timeline", str(moved)], capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and (moved / "timeline.png").exists(), drawn.stderr


def test_a_discovery_script_slower_than_discovery_timeout_fails_the_launch(workdir: Path) -> None:
    script = executable(workdir / "discover.sh", "#!/bin/sh\nsleep 30\necho localhost:1\n")
    started = time.monotonic()
    run = cli(workdir, "launch", "-np", "1", "--host-discovery-script", str(script), "--discovery-timeout", "1",
              PYTHON, "-c", "pass")
    line = Line("host discovery script {path} did not finish within {seconds} s (--discovery-timeout)",
                {"path": script, "seconds": 1})
    assert (run.code, run.lines[-1]) == (1, PREFIXES["job"] + line.text), run.stderr
    assert time.monotonic() - started < 20
    assert_documented(line)


def test_x_pythonpath_is_merged_with_the_launchers_own_entry(workdir: Path) -> None:
    # mpirun's and horovodrun's habit: -x PYTHONPATH forwards one's own. It must not replace
    # the launcher's entry (lightning_elastic/_autoload), whose sitecustomize registers
    # strategy="elastic_hvd" for a script that never imports lightning_elastic (issue 37, item 5).
    (workdir / "mine").mkdir()
    (workdir / "mine" / "helper_of_mine.py").write_text("FOUND = True\n")
    (workdir / "train.py").write_text(
        "import sys\n"
        "import helper_of_mine  # from the PYTHONPATH given with -x\n"
        "record = sys.modules.get('_lightning_elastic_autoload_record')\n"
        "assert record is not None and record.installed, 'the launcher\\'s sitecustomize did not run'\n"
        + JOINS)
    run = cli(workdir, "launch", "-np", "1", "-x", f"PYTHONPATH={workdir / 'mine'}", PYTHON, "train.py")
    assert run.code == 0, run.stderr[-3000:] + run.stdout[-3000:]


SCRIPT_FAILED = ("the script failed on every host before joining the job ({n} worker(s) on {hosts}): worker {worker} "
                 "exited with status {status}: {error}")


@pytest.mark.parametrize(("script", "text", "error"), [
    ("train.py", "import nosuchmodule_xyz\n", "ModuleNotFoundError: No module named 'nosuchmodule_xyz'"),
    ("train.py", "x = (\n", "SyntaxError: '(' was never closed"),
    ("nosuch.py", None, "{python}: can't open file '{dir}/nosuch.py': [Errno 2] No such file or directory"),
], ids=["import error", "syntax error", "no such script"])
def test_a_script_that_fails_before_joining_is_the_verdict_not_the_hosts(workdir: Path, script: str, text: str | None,
                                                                        error: str) -> None:
    # Issue 37, item 7: it ended "2 slot(s) needed and 1 left in the fixed host list ... lower
    # --min-np, or give hosts", impossible advice with --min-np 1.
    if text is not None:
        (workdir / script).write_text(text)
    started = time.monotonic()
    run = cli(workdir, "launch", "-np", "2", "--min-np", "1", PYTHON, script)
    assert time.monotonic() - started < 30
    status = 2 if text is None else 1
    error = error.format(python=PYTHON, dir=workdir)
    lines = [Line(SCRIPT_FAILED, {"n": 2, "hosts": "localhost", "worker": worker, "status": status, "error": error})
             for worker in ("localhost[0]#0", "localhost[1]#1")]  # whichever the driver reaped first
    assert run.code == 1, run.stderr[-3000:]
    assert run.lines[-1] in [PREFIXES["job"] + line.text for line in lines], run.stderr[-3000:]
    assert "the job fails in" not in run.stderr  # no wait is announced for a job that cannot wait
    assert_documented(lines[0])


# A loop that commits every few milliseconds, snapshotted often; it prints the value it ends with.
COMMITS = """\
import sys
import time
import lightning_elastic as le

le.init()
state = le.ObjectState(value=0)  # no "step": a snapshot's step is the number of commits


@le.run
def train(state):
    for _ in range(int(sys.argv[1])):
        state.value += 1
        state.commit()
        time.sleep(0.01)


train(state)
print("value", state.value, flush=True)
"""


def test_a_snapshot_dir_of_another_command_is_refused_unless_the_user_says_so(workdir: Path) -> None:
    # Issue 37, item 8: a reused --snapshot-dir resumed another script's state with a warning
    # only (a train.py then trained zero epochs and exited 0).
    (workdir / "other.py").write_text(COMMITS)
    (workdir / "train.py").write_text(COMMITS)
    snapshots = workdir / "snapshots"
    launch = ["launch", "-np", "1", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.05"]
    first = cli(workdir, *launch, PYTHON, "other.py", "40")
    assert first.code == 0 and list(snapshots.glob("*.json")), first.stderr[-3000:]
    newest = max(snapshots.glob("*.pt"), key=lambda path: tuple(int(n) for n in re.findall(r"\d+", path.name)))
    run = cli(workdir, *launch, PYTHON, "train.py", "40")
    from lightning_elastic.durable.files import job_id_of  # noqa: PLC0415 - how the ids are made

    line = Line("--snapshot-dir: {name} in {dir} was written by another command (job id {id}, this one's is "
                "{ours}): pass --no-resume or another --snapshot-dir to start over, or --resume-other-command to resume "
                "from it", {"name": newest.name, "dir": snapshots, "id": job_id_of((PYTHON, "other.py", "40")),
                            "ours": job_id_of((PYTHON, "train.py", "40"))})
    assert (run.code, run.lines[-1]) == (2, PREFIXES["error"] + line.text), run.stderr[-3000:]
    assert "Started worker" not in run.stderr  # refused before anything started
    assert_documented(line)
    # Said so: resumed (the value goes on from the snapshot's), with a warning.
    run = cli(workdir, *launch, "--resume-other-command", PYTHON, "train.py", "40")
    assert run.code == 0, run.stderr[-3000:]
    assert f"resumed from:  {newest}" in run.stderr
    assert int(re.search(r"value (\d+)", run.stdout).group(1)) > 40


def test_a_preload_module_that_cannot_be_imported_is_one_line(workdir: Path) -> None:
    # Issue 37, item 10: the fork server said "workers start cold" and the worker "starting
    # cold", two lines for one fact.
    (workdir / "train.py").write_text(JOINS)
    run = cli(workdir, "launch", "-np", "1", "--preload", "nosuchmodule_xyz", PYTHON, "train.py")
    assert run.code == 0, run.stderr[-3000:]
    said = [line for line in (run.stdout + run.stderr).splitlines() if "cannot import" in line or " cold" in line]
    line = Line("lightning-elastic: --preload: {reason}: starting cold",
                {"reason": "the fork server cannot import 'nosuchmodule_xyz' (ModuleNotFoundError: No module named "
                           "'nosuchmodule_xyz')"})
    assert said == [f"[-] {line.text}"], said


def test_launch_options_after_the_command_and_a_job_without_min_np_are_said_at_the_start(workdir: Path) -> None:
    # Issue 37, item 10: `launch -np 2 train.py --min-np 1` gave --min-np to the script without
    # a word, and nothing said the job could not go on with fewer than 2 workers.
    (workdir / "train.py").write_text(JOINS)
    run = cli(workdir, "launch", "-np", "2", "train.py", "--min-np", "1")
    assert run.code == 0, run.stderr[-3000:]
    hint = Line("Passing {options} to the command, as everything after it: if it is meant for launch, put it before "
                "the command (-- before the command silences this).", {"options": "--min-np"})
    elastic = Line("Not elastic below -np: without --min-np, training needs all {n} workers of -np (after a lost worker "
                   "it waits, up to --elastic-timeout, for a replacement); pass --min-np to train on with fewer.",
                   {"n": 2})
    for line in (hint, elastic):
        assert logged(run, line, "INFO") == [line.text], run.stderr[-3000:]
        assert_documented(line)
