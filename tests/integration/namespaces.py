"""Remote machines for integration tests, built from network namespaces on this box.

``lightning-elastic launch`` starts workers over ssh, so its tests need hosts with their own
address, host name and sshd that can be partitioned or killed. Each host here is a network
namespace on a bridge with the root namespace, running its own sshd in its own UTS namespace
(so ``hostname`` inside an ssh session prints the host's name). Processes in the namespaces
share this box's filesystem, so a worker started over ssh sees the repository and its venv.

Everything is created by :meth:`NamespacedHosts.start` and removed by
:meth:`NamespacedHosts.close`, which also cleans leftovers of a crashed earlier run. Needs root.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

SUBNET = "10.213.77"  # a /24 used only by these hosts: bridge .1, hosts .11, .12, ...
BRIDGE = "lebr0"
SSH_HOSTS = ("le-h1", "le-h2", "le-h3")
UNREACHABLE = "le-h4"  # address and host name, but no sshd
SSHD = Path("/usr/sbin/sshd")
ETC_HOSTS = Path("/etc/hosts")
MARK = "# lightning-elastic test host"  # ends every /etc/hosts line we add, so we remove exactly those
TMP_PREFIX = "le-hosts-"
INSTALL_TIMEOUT = 300.0
REQUIRED_TOOLS = ("ip", "unshare", "ssh", "ssh-keygen")

# Run a command in the namespace with its own host name, as a process on that machine would.
_WITH_HOSTNAME = 'hostname "$0" && exec "$@"'


class HostsUnavailable(RuntimeError):
    """This box cannot provide namespaced hosts (not root, tools missing, no namespaces)."""


def _run(argv: Sequence[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a set-up command; its stderr goes into the error so a failure says what went wrong."""
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}: {result.stderr.strip()}")
    return result


