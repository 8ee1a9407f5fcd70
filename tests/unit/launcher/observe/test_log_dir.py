"""launcher/observe/events.py prepare_log_dir: a --log-dir used again keeps the previous job's files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.observe.events import EventLog, prepare_log_dir, read_events

STARTED = 1_700_000_000.0  # the first job's start, wall clock
STAMP = time.strftime("%Y%m%d-%H%M%S", time.localtime(STARTED))
WHEN = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(STARTED))


def write_job(directory: Path, started: float = STARTED) -> None:
    log = EventLog(directory, clock=lambda: started)
    log.emit("job_started", np=1, min_np=1, max_np=1)
    log.emit("job_ended", success=True, reason="done")
    log.close()
    (directory / "worker-0-localhost-0.log").write_text("first job\n")
    (directory / "timeline.png").write_bytes(b"png")


def test_a_new_directory_is_created_and_nothing_said(tmp_path):
    assert prepare_log_dir(tmp_path / "a" / "logs") is None
    assert (tmp_path / "a" / "logs").is_dir()


def test_a_directory_with_other_files_only_is_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert prepare_log_dir(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_previous_jobs_files_move_into_a_directory_named_after_its_start(tmp_path):
    write_job(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    said = prepare_log_dir(tmp_path)
    target = tmp_path / f"job-{STAMP}"
    assert said == (f"--log-dir {tmp_path} held a job started at {WHEN}: moved its 3 file(s) to {target} "
                    f"(lightning-elastic timeline {target} draws it)")
    assert sorted(p.name for p in target.iterdir()) == ["events.jsonl", "timeline.png", "worker-0-localhost-0.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"job-{STAMP}", "notes.txt"]
    assert [e["kind"] for e in read_events(target)] == ["job_started", "job_ended"]  # the timeline reads it


def test_jobs_started_in_the_same_second_get_distinct_directories(tmp_path):
    for _ in range(3):
        write_job(tmp_path)
        prepare_log_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"job-{STAMP}", f"job-{STAMP}-2", f"job-{STAMP}-3"]


def test_worker_logs_without_events_are_named_after_their_oldest_file(tmp_path):
    log = tmp_path / "worker-0-localhost-0.log"
    log.write_text("x")
    os.utime(log, (STARTED, STARTED))
    prepare_log_dir(tmp_path)
    assert (tmp_path / f"job-{STAMP}" / log.name).read_text() == "x"


def test_a_log_dir_that_cannot_be_created_is_a_config_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=rf"^--log-dir: cannot create {tmp_path}/afile/logs: Not a directory$"):
        prepare_log_dir(tmp_path / "afile" / "logs")


def test_the_new_job_writes_a_fresh_events_file(tmp_path):
    write_job(tmp_path)
    prepare_log_dir(tmp_path)
    log = EventLog(tmp_path, clock=lambda: STARTED + 60)
    log.emit("job_started", np=1, min_np=1, max_np=1)
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["time"] for line in lines] == [STARTED + 60]
