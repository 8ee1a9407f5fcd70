"""examples/discover_hosts.sh, the README's sample discovery script: what it prints is what
the driver parses, from a hosts file or a Slurm allocation."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_elastic.launcher.job.slots import HostSlots, parse_discovery_output

SCRIPT = Path(__file__).resolve().parents[4] / "examples" / "discover_hosts.sh"

pytestmark = pytest.mark.timeout(60)


def discover(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "HOSTS_FILE"}
    return subprocess.run([str(SCRIPT)], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=30)


def test_it_lists_the_hosts_file_of_the_working_directory(tmp_path):
    (tmp_path / "hosts.txt").write_text("# the job's machines\n127.0.0.1:2\n\n  # spare\n127.0.0.2\n")
    result = discover(tmp_path)
    assert result.returncode == 0, result.stderr
    assert parse_discovery_output(result.stdout, default_slots=1) == [HostSlots("127.0.0.1", 2), HostSlots("127.0.0.2", 1)]
    (tmp_path / "other.txt").write_text("# nothing yet\n")
    result = discover(tmp_path, HOSTS_FILE=str(tmp_path / "other.txt"))
    assert (result.returncode, result.stdout) == (0, "")


def test_a_missing_hosts_file_is_a_failed_discovery(tmp_path):
    result = discover(tmp_path)
    assert result.returncode == 1
    assert "no hosts file hosts.txt" in result.stderr


def test_inside_slurm_it_lists_the_allocations_nodes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # Slurm's: "show hostnames LIST" expands node[1-2]
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[1-2]" ] || exit 3\nprintf "node1\\nnode2\\n"\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]"}
    result = discover(tmp_path, SLURM_NTASKS_PER_NODE="4(x2)", **env)
    assert result.returncode == 0, result.stderr
    assert parse_discovery_output(result.stdout, None) == [HostSlots("node1", 4), HostSlots("node2", 4)]
    result = discover(tmp_path, SLOTS_PER_HOST="2", **env)
    assert parse_discovery_output(result.stdout, None) == [HostSlots("node1", 2), HostSlots("node2", 2)]
