from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Job, wait_for
from tests.integration.namespaces import HostsUnavailable, NamespacedHosts
from tests.integration.slurm_cluster import ClusterUnavailable, SlurmCluster


# Where to append one JSON line per launch (test, exit status, verdict, the driver's own
# duration, world sizes): the measured column of docs/reliability.md's chaos matrix.
REPORT_ENV = "LIGHTNING_ELASTIC_CHAOS_REPORT"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Kept on the item so that the job fixture knows, at teardown, whether the test failed.
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def job(tmp_path, request: pytest.FixtureRequest) -> Iterator[Job]:
    """A launch in its own directory; afterwards no process of it may be left running."""
    j = Job(tmp_path)
    started = time.monotonic()
    yield j
    call = getattr(request.node, "report_call", None)
    if call is not None and call.failed:
        # A failure in CI can rarely be reproduced: keep what the job was doing.
        request.node.add_report_section("teardown", "job", diagnosis(j))
    j.kill()
    report = os.environ.get(REPORT_ENV)
    if report and j.proc is not None:
        record_launch(Path(report), request.node.nodeid, j, time.monotonic() - started)
    # The driver must have stopped every worker it started (bounded wait for exits in flight).
    try:
        wait_for(lambda: not j.stray_processes(), 15, "the job's processes to exit")
    except AssertionError:
        stray = j.stray_processes()
        for proc in stray:
            proc.kill()
        pytest.fail(f"processes left behind after the driver exited: {[p.pid for p in stray]}")


def diagnosis(job: Job) -> str:
    """The driver's last output and the Python stacks of the job's processes still running."""
    parts = [f"--- driver stderr (last 4000 characters) ---\n{job.stderr()[-4000:]}"]
    if job.proc is not None and job.proc.poll() is None:
        parts.append(f"driver pid {job.proc.pid} still running")
    parts.append(job.stacks())
    return "\n".join(parts)


def record_launch(report: Path, test: str, job: Job, wall: float) -> None:
    match = re.search(r"duration:\s+([0-9.]+) s", job.stderr())
    entry = {
        "test": test,
        "exit": job.proc.returncode if job.proc is not None else None,
        "verdict": job.reason(),
        "driver_seconds": float(match.group(1)) if match else None,
        "test_seconds": round(wall, 1),
        "world_sizes": job.world_sizes(),
    }
    with report.open("a") as f:
        f.write(json.dumps(entry) + "\n")


@pytest.fixture(scope="session")
def remote_hosts(request: pytest.FixtureRequest) -> Iterator[NamespacedHosts]:
    """Network namespaces le-h1..le-h3 with sshd (and le-h4 without) as remote machines.

    Skipped where this box cannot have them (not root, no ``ip``, no namespaces), but in CI
    (``CI`` set) that is a failure: CI must run these tests, not silently skip them.
    """
    yield from started(NamespacedHosts(), HostsUnavailable, "namespaced remote hosts", request)


def started(bed, unavailable: type[Exception], what: str, request: pytest.FixtureRequest) -> Iterator:
    """Start a test bed for a session fixture to yield, and close it after; a bed this box
    cannot have skips (or fails in CI, see ``skip_or_fail``)."""
    try:
        try:
            bed.start()
        except unavailable as exc:
            skip_or_fail(request, f"{what} unavailable: {exc}")
        yield bed
    finally:
        bed.close()


def skip_or_fail(request: pytest.FixtureRequest, reason: str) -> None:
    """Skip with a visible reason; but in CI (``CI`` set) fail: CI must run these tests."""
    # Shown even under -q and output capture: a skipped session deserves a visible reason.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{reason}", yellow=True)
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason} (CI is set, so this is not skipped)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """A Slurm cluster of namespaced nodes le-s1..le-s4 (see slurm_cluster.py), shared by the
    session's Slurm tests; every daemon stopped and namespace removed at the end."""
    yield from started(SlurmCluster(), ClusterUnavailable, "namespaced Slurm cluster", request)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """The session's cluster, with no job left and every node back up after each test."""
    yield slurm_cluster
    call = getattr(request.node, "report_call", None)
    if call is not None and call.failed:
        request.node.add_report_section("teardown", "slurm", slurm_cluster.logs())
    slurm_cluster.cancel_all()


@pytest.fixture
def hosts(remote_hosts: NamespacedHosts) -> Iterator[NamespacedHosts]:
    """The session's hosts, healed and with sshd running again after each test."""
    yield remote_hosts
    remote_hosts.restore_all()
