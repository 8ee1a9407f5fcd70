"""Durable snapshots end to end: a whole job lost and launched again, real processes.

Each job writes snapshots (``--snapshot-dir``) while the example loop trains; the test
SIGKILLs the driver and every worker at once, as a lost allocation would, and runs the same
command again. What the second launch resumed from is read from its summary and its
``events.jsonl``; exactly-once from the example's per-epoch records; the final model from
the hash of its parameters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.integration.harness import Job, assert_epochs_complete, wait_for

pytestmark = pytest.mark.integration

H1, H2, H3 = "127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"
TRAIN = ["--step-delay", "0.1", "--samples", "192", "--batch-size", "8", "--commit-every", "2", "--epochs", "2"]


def relaunch(job: Job, name: str) -> Job:
    """Another launch of the same command in the same directory (its own driver output)."""
    again = Job(job.dir)
    again.stdout_path, again.stderr_path = job.dir / f"{name}.out", job.dir / f"{name}.err"
    return again


def data_name(manifest: dict) -> str:
    """The data file of a snapshot as this version names it: its number and its step."""
    return f"snapshot-{manifest['sequence']}-step-{manifest['step']}.pt"


def manifests(directory: Path) -> list[dict]:
    found = []
    for path in sorted(directory.glob("snapshot-*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # pruned or not yet renamed into place
    return sorted(found, key=lambda m: (m["sequence"], m["step"]))


def kill_everything(job: Job, earlier: set[int] = frozenset()) -> None:
    """SIGKILL the driver and every worker at once: nothing is told, nothing cleans up."""
    assert job.proc is not None
    pids = {job.proc.pid, *(pids_of(job) - earlier)}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.proc.wait(10)
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                             for pid in pids), 15, "every process of the job to die")


def driver_events(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def done_digests(job: Job, since_pids: set[int]) -> set[str]:
    return {e["digest"] for e in job.events("done") if e["pid"] not in since_pids}


def mid_epoch_snapshot(directory: Path, after_step: int) -> dict | None:
    newest = manifests(directory)[-1:] or [None]
    m = newest[0]
    return m if m is not None and m["step"] >= after_step and 0 < m["sampler"]["consumed"] < 192 else None


def pids_of(job: Job) -> set[int]:
    return {e["pid"] for e in job.events("start")}


def test_a_job_killed_whole_resumes_from_its_newest_snapshot_and_ends_as_if_never_interrupted(job: Job) -> None:
    snapshots, logs = job.dir / "snapshots", job.dir / "logs"
    launch = ["-np", "2", "-H", f"{H1},{H2}", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.2"]

    # The reference: the same job, never interrupted (its own snapshot directory).
    reference = relaunch(job, "reference")
    ref_args = ["-np", "2", "-H", f"{H1},{H2}", "--snapshot-dir", str(job.dir / "ref-snapshots")]
    assert reference.run(ref_args, TRAIN) == 0, reference.stderr()[-3000:]
    expected = done_digests(reference, set())
    assert len(expected) == 1
    before = pids_of(reference)

    job.start(launch, TRAIN)
    snapshot = wait_for(lambda: mid_epoch_snapshot(snapshots, 14) or job._ended(), 90, "a mid-epoch snapshot")
    assert isinstance(snapshot, dict), job.stderr()[-3000:]
    kill_everything(job, before)
    newest = manifests(snapshots)[-1]
    assert not done_digests(job, before), "the job ended before it was killed: nothing to resume"
    before = pids_of(job)

    again = relaunch(job, "again")
    assert again.run([*launch, "--log-dir", str(logs)], TRAIN) == 0, again.stderr()[-3000:]
    err = again.stderr()
    resumed = [e for e in driver_events(logs) if e["kind"] == "resumed_from_snapshot"]
    assert len(resumed) == 1 and resumed[0]["sequence"] == newest["sequence"], (resumed, newest)
    assert f"resumed from:  {snapshots / data_name(newest)}" in err
    # Training went on from the snapshot's step, on every rank.
    synced = [e for e in again.events("synced") if e["pid"] not in before]
    assert {e["step"] for e in synced} == {newest["step"]} and len(synced) == 2
    # Each sample of each epoch once in the committed history, across the break...
    assert_epochs_complete(again, 2)
    # ... and the model equal bit for bit to the uninterrupted run's.
    assert done_digests(again, before) == expected
    assert "snapshots:" in err and " 0 failed" in err


def test_resume_at_another_world_size_from_the_previous_snapshot_when_the_newest_is_torn(job: Job) -> None:
    snapshots = job.dir / "snapshots"
    common = ["--snapshot-dir", str(snapshots), "--snapshot-every", "0.2", "--snapshot-keep", "3"]
    job.start(["-np", "3", "-H", f"{H1},{H2},{H3}", *common], TRAIN)
    wait_for(lambda: len(manifests(snapshots)) >= 2 and mid_epoch_snapshot(snapshots, 10) or job._ended(),
             90, "two snapshots")
    kill_everything(job)
    first_pids = pids_of(job)
    *_, previous, newest = manifests(snapshots)
    torn = snapshots / data_name(newest)
    torn.write_bytes(torn.read_bytes()[: newest["size"] // 2])  # a write cut off half way

    again = relaunch(job, "again")
    assert again.run(["-np", "2", "-H", f"{H1},{H2}", *common], TRAIN) == 0, again.stderr()[-3000:]
    err = again.stderr()
    assert f"skipping snapshot {data_name(newest).removesuffix('.pt')}.json" in err
    assert f"resumed from:  {snapshots / data_name(previous)}" in err
    synced = [e for e in again.events("synced") if e["pid"] not in first_pids]
    assert {e["step"] for e in synced} == {previous["step"]} and {e["size"] for e in synced} == {2}
    assert again.world_sizes() == [2]
    assert_epochs_complete(again, 2)  # exactly once per epoch across the break, 3 -> 2 workers


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_snapshot_directory_turned_read_only_mid_run_fails_snapshots_not_training(job: Job) -> None:
    snapshots = job.dir / "snapshots"
    snapshots.mkdir()
    job.start(["-np", "2", "-H", f"{H1},{H2}", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.2"],
              TRAIN)
    wait_for(lambda: manifests(snapshots) or job._ended(), 90, "a first snapshot")
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(snapshots), str(snapshots)], capture_output=True)
    if mounted.returncode != 0:
        job.kill()
        pytest.skip(f"cannot bind-mount read-only here: {mounted.stderr.decode().strip()}")
    try:
        assert job.wait() == 0, job.stderr()[-3000:]
    finally:
        subprocess.run(["umount", str(snapshots)], check=False)
    err, out = job.stderr(), job.stdout()
    # Rank 0's log (the workers' output) says it once; the summary counts every failure.
    assert out.count("Could not write a snapshot") == 1 and "Read-only file system" in out
    line = next(x for x in err.splitlines() if x.strip().startswith("snapshots:"))
    written, failed = (int(w) for w in re.findall(r"(\d+) (?:written|failed)", line))
    assert written >= 1 and failed >= 2 and "Read-only file system" in line, line
    assert_epochs_complete(job, 2)


def test_a_killed_elastic_lightning_job_resumes_mid_epoch_from_its_snapshot(job: Job) -> None:
    from tests.integration import test_lightning as lit

    snapshots = job.dir / "snapshots"
    launch = ["-np", "2", "-H", f"{H1},{H2}", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.3"]
    lit.start(job, launch, step_delay=0.1)
    per_epoch = lit.SAMPLES // (2 * lit.BATCH)  # 30 steps at world size 2

    def in_second_epoch() -> dict | None:
        m = (manifests(snapshots) or [None])[-1]
        return m if m is not None and m["epoch"] == 1 and 5 <= m["step"] - per_epoch < per_epoch - 10 else None

    assert isinstance(wait_for(lambda: in_second_epoch() or job._ended(), 120, "a snapshot in epoch 1"), dict), \
        job.stderr()[-3000:]
    kill_everything(job)
    first = pids_of(job)
    newest = manifests(snapshots)[-1]
    assert newest["kind"] == "lightning"
    # Kept for plain DDP below (the relaunch prunes its directory to the last two).
    kept = Path(shutil.copy(snapshots / data_name(newest), job.dir / "kept.pt"))

    again = relaunch(job, "again")
    # Without the first launch's --step-delay: another command line, resumed as the user says.
    lit.start(again, [*launch, "--resume-other-command"], step_delay=0.0)
    assert again.wait(180) == 0, again.stderr()[-3000:]
    assert f"resumed from:  {snapshots / data_name(newest)}" in again.stderr()
    resumed = [e for e in again.events("synced") if e["pid"] not in first]
    assert {e["step"] for e in resumed} == {newest["step"]} and len(resumed) == 2
    # Mid-epoch: the relaunch ran only the steps after the snapshot; together with the
    # killed launch's steps up to it, every sample of each epoch exactly once.
    history: dict[int, list[dict]] = {}
    for e in job.events("step"):
        if (e["pid"] in first) == (e["step"] <= newest["step"]):
            history.setdefault(e["step"], []).append(e)
    assert min(s for s in history if s > newest["step"]) == newest["step"] + 1
    assert sorted(history) == list(range(1, 2 * per_epoch + 1))
    for epoch in (0, 1):
        seen = [i for records in history.values() for r in records if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(seen) == list(range(lit.SAMPLES)), f"epoch {epoch}: not exactly once"

    # Outside the launcher, plain DDP (two processes, gloo) goes on from the same snapshot:
    # every rank starts from its weights at its step, and the fit ends at the same step count.
    synced_checksum = {e["checksum"] for e in resumed}
    events = job.dir / "ddp-events"
    plain = subprocess.run(
        [sys.executable, str(lit.EXAMPLE), "--strategy", "ddp", "--devices", "2", "--ckpt-path", str(kept),
         "--events", str(events), "--log-dir", str(job.dir / "ddp-logs"), "--samples", str(lit.SAMPLES),
         "--batch-size", str(lit.BATCH), "--epochs", str(lit.EPOCHS), "--lr", str(lit.LR)],
        cwd=job.dir, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ELASTIC_")})
    records = [json.loads(line) for path in events.glob("*.jsonl") for line in path.read_text().splitlines()]
    by_kind = {kind: [r for r in records if r["kind"] == kind] for kind in ("synced", "step", "done")}
    assert len(by_kind["done"]) == 2, plain.stderr[-3000:]
    assert lit.ddp_ended_well(plain), plain.stderr[-3000:]
    assert [(r["rank"], r["size"], r["step"]) for r in sorted(by_kind["synced"], key=lambda r: r["rank"])] == \
        [(0, 2, newest["step"]), (1, 2, newest["step"])]
    assert {r["checksum"] for r in by_kind["synced"]} == synced_checksum  # the snapshot's weights
    assert min(r["step"] for r in by_kind["step"]) == newest["step"] + 1
    assert {r["step"] for r in by_kind["done"]} == {2 * per_epoch}
    assert len({r["checksum"] for r in by_kind["done"]}) == 1, "plain DDP replicas differ"


def test_a_killed_fabric_job_resumes_from_its_snapshot_with_no_change_to_its_loop(job: Job) -> None:
    """``examples/fabric_loop.py`` (``le.FabricState`` in ``@le.run``) run with
    ``--snapshot-dir`` and nothing else: killed whole mid-epoch, the same command again."""
    import lightning_elastic as le
    from tests.integration import test_fabric as fab

    snapshots = job.dir / "snapshots"
    launch = ["-np", "2", "-H", f"{H1},{H2}", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.2"]
    command = [sys.executable, str(fab.EXAMPLE), "--events", str(job.events_dir), "--samples", "192",
               "--batch-size", "8", "--epochs", "2", "--commit-every", "2", "--step-delay", "0.1"]
    job.start(launch, command=command)
    snapshot = wait_for(lambda: mid_epoch_snapshot(snapshots, 14) or job._ended(), 90, "a mid-epoch snapshot")
    assert isinstance(snapshot, dict), job.stderr()[-3000:]
    kill_everything(job)
    first = pids_of(job)
    assert not [e for e in job.events("done") if e["pid"] in first], "the job ended before it was killed"
    newest = manifests(snapshots)[-1]
    saved = le.load_snapshot(snapshots / data_name(newest))  # checksum verified

    again = relaunch(job, "again")
    again.start(launch, command=command)
    assert again.wait(90) == 0, again.stderr()[-3000:]
    assert f"resumed from:  {snapshots / data_name(newest)}" in again.stderr()
    synced = [e for e in again.events("synced") if e["pid"] not in first]
    assert {(e["step"], e["epoch"]) for e in synced} == {(newest["step"], newest["epoch"])} and len(synced) == 2
    # Both ranks resumed with the snapshot's parameters (the example's checksum of them).
    weights = float(sum(t.double().sum() for t in saved["model"].values()))
    assert {e["checksum"] for e in synced} == {weights}
    # The epoch's samples seen before the snapshot ride in the state: each epoch whole, once.
    assert_epochs_complete(again, 2)
    done = [e for e in again.events("done") if e["pid"] not in first]
    assert len(done) == 2 and len({e["checksum"] for e in done}) == 1 and {e["step"] for e in done} == {24}


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_job_killed_whole_resumes_from_its_newest_snapshot_in_an_object_store(job: Job) -> None:
    """``--snapshot-dir s3://bucket/job``: the same kill and relaunch as above, with the
    snapshots in an S3 bucket (the fsspec store: objects under their final names, the
    manifest last, pruning deletes objects).

    moto's S3 server, on 127.0.0.1 in this test's process, stands in for an object store,
    which cannot run here; the job reaches it as it would a real one, through the AWS_*
    variables (``AWS_ENDPOINT_URL`` for the endpoint) forwarded with ``-x``.
    """
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        credentials = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=credentials["AWS_ENDPOINT_URL"])
        fs.mkdir("bucket")
        env = {**os.environ, **credentials}

        def stored() -> list[dict]:
            fs.invalidate_cache("bucket/job")
            found = []
            for path in fs.ls("bucket/job", detail=False) if fs.exists("bucket/job") else []:
                if path.endswith(".json"):
                    try:
                        found.append(json.loads(fs.cat_file(path)))
                    except (OSError, ValueError):
                        continue  # pruned since listed
            return sorted(found, key=lambda m: (m["sequence"], m["step"]))

        def mid_epoch() -> dict | None:
            m = (stored() or [None])[-1]
            return m if m is not None and m["step"] >= 14 and 0 < m["sampler"]["consumed"] < 192 else None

        forward = [a for name in credentials for a in ("-x", name)]
        launch = ["-np", "2", "-H", f"{H1},{H2}", *forward, "--snapshot-dir", "s3://bucket/job",
                  "--snapshot-every", "0.2", "--snapshot-keep", "2"]
        job.start(launch, TRAIN, env=env)
        snapshot = wait_for(lambda: mid_epoch() or job._ended(), 60, "a mid-epoch snapshot in the bucket")
        assert isinstance(snapshot, dict), job.stderr()[-3000:]
        kill_everything(job)
        before = pids_of(job)
        assert not done_digests(job, set()), "the job ended before it was killed: nothing to resume"
        newest = stored()[-1]

        again = relaunch(job, "again")
        again.start([*launch, "--log-dir", str(job.dir / "logs")], TRAIN, env=env)
        assert again.wait(90) == 0, again.stderr()[-3000:]
        err = again.stderr()
        resumed = [e for e in driver_events(job.dir / "logs") if e["kind"] == "resumed_from_snapshot"]
        url = f"s3://bucket/job/{data_name(newest)}"
        assert [(e["sequence"], e["path"]) for e in resumed] == [(newest["sequence"], url)], (resumed, newest)
        assert f"resumed from:  {url}" in err
        synced = [e for e in again.events("synced") if e["pid"] not in before]
        assert {e["step"] for e in synced} == {newest["step"]} and len(synced) == 2
        assert_epochs_complete(again, 2)  # each sample of each epoch once across the break
        line = next(x for x in err.splitlines() if x.strip().startswith("snapshots:"))
        assert " 0 failed" in line and int(re.findall(r"(\d+) written", line)[0]) >= 1, line
        # Pruned to the last two: older objects deleted, no temporary object left.
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bucket/job", detail=False, refresh=True))
        kept = [data_name(m).removesuffix(".pt") for m in stored()[-2:]]
        assert names == sorted(f"{name}.{ext}" for name in kept for ext in ("json", "pt")), names
    finally:
        server.stop()


# ----- two writers, and what a killed one leaves (issue 34, points 6 and 7) ---------------------
#
# The example's --snapshot-gate holds the snapshot writes of rank 0 on 127.0.0.1 (its
# writer thread waits while the gate file exists, its temporary file open and locked):
# a write in progress for as long as the test needs, with real processes and signals.

GATED = [*TRAIN[:-2], "--epochs", "4", "--snapshot-gate-on-host", "127.0.0.1"]


def temporary_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(".tmp-snapshot-*"))


def test_a_killed_writers_temporary_file_is_removed_by_the_next_writer_of_another_pid(job: Job) -> None:
    snapshots, gate = job.dir / "snapshots", job.dir / "gate"
    gate.write_text("")
    job.set_hosts(H1, H2)
    job.start(["--host-discovery-script", str(job.discovery_script()), "-np", "2", "--min-np", "1",
               "--snapshot-dir", str(snapshots), "--snapshot-every", "0.5", "--snapshot-keep", "1"],
              [*GATED, "--snapshot-gate", str(gate), "--ballast-mb", "8"])
    left = wait_for(lambda: temporary_files(snapshots) or job._ended(), 90, "rank 0's write to start")
    assert isinstance(left, list) and not manifests(snapshots), job.stderr()[-3000:]
    os.kill(job.worker_pid("127.0.0.1"), signal.SIGKILL)  # rank 0, mid-write: its temporary file stays
    # The survivor, rank 0 of the next round, writes: it removes the dead writer's file first.
    wait_for(lambda: manifests(snapshots) or job._ended(), 60, "the next rank 0's snapshot")
    assert not set(left) & set(temporary_files(snapshots)), f"left by the killed writer: {left}"
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 1]
    names = sorted(p.name for p in snapshots.iterdir())
    assert len(names) == 2 and not temporary_files(snapshots), names  # one snapshot (--snapshot-keep 1)


def test_a_newer_snapshot_is_never_replaced_by_an_older_write_that_ends_after_it(job: Job) -> None:
    from lightning_elastic.durable import files  # noqa: PLC0415 - the reader the driver resumes with

    snapshots, gate = job.dir / "snapshots", job.dir / "gate"
    gate.write_text("")
    job.set_hosts(H1, H2)
    job.start(["--host-discovery-script", str(job.discovery_script()), "--discovery-interval", "0.2",
               "-np", "2", "--min-np", "1", "--snapshot-dir", str(snapshots), "--snapshot-every", "3",
               "--snapshot-keep", "4"],
              [*GATED, "--snapshot-gate", str(gate)])
    assert wait_for(lambda: temporary_files(snapshots) or job._ended(), 90, "rank 0's write to start") is not True
    older = job.worker_pid("127.0.0.1")
    job.set_hosts(H2)  # rank 0 leaves (its write held); the other worker is rank 0 of round 2 and writes
    wait_for(lambda: manifests(snapshots) or job._ended(), 60, "round 2's snapshot")
    (newer,) = manifests(snapshots)
    assert newer["round"] >= 2, newer
    newer_manifest = snapshots / data_name(newer).replace(".pt", ".json")
    newer_text = newer_manifest.read_text()
    gate.unlink()  # the older write (round 1's commit) ends now, after the newer one
    wait_for(lambda: not psutil.pid_exists(older) or psutil.Process(older).status() == psutil.STATUS_ZOMBIE,
             60, "the leaving rank 0 to finish its write and exit")
    # Both kept under names of their own; the newer one unchanged, and the one a resume takes.
    assert newer_manifest.read_text() == newer_text
    written = manifests(snapshots)
    assert [m["round"] for m in written if m["step"] < newer["step"]] == [1], written
    found = files.newest_valid(snapshots, pytest.fail)
    assert found is not None and found.manifest.step >= newer["step"], (found, newer)
    assert job.wait() == 0, job.stderr()[-3000:]
    assert job.world_sizes() == [2, 1]
    assert "0 failed" in next(x for x in job.stderr().splitlines() if x.strip().startswith("snapshots:"))


# A loop whose state has no "step" of its own: a snapshot's step is its number of commits.
COMMITS = """\
import sys
import time
import lightning_elastic as le

