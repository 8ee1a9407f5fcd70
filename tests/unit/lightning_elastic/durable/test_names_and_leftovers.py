"""Snapshot names no two writers share, published without replacing anything, and the
temporary files of dead writers removed by any later writer (issue 34, points 6 and 7)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import lightning_elastic as le
from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.durable import files
from lightning_elastic.durable import fs as snapshot_fs
from lightning_elastic.durable.files import SnapshotSettings
from lightning_elastic.durable.store import SnapshotInfo, SnapshotWriter
from tests.unit.proc_tools import BOUND

HELD = threading.Event()
RELEASE = threading.Event()


class Held:
    """Pickled by the writer's torch.save: waits there until released (deep copies pass)."""

    def __reduce__(self):
        if threading.current_thread().name == "elastic-snapshot" and sys._getframe(1).f_code.co_filename != \
                __import__("copy").__file__:
            HELD.set()
            RELEASE.wait(BOUND)
        return (Held, ())


def offer(writer: SnapshotWriter, step: int, **values) -> HostSnapshot:
    snapshot = HostSnapshot()
    snapshot.capture({"values": {"step": step, **values}, "stateful": {"w": {"t": torch.full((10,), float(step))}}})
    assert writer.offer(snapshot, SnapshotInfo(round=1, step=step, epoch=0, world_size=1, sampler=None))
    return snapshot


def writer_for(directory, keep: int = 4) -> SnapshotWriter:
    return SnapshotWriter(SnapshotSettings(directory, every=1e-6, keep=keep), "job", clock=time.monotonic)


