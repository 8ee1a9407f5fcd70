"""--state-dir: the saved job state, the lock, the keeper and adopting a worker's process."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from lightning_elastic.launcher.restart import adoption, state_codec
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.blacklist import HostManager
from lightning_elastic.launcher.job.slots import HostSlots, SlotAssignment, SlotKey
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.detached import DetachedLauncher, LostProcess, is_running
from lightning_elastic.launcher.node.supervisor import MARK
from lightning_elastic.launcher.job.state import JobState, Tally, WorkerRecord
from lightning_elastic.launcher.service.registry import Registry
from lightning_elastic.launcher.restart.state_dir import STATE_VERSION, StateDir, StateWriter
from lightning_elastic.protocol import HeartbeatRequest, Outcome, RendezvousRequest, Report
from tests.unit.launcher.restart.test_state_codec import facts
from tests.unit.proc_tools import BOUND, REPO, LineReader

pytestmark = pytest.mark.timeout(60)


def wait_until(predicate, what: str, bound: float = BOUND):
    deadline = time.monotonic() + bound
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def a_registry() -> Registry:
    """A driver's registry over a JobState whose host manager has a cooldown (as the driver's)."""
    return Registry(state=JobState(hosts=HostManager((10.0, 20.0), time.monotonic)))


def a_job(tmp_path) -> tuple[Registry, HostManager, list[SlotAssignment]]:
    """A registry with a formed round of two members and a third worker still starting."""
    reg = a_registry()
    hosts = reg.state.hosts
    hosts.update([HostSlots("a", 2), HostSlots("b", 1)])
    hosts.record_failure(SlotKey("b", 0))
    target = [SlotAssignment(SlotKey("a", i), i, 2, 2, 0, 1) for i in range(2)]
    reg.state.target = list(target)
    with reg.cond:
        records = [reg.add_worker(f"a[{i}]#{i}", SlotKey("a", i)) for i in range(2)]
        reg.form_round(list(zip(records, target)), ("127.0.0.1", 4242))
        for r in records:
            r.joined = True
        reg.add_worker("a[1]#2", SlotKey("a", 1))
        reg.bump_generation()
        records[0].report = Report(records[0].worker_id, 1, Outcome.DONE)
    return reg, hosts, target


def saved(reg: Registry, now: float | None = None) -> JobState:
    """What a restarted driver loads of ``reg``'s job: captured, written as JSON, read back."""
    now = time.monotonic() if now is None else now
    return state_codec.decode(state_codec.encode(state_codec.capture(reg.state), now))


def restore(state: JobState, now: float | None = None) -> tuple[Registry, adoption.Restored]:
    """A new driver's registry, given ``state`` (its workers' processes all lost)."""
    new_reg = a_registry()
    new_reg.state.hosts.update([HostSlots("a", 2), HostSlots("b", 1)])
    with new_reg.cond:
        restored = adoption.restore(state, new_reg, lambda record, prefix: LostProcess(), lambda record: lambda: "",
                                    time.monotonic() if now is None else now)
    return new_reg, restored


def as_saved(state: JobState, now: float) -> str:
    """``state`` as a save at ``now`` writes it: two states compared so."""
    return state_codec.encode(state, now)


def test_job_state_round_trips_through_its_file(tmp_path):
    reg, hosts, target = a_job(tmp_path)
    reg.state.tally = Tally(3, blacklisted=["b"], outages=["earlier outage"])
    reg.state.tally.rounds.append(2)
    reg.state.tally.failures.append("worker x was killed")
    directory = StateDir(tmp_path / "state")
    directory.lock()
    directory.save(state_codec.capture(reg.state), 100.0)
    loaded = directory.load()
    assert as_saved(loaded, 0.0) == as_saved(state_codec.capture(reg.state), 100.0)
    assert set(loaded.workers) == {"a[0]#0", "a[1]#1", "a[1]#2"}
    assert loaded.round is not None and loaded.round.members == ("a[0]#0", "a[1]#1")
    assert list(loaded.blacklist.hosts) == ["b"] and not loaded.blacklist.slots
    assert json.loads((tmp_path / "state" / "state.json").read_text())["version"] == STATE_VERSION == 2