le.init()
state = le.ObjectState(value=0)


@le.run
def train(state):
    for _ in range(int(sys.argv[1])):
        state.value += 1
        state.commit()
        time.sleep(0.01)


train(state)
"""


def test_after_a_resume_the_snapshots_steps_go_on_from_the_resumed_one(job: Job) -> None:
    # Issue 37, item 9: after a resume from step 110 the next snapshot was step 1.
    script, snapshots = job.dir / "commits.py", job.dir / "snapshots"
    script.write_text(COMMITS)
    launch = ["-np", "1", "--snapshot-dir", str(snapshots), "--snapshot-every", "0.05", "--snapshot-keep", "50"]
    command = [sys.executable, str(script), "30"]
    job.start(launch, command=command)
    assert job.wait(120) == 0, job.stderr()[-3000:]
    first = manifests(snapshots)
    assert first, job.stdout()[-3000:]
    resumed = first[-1]
    again = relaunch(job, "again")
    again.start(launch, command=command)
    assert again.wait(120) == 0, again.stderr()[-3000:]
    assert f"resumed from:  {snapshots / data_name(resumed)}" in again.stderr()
    later = [m for m in manifests(snapshots) if m["sequence"] > resumed["sequence"]]
    assert later, again.stdout()[-3000:]
    assert all(resumed["step"] < m["step"] <= resumed["step"] + 30 for m in later), (resumed["step"], later)
    written = [int(n) for n in re.findall(r"Snapshot snapshot-\d+-step-\d+\.pt written \(step (\d+),", again.stdout())]
    assert written and min(written) > resumed["step"], (resumed["step"], written)
