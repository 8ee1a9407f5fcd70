"""Snapshots in an fsspec store (``--snapshot-dir s3://...``), against fsspec's in-memory
file system: the same writer, manifests, pruning and choice of the newest valid snapshot
as on disk, through ``snapshot_fs.FsspecStore`` (no rename: objects under their final
names, the manifest last)."""

from __future__ import annotations

import json
import logging
import sys
import uuid

import pytest
import torch

import lightning_elastic as le
from lightning_elastic.durable import files
from lightning_elastic.durable import fs as snapshot_fs
from lightning_elastic.durable import store as snapshot_store
from lightning_elastic.launcher import cli
from lightning_elastic.launcher.restart import resume as snapshots
from lightning_elastic.launcher.observe.events import EventLog
from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.durable.files import SnapshotError, SnapshotSettings
from lightning_elastic.durable.store import ResumePlan, SnapshotInfo, SnapshotWriter

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def url():
    """A fresh directory of the process-wide memory file system, removed afterwards."""
    where = f"memory://snapshots-{uuid.uuid4().hex[:8]}/job"
    yield where
    fs = fsspec.filesystem("memory")
    if fs.exists(where):
        fs.rm(where, recursive=True)


def tree(step: int) -> dict:
    return {"values": {"step": step}, "stateful": {"model": {"w": torch.full((1000,), float(step))}}}


def info(step: int, **extra) -> SnapshotInfo:
    return SnapshotInfo(round=1, step=step, epoch=0, world_size=2, sampler={"epoch": 0, "consumed": step},
                        extra=extra or None)


# The job id of the command the driver tests launch: their snapshots are this command's.
JOB_ID = files.job_id_of(("python", "train.py"))


def write(url: str, steps, keep: int = 3) -> SnapshotWriter:
    clock = iter(range(0, 10**6, 100))  # every offer is due
    snapshot = HostSnapshot()
    writer = SnapshotWriter(SnapshotSettings(url, every=1.0, keep=keep), JOB_ID, clock=lambda: next(clock))
    for step in steps:
        snapshot.capture(tree(step))
        assert writer.offer(snapshot, info(step))
        assert writer.wait(10)
    return writer


def names(url: str) -> list[str]:
    return sorted(snapshot_fs.open_store(url).names())


def put(url: str, name: str, data: bytes) -> None:
    with fsspec.open(f"{url}/{name}", "wb") as f:
        f.write(data)


def cat(url: str, name: str) -> bytes:
    return fsspec.filesystem("memory").cat_file(f"{url}/{name}")


def test_a_url_is_kept_as_a_url_and_a_path_stays_a_path(tmp_path):
    assert SnapshotSettings("memory://bucket/prefix/").directory == "memory://bucket/prefix"
    assert SnapshotSettings(str(tmp_path)).directory == tmp_path
    settings, chosen = snapshot_store.plan({files.ENV_DIR: "memory://b/p",
                                            files.ENV_RESUME_FROM: "memory://b/p/snapshot-2-step-2.pt"})
    assert settings is not None and settings.directory == "memory://b/p" and chosen == "memory://b/p/snapshot-2-step-2.pt"
    assert isinstance(snapshot_fs.open_store(tmp_path), snapshot_fs.LocalStore)
    assert isinstance(snapshot_fs.open_store("memory://b/p"), snapshot_fs.FsspecStore)


def test_snapshots_are_objects_with_manifests_and_the_last_k_kept(url):
    writer = write(url, range(1, 5), keep=2)
    assert writer.stats == snapshot_store.WriterStats(written=4)
    # Pruning deleted the two oldest snapshots' objects; no temporary object anywhere.
    assert names(url) == ["snapshot-3-step-3.json", "snapshot-3-step-3.pt", "snapshot-4-step-4.json", "snapshot-4-step-4.pt"]
    manifest = json.loads(cat(url, "snapshot-4-step-4.json"))
    assert manifest["step"] == 4 and manifest["job_id"] == JOB_ID and manifest["size"] == len(cat(url, "snapshot-4-step-4.pt"))
    assert manifest["sha256"] == files.file_sha256(f"{url}/snapshot-4-step-4.pt")
    loaded = le.load_snapshot(url)  # the directory: its newest valid snapshot
    assert loaded["values"] == {"step": 4} and torch.equal(loaded["stateful"]["model"]["w"], torch.full((1000,), 4.0))
    assert le.load_snapshot(f"{url}/snapshot-3-step-3.pt")["values"] == {"step": 3}
    assert le.load_snapshot(f"{url}/snapshot-3-step-3.json")["values"] == {"step": 3}


def test_a_torn_newest_snapshot_falls_back_to_the_previous_with_a_warning(url):
    write(url, (1, 2, 3))
    put(url, "snapshot-3-step-3.pt", cat(url, "snapshot-3-step-3.pt")[:100])  # an upload cut off
    warned: list[str] = []
    found = files.newest_valid(url, warned.append)
    assert found is not None and found.manifest.step == 2 and found.path == f"{url}/snapshot-2-step-2.pt"
    assert len(warned) == 1 and "snapshot-3-step-3.json" in warned[0] and "torn or truncated" in warned[0]