def test_restore_gives_a_new_driver_the_same_job(tmp_path):
    reg, hosts, target = a_job(tmp_path)
    reg.state.tally.next_worker = 3
    now = time.monotonic()
    new_reg, restored = restore(saved(reg, now), now)
    assert new_reg.state.round == reg.state.round
    assert new_reg.state.generation == reg.state.generation == 1
    for worker_id, record in reg.state.workers.items():
        again = new_reg.state.workers[worker_id]
        assert (again.slot, again.state, again.assignment, again.report) == \
               (record.slot, record.state, record.assignment, record.report)
    new_hosts = new_reg.state.hosts
    assert new_hosts.is_blacklisted("b") and not new_hosts.is_blacklisted("a")
    assert new_reg.state.target == target and restored.ended == 3 and restored.adopted == 0
    # What the new driver would save is what the old one saved, but for the timers that start
    # afresh at an adoption, and the worker numbers it reserved past its predecessor's.
    reserve = adoption.reserved_workers(len(reg.state.workers), len(target))
    assert new_reg.state.tally.next_worker == 3 + reserve
    new_reg.state.tally.next_worker = 3
    assert without_timers(as_saved(new_reg.state, now)) == without_timers(as_saved(reg.state, now))


def without_timers(text: str) -> dict:
    """A saved state but the workers' timers, which an adoption starts afresh."""
    raw = json.loads(text)
    for worker in raw["workers"].values():
        for name in ("started_at", "last_heartbeat", "reported_at"):
            del worker[name]
    for entry in raw["blacklist"]["hosts"].values():  # a cooldown goes on: the same to a few ms
        entry["until"] = round(entry["until"], 6)
    return raw


def test_unreadable_state_is_a_new_job(tmp_path, caplog):
    directory = StateDir(tmp_path)
    directory.lock()
    (tmp_path / "state.json").write_text("{not json")
    assert directory.load() is None
    assert "cannot be read" in caplog.text


def test_second_lock_on_a_state_dir_is_refused_in_one_line(tmp_path):
    first = StateDir(tmp_path)
    first.lock()
    with pytest.raises(ConfigError, match=rf"--state-dir {tmp_path}: another driver \(pid {os.getpid()}\) runs this job"):
        StateDir(tmp_path).lock()
    first.release()
    StateDir(tmp_path).lock()  # free again once the holder is gone


def test_secret_is_kept_with_mode_0600(tmp_path):
    directory = StateDir(tmp_path)
    secret = directory.secret()
    assert len(secret) == 64 and directory.secret() == secret
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    directory.clear()
    assert directory.secret() != secret  # a new job, a new secret


def test_writer_saves_the_newest_state_and_touches_alive(tmp_path):
    directory = StateDir(tmp_path)
    reg, hosts, target = a_job(tmp_path)
    states = []
    for port in (1, 2, 3):
        reg.state.port = port
        states.append(state_codec.capture(reg.state))
    writer = StateWriter(directory)
    writer.start()
    for s in states:
        writer.submit(s, 100.0)
    writer.close()
    assert as_saved(directory.load(), 0.0) == as_saved(states[-1], 100.0)
    assert directory.load().port == 3
    assert directory.last_alive() is not None


# ----- workers under keepers --------------------------------------------------------------

TRAIN = r"""
import os, sys, time
fd = int(os.environ["LIGHTNING_ELASTIC_SECRET_FD"])
print("secret", os.read(fd, 100).decode(), flush=True)
print("pid", os.getpid(), flush=True)
for i in range(int(sys.argv[1])):
    print("line", i, flush=True)
    time.sleep(0.02)
sys.exit(int(sys.argv[2]))
"""


def spec(tmp_path, *args: str) -> WorkerSpec:
    return WorkerSpec("h[0]#0", "h", (sys.executable, "-c", TRAIN, *args), {}, "s3cret", str(tmp_path))


def test_keeper_reports_the_workers_exit_and_output_is_followed(tmp_path):
    directory = StateDir(tmp_path / "state")
    directory.lock()
    out = io.StringIO()
    proc = DetachedLauncher(directory, out).start(spec(tmp_path, "3", "7"), lambda: "[0] ")
    assert proc.wait(BOUND) == 7  # the worker's status, through its keeper's file
    proc.finish_output(BOUND)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0] secret s3cret"
    assert lines[2:] == ["[0] line 0", "[0] line 1", "[0] line 2"]


