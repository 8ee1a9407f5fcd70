"""launcher/observe/events.py and launcher/observe/timeline.py: the job's events, and the PNG drawn from them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lightning_elastic.launcher.cli import main
from lightning_elastic.launcher.observe.events import EventLog, read_events
from lightning_elastic.launcher.observe.timeline import build_timeline

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass(frozen=True)
class Break:
    round: int
    cause: str


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_job(directory: Path) -> list[dict]:
    """A job: 2 workers, one killed (fault), a third host joins (host change)."""
    clock = Clock()
    log = EventLog(directory, clock)
    log.emit("job_started", np=2, min_np=1, max_np=3)
    log.emit("worker_started", worker="a#0", host="a", pid=1)
    log.emit("worker_started", worker="b#1", host="b", pid=2)
    clock.now = 1001.0
    log.round_formed(1, [{"rank": 0, "worker": "a#0", "host": "a"}, {"rank": 1, "worker": "b#1", "host": "b"}])
    log.observe([], {1: 1001.5}, current_round=1)
    clock.now = 1003.0
    log.emit("worker_failed", worker="b#1", host="b", reason="worker b#1 was killed by SIGKILL")
    log.observe([Break(1, "worker b#1 was killed by SIGKILL")], {1: 1001.5}, current_round=1)
    clock.now = 1003.1
    log.round_formed(2, [{"rank": 0, "worker": "a#0", "host": "a"}])
    log.observe([Break(1, "...")], {1: 1001.5, 2: 1003.25}, current_round=2)
    clock.now = 1005.0
    log.emit("worker_started", worker="c#2", host="c", pid=3)
    clock.now = 1006.0
    log.host_change_announced(2, generation=1)
    clock.now = 1006.3
    log.round_formed(3, [{"rank": 0, "worker": "a#0", "host": "a"}, {"rank": 1, "worker": "c#2", "host": "c"}])
    log.observe([Break(1, "...")], {1: 1001.5, 2: 1003.25, 3: 1006.8}, current_round=3)
    clock.now = 1010.0
    log.emit("worker_done", worker="a#0", host="a")
    log.emit("worker_done", worker="c#2", host="c")
    log.emit("job_ended", success=True, reason="training finished on all 2 worker(s) of round 3")
    log.close()
    return read_events(directory)


def test_rounds_first_steps_and_recoveries_become_events(tmp_path: Path) -> None:
    events = write_job(tmp_path)
    kinds = [e["kind"] for e in events]
    assert kinds.count("first_step") == 3  # each round's once, however often observed
    assert [e["size"] for e in events if e["kind"] == "round_formed"] == [2, 1, 2]
    recoveries = [e for e in events if e["kind"] == "recovery"]
    assert [(r["round"], r["after"]) for r in recoveries] == [(2, "fault"), (3, "host change")]
    assert recoveries[0]["duration_s"] == pytest.approx(0.25)  # the break at 1003.0 to the first step
    assert recoveries[1]["duration_s"] == pytest.approx(0.8)  # the announcement at 1006.0 to the first step
    assert all(e["time"] >= 1000.0 for e in events)


def test_the_timeline_has_the_world_sizes_lanes_and_faults(tmp_path: Path) -> None:
    timeline = build_timeline(write_job(tmp_path))
    assert [size for _, size in timeline.world] == [2, 1, 2]
    assert timeline.hosts == ["a", "b", "c"]
    assert [(s.host, s.ended) for s in timeline.spans] == [("a", "worker_done"), ("b", "worker_failed"),
                                                           ("c", "worker_done")]
    assert timeline.faults == ((3.0, "b"),)
    assert timeline.joins == ((5.0, "c"),)
    assert [round(seconds, 2) for _, seconds, _ in timeline.recoveries] == [0.25, 0.8]
    assert timeline.success is True


def test_the_command_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    write_job(tmp_path)
    assert main(["timeline", str(tmp_path), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"timeline written to {tmp_path / 't.png'}" in capsys.readouterr().err


def test_a_directory_without_events_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lightning-elastic: error: timeline: {tmp_path / 'events.jsonl'} not found "
                   "(run lightning-elastic launch with --log-dir)")


def test_a_corrupt_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1, "kind": "job_started"}) + "\n{not json\n")
    assert main(["timeline", str(tmp_path)]) == 2
    assert f"{tmp_path / 'events.jsonl'}:2: not a JSON event" in capsys.readouterr().err


def test_without_a_log_dir_nothing_is_written(tmp_path: Path) -> None:
    log = EventLog(None)
    log.emit("job_started", np=1, min_np=1, max_np=1)
    log.close()
    assert not list(tmp_path.iterdir())


def test_a_driver_outage_is_a_span_of_the_timeline():
    events = [
        {"time": 100.0, "kind": "job_started", "np": 2, "min_np": 2, "max_np": 2},
        {"time": 101.0, "kind": "round_formed", "round": 1, "size": 2, "members": []},
        {"time": 110.0, "kind": "driver_restarted", "outage_s": 4.5, "adopted": 2, "ended": 0, "round": 1},
        {"time": 112.0, "kind": "job_ended", "success": True, "reason": "done"},
    ]
    assert build_timeline(events).outages == ((5.5, 10.0),)
