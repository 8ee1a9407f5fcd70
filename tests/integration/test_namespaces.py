"""The namespaced remote hosts behave like separate machines: own name and address over ssh,
an unreachable host refuses at once, and a partition stops answers until healed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.namespaces import NamespacedHosts


def ssh(hosts: NamespacedHosts, name: str, command: str,
        connect_timeout: int | None = None) -> subprocess.CompletedProcess[str]:
    argv = hosts.ssh_command(name)
    if connect_timeout is not None:  # ssh keeps the first value given for an option
        argv = [argv[0], "-o", f"ConnectTimeout={connect_timeout}", *argv[1:]]
    return subprocess.run([*argv, command], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_hosts_are_separate_machines(hosts: NamespacedHosts) -> None:
    had_ssh_dir = (Path.home() / ".ssh").exists()
    for name in hosts.names:
        result = ssh(hosts, name, "hostname && ip -4 addr")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0] == name
        assert f"inet {hosts.address(name)}/24" in result.stdout

    started = time.monotonic()
    result = ssh(hosts, hosts.unreachable, "true")
    assert result.returncode == 255
    assert time.monotonic() - started < 3, "a host without sshd must refuse, not time out"

    hosts.partition("le-h2")
    started = time.monotonic()
    result = ssh(hosts, "le-h2", "hostname", connect_timeout=2)
    assert result.returncode == 255 and not result.stdout
    assert time.monotonic() - started >= 1.5, f"a partitioned host answered: {result.stderr}"
    hosts.heal("le-h2")
    result = ssh(hosts, "le-h2", "hostname")
    assert (result.returncode, result.stdout.strip()) == (0, "le-h2"), result.stderr

    assert (Path.home() / ".ssh").exists() == had_ssh_dir, "ssh must not write to ~/.ssh"