def test_a_corrupt_object_of_the_right_size_fails_its_checksum(url):
    write(url, (1, 2, 3))
    data = bytearray(cat(url, "snapshot-3-step-3.pt"))
    data[len(data) // 2] ^= 0xFF
    put(url, "snapshot-3-step-3.pt", bytes(data))
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        le.load_snapshot(f"{url}/snapshot-3-step-3.pt")
    assert le.load_snapshot(url)["values"] == {"step": 2}


def test_a_data_object_without_its_manifest_is_no_snapshot(url):
    write(url, (1, 2, 3))
    fsspec.filesystem("memory").rm_file(f"{url}/snapshot-3-step-3.json")  # the writer died before the manifest
    warned: list[str] = []
    found = files.newest_valid(url, warned.append)
    assert found is not None and found.manifest.step == 2 and warned == []  # silently: it never existed
    fsspec.filesystem("memory").rm_file(f"{url}/snapshot-2-step-2.pt")  # a manifest without its data
    found = files.newest_valid(url, warned.append)
    assert found is not None and found.manifest.step == 1 and "snapshot-2-step-2.json" in warned[0]
    # The next snapshot takes the number after the orphan's (no name is used twice), and the
    # orphan goes once it is older than every snapshot kept.
    assert files.next_sequence(url) == 4
    write(url, (7, 8, 9), keep=2)
    assert names(url) == ["snapshot-5-step-8.json", "snapshot-5-step-8.pt", "snapshot-6-step-9.json",
                          "snapshot-6-step-9.pt"]
    assert le.load_snapshot(url)["values"] == {"step": 9}


def test_a_write_that_fails_midway_leaves_no_object_and_training_goes_on(url, caplog):
    clock = iter(range(0, 10**6, 100))
    writer = SnapshotWriter(SnapshotSettings(url, every=1.0), clock=lambda: next(clock))
    snapshot = HostSnapshot()
    snapshot.capture(tree(1))
    with caplog.at_level(logging.WARNING, logger="lightning_elastic"):
        # Something torch.save cannot pickle, after the tensors: the upload is abandoned.
        assert writer.offer(snapshot, info(1, unpicklable=lambda: None))
        assert writer.wait(10)
    assert writer.stats.failed == 1 and "Could not write a snapshot to memory://" in caplog.text
    assert names(url) == []
    assert files.newest_valid(url, pytest.fail) is None


def test_the_driver_picks_the_newest_valid_snapshot_of_the_store_for_its_workers(url, tmp_path, caplog):
    write(url, (1, 2, 3))
    put(url, "snapshot-3-step-3.pt", b"torn")
    events = EventLog(tmp_path / "logs")
    with caplog.at_level(logging.INFO, logger="lightning_elastic"):
        resume = snapshots.choose(SnapshotSettings(url), ("python", "train.py"), events)
    events.close()
    assert resume is not None and resume.found is not None and resume.found.manifest.step == 2
    assert resume.env[files.ENV_DIR] == url
    assert resume.env[files.ENV_RESUME_FROM] == f"{url}/snapshot-2-step-2.pt"
    assert "skipping snapshot snapshot-3-step-3.json" in caplog.text
    logged = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert [e["path"] for e in logged if e["kind"] == "resumed_from_snapshot"] == [f"{url}/snapshot-2-step-2.pt"]
    # A worker reads the same store: the driver's choice, as its environment hands it over.
    settings, chosen = snapshot_store.plan(resume.env)
    assert settings is not None
    found = ResumePlan(chosen, settings.directory).locate()
    assert found is not None and found.manifest.step == 2
    assert snapshot_store.read_tree(found.path)["values"] == {"step": 2}
    assert ResumePlan(None, settings.directory).locate().manifest.step == 2  # without a driver: rank 0 searches the store


@pytest.mark.parametrize(("setup", "expected"), [
    ("no-fsspec", "--snapshot-dir: s3://bucket/job: a URL needs fsspec, which is not installed: "
                  "pip install 'lightning-elastic[snapshots-s3]'"),
    ("no-s3fs", "--snapshot-dir: s3://bucket/job: no fsspec implementation of s3:// is installed ("),
    ("unknown", "--snapshot-dir: nosuch://bucket/job: fsspec knows no file system for nosuch://: expected a "
                "local directory or a URL such as s3://bucket/prefix"),
])
def test_a_url_nothing_can_open_exits_2_with_one_line_naming_it_and_the_extra(capsys, monkeypatch, setup, expected):
    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail("launched"))
    target = "nosuch://bucket/job" if setup == "unknown" else "s3://bucket/job"
    if setup == "no-fsspec":
        monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec raises ImportError
    elif setup == "no-s3fs":
        monkeypatch.setitem(sys.modules, "s3fs", None)
        monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)  # not imported yet, as in a fresh process
    try:
        code = cli.main(["launch", "-np", "1", "--snapshot-dir", target, "python"], {})
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"lightning-elastic: error: {expected}")
    if setup == "no-s3fs":
        assert err[0].endswith("pip install 'lightning-elastic[snapshots-s3]'")


def test_a_file_url_goes_through_fsspec_to_a_real_directory(tmp_path):
    url = f"file://{tmp_path}/snaps"
    write(url, (1, 2, 3), keep=2)
    # fsspec's local file system made the directory; the objects are plain files there.
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [
        "snapshot-2-step-2.json", "snapshot-2-step-2.pt", "snapshot-3-step-3.json", "snapshot-3-step-3.pt"]
    found = files.newest_valid(url, pytest.fail)
    assert found is not None and found.path == f"{url}/snapshot-3-step-3.pt" and found.name == "snapshot-3-step-3.pt"
    assert le.load_snapshot(found.path)["values"] == {"step": 3}
    # The same snapshot read through the plain path (the local store) agrees.
    assert files.newest_valid(tmp_path / "snaps", pytest.fail).manifest == found.manifest