def test_two_writers_taking_the_same_number_keep_both_and_the_newer_step_is_resumed(tmp_path):
    HELD.clear()
    RELEASE.clear()
    older, newer = writer_for(tmp_path), writer_for(tmp_path)
    offer(older, 100, held=Held())  # the previous round's rank 0, its write held mid-way
    assert HELD.wait(BOUND)
    offer(newer, 200)
    assert newer.wait(BOUND) and newer.stats.written == 1
    before = (tmp_path / "snapshot-1-step-200.json").read_text()
    RELEASE.set()
    assert older.wait(BOUND) and older.stats.written == 1
    assert (tmp_path / "snapshot-1-step-200.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "snapshot-1-step-100.json", "snapshot-1-step-100.pt", "snapshot-1-step-200.json", "snapshot-1-step-200.pt"]
    found = files.newest_valid(tmp_path, pytest.fail)
    assert found is not None and found.manifest.step == 200
    assert le.load_snapshot(tmp_path)["values"]["step"] == 200


def test_a_file_is_never_published_over_an_existing_one(tmp_path):
    (tmp_path / "snapshot-1-step-5.pt").write_bytes(b"theirs")
    with pytest.raises(FileExistsError):
        snapshot_fs.write_atomically(tmp_path / "snapshot-1-step-5.pt", lambda f: f.write(b"mine"), exclusive=True)
    assert (tmp_path / "snapshot-1-step-5.pt").read_bytes() == b"theirs"
    assert os.listdir(tmp_path) == ["snapshot-1-step-5.pt"]  # no temporary file left


def test_without_hard_links_the_name_is_taken_with_o_excl(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    snapshot_fs.write_atomically(tmp_path / "a.pt", lambda f: f.write(b"one"), exclusive=True)
    with pytest.raises(FileExistsError):
        snapshot_fs.write_atomically(tmp_path / "a.pt", lambda f: f.write(b"two"), exclusive=True)
    assert (tmp_path / "a.pt").read_bytes() == b"one" and os.listdir(tmp_path) == ["a.pt"]


def test_an_fsspec_store_creates_each_object_exclusively(monkeypatch):
    fsspec = pytest.importorskip("fsspec")
    url = "memory://names-exclusive/job"
    store = snapshot_fs.open_store(url)
    try:
        store.write("x.pt", lambda f: f.write(b"one"), exclusive=True)
        with pytest.raises(FileExistsError):
            store.write("x.pt", lambda f: f.write(b"two"), exclusive=True)
        # An implementation without the exclusive mode: a look first.
        real_open = store._fs.open
        monkeypatch.setattr(store._fs, "open", lambda path, mode="rb", **kw: (
            (_ for _ in ()).throw(ValueError("unsupported mode")) if mode == "xb" else real_open(path, mode, **kw)))
        with pytest.raises(FileExistsError):
            store.write("x.pt", lambda f: f.write(b"three"), exclusive=True)
        store.write("y.pt", lambda f: f.write(b"four"), exclusive=True)
        assert store.read_bytes("x.pt") == b"one" and store.read_bytes("y.pt") == b"four"
    finally:
        fsspec.filesystem("memory").rm("names-exclusive", recursive=True)


def test_snapshots_of_the_previous_naming_are_still_read_ordered_and_pruned(tmp_path):
    writer = writer_for(tmp_path, keep=2)
    for step in (10, 20):
        offer(writer, step)
        assert writer.wait(BOUND)
    for name in os.listdir(tmp_path):  # as the previous version named them: snapshot-N.pt/.json
        number = name.split("-")[1]
        os.rename(tmp_path / name, tmp_path / f"snapshot-{number}{os.path.splitext(name)[1]}")
    assert files.newest_valid(tmp_path, pytest.fail).manifest.step == 20
    assert le.load_snapshot(tmp_path / "snapshot-2.pt")["values"]["step"] == 20
    fresh = writer_for(tmp_path, keep=2)
    offer(fresh, 30)
    assert fresh.wait(BOUND)
    assert sorted(os.listdir(tmp_path)) == ["snapshot-2.json", "snapshot-2.pt", "snapshot-3-step-30.json",
                                            "snapshot-3-step-30.pt"]
    assert json.loads((tmp_path / "snapshot-3-step-30.json").read_text())["sequence"] == 3


WRITER = """\
import sys, time
from pathlib import Path
from lightning_elastic.durable import fs
def fill(f):
    f.write(b"x" * 1000); f.flush()
    print("writing", flush=True)
    time.sleep(60)
fs.write_atomically(Path(sys.argv[1]), fill)
"""


def test_a_live_writers_temporary_file_is_kept_and_a_killed_ones_removed(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "snapshot-1-step-1.pt")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        (temp,) = tmp_path.glob(".tmp-snapshot-*")
        snapshot_fs.LocalStore(tmp_path).clean_up()
        assert temp.exists()  # its writer holds the lock
        writer.send_signal(signal.SIGKILL)
        writer.wait(BOUND)
        snapshot_fs.LocalStore(tmp_path).clean_up()  # another pid than the writer's
        assert not temp.exists()
    finally:
        writer.kill()
        writer.wait(BOUND)
        writer.stdout.close()


def test_which_temporary_files_are_abandoned(tmp_path):
    mine = tmp_path / snapshot_fs.temp_name("snapshot-1-step-1.pt")
    mine.write_bytes(b"")  # a live process of this pid space, between its file's creation and its lock
    assert not snapshot_fs.temp_is_abandoned(mine)
    space = mine.name.split("-")[2]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".tmp-snapshot-{space}-{dead.stdout.strip()}-1-snapshot-2-step-2.pt"
    gone.write_bytes(b"")
    assert snapshot_fs.temp_is_abandoned(gone)
    reused = tmp_path / f".tmp-snapshot-{space}-{os.getpid()}-1-snapshot-3-step-3.pt"  # our pid, another start
    reused.write_bytes(b"")
    assert snapshot_fs.temp_is_abandoned(reused)
    # Another machine's, or the previous version's (no lock taken): only once untouched for long.
    for name in (".tmp-snapshot-0123456789ab-4242-7-snapshot-4-step-4.pt", ".tmp-snapshot-4242-snapshot-4.pt"):
        other = tmp_path / name
        other.write_bytes(b"")
        now = other.stat().st_mtime
        assert not snapshot_fs.temp_is_abandoned(other, now=lambda: now + 60)
        assert snapshot_fs.temp_is_abandoned(other, now=lambda: now + snapshot_fs.FOREIGN_TEMP_AGE + 1)