def _poll(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _write_atomically(path: Path, text: str) -> None:
    """Readers (every name lookup on the box) never see a half-written file."""
    tmp = path.with_name(f".{path.name}.le-tmp")
    tmp.write_text(text)
    shutil.copymode(path, tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # a bind-mounted file (Docker's /etc/hosts) cannot be replaced, only rewritten
        tmp.unlink()
        path.write_text(text)


def namespace_pids(name: str) -> list[int]:
    """Every process in the network namespace ``name``."""
    return [int(p) for p in _run(["ip", "netns", "pids", name]).stdout.split()]


def kill_namespace(name: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in the namespace until none is left, as if the machine died."""
    def gone() -> bool:
        pids = namespace_pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids

    _poll(gone, timeout, f"every process on {name} to exit")


def make_bridged_namespaces(bridge: str, bridge_address: str, addresses: dict[str, str],
                            unavailable: type[Exception]) -> None:
    """A bridge with ``bridge_address``/24 and one namespace per ``addresses`` entry (name ->
    address) on it, its end named eth0; ``unavailable`` is raised when no namespace can be made."""
    _run(["ip", "link", "add", bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{bridge_address}/24", "dev", bridge])
    _run(["ip", "link", "set", bridge, "up"])
    for name, addr in addresses.items():
        result = _run(["ip", "netns", "add", name], check=False)
        if result.returncode != 0:
            raise unavailable(f"cannot create network namespace {name}: {result.stderr.strip()}")
        veth = f"v-{name}"  # 7 characters, well within IFNAMSIZ
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name])
        _run(["ip", "link", "set", veth, "master", bridge, "up"])
        _run(["ip", "-n", name, "addr", "add", f"{addr}/24", "dev", "eth0"])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        _run(["ip", "-n", name, "link", "set", "eth0", "up"])
        # Nothing beyond the bridge: the box's DNS server is out of reach from here, and a
        # query that fails at once beats one that times out (torch resolves peer addresses).
        _run(["ip", "-n", name, "route", "add", "unreachable", "default"])


def delete_links(names: Sequence[str], bridge: str) -> None:
    """Delete the namespaces' veth ends and the bridge. A namespace is destroyed
    asynchronously, taking its veth pair along; deleting the links ourselves means a start()
    right after this can create them again."""
    for link in [*(f"v-{n}" for n in names), bridge]:
        if _run(["ip", "link", "show", link], check=False).returncode == 0:
            _run(["ip", "link", "delete", link], check=False)  # may vanish on its own meanwhile


def set_marked_hosts(entries: dict[str, str], mark: str) -> None:
    """Replace the /etc/hosts lines ending in ``mark`` with ``entries`` (name -> address)."""
    old = ETC_HOSTS.read_text()
    kept = [line for line in old.splitlines(keepends=True) if not line.rstrip().endswith(mark)]
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    new = "".join(kept) + "".join(f"{addr}\t{name}\t{mark}\n" for name, addr in entries.items())
    if new != old:
        _write_atomically(ETC_HOSTS, new)


class Steps:
    """Tear-down steps, each tried even if an earlier one failed; ``raise_first()`` at the end."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def attempt(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - keep tearing down, report afterwards
            self.errors.append(exc)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


def remove_bridged_namespaces(names: Sequence[str], bridge: str, mark: str, kill: Callable[[str], object],
                              steps: Steps) -> None:
    """Undo ``make_bridged_namespaces``: ``kill(name)`` what runs in each of ``names`` that
    exists, delete it, its link and the bridge, and the /etc/hosts lines ending in ``mark``."""
    listed = [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]
    for name in names:
        if name in listed:
            steps.attempt(lambda name=name: kill(name))
            steps.attempt(lambda name=name: _run(["ip", "netns", "delete", name]))
    delete_links(names, bridge)
    steps.attempt(lambda: set_marked_hosts({}, mark))


class NamespacedHosts:
    """Hosts ``le-h1``..``le-h3`` with sshd and ``le-h4`` without, on bridge ``lebr0``."""

    def __init__(self) -> None:
        self.names: list[str] = list(SSH_HOSTS)
        self.unreachable: str = UNREACHABLE
        self.bridge_address: str = f"{SUBNET}.1"
        self.ssh_args: list[str] = []
        self._addresses = {n: f"{SUBNET}.{11 + i}" for i, n in enumerate([*SSH_HOSTS, UNREACHABLE])}
        self._dir: Path | None = None
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}

    # ----- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Create the hosts. Raises HostsUnavailable when this box cannot have them."""
        self._check_environment()
        self._remove_leftovers()
        self._check_subnet_unused()
        self._ensure_sshd()
        self._dir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
        self._make_keys()
        self._make_network()
        set_marked_hosts(self._addresses, MARK)
        for name in self.names:
            self._start_sshd(name)
        for name in self.names:
            self._wait_for_sshd(name)

    def close(self) -> None:
        """Remove everything start() made; safe after a partial start or a failure."""
        try:
            self._remove_leftovers()  # this run's namespaces, bridge, /etc/hosts lines, temp dir
        finally:
            for proc in self._sshd.values():
                if proc.poll() is None:  # only if killing its namespace failed
                    proc.kill()
                proc.wait()
            self._sshd.clear()
            self._dir = None

    # ----- addresses and ssh ----------------------------------------------------------

    def address(self, name: str) -> str:
        return self._addresses[name]

    @property
    def _key(self) -> Path:
        assert self._dir is not None, "start() first"
        return self._dir / "client_key"

    def ssh_command(self, name: str) -> list[str]:
        """Argv prefix for a plain ssh to ``name``, append the remote command."""
        options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
                   "BatchMode=yes", "ConnectTimeout=5"]
        return ["ssh", "-i", str(self._key), *(a for o in options for a in ("-o", o)), name]

    # ----- acting on a host -----------------------------------------------------------

    def exec(self, name: str, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host's namespace (with its host name), output captured as text."""
        return subprocess.run(
            ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", _WITH_HOSTNAME, name, *argv],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )

    def pids(self, name: str) -> list[int]:
        """Every process in the host's network namespace (sshd, sessions, workers)."""
        return namespace_pids(name)

    def partition(self, name: str) -> None:
        """Cut the host off the network; its processes keep running."""
        _run(["ip", "-n", name, "link", "set", "eth0", "down"])

    def heal(self, name: str) -> None:
        """Undo partition(); the link's routes went away with it, so put them back."""
        _run(["ip", "-n", name, "link", "set", "eth0", "up"])
        _run(["ip", "-n", name, "route", "replace", "unreachable", "default"])

    def kill_all(self, name: str, timeout: float = 10.0) -> None:
        """SIGKILL every process on the host, sshd included, as if the machine died."""
        kill_namespace(name, timeout)
        proc = self._sshd.get(name)
        if proc is not None:
            proc.wait(timeout=timeout)

    def restore(self, name: str) -> None:
        """Make the host usable again after a test partitioned it or killed its sshd."""
        self.heal(name)
        if name in self.names:
            proc = self._sshd.get(name)
            if proc is None or proc.poll() is not None:
                self._start_sshd(name)
            self._wait_for_sshd(name)

    def restore_all(self) -> None:
        for name in [*self.names, self.unreachable]:
            self.restore(name)

    # ----- set-up steps ---------------------------------------------------------------

    def _check_environment(self) -> None:
        if os.geteuid() != 0:
            raise HostsUnavailable("network namespaces need root")
        missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
        if missing:
            raise HostsUnavailable(f"missing tools: {', '.join(missing)}")

    def _check_subnet_unused(self) -> None:
        """Refuse to shadow a network this box already uses (run after leftovers are gone)."""
        ours = ipaddress.ip_network(f"{SUBNET}.0/24")
        routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout)
        for route in routes:
            dst = route.get("dst", "default")
            if dst != "default" and "." in dst and ipaddress.ip_network(dst, strict=False).overlaps(ours):
                raise HostsUnavailable(f"{ours} is already routed on this box ({dst} dev {route.get('dev')})")

    def _ensure_sshd(self) -> None:
        """Install Debian's openssh-server if sshd is missing, without starting its service."""
        if SSHD.exists():
            return
        if shutil.which("apt-get") is None:
            raise HostsUnavailable(f"{SSHD} is missing and there is no apt-get to install it")
        # policy-rc.d exit 101 stops the package's postinst from starting an sshd on this box.
        policy = Path("/usr/sbin/policy-rc.d")
        created_policy = not policy.exists()
        if created_policy:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        deadline = time.monotonic() + INSTALL_TIMEOUT
        try:
            for argv in (["apt-get", "update"],
                         ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server"]):
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
                try:
                    out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise HostsUnavailable(f"installing openssh-server took over {INSTALL_TIMEOUT:.0f} s"
                                           f" ({' '.join(argv)})") from None
                if proc.returncode != 0:
                    tail = "\n".join(out.splitlines()[-15:])
                    raise HostsUnavailable(f"{' '.join(argv)} exited with {proc.returncode}:\n{tail}")
        finally:
            if created_policy:
                policy.unlink()
        if not SSHD.exists():
            raise HostsUnavailable(f"openssh-server installed but {SSHD} is still missing")

    def _make_keys(self) -> None:
        """A host key and a client key for this run only; nothing goes to ~/.ssh."""
        assert self._dir is not None
        for key in ("host_key", "client_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"lightning-elastic-test-{key}",
                  "-f", str(self._dir / key)])
        shutil.copy(self._dir / "client_key.pub", self._dir / "authorized_keys")
        self.ssh_args = ["--ssh-identity-file", str(self._key),
                         "--ssh-option", "StrictHostKeyChecking=no",
                         "--ssh-option", "UserKnownHostsFile=/dev/null",
                         "--ssh-option", "LogLevel=ERROR"]

    def _make_network(self) -> None:
        make_bridged_namespaces(BRIDGE, self.bridge_address, self._addresses, HostsUnavailable)

    def _start_sshd(self, name: str) -> None:
        assert self._dir is not None
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
        config = self._dir / f"sshd-{name}.conf"
        config.write_text(
            f"ListenAddress {self.address(name)}\n"
            f"HostKey {self._dir / 'host_key'}\n"
            f"AuthorizedKeysFile {self._dir / 'authorized_keys'}\n"
            f"PidFile {self._dir / f'sshd-{name}.pid'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "PrintMotd no\n"
        )
        with open(self._dir / f"sshd-{name}.log", "ab") as log:
            self._sshd[name] = subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", _WITH_HOSTNAME, name,
                 str(SSHD), "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _wait_for_sshd(self, name: str, timeout: float = 15.0) -> None:
        """Poll until the host's port 22 sends an ssh banner across the bridge."""
        assert self._dir is not None
        proc = self._sshd[name]
        log_path = self._dir / f"sshd-{name}.log"

        def answers() -> bool:
            if proc.poll() is not None:
                log = log_path.read_text(errors="replace")
                raise RuntimeError(f"sshd on {name} exited with {proc.returncode}:\n{log[-2000:]}")
            try:
                with socket.create_connection((self.address(name), 22), timeout=1) as sock:
                    return sock.recv(4).startswith(b"SSH-")
            except OSError:
                return False

        _poll(answers, timeout, f"sshd on {name} to answer")

    # ----- tear-down ------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        """Kill processes in and delete our namespaces, the bridge, our /etc/hosts lines and
        temp dirs. Every step is tried even if an earlier one fails; the first error is raised."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return  # start() refused before making anything
        steps = Steps()
        remove_bridged_namespaces([*SSH_HOSTS, UNREACHABLE], BRIDGE, MARK, self.kill_all, steps)
        for stale in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):  # keys, configs, logs
            shutil.rmtree(stale, ignore_errors=True)
        steps.raise_first()
