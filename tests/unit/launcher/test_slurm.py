"""--slurm without a cluster: the allocation read from the environment, discovery through
fake squeue/scontrol on PATH, and an srun step's exit that carries no worker status."""

from __future__ import annotations

import io
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from lightning_elastic.launcher.cli import config_from_args, parse_args
from lightning_elastic.launcher.config import SlurmSettings
from lightning_elastic.launcher.errors import ConfigError, DiscoveryError
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.node.supervisor import MARK
from lightning_elastic.launcher.processes.slurm import LOST, SlurmLauncher, srun_argv, step_environment
from lightning_elastic.launcher.hosts.slurm import SlurmDiscovery, SlurmNodes, expand_tasks_per_node, slurm_settings

BOUND = 20.0


def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **scripts: str) -> None:
    """Shell scripts named like Slurm's commands, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


@pytest.mark.parametrize(("text", "counts"), [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1])])
def test_tasks_per_node_is_expanded_as_slurm_writes_it(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_outside_an_allocation_slurm_is_one_line_naming_it(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, srun="exit 0", squeue="exit 0")
    with pytest.raises(ConfigError, match=r"^--slurm: not inside a Slurm allocation \(SLURM_JOB_ID is not set\)"):
        slurm_settings({}, None, None)
    with pytest.raises(ConfigError, match=r"--slurm-jobs: expected Slurm job ids like 1234 or job names like "
                                          r"more-gpus, got 'x;rm'"):
        slurm_settings({"SLURM_JOB_ID": "7"}, "8,x;rm", None)
    with pytest.raises(ConfigError, match=r"--slurm-jobs: .* got 'two words'"):
        slurm_settings({"SLURM_JOB_ID": "7"}, "two words", None)
    with pytest.raises(ConfigError, match=r"^SLURM_JOB_ID: expected a Slurm job id like 1234, got 'x'$"):
        slurm_settings({"SLURM_JOB_ID": "x"}, None, None)
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE: expected entries like 2 or 2"):
        slurm_settings({"SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "two"}, None, None)


def test_the_allocation_and_other_jobs_come_from_the_environment_and_slurm_jobs(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, srun="exit 0", squeue="exit 0")
    settings = slurm_settings({"SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "n[1-2]"},
                              "8, 7", None)
    assert settings == SlurmSettings(job_ids=("7", "8"), tasks_per_node=(2, 2), nodelist="n[1-2]")
    named = slurm_settings({"SLURM_JOB_ID": "7"}, "more-gpus,8,more-gpus,spot.b", None)
    assert (named.job_ids, named.job_names) == (("7", "8"), ("more-gpus", "spot.b"))


def test_cli_slurm_defaults_np_to_the_allocations_tasks_and_is_a_host_source(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, srun="exit 0", squeue="exit 0")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2),1")
    config = config_from_args(parse_args(["launch", "--slurm", sys.executable, "-c", "pass"], environ={}))
    assert config.np == 5 and config.slurm is not None and config.hosts is None
    with pytest.raises(ConfigError, match="^--slurm-jobs: only with --slurm$"):
        config_from_args(parse_args(["launch", "--slurm-jobs", "8", sys.executable, "-c", "pass"], environ={}))
    # From the environment too, and a flag set false is no source.
    args = parse_args(["launch", "-np", "2", sys.executable], environ={"LIGHTNING_ELASTIC_SLURM": "1"})
    assert args.slurm is True
    args = parse_args(["launch", "-np", "2", sys.executable],
                      environ={"LIGHTNING_ELASTIC_SLURM": "0", "LIGHTNING_ELASTIC_HOSTS": "a:2"})
    assert args.slurm is False and args.hosts == "a:2"


def test_discovery_lists_running_jobs_nodes_in_order_with_their_slots_and_jobs(tmp_path, monkeypatch):
    fake_tools(
        tmp_path, monkeypatch,
        # Another job of this user's (9) is not ours: left out.
        squeue=f'echo "$@" > {tmp_path / "squeue.args"}; echo "8 m1 more"; echo "9 x1 other job"; '
               'echo "7 n[1-2] train"',
        scontrol='[ "$1 $2" = "show hostnames" ] || exit 1; echo "$3" | sed "s/n\\[1-2\\]/n1 n2/" | tr " " "\\n"',
    )
    nodes = SlurmNodes("7")
    settings = SlurmSettings(job_ids=("7", "8"), tasks_per_node=(2, 3), nodelist="n[1-2]")
    found = SlurmDiscovery(settings, nodes).discover()
    assert found == [HostSlots("n1", 2), HostSlots("n2", 3), HostSlots("m1", 1)]
    assert (nodes.job_of("n2"), nodes.job_of("m1"), nodes.job_of("unknown")) == ("7", "8", "7")
    # Never `-j IDS`: squeue fails as a whole once one of them is purged.
    assert (tmp_path / "squeue.args").read_text().split() == ["-h", "--me", "-t", "RUNNING", "-o", "%A", "%N", "%j"]


def test_a_job_name_takes_in_every_running_job_so_named_after_the_ids(tmp_path, monkeypatch):
    fake_tools(
        tmp_path, monkeypatch,
        # Two jobs named "more" (capacity submitted twice), one job with a space in its name;
        # a pending job of that name shows no nodes and brings none.
        squeue='echo "12 m2 more"; echo "9 x1 more than this"; echo "7 n1 train"; echo "11 m1 more"; '
               'echo "13  more"; echo "8 k1 spot"',
    )
    nodes = SlurmNodes("7")
    settings = SlurmSettings(job_ids=("7", "8"), job_names=("more",))
    found = SlurmDiscovery(settings, nodes).discover()
    assert [h.host for h in found] == ["n1", "k1", "m1", "m2"]
    assert (nodes.job_of("m1"), nodes.job_of("m2"), nodes.job_of("k1")) == ("11", "12", "8")


def test_a_failing_squeue_is_a_discovery_error_with_its_message(tmp_path, monkeypatch):
    fake_tools(tmp_path, monkeypatch, squeue='echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    with pytest.raises(DiscoveryError, match="squeue -h exited with status 1: slurm_load_jobs error: Unable"):
        SlurmDiscovery(SlurmSettings(job_ids=("7",)), SlurmNodes("7")).discover()


def test_srun_argv_is_one_overlapping_single_task_step_on_the_node():
    argv = srun_argv("7", "n2", "/work", "n2[0]#3", python="/venv/bin/python")
    assert argv[:9] == ["srun", "--jobid", "7", "--overlap", "--nodes=1", "--ntasks=1", "-w", "n2", "--quiet"]
    assert argv[-3:] == ["/venv/bin/python", "-m", "lightning_elastic.launcher.node.supervisor"]


def test_the_batch_steps_task_layout_is_not_passed_to_srun():
    env = step_environment({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "8", "HOME": "/h"})
    assert env == {"SLURM_JOB_ID": "7", "HOME": "/h"}


def start_with_fake_srun(tmp_path, monkeypatch, body: str):
    fake_tools(tmp_path, monkeypatch, srun=body, scancel=f'echo "$@" >> {tmp_path / "scancel.log"}')
    launcher = SlurmLauncher(SlurmNodes("7"), io.StringIO())
    spec = WorkerSpec(worker_id="n1[0]#0", host="n1", command=(sys.executable, "-c", "pass"), env={},
                      secret="s" * 64, cwd=str(tmp_path))
    return launcher, launcher.start(spec, lambda: "[0] ")


def test_a_step_that_exits_0_without_the_workers_status_is_lost_not_a_success(tmp_path, monkeypatch):
    # As srun does for a single-node step whose node died: status 0, no worker status.
    launcher, proc = start_with_fake_srun(tmp_path, monkeypatch, "cat > /dev/null; exit 0")
    proc.send("")  # nothing more: close our end as the driver's exit would
    proc._proc.stdin.close()  # noqa: SLF001
    assert proc.wait(BOUND) == LOST
    assert "ended without the worker's exit status (srun status 0" in proc.exit_detail()
    launcher.close()


def test_the_supervisors_status_and_step_come_through_srun(tmp_path, monkeypatch):
    mark = MARK
    body = (f'read line; echo "{mark} started 1" >&2; echo "{mark} step 7.3" >&2; '
            f'while read l; do echo "$l" >> {tmp_path / "stdin.log"}; [ "$l" = "signal 9" ] && exit 0; done; '
            f'echo "{mark} exit 3" >&2')
    launcher, proc = start_with_fake_srun(tmp_path, monkeypatch, body)
    deadline = time.monotonic() + BOUND
    while proc._step is None and time.monotonic() < deadline:  # noqa: SLF001 - the step srun reported
        time.sleep(0.01)
    assert proc.poll() is None and proc._step == "7.3"  # noqa: SLF001
    proc.signal(signal.SIGKILL)  # to the supervisor over stdin, and through Slurm to the step
    assert proc.wait(BOUND) == -signal.SIGKILL
    launcher.close()
    assert (tmp_path / "scancel.log").read_text().split() == ["--signal=KILL", "7.3"]
