"""launcher/hosts/discovery.py ``ScriptDiscovery``: a script's run is bounded, whatever it leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from lightning_elastic.launcher.hosts import discovery
from lightning_elastic.launcher.hosts.discovery import ScriptDiscovery
from lightning_elastic.launcher.errors import DiscoveryError

pytestmark = pytest.mark.timeout(60)


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("body,said", [
    # A daemon in a session of its own keeps the script's stdout open after the script exits.
    ("echo 127.0.0.1:1\nsetsid sh -c 'echo $$ > daemon.pid; exec sleep 30' &\n",
     "a process it started still held its output"),
    # The script hangs and its daemon would hold stdout after the script is killed.
    ("setsid sh -c 'echo $$ > daemon.pid; exec sleep 30' &\nsleep 30\n", "did not finish within 1 s"),
], ids=["daemon-holds-stdout", "hangs-with-a-daemon"])
def test_a_script_whose_daemon_holds_its_output_is_bounded(tmp_path, monkeypatch, body, said):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(DiscoveryError, match=said):
            ScriptDiscovery(script(tmp_path, body), 1, timeout=1.0).discover()
        took = time.monotonic() - started
    finally:
        pid_file = tmp_path / "daemon.pid"
        if pid_file.exists():  # the daemon outlives the script by design: end it here
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert took < 1.0 + discovery.OUTPUT_GRACE + 2.0, took  # was: until the daemon closed stdout


def test_a_large_listing_is_read_while_the_script_runs(tmp_path):
    body = "i=0\nwhile [ $i -lt 8000 ]; do echo host$i:8; i=$((i+1)); done\n"  # ~100 KB: more than a pipe holds
    hosts = ScriptDiscovery(script(tmp_path, body), 1).discover()
    assert len(hosts) == 8000


def test_every_host_name_is_prepared_in_the_discovery_thread_before_the_driver_reads_it() -> None:
    """The driver's name lookups (DNS) run in the poller's thread, never in its loop."""
    import threading

    from lightning_elastic.launcher.hosts.discovery import DiscoveryPoller, FixedHosts
    from lightning_elastic.launcher.job.slots import HostSlots

    prepared: list[tuple[str, str]] = []
    hosts = (HostSlots("node-a", 1), HostSlots("node-b", 2))
    poller = DiscoveryPoller(FixedHosts(hosts), interval=0.01,
                             prepare=lambda name: prepared.append((name, threading.current_thread().name)))
    try:
        poller.start()  # the first discovery: in the caller's thread, before any service runs
        assert [name for name, _ in prepared] == ["node-a", "node-b"]
        first = poller.latest()
        deadline = threading.Event()
        for _ in range(500):
            latest = poller.latest()
            if latest is not None and first is not None and latest.sequence > first.sequence:
                break
            deadline.wait(0.01)
        else:
            raise AssertionError("the poller published nothing in 5 s")
        later = prepared[2:4]
        assert later == [("node-a", "host-discovery"), ("node-b", "host-discovery")]  # prepared, then published
    finally:
        poller.close()
