"""A real Slurm cluster for integration tests, built from network namespaces on this box.

Nodes ``le-s1``..``le-s4`` are network namespaces on bridge ``lebr1``, each running its own
``slurmd`` under its own host name; ``slurmctld`` runs in the root namespace (as host
``le-sctl``, on the bridge's address) and one ``munged`` serves every namespace through a
socket in this run's directory. The driver under test runs in the root namespace like a
login node's process inside an allocation (``SLURM_JOB_ID``), and starts its workers as
``srun`` steps on the nodes. The nodes share this box's filesystem and PID namespace, so a
worker sees the repository and its venv, and the tests see every node's processes.

What it took (Slurm 22.05 on Debian 12): slurmd refuses ``ip netns exec`` (which remounts
/sys: "No filesystem mounted on /sys/fs/cgroup"), so a node is ``nsenter --net`` plus
``unshare --uts``; munged wants its socket directory 0755 and its key directory 0700;
``SlurmdParameters=config_overrides`` accepts any CPU count; proctrack/linuxproc and
task/none need no cgroups.

Everything is made by :meth:`SlurmCluster.start` and removed by :meth:`SlurmCluster.close`
(every daemon stopped, every namespace deleted), which also cleans a crashed earlier run's
leftovers. Needs root; installs the Debian packages when they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.integration.namespaces import (Steps, _poll, kill_namespace, make_bridged_namespaces, namespace_pids,
                                          remove_bridged_namespaces, set_marked_hosts)

SUBNET = "10.213.79"  # bridge .1 (and slurmctld), nodes .11, .12, ...
BRIDGE = "lebr1"
NODES = ("le-s1", "le-s2", "le-s3", "le-s4")
CONTROLLER = "le-sctl"
MARK = "# lightning-elastic slurm test node"  # ends every /etc/hosts line we add
TMP_PREFIX = "le-slurm-"
CTLD_PORT, SLURMD_PORT = 6917, 6918
PACKAGES = {"/usr/sbin/slurmctld": "slurmctld", "/usr/sbin/slurmd": "slurmd", "/usr/bin/srun": "slurm-client",
            "/usr/sbin/munged": "munge"}
REQUIRED_TOOLS = ("ip", "unshare", "nsenter")
INSTALL_TIMEOUT = 300.0
UP_TIMEOUT = 20.0


class ClusterUnavailable(RuntimeError):
    """This box cannot run the test cluster (not root, tools missing, no namespaces)."""


class SlurmCluster:
    def __init__(self) -> None:
        self.nodes: list[str] = list(NODES)
        self.controller_address = f"{SUBNET}.1"
        self._addresses = {n: f"{SUBNET}.{11 + i}" for i, n in enumerate(NODES)}
        self.dir: Path | None = None
        self._munged: subprocess.Popen[bytes] | None = None
        self._slurmctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailable("network namespaces and Slurm's daemons need root")
        missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise ClusterUnavailable(f"missing tools: {', '.join(missing)}")
        self._remove_leftovers()
        _install_missing()
        self.dir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
        self._make_network()
        set_marked_hosts(self._addresses, MARK)
        self._write_config()
        self._start_munged()
        self._start_slurmctld()
        for node in self.nodes:
            self._start_slurmd(node)
        self.wait_idle()

    def close(self) -> None:
        """Stop every daemon and remove every namespace; safe after a partial start."""
        try:
            self._remove_leftovers()
        finally:
            for proc in [*self._slurmd.values(), self._slurmctld, self._munged]:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                if proc is not None:
                    proc.wait(10)
            self._slurmd.clear()
            self._slurmctld = self._munged = None
            self.dir = None

    # ----- using it -------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        assert self.dir is not None, "start() first"
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process on this cluster's submit host (the root namespace)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, argv: Sequence[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}")
        return result

    def allocate(self, nodes: Sequence[str], name: str = "le-test") -> str:
        """An allocation of exactly ``nodes`` (``--no-kill``: a lost node does not end it); its id."""
        out = self.run(["salloc", "--no-shell", "--immediate=10", "--no-kill", "-J", name,
                        "-N", str(len(nodes)), "-w", ",".join(nodes)], timeout=30)
        match = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout)
        assert match, f"salloc said: {out.stderr}"
        return match.group(1)

    def steps(self, job_id: str) -> dict[str, str]:
        """The job's running steps: step id (JOB.STEP) -> node."""
        out = self.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %N"]).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def cancel_all(self, timeout: float = 20.0) -> None:
        """Cancel every job and have every node idle. After a test crashed a node, the whole
        cluster starts afresh (1-2 s): a controller that saw a node die mid-job keeps state
        about it (a job completing there) that the next test must not inherit."""
        if any(self._exited(proc) for proc in [self._slurmctld, self._munged, *self._slurmd.values()]):
            self.close()
            self.start()
            return
        self.run(["scancel", "--user", "root"], check=False)
        _poll(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), timeout, "every job to end")
        self.wait_idle(timeout)

    def logs(self) -> str:
        """The tails of the daemons' logs, for a failed test's report."""
        return self._logs()

    def wait_idle(self, timeout: float = UP_TIMEOUT) -> None:
        def idle() -> bool:
            for proc in [self._slurmctld, *self._slurmd.values()]:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited with {proc.returncode}: {self._logs()}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            return all(states.get(n) == "idle" for n in self.nodes)

        _poll(idle, timeout, f"nodes {', '.join(self.nodes)} to be idle")

    def pids(self, node: str) -> list[int]:
        """Every process of the node's namespace: slurmd, step daemons, workers."""
        return namespace_pids(node)

    def crash(self, node: str, timeout: float = 10.0) -> None:
        """SIGKILL every process of the node, slurmd included, as if the machine died."""
        kill_namespace(node, timeout)
        proc = self._slurmd.get(node)
        if proc is not None:
            proc.wait(timeout)

    # ----- set-up steps ---------------------------------------------------------------

    def _make_network(self) -> None:
        make_bridged_namespaces(BRIDGE, self.controller_address, self._addresses, ClusterUnavailable)

    def _write_config(self) -> None:
        assert self.dir is not None
        d = self.dir
        for sub in ("state", "spool", "munge-socket", "munge-key"):
            (d / sub).mkdir()
        (d / "munge-socket").chmod(0o755)
        (d / "munge-key").chmod(0o700)
        key = d / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        nodes = "".join(f"NodeName={n} NodeAddr={a} CPUs=4 State=UNKNOWN\n" for n, a in self._addresses.items())
        self.conf.write_text(
            "ClusterName=le-test\n"
            f"SlurmctldHost={CONTROLLER}({self.controller_address})\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={d / 'munge-socket' / 'munge.socket'}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d / 'spool'}/%n\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d / 'slurmd'}-%n.pid\n"
            f"SlurmctldPort={CTLD_PORT}\nSlurmdPort={SLURMD_PORT}\n"
            f"SlurmctldLogFile={d / 'slurmctld.log'}\nSlurmdLogFile={d / 'slurmd'}-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
            "MailProg=/bin/true\nReturnToService=2\nSlurmdParameters=config_overrides\n"
            "SchedulerType=sched/builtin\nSelectType=select/linear\n"
            "KillWait=5\n"  # a cancelled job's tasks get SIGKILL 5 s after SIGTERM (default 30)
            f"{nodes}"
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n"
        )

    def _daemon(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        assert self.dir is not None
        with open(self.dir / log_name, "ab") as log:
            return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self.env)

    def _start_munged(self) -> None:
        assert self.dir is not None
        d = self.dir
        self._munged = self._daemon(
            ["munged", "-F", f"--socket={d / 'munge-socket' / 'munge.socket'}",
             f"--key-file={d / 'munge-key' / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
             f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge.seed'}", "--force"],
            "munged.out",
        )
        _poll(lambda: (d / "munge-socket" / "munge.socket").exists() or self._exited(self._munged), 10,
              "munged's socket")
        if self._exited(self._munged):
            raise RuntimeError(f"munged exited: {self._logs()}")

    def _start_slurmctld(self) -> None:
        # Its host name must be SlurmctldHost's; its own UTS namespace keeps the box's.
        self._slurmctld = self._daemon(
            ["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER} && exec slurmctld -D -i -f "$0"',
             str(self.conf)], "slurmctld.out",
        )

    def _start_slurmd(self, node: str) -> None:
        self._slurmd[node] = self._daemon(
            ["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "sh", "-c",
             f'hostname {node} && exec slurmd -D -f "$0"', str(self.conf)], f"slurmd-{node}.out",
        )

    @staticmethod
    def _exited(proc: subprocess.Popen[bytes] | None) -> bool:
        return proc is not None and proc.poll() is not None

    def _logs(self) -> str:
        if self.dir is None:
            return ""
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log")))

    # ----- tear-down ------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        """Kill this (or a crashed earlier) run's daemons and node processes; delete the
        namespaces, the bridge, our /etc/hosts lines and temp dirs. Every step is tried."""
        steps = Steps()
        remove_bridged_namespaces(NODES, BRIDGE, MARK, self.crash, steps)
        # The controller and munged run in the root namespace: found by their pid files.
        for stale in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
            for pid_file in ("slurmctld.pid", "munged.pid"):
                steps.attempt(lambda path=stale / pid_file, d=stale: _kill_daemon(path, str(d)))
        for proc in (self._slurmctld, self._munged):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for stale in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        steps.raise_first()


def _kill_daemon(pid_file: Path, marker: str) -> None:
    """SIGKILL the daemon named by ``pid_file`` if its command line is still ours."""
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return
    if marker in cmdline or "slurmctld" in cmdline:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _install_missing() -> None:
    """Install Debian's Slurm and munge packages if missing, without starting their services."""
    packages = sorted({pkg for path, pkg in PACKAGES.items() if not Path(path).exists()})
    if not packages:
        return
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"{', '.join(packages)} missing and there is no apt-get to install them")
    policy = Path("/usr/sbin/policy-rc.d")  # exit 101: the postinst scripts start no daemon here
    created_policy = not policy.exists()
    if created_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + INSTALL_TIMEOUT
    try:
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *packages]):
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise ClusterUnavailable(f"installing {' '.join(packages)} took over {INSTALL_TIMEOUT:.0f} s") from None
            if proc.returncode != 0:
                tail = "\n".join(out.splitlines()[-15:])
                raise ClusterUnavailable(f"{' '.join(argv)} exited with {proc.returncode}:\n{tail}")
    finally:
        if created_policy:
            policy.unlink()
    still = [path for path in PACKAGES if not Path(path).exists()]
    if still:
        raise ClusterUnavailable(f"installed {' '.join(packages)} but {', '.join(still)} still missing")


def job_nodes(cluster: SlurmCluster, job_id: str) -> list[str]:
    out = cluster.run(["squeue", "-h", "-j", job_id, "-o", "%N"]).stdout.strip()
    return cluster.run(["scontrol", "show", "hostnames", out]).stdout.split() if out else []

