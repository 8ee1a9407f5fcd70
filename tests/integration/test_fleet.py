"""The driver at fleet scale, as real processes: the fleet simulation's own run.

``benchmarks/fleet_sim.py`` starts the real driver in a process of its own and hundreds of
simulated workers speaking the real signed protocol in another, then kills one, lets
the job re-form and end. What it must show holds at any speed (timings are the
benchmark's, not the test's): every phase completes, the job succeeds, no worker saw a
connection fail and none was falsely declared wedged, the process-group bootstrap through
the store completes, and the driver's threads do not grow with the number of workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("fleet") / "fleet.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet_sim.py"), "--workers", "64,512", "--steady", "2",
         "--bound", "90", "--store-patterns", "nccl-scalable", "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=280,
    )
    return {r["workers"]: r for r in json.loads(out.read_text())["results"]}


@pytest.mark.parametrize("n", [64, 512])
def test_every_phase_completes_and_the_job_succeeds(results, n):
    r = results[n]
    assert r["first_round_s"] is not None and r["reform_s"] is not None, r.get("driver_log_tail")
    assert r["job"]["success"] is True, r["job"]
    assert r["job"]["rounds"] == [n, n - 1]  # only the victim's slot left: its 7 siblings stayed
    assert r["store_nccl-scalable"]["seconds"] is not None
    assert r["store_nccl-scalable"]["requests"] == n + (n + 127) // 128  # one MULTI_GET each, one set per root


@pytest.mark.parametrize("n", [64, 512])
def test_no_connection_failed_and_no_worker_was_falsely_declared_wedged(results, n):
    r = results[n]
    assert r["connection_errors_before_end"] == 0, r["error_kinds"]
    assert r["false_wedged"] == 0 and r["disowned"] == 0


def test_the_drivers_threads_do_not_grow_with_the_workers(results):
    assert results[512]["driver_threads"] == results[64]["driver_threads"] <= 6
