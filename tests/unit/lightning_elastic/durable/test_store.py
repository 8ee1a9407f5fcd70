"""Durable snapshots: the background writer, the files on disk, and reading them back."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

import lightning_elastic as le
from lightning_elastic.durable import files
from lightning_elastic.durable import fs as snapshot_fs
from lightning_elastic.durable import store as snapshot_store
from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.durable.files import SnapshotError, SnapshotSettings
from lightning_elastic.durable.store import SnapshotInfo, SnapshotWriter


def tree(step: int, size: int = 1000) -> dict:
    return {"values": {"step": step}, "stateful": {"model": {"w": torch.full((size,), float(step))}}}


def info(step: int) -> SnapshotInfo:
    return SnapshotInfo(round=1, step=step, epoch=0, world_size=2, sampler={"epoch": 0, "consumed": step})


def writer_for(directory, keep: int = 2) -> SnapshotWriter:
    clock = iter(range(0, 10**6, 100))  # every offer is due: 100 s apart
    return SnapshotWriter(SnapshotSettings(directory, every=1.0, keep=keep), "job-1", clock=lambda: next(clock))


def test_the_newest_commits_are_written_with_manifests_and_the_last_k_kept(tmp_path):
    snapshot, writer = HostSnapshot(), writer_for(tmp_path, keep=2)
    for step in range(1, 5):
        snapshot.capture(tree(step))
        assert writer.offer(snapshot, info(step))
        assert writer.wait(10)
    assert writer.stats == snapshot_store.WriterStats(written=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "snapshot-3-step-3.json", "snapshot-3-step-3.pt", "snapshot-4-step-4.json", "snapshot-4-step-4.pt"]
    manifest = json.loads((tmp_path / "snapshot-4-step-4.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["job_id"] == "job-1"
    assert manifest["sampler"] == {"epoch": 0, "consumed": 4}
    assert manifest["sha256"] == files.file_sha256(tmp_path / "snapshot-4-step-4.pt")
    assert manifest["library"] == le.__version__ and manifest["torch"] == str(torch.__version__)
    loaded = le.load_snapshot(tmp_path)
    assert loaded["values"] == {"step": 4} and torch.equal(loaded["stateful"]["model"]["w"], torch.full((1000,), 4.0))
    assert le.load_snapshot(tmp_path / "snapshot-3-step-3.pt")["values"] == {"step": 3}


def test_a_snapshot_is_due_only_every_period():
    now = [0.0]
    writer = SnapshotWriter(SnapshotSettings(__import__("pathlib").Path("/nonexistent-unused"), every=10.0),
                            clock=lambda: now[0])
    snapshot = HostSnapshot()
    snapshot.capture(tree(1))
    now[0] = 5.0
    assert not writer.offer(snapshot, info(1))  # 5 s after the start: not yet
    assert not writer.offer(snapshot, info(1), may_start=False)


def test_commits_during_a_write_are_skipped_and_never_touch_its_buffers(tmp_path, monkeypatch):
    release = threading.Event()
    real_save = torch.save

    def slow_save(obj, f):  # the disk is slow: the write holds its lease until released
        assert release.wait(10)
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", slow_save)
    snapshot, writer = HostSnapshot(), writer_for(tmp_path)
    snapshot.capture(tree(1))
    assert writer.offer(snapshot, info(1))
    buffer_sets = set()
    for step in range(2, 8):  # commits while the write is in progress
        snapshot.capture(tree(step))
        buffer_sets.add(id(snapshot.committed().tensors[0]))
        assert not writer.offer(snapshot, info(step))  # skipped: one write at a time
    # The leased commit's buffers were never reused: two other sets took turns.
    assert len(buffer_sets) == 2
    release.set()
    assert writer.wait(10)
    assert le.load_snapshot(tmp_path)["values"] == {"step": 1}
    assert torch.equal(le.load_snapshot(tmp_path)["stateful"]["model"]["w"], torch.full((1000,), 1.0))
    # The lease ends at the next offer: its buffers become the third set, reused from then
    # on (no fresh allocation per commit; at most three sets in all).
    snapshot.capture(tree(8))
    writer.offer(snapshot, info(8))
    for step in range(9, 15):
        snapshot.capture(tree(step))
        buffer_sets.add(id(snapshot.committed().tensors[0]))
    assert len(buffer_sets) <= 3


def test_a_failing_directory_is_counted_and_said_once_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    snapshot, writer = HostSnapshot(), writer_for(blocker / "snapshots")
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        for step in range(3):
            snapshot.capture(tree(step))
            assert writer.offer(snapshot, info(step))
            assert writer.wait(10)
    stats = writer.stats
    assert stats.written == 0 and stats.failed == 3 and "Not a directory" in stats.last_error
    warnings = [r for r in caplog.records if "Could not write a snapshot" in r.getMessage()]
    assert len(warnings) == 1
    assert snapshot.committed().tree()["values"] == {"step": 2}  # the commits themselves are untouched


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_fails_the_write_not_the_job(tmp_path):
    tmp_path.chmod(0o500)
    try:
        snapshot, writer = HostSnapshot(), writer_for(tmp_path)
        snapshot.capture(tree(1))
        writer.offer(snapshot, info(1))
        assert writer.wait(10)
        assert writer.stats.failed == 1
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_file_system_fails_the_write_leaves_nothing_and_the_next_fits(tmp_path, caplog):
    import subprocess  # noqa: PLC0415

    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        snapshot, writer = HostSnapshot(), writer_for(full)
        with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
            snapshot.capture(tree(1, size=200_000))  # 800 kB of tensors: more than the file system holds
            assert writer.offer(snapshot, info(1)) and writer.wait(10)
            assert writer.stats.failed == 1 and "No space left on device" in writer.stats.last_error
            assert list(full.iterdir()) == []  # the partial temporary file removed
            assert "Could not write a snapshot" in caplog.text
            snapshot.capture(tree(2, size=1000))  # training went on; a smaller state fits
            assert writer.offer(snapshot, info(2)) and writer.wait(10)
        assert writer.stats.written == 1 and sorted(p.name for p in full.iterdir()) == ["snapshot-1-step-2.json", "snapshot-1-step-2.pt"]
        assert le.load_snapshot(full)["values"] == {"step": 2}
    finally:
        subprocess.run(["umount", str(full)], check=False)


def write_three(directory) -> None:
    snapshot, writer = HostSnapshot(), writer_for(directory, keep=3)
    for step in (1, 2, 3):
        snapshot.capture(tree(step))
        writer.offer(snapshot, info(step))
        assert writer.wait(10)


def test_a_truncated_newest_snapshot_falls_back_to_the_previous_with_a_warning(tmp_path):
    write_three(tmp_path)
    newest = tmp_path / "snapshot-3-step-3.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    warned: list[str] = []
    found = files.newest_valid(tmp_path, warned.append)
    assert found is not None and found.manifest.step == 2
    assert len(warned) == 1 and "snapshot-3-step-3.json" in warned[0] and "truncated" in warned[0]


def test_a_corrupt_snapshot_of_the_right_size_fails_its_checksum(tmp_path):
    write_three(tmp_path)
    newest = tmp_path / "snapshot-3-step-3.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        le.load_snapshot(newest)
    assert le.load_snapshot(tmp_path)["values"] == {"step": 2}


def test_a_manifest_of_a_newer_format_is_refused_in_one_line(tmp_path):
    write_three(tmp_path)
    manifest = tmp_path / "snapshot-3-step-3.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "format": files.FORMAT + 1}))
    with pytest.raises(SnapshotError, match="snapshot format") as err:
        files.check(manifest)
    assert "\n" not in str(err.value)


def test_no_snapshot_is_one_line(tmp_path):
    with pytest.raises(SnapshotError, match="no valid snapshot"):
        le.load_snapshot(tmp_path)
    with pytest.raises(SnapshotError, match="no such snapshot"):
        le.load_snapshot(tmp_path / "snapshot-9-step-9.pt")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every": 0.0}, "--snapshot-every: expected a positive"),
    ({"every": float("nan")}, "--snapshot-every"),
    ({"keep": 0}, "--snapshot-keep: expected 1 or more"),
])
def test_settings_are_validated(tmp_path, kwargs, message):
    with pytest.raises(SnapshotError, match=message):
        SnapshotSettings(tmp_path, **kwargs)


def test_init_arguments_override_the_launchers_environment(tmp_path):
    environ = {files.ENV_DIR: str(tmp_path / "a"), files.ENV_EVERY: "5", files.ENV_KEEP: "3",
               files.ENV_RESUME_FROM: str(tmp_path / "a" / "snapshot-1-step-1.pt")}
    settings, chosen = snapshot_store.plan(environ)
    assert settings == SnapshotSettings(tmp_path / "a", 5.0, 3, True) and chosen == tmp_path / "a" / "snapshot-1-step-1.pt"
    settings, chosen = snapshot_store.plan(environ, every=1.5, resume=False)
    assert settings == SnapshotSettings(tmp_path / "a", 1.5, 3, False) and chosen is None
    settings, _ = snapshot_store.plan({}, directory=tmp_path / "b", keep=4)
    assert settings == SnapshotSettings(tmp_path / "b", 60.0, 4, True)
    with pytest.raises(SnapshotError, match="need snapshot_dir"):
        snapshot_store.plan({}, every=3.0)


# ----- the State API: commits offered, a snapshot resumed -----------------------------------


def make_state(worker, scale: float = 1.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * scale)
    return le.TorchState(model, optimizer, worker=worker, epoch=0, step=0)


def test_rank_0_writes_its_commits_and_a_new_job_resumes_from_them_with_the_reset_callbacks(tmp_path):
    from lightning_elastic.training.runner import _StateRecovery
    from lightning_elastic.durable.store import ResumePlan
    from tests.unit.fakes import FakeWorker

    worker = FakeWorker(rank=0, size=3)
    worker.snapshot_writer = writer_for(tmp_path)
    state = make_state(worker)
    with torch.no_grad():
        state.model.weight.add_(1.0)
    state.step, state.epoch = 7, 1
    state.commit()
    assert worker.snapshot_writer.wait(10) and worker.snapshot_writer.stats.written == 1
    manifest = json.loads((tmp_path / "snapshot-1-step-7.json").read_text())
    assert (manifest["step"], manifest["epoch"], manifest["world_size"]) == (7, 1, 3)
    saved = state.model.weight.detach().clone()

    fresh = FakeWorker(rank=0, size=1)
    fresh.resume_from = ResumePlan(None, tmp_path)
    resumed = make_state(fresh)
    resets: list[int] = []
    resumed.register_reset_callbacks([lambda: resets.append(fresh.assignment.size)])
    _StateRecovery(resumed, lambda: None).prepare(resumed=False)
    assert torch.equal(resumed.model.weight, saved) and (resumed.step, resumed.epoch) == (7, 1)
    assert resets == [1]  # the world size may differ from the one that wrote it (3)
    assert fresh.resume_from is None  # only the first round resumes
    resumed.step = 99
    resumed.restore()
    assert resumed.step == 7  # the snapshot is the commit a failure goes back to


def test_resuming_from_a_snapshot_of_another_model_is_one_line_saying_how_to_start_over(tmp_path):
    from lightning_elastic.training.runner import _StateRecovery
    from lightning_elastic.durable.store import ResumePlan
    from tests.unit.fakes import FakeWorker

    worker = FakeWorker(rank=0, size=1)
    worker.snapshot_writer = writer_for(tmp_path)
    make_state(worker).commit()
    assert worker.snapshot_writer.wait(10)
    fresh = FakeWorker(rank=0, size=1)
    fresh.resume_from = ResumePlan(tmp_path / "snapshot-1-step-0.pt", tmp_path)
    other = le.TorchState(torch.nn.Linear(5, 2), worker=fresh, step=0)
    with pytest.raises(SnapshotError) as err:
        _StateRecovery(other, lambda: None).prepare(resumed=False)
    text = str(err.value)
    # The way out first: the driver's report of a worker's error keeps its first 500 characters.
    assert "\n" not in text and text.startswith(
        f"{tmp_path / 'snapshot-1-step-0.pt'}: does not fit this state (another model?; to start over instead: --no-resume "
        "(or resume=False), or another --snapshot-dir): ")
    assert "size mismatch" in text


def test_a_rank_other_than_0_never_writes(tmp_path):
    from tests.unit.fakes import FakeWorker

    worker = FakeWorker(rank=1, size=2)
    worker.snapshot_writer = writer_for(tmp_path)
    state = make_state(worker)
    state.commit()
    assert worker.snapshot_writer.wait(10) and worker.snapshot_writer.stats.written == 0
    assert not list(tmp_path.iterdir())


def test_a_snapshot_of_another_model_is_one_line_and_keeps_the_state(tmp_path):
    from tests.unit.fakes import FakeWorker

    worker = FakeWorker()
    worker.snapshot_writer = writer_for(tmp_path)
    state = make_state(worker)
    state.commit()
    assert worker.snapshot_writer.wait(10)
    other = le.TorchState(torch.nn.Linear(5, 2), worker=FakeWorker(), step=3)
    before = [t.detach().clone() for t in other.model.parameters()]
    other.commit()
    with pytest.raises(SnapshotError, match="does not fit this state") as err:
        other.load_tree(le.load_snapshot(tmp_path), "snapshot-1-step-1.pt")
    assert "\n" not in str(err.value) and "size mismatch" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), before))  # the bias fitted: undone
    with pytest.raises(SnapshotError, match="holds a Lightning checkpoint"):
        other.load_tree({"state_dict": {}, "epoch": 0}, "ckpt")


# ----- the driver: counts for the summary, the snapshot to resume from ----------------------


def test_the_summary_counts_every_workers_snapshots_from_heartbeats_and_final_reports():
    from lightning_elastic.launcher.restart import resume as snapshots
    from lightning_elastic.launcher.job.slots import SlotKey
    from lightning_elastic.launcher.service.registry import Registry
    from lightning_elastic.protocol import HeartbeatRequest, Outcome, Report

    reg = Registry()
    with reg.cond:
        reg.add_worker("a", SlotKey("h1", 0))
        reg.add_worker("b", SlotKey("h2", 0))
    reg.heartbeat(HeartbeatRequest("a", 0, 0, 0.0, snapshots_written=2))
    reg.heartbeat(HeartbeatRequest("b", 0, 0, 0.0, snapshots_written=1, snapshots_failed=1, snapshot_error="x"))
    reg.report(Report("b", 0, Outcome.DONE, "", 1, 3, "Read-only file system: /s"))
    assert snapshots.totals(reg.state.workers.values()) == (3, 3, "Read-only file system: /s")


def test_the_driver_resumes_from_the_newest_valid_snapshot_and_says_so(tmp_path, caplog):
    from lightning_elastic.launcher.restart import resume as snapshots
    from lightning_elastic.launcher.observe.events import EventLog

    write_three(tmp_path / "s")
    (tmp_path / "s" / "snapshot-3-step-3.pt").write_bytes(b"torn")
    events = EventLog(tmp_path / "logs")
    job_id = files.job_id_of(("python", "train.py"))
    for manifest in (tmp_path / "s").glob("*.json"):  # this command's snapshots
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "job_id": job_id}))
    with caplog.at_level(logging.INFO, logger="lightning_elastic"):
        resume = snapshots.choose(SnapshotSettings(tmp_path / "s"), ("python", "train.py"), events)
    events.close()
    assert resume is not None and resume.found is not None and resume.found.manifest.step == 2
    assert resume.env[files.ENV_RESUME_FROM] == str(tmp_path / "s" / "snapshot-2-step-2.pt")
    assert "skipping snapshot snapshot-3-step-3.json" in caplog.text
    assert "another command" not in caplog.text
    assert "was written by lightning-elastic" not in caplog.text  # this very version
    logged = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if e["kind"] == "resumed_from_snapshot"] == [2]
    no_resume = snapshots.choose(SnapshotSettings(tmp_path / "s", resume=False), ("python",), EventLog(None))
    assert no_resume is not None and no_resume.found is None and files.ENV_RESUME_FROM not in no_resume.env


def test_a_snapshot_another_command_wrote_is_refused_unless_the_user_says_so(tmp_path, caplog):
    # Issue 37, item 8: resumed with a warning only, another script's state trained nothing.
    from lightning_elastic.launcher.errors import ConfigError
    from lightning_elastic.launcher.observe.events import EventLog
    from lightning_elastic.launcher.restart import resume as snapshots

    write_three(tmp_path)  # by job "job-1"
    this = files.job_id_of(("python", "train.py"))
    with pytest.raises(ConfigError) as refused:
        snapshots.choose(SnapshotSettings(tmp_path), ("python", "train.py"), EventLog(None))
    assert str(refused.value) == (
        f"--snapshot-dir: snapshot-3-step-3.pt in {tmp_path} was written by another command (job id job-1, this one's "
        f"is {this}): pass --no-resume or another --snapshot-dir to start over, or --resume-other-command to resume "
        "from it")
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        resume = snapshots.choose(SnapshotSettings(tmp_path, resume_other_command=True), ("python", "train.py"),
                                  EventLog(None))
    assert resume is not None and resume.found is not None and resume.found.manifest.step == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"Snapshot snapshot-3-step-3.pt was written by a launch with another command (job id job-1, this one {this}): "
        "resuming from it (--resume-other-command)."]
    fresh = snapshots.choose(SnapshotSettings(tmp_path, resume=False), ("python", "train.py"), EventLog(None))
    assert fresh is not None and fresh.found is None  # --no-resume: nothing to refuse
    with pytest.raises(SnapshotError, match="--resume-other-command: not with --no-resume"):
        SnapshotSettings(tmp_path, resume=False, resume_other_command=True)


def test_a_snapshot_of_another_version_or_format_is_said_in_one_line(tmp_path, caplog):
    from lightning_elastic.launcher.restart import resume as snapshots
    from lightning_elastic.launcher.observe.events import EventLog

    write_three(tmp_path)
    newest, previous = tmp_path / "snapshot-3-step-3.json", tmp_path / "snapshot-2-step-2.json"
    newest.write_text(json.dumps({**json.loads(newest.read_text()), "format": files.FORMAT + 1}))
    previous.write_text(json.dumps({**json.loads(previous.read_text()), "library": "0.0.1"}))
    with caplog.at_level(logging.INFO, logger="lightning_elastic"):
        resume = snapshots.choose(SnapshotSettings(tmp_path, resume_other_command=True), ("python", "train.py"),
                                  EventLog(None))
    assert resume is not None and resume.found is not None and resume.found.manifest.step == 2
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    refused = [m for m in said if "snapshot-3-step-3.json" in m]
    older = [m for m in said if "written by lightning-elastic 0.0.1" in m]
    assert len(refused) == 1 and "snapshot format" in refused[0], said  # a newer format: skipped
    assert len(older) == 1 and f"this is {le.__version__}" in older[0], said  # an older version: resumed, said
    assert all("\n" not in m for m in said)


def test_a_failure_of_the_same_kind_is_said_once_whatever_file_it_names(tmp_path, caplog, monkeypatch):
    def refuse(path, fill, exclusive=False):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(snapshot_fs, "write_atomically", refuse)  # what LocalStore writes with
    snapshot, writer = HostSnapshot(), writer_for(tmp_path)
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        for step in range(4):
            snapshot.capture(tree(step))
            assert writer.offer(snapshot, info(step))
            assert writer.wait(10)
    assert writer.stats.failed == 4 and writer.stats.last_error.startswith("Read-only file system: ")
    assert [r.getMessage().count("Could not write") for r in caplog.records] == [1]
    monkeypatch.undo()
    snapshot.capture(tree(9))
    assert writer.offer(snapshot, info(9)) and writer.wait(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot-1-step-9.json", "snapshot-1-step-9.pt"]  # none used up