def test_worker_outlives_the_driver_and_is_adopted_with_its_status(tmp_path):
    """The real thing in one process tree: a 'driver' that starts a worker and is SIGKILLed."""
    state = tmp_path / "state"
    driver = subprocess.Popen([sys.executable, "-c", f"""
import io, sys, time
sys.path.insert(0, {str(REPO)!r})
from tests.unit.launcher.restart.test_state_dir import spec
from lightning_elastic.launcher.restart.state_dir import StateDir
from lightning_elastic.launcher.processes.detached import DetachedLauncher
from pathlib import Path
d = StateDir(Path({str(state)!r})); d.lock()
proc = DetachedLauncher(d, io.StringIO()).start(spec(Path({str(tmp_path)!r}), "150", "0"), lambda: "")
print(proc.pid, proc.ticks, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    keeper_pid, ticks = map(int, driver.stdout.readline().split())
    directory = StateDir(state)
    offset = directory.worker_file("h[0]#0", "offset")
    wait_until(lambda: offset.exists() and int(offset.read_text() or 0) > 0, "the driver to forward some output")
    driver.kill()
    driver.wait(BOUND)
    directory.lock()  # the dead driver's lock went with it
    assert is_running(keeper_pid, ticks), "the worker died with its driver"
    out = io.StringIO()
    record = WorkerRecord("h[0]#0", SlotKey("h", 0), 0.0, joined=True, keeper_pid=keeper_pid, start_ticks=ticks)
    # Its pid and start time are anyone's to read: without the job's secret it is not this job's keeper.
    assert isinstance(DetachedLauncher(directory, secret="another").adopt(record, lambda: ""), LostProcess)
    proc = DetachedLauncher(directory, out, secret="s3cret").adopt(record, lambda: "> ")
    assert proc.pid == keeper_pid
    assert proc.wait(10) == 0
    proc.finish_output(BOUND)
    shown = out.getvalue().splitlines()
    assert shown and shown[-1] == "> line 149"
    assert "> secret s3cret" not in shown  # resumed where the dead driver had got to
    # A pid that is not the same process any more (another start time) is not adopted.
    assert isinstance(DetachedLauncher(directory).adopt(
        WorkerRecord("h[0]#9", SlotKey("h", 0), 0.0, joined=True, keeper_pid=os.getpid(), start_ticks=1), lambda: ""),
        LostProcess)


def test_sigterm_reaches_the_worker_not_the_keeper(tmp_path):
    directory = StateDir(tmp_path / "state")
    directory.lock()
    proc = DetachedLauncher(directory, io.StringIO()).start(spec(tmp_path, "1000", "0"), lambda: "")
    wait_until(lambda: "line 1" in directory.worker_file("h[0]#0", "log").read_text(), "the worker to start")
    proc.signal(signal.SIGTERM)
    assert proc.wait(BOUND) == -signal.SIGTERM


# ----- options ----------------------------------------------------------------------------


def test_state_dir_and_patience_from_the_command_line_or_the_environment(tmp_path):
    from lightning_elastic.launcher.cli import config_from_args, parse_args

    given = config_from_args(parse_args(["launch", "--state-dir", str(tmp_path), "--driver-patience", "7", "true"], {}))
    from_env = config_from_args(parse_args(["launch", "true"], {"LIGHTNING_ELASTIC_STATE_DIR": str(tmp_path),
                                                                "LIGHTNING_ELASTIC_DRIVER_PATIENCE": "7"}))
    assert (given.state_dir, given.driver_patience) == (from_env.state_dir, from_env.driver_patience) == (tmp_path, 7.0)
    assert config_from_args(parse_args(["launch", "true"], {})).state_dir is None


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_patience_that_is_not_a_positive_number_is_refused(value):
    from lightning_elastic.launcher.cli import config_from_args, parse_args

    with pytest.raises(ConfigError, match=f"--driver-patience: expected a positive number of seconds, got {value}"):
        config_from_args(parse_args(["launch", "--driver-patience", value, "true"], {}))


def test_a_worker_waits_for_its_driver_for_the_patience():
    from lightning_elastic.membership.worker import WorkerSettings

    base = dict(driver_url="http://x", secret="s", worker_id="w", hostname="h", heartbeat_interval=1.0,
                heartbeat_timeout=10.0, elastic_timeout=600.0, lost_member_wait=5.0, process_group_timeout=60.0,
                preemption_grace=30.0)
    assert WorkerSettings(**base).driver_lost_after == 20.0  # without --state-dir: as before
    assert WorkerSettings(**base, driver_patience=120.0).driver_lost_after == 120.0
    assert WorkerSettings(**base, driver_patience=120.0).client()._retry_for == 120.0


# ----- the ssh supervisor with --state-dir (run here as a local subprocess, no ssh) ---------


def supervisor(message: dict) -> tuple[subprocess.Popen, LineReader, LineReader]:
    proc = subprocess.Popen([sys.executable, "-m", "lightning_elastic.launcher.node.supervisor"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()
    return proc, LineReader(proc.stdout), LineReader(proc.stderr)


def test_a_detached_remote_worker_outlives_its_connection_and_is_reattached(tmp_path):
    remote = str(tmp_path / "remote")
    first, out, err = supervisor({
        "command": [sys.executable, "-c", TRAIN, "60", "3"], "env": {}, "cwd": str(tmp_path), "secret": "s3cret",
        "secret_fd_variable": "LIGHTNING_ELASTIC_SECRET_FD", "detach": {"dir": remote, "name": "w1", "mark": "job-m1"}})
    started = err.next()
    assert started.startswith(f"{MARK} started "), started
    pid, ticks, offset = map(int, started.split()[-3:])
    assert offset == 0
    assert out.next() == "secret s3cret"
    seen = [out.next(), out.next()]  # "pid N", "line 0"
    first.stdin.close()  # the connection drops (the driver died)
    assert first.wait(BOUND) == 0
    assert is_running(pid, ticks), "the worker died with its connection"

    relayed = len("".join(f"{line}\n" for line in ["secret s3cret", *seen]).encode())
    # A running process without this job's mark is never adopted (nor signalled): reported killed.
    other, _, err4 = supervisor({"attach": {"dir": remote, "name": "w1", "pid": pid, "ticks": ticks,
                                            "offset": relayed, "mark": "job-other"}})
    assert err4.next() == f"{MARK} exit -9"
    other.wait(BOUND)
    assert is_running(pid, ticks)
    again, out2, err2 = supervisor({"attach": {"dir": remote, "name": "w1", "pid": pid, "ticks": ticks,
                                               "offset": relayed, "mark": "job-m1"}})
    assert err2.next() == f"{MARK} started {pid} {ticks} {relayed}"
    assert out2.next() == "line 1"  # from where the first connection had got to
    lines = []
    while (line := out2.next(10)) is not None:
        lines.append(line)
    assert lines[-1] == "line 59"
    assert err2.next() == f"{MARK} exit 3"
    assert again.wait(BOUND) == 0
    # A worker that is gone without a status is reported killed.
    gone, _, err3 = supervisor({"attach": {"dir": remote, "name": "w9", "pid": os.getpid(), "ticks": 1, "offset": 0,
                                                  "mark": "job-m9"}})
    assert err3.next() == f"{MARK} exit -9"
    gone.wait(BOUND)


def test_an_adopting_driver_refuses_requests_signed_before_it_started():
    """Its nonce cache is new: a request to its predecessor, replayed, must not pass."""
    import requests

    from lightning_elastic import protocol as p
    from lightning_elastic.launcher.service.rendezvous_server import RendezvousServer
    from tests.unit.launcher.service.test_rendezvous_server import SECRET, sign

    reg = Registry()
    with reg.cond:
        reg.add_worker("w", SlotKey("h", 0)).last_heartbeat = 0.0
    started = time.time()
    srv = RendezvousServer(reg, SECRET, not_before=adoption.not_before(started))
    srv.start()
    try:
        body = p.to_json(p.HeartbeatRequest("w", 0, 0, 0.0))
        before = requests.post(srv.url + p.PATH_HEARTBEAT, data=body, timeout=10,
                               headers=sign(p.PATH_HEARTBEAT, body, timestamp=int(started) - 5))
        assert before.status_code == 401 and "signed before this driver started" in before.text
        # Signed now, or by a worker whose clock lags a little: accepted.
        for stamp in (None, int(started - 0.9)):
            assert requests.post(srv.url + p.PATH_HEARTBEAT, data=body, timeout=10,
                                 headers=sign(p.PATH_HEARTBEAT, body, timestamp=stamp)).status_code == 200
    finally:
        srv.close()


def test_saves_are_paced_by_their_cost_a_new_round_after_its_announcement():
    """At 4,096 workers a save costs ~0.1 s: after every pass it starved the service."""
    pacing = adoption.SavePacing(share=0.1)
    assert not pacing.due(0.0, (1, 0))  # nothing changed: nothing to save
    pacing.changed()
    assert pacing.due(0.0, (1, 0))  # the first: at once
    pacing.saved(0.0, (1, 0), cost=0.05)  # the next one no sooner than 0.5 s later
    pacing.changed()
    assert not pacing.due(0.2, (1, 0))
    assert pacing.due(0.5, (1, 0))  # still due: the loop saves it on a later turn
    # A new round (or generation): 0.5 s after it was first seen, not after the last save,
    # so that the save does not compete with the round's announcement.
    assert not pacing.due(0.4, (2, 0))
    assert not pacing.due(0.8, (2, 0)) and pacing.due(0.9, (2, 0))
    assert not pacing.due(0.95, (2, 1)) and pacing.due(1.45, (2, 1))  # another one since: from then
    pacing.saved(1.45, (2, 1), cost=0.0001)
    pacing.changed()
    assert pacing.due(1.4511, (2, 1))  # cheap saves (tens of workers): after every pass
    assert not pacing.due(1.4511, (3, 1)) and pacing.due(1.4522, (3, 1))  # a new round, a millisecond on


def test_spares_holds_and_the_exit_timeout_survive_a_restart(tmp_path):
    """A restart must not turn a hot spare into a member, end a preempted slot's hold early,
    or give the workers after training returned a new --exit-timeout."""
    reg, hosts, target = a_job(tmp_path)
    spare = reg.state.workers["a[1]#2"]
    spare.standby = True
    reg.state.standby = (SlotKey("a", 1),)
    reg.state.held_until = {SlotKey("b", 0): 105.0, SlotKey("a", 0): 99.0}  # the second is over
    reg.state.first_exit = (90.0, "a[0]#0")
    directory = StateDir(tmp_path / "state")
    directory.lock()
    directory.save(state_codec.capture(reg.state), 100.0)
    loaded = directory.load()
    assert as_saved(loaded, 0.0) == as_saved(reg.state, 100.0)
    new_reg, _ = restore(loaded, now=500.0)  # another clock
    job = new_reg.state
    assert job.standby == (SlotKey("a", 1),) and job.first_exit == (490.0, "a[0]#0")
    assert job.held_until[SlotKey("b", 0)] == 505.0
    assert job.held_until[SlotKey("a", 0)] <= 500.0  # still over: the next decision pass drops it
    assert job.workers["a[1]#2"].standby and not job.workers["a[0]#0"].standby
    # A state saved before these were kept still loads: nothing waited out.
    raw = json.loads((tmp_path / "state" / "state.json").read_text())
    for key in ("standby", "held_until", "first_exit"):
        del raw["job"][key]
    (tmp_path / "state" / "state.json").write_text(json.dumps(raw))
    old = directory.load()
    assert (old.standby, old.held_until, old.first_exit) == ((), {}, None)


def test_a_state_saved_by_a_driver_of_another_version_is_a_new_job(tmp_path, caplog):
    """Version 1 was a translation of the state (SavedState): not adopted, said in one line."""
    reg, hosts, target = a_job(tmp_path)
    directory = StateDir(tmp_path)
    directory.save(state_codec.capture(reg.state), 100.0)
    raw = json.loads((tmp_path / "state.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps({**raw, "version": 1}))
    assert directory.load() is None
    assert "cannot be read (version 1, not 2: saved by another version of the driver): starting a new job" \
        in caplog.text


def test_workers_in_a_round_the_previous_driver_did_not_save_re_form_under_a_new_number(tmp_path):
    """Saves are never waited for: a driver can announce round 2 and die before it is on disk.
    The next driver, told by the workers that they know more than its saved round 1, must not
    number a round 2 again (a worker in the unsaved round 2 would never take it) nor bump the
    generation to one they already know (they would not hear of it): it re-forms past both."""
    reg, hosts, target = a_job(tmp_path)
    state = saved(reg)
    members = [reg.state.workers["a[0]#0"], reg.state.workers["a[1]#1"]]
    with reg.cond:  # the unsaved change: a new generation and round 2, announced
        reg.bump_generation()
        reg.form_round(list(zip(members, target)), ("127.0.0.1", 4242))
    assert (reg.state.round.number, reg.state.generation) == (2, 2) and state.round.number == 1
    new_reg, _ = restore(state)
    # A heartbeat of a worker of round 2, as it knows it: at once, the driver moves past every
    # generation its predecessor may have announced unsaved.
    reserve = adoption.RESERVED_CHANGES
    reply = new_reg.heartbeat_poll(HeartbeatRequest("a[0]#0", 2, 0, 5.0)).wait()
    assert reply.generation == new_reg.state.generation == 1 + reserve + 1
    assert 1 in new_reg.state.broken_rounds
    # Both come back from round 2; the driver's next round is 3, and they take it.
    waiting = [new_reg.rendezvous_poll(RendezvousRequest(w.worker_id, 2), timeout=0.01) for w in members]
    with new_reg.cond:
        assert new_reg.state.generation == reserve + 2  # their round 2 moved nothing more
        formed = new_reg.form_round([(new_reg.state.workers[w.worker_id], s) for w, s in zip(members, target)],
                                    ("127.0.0.1", 4242))
    assert formed.number == 1 + reserve + 1 and formed.generation == reserve + 2
    replies = [poll.wait() for poll in waiting]
    assert [r.assignment.round for r in replies] == [formed.number] * 2


def test_a_round_the_workers_knew_only_from_a_rendezvous_is_also_passed(tmp_path):
    """The saved generation already counted the change; only the round was not saved: a
    member back from round 2 shows it, and the next round is past the reserve."""
    reg, hosts, target = a_job(tmp_path)
    new_reg, _ = restore(saved(reg))
    poll = new_reg.rendezvous_poll(RendezvousRequest("a[0]#0", 2), timeout=0.01)
    assert new_reg.state.generation == 1 + adoption.RESERVED_CHANGES + 1 and 1 in new_reg.state.broken_rounds
    # Its round-2 peers, still in it, hear of the new generation at their next heartbeat.
    assert new_reg.heartbeat_poll(HeartbeatRequest("a[1]#1", 1, 0, 5.0)).wait().generation == new_reg.state.generation
    with new_reg.cond:
        formed = new_reg.form_round([(new_reg.state.workers["a[0]#0"], target[0])], ("127.0.0.1", 4242))
    assert formed.number == 1 + adoption.RESERVED_CHANGES + 1
    assert poll.wait().assignment.round == formed.number


def test_workers_in_the_saved_round_change_nothing(tmp_path):
    """The common case: the saved round is the workers' round, which the new driver takes up."""
    reg, hosts, target = a_job(tmp_path)
    new_reg, _ = restore(saved(reg))
    new_reg.heartbeat_poll(HeartbeatRequest("a[0]#0", 1, 0, 0.01)).wait()
    new_reg.report(Report("a[1]#1", 1, Outcome.DONE))
    assert (new_reg.state.round, new_reg.state.generation, new_reg.state.broken_rounds) == (reg.state.round, 1, set())


def test_a_snapshot_read_under_the_lock_is_the_state_of_then(tmp_path):
    """The driver captures the state under its lock and the writer thread encodes it later:
    what the driver changes meanwhile must not leak into the saved state."""
    reg, hosts, target = a_job(tmp_path)
    before = as_saved(reg.state, 100.0)
    snap = state_codec.capture(reg.state)
    members = [reg.state.workers["a[0]#0"], reg.state.workers["a[1]#1"]]
    with reg.cond:  # the next pass: a new round, a report, a worker gone
        reg.bump_generation()
        reg.form_round(list(zip(members, target)), ("127.0.0.1", 4242))
        members[1].report = Report("a[1]#1", 2, Outcome.FAILED, "later")
        reg.state.workers["a[1]#2"].leave = True
        hosts.record_failure(SlotKey("a", 0))
        reg.state.target.pop()
        reg.state.tally.failures.append("worker a[1]#1 failed")
        reg.state.held_until[SlotKey("a", 1)] = 130.0
    directory = StateDir(tmp_path)
    writer = StateWriter(directory)
    writer.start()
    writer.submit(snap, 100.0)
    writer.close()
    assert as_saved(directory.load(), 0.0) == before


def test_the_adoption_time_is_the_last_arrival_not_when_the_loop_looked():
    reg = Registry(clock=lambda: 0.0)
    with reg.cond:
        records = [reg.add_worker(f"a[{i}]#{i}", SlotKey("a", i)) for i in range(2)]
    watch = adoption.AdoptionWatch(records, adopted_at=10.0, driver_started=9.5)
    records[0].last_heartbeat = 10.2
    assert watch.check(10.25) is None
    records[1].last_heartbeat = 10.4
    records[0].last_heartbeat = 10.45  # its next request, before the loop looks again
    assert watch.check(10.5) == pytest.approx(10.4 - 9.5)


def test_the_summary_counts_survive_a_restart_as_one_structure(tmp_path):
    reg, hosts, target = a_job(tmp_path)
    tally = Tally(next_worker=3)
    tally.rounds.append(2)
    tally.failures.append("worker a[1]#1 was killed by SIGKILL")
    tally.blacklisted.append("b")
    tally.departures.append("worker a[0]#0 left on a preemption notice")
    tally.outages.append("driver restarted after 5.0 s without one")
    reg.state.tally = tally
    directory = StateDir(tmp_path)
    directory.save(state_codec.capture(reg.state), 100.0)
    new_reg, _ = restore(directory.load())
    restored = new_reg.state.tally
    assert facts(dataclasses.replace(restored, next_worker=3)) == facts(tally)
    assert restored.next_worker > tally.next_worker  # past the reserve: next test


def test_a_restarted_driver_numbers_its_workers_past_any_its_predecessor_started_unsaved(tmp_path):
    # Saves are not waited for: the predecessor may have started workers after its last
    # save. One of them outliving it must never share an id with the successor's workers.
    reg, hosts, target = a_job(tmp_path)
    saved_next = 3
    reg.state.tally = Tally(saved_next)
    directory = StateDir(tmp_path)
    directory.save(state_codec.capture(reg.state), 100.0)
    # Before its next save, a whole pass of replacements and then each replaced again.
    started_unsaved = range(saved_next, saved_next + 2 * max(len(reg.state.workers), len(target)))
    new_reg, _ = restore(directory.load())
    assert new_reg.state.tally.next_worker > max(started_unsaved)


def test_the_reset_limit_still_counts_every_round_after_a_restart_past_the_kept_history(tmp_path):
    # The rounds history keeps its first 20 and newest 80 entries; a restart used to take up
    # only those, so a job of 150 rounds counted 100 against --reset-limit afterwards.
    reg, hosts, target = a_job(tmp_path)
    tally = Tally(next_worker=3)
    for size in range(150):
        tally.rounds.append(size)
    reg.state.tally = tally
    directory = StateDir(tmp_path)
    directory.save(state_codec.capture(reg.state), 100.0)
    new_reg, _ = restore(directory.load())
    restored = new_reg.state.tally
    assert (restored.rounds.total, restored.rounds.omitted) == (150, 50)
    assert list(restored.rounds) == list(tally.rounds)


def test_what_the_driver_waits_out_is_carried_by_a_save():
    state = JobState(standby=(SlotKey("a", 1),), held_until={SlotKey("b", 0): 130.0}, first_exit=(95.0, "a[0]#0"))
    copy = state_codec.capture(state)
    assert (copy.standby, copy.held_until, copy.first_exit) == (
        (SlotKey("a", 1),), {SlotKey("b", 0): 130.0}, (95.0, "a[0]#0"))
    state.held_until.clear()  # the driver's own dict: the save's copy is left alone
    assert copy.held_until


def test_an_adoption_keeps_a_stop_under_way_and_the_process_facts_it_finds_workers_by(tmp_path):
    """A worker the previous driver was stopping is still stopped (SIGKILL when the rest of its
    grace is over), and a launcher's ``adopt`` gets the record with its keeper's pid."""
    reg, hosts, target = a_job(tmp_path)
    stopping = reg.state.workers["a[1]#2"]
    stopping.stop_deadline, stopping.kill_reason = 105.0, "its slot left the job"
    stopping.keeper_pid, stopping.start_ticks, stopping.log_file = 4242, 99, "/logs/w.log"
    asked = []

    def adopt(record: WorkerRecord, prefix) -> LostProcess:
        asked.append((record.worker_id, record.slot, record.keeper_pid, record.start_ticks, record.log_file))
        return LostProcess()

    new_reg = a_registry()
    with new_reg.cond:
        adoption.restore(saved(reg, 100.0), new_reg, adopt, lambda record: lambda: "", 500.0)
    again = new_reg.state.workers["a[1]#2"]
    assert (again.stop_deadline, again.kill_reason) == (505.0, "its slot left the job")
    assert ("a[1]#2", SlotKey("a", 1), 4242, 99, "/logs/w.log") in asked
    assert (again.started_at, again.last_heartbeat) == (500.0, None)  # never joined: its start-up bound, from now
    assert new_reg.state.workers["a[0]#0"].last_heartbeat == 500.0  # joined: its heartbeat deadline, from now
