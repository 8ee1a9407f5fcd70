"""restart/state_codec.py: the saved state is the live JobState itself, round-tripped whole."""

from __future__ import annotations

import collections
import dataclasses
import json
from enum import Enum
from typing import Any

import pytest

from lightning_elastic.launcher.job.blacklist import Blacklist, Blacklisting, HostManager
from lightning_elastic.launcher.job.field_marks import is_transient, transient
from lightning_elastic.launcher.job.history import BoundedHistory
from lightning_elastic.launcher.job.slots import SlotAssignment, SlotKey
from lightning_elastic.launcher.job.state import JobState, RoundBreak, RoundInfo, Tally, WorkerRecord, WorkerState
from lightning_elastic.launcher.restart import state_codec
from lightning_elastic.protocol import Assignment, Outcome, Report

A0, A1, B0 = SlotKey("a", 0), SlotKey("a", 1), SlotKey("b", 0)


def history(items: list, omitted: int) -> BoundedHistory:
    return BoundedHistory.of(items, omitted)


def populated(t: float) -> JobState:
    """A JobState with every persisted field (and its parts' fields) set to a value that is
    not its default, its driver-clock times ``t`` plus a different offset each, and its
    transient fields set too (a save must leave them out)."""
    assignment = Assignment(round=7, rank=1, size=2, local_rank=1, local_size=2, cross_rank=3, cross_size=4,
                            hostname="a", store_host="10.0.0.1", store_port=29400, generation=5)
    worker = WorkerRecord(
        worker_id="a[1]#4", slot=A1, started_at=t + 1.0, state=WorkerState.MEMBER, assignment=assignment,
        arrived_after_round=6, waiting_since=t + 2.0, last_heartbeat=t + 3.0, asking_round=7,
        report=Report("a[1]#4", 7, Outcome.FAILED, "boom", snapshots_written=2, snapshots_failed=1,
                      snapshot_error="disk full"),
        reported_at=t + 4.0, leave=True, departing="a preemption notice", stop_deadline=t + 5.0,
        kill_reason="wedged", failure="worker a[1]#4 was killed", standby=True, joined=True, exit_status=-9,
        snapshots=(3, 1, "disk full"), keeper_pid=4242, start_ticks=987654, log_file="/logs/worker-4.log",
        via_agent=True, wake=object())
    done = WorkerRecord("a[0]#3", A0, t + 6.0, state=WorkerState.DONE, exit_status=0)
    state = JobState(
        address="10.0.0.1", port=29400,
        workers={done.worker_id: done, worker.worker_id: worker},
        round=RoundInfo(7, (done.worker_id, worker.worker_id), 5, (A0, A1)),
        generation=5,
        broken_rounds={3, 6},
        target=[SlotAssignment(A0, 0, 2, 2, 0, 1), SlotAssignment(A1, 1, 2, 2, 0, 1)],
        standby=(A1,),
        announced_for=(A0, A1),
        held_until={B0: t + 7.0},
        first_exit=(t - 8.0, "a[0]#3"),
        tally=Tally(next_worker=5, rounds=history(list(range(120)), 30), failures=history(["worker x failed"], 2),
                    blacklisted=["b"], departures=history(["worker y left"], 1), outages=["restarted after 3 s"]),
        blacklist=Blacklist(hosts={"b": Blacklisting(2, t + 9.0)}, slots={A0: Blacklisting(1, t - 10.0)}),
        # Transient: none of these may come back.
        breaks=collections.deque([RoundBreak(6, (A0,), "lost")], maxlen=64), first_steps={7: 1.5},
        repeated_error="same", user_error_rounds={6}, own_errors={7: {"x"}}, returned_in=7, reserved=(70, 69),
        round_floor=9, closing=True, reset_pending_since=t, below_since=t, short_of_slots_said_at=t,
        discovery_error="no", never_joined="w",
        hosts=HostManager((1.0, 2.0), lambda: t),
    )
    return state


def facts(value: Any) -> Any:
    """``value`` as comparable plain data: dataclasses by their persisted fields (type
    included), containers by type and content. Independent of the codec."""
    if dataclasses.is_dataclass(value):
        return (type(value).__name__,
                tuple((f.name, facts(getattr(value, f.name))) for f in dataclasses.fields(value) if not is_transient(f)))
    if isinstance(value, BoundedHistory):
        return ("BoundedHistory", [facts(x) for x in value], value.omitted, value.total)
    if isinstance(value, dict):
        return (type(value).__name__, {k: facts(v) for k, v in value.items()})
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, frozenset(facts(x) for x in value))
    if isinstance(value, (list, tuple, collections.deque)):
        return (type(value).__name__, [facts(x) for x in value])
    if isinstance(value, Enum):
        return (type(value).__name__, value.value)
    return (type(value).__name__, value)


def defaults_left(value: Any, where: str = "state") -> list[str]:
    """The persisted fields (in ``value`` and its parts) that hold their default value."""
    found = []
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if is_transient(f):
                continue
            v = getattr(value, f.name)
            if f.default is not dataclasses.MISSING and facts(v) == facts(f.default):
                found.append(f"{where}.{f.name}")
            elif f.default_factory is not dataclasses.MISSING and facts(v) == facts(f.default_factory()):
                found.append(f"{where}.{f.name}")
            found += defaults_left(v, f"{where}.{f.name}")
    elif isinstance(value, BoundedHistory):
        if not value.omitted:
            found.append(f"{where} (nothing omitted)")
        for x in value:
            found += defaults_left(x, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            found += defaults_left(k, f"{where}[{k!r}]") + defaults_left(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        for x in value:
            found += defaults_left(x, f"{where}[]")
    return found


def test_the_test_state_sets_every_persisted_field():
    """So that a field the codec forgets fails the round trip below: a field added to
    JobState (or its parts) must be given a value here."""
    assert defaults_left(populated(0.0).workers["a[1]#4"], "worker") == []
    assert set(defaults_left(populated(0.0))) == {  # but the finished worker's: a second, plain one
        f"state.workers['a[0]#3'].{name}" for name in
        ("assignment", "last_heartbeat", "report", "reported_at", "leave", "departing", "stop_deadline",
         "kill_reason", "failure", "standby", "joined", "snapshots", "keeper_pid", "start_ticks", "log_file", "via_agent")}


def test_a_job_state_round_trips_whole_its_clock_times_moved_to_the_new_drivers_clock():
    saved = state_codec.encode(state_codec.capture(populated(100.0)), now=100.0)
    again = state_codec.decode(saved, now=500.0)  # another driver: another clock
    assert type(again) is JobState
    assert facts(again) == facts(populated(500.0))  # every time 400 s later, nothing else changed
    worker = again.workers["a[1]#4"]
    assert (worker.stop_deadline, again.held_until, again.first_exit) == (505.0, {B0: 507.0}, (492.0, "a[0]#3"))
    assert again.blacklist.hosts["b"] == Blacklisting(2, 509.0)
    # The transient fields are their defaults; the host manager works on the state's blacklist.
    fresh, fresh_worker = JobState(), WorkerRecord("x", A0, 0.0)
    for name in ("breaks", "first_steps", "repeated_error", "user_error_rounds", "own_errors", "returned_in",
                 "reserved", "closing", "reset_pending_since", "below_since", "short_of_slots_said_at",
                 "discovery_error", "never_joined"):
        assert facts(getattr(again, name)) == facts(getattr(fresh, name)), name
    assert again.breaks.maxlen == fresh.breaks.maxlen
    assert again.round_floor == 9  # saved: the next round is numbered past it (a round given up, say)
    for name in ("arrived_after_round", "waiting_since", "asking_round", "wake", "adopted"):
        assert getattr(worker, name) == getattr(fresh_worker, name), name
    assert again.hosts.table is again.blacklist


def test_what_is_saved_leaves_out_the_transient_fields_and_holds_times_as_seconds_from_the_save():
    raw = json.loads(state_codec.encode(state_codec.capture(populated(100.0)), now=100.0))
    assert "hosts" not in raw and "breaks" not in raw and "reserved" not in raw
    worker = raw["workers"]["a[1]#4"]
    assert "wake" not in worker and "asking_round" not in worker
    assert (worker["started_at"], worker["stop_deadline"], raw["first_exit"]) == (1.0, 5.0, [-8.0, "a[0]#3"])
    assert raw["held_until"] == [[{"host": "b", "local_rank": 0}, 7.0]]  # a dict not keyed by strings: pairs


def test_a_capture_is_not_changed_by_what_the_driver_does_next():
    live = populated(100.0)
    copy = state_codec.capture(live)
    before = facts(copy)
    worker = live.workers["a[1]#4"]
    worker.state, worker.failure = WorkerState.FAILED, "later"
    live.workers["new"] = WorkerRecord("new", B0, 0.0)
    live.broken_rounds.add(7)
    live.target.pop()
    live.held_until.clear()
    live.tally.failures.append("later")
    live.tally.blacklisted.append("c")
    live.blacklist.hosts["c"] = Blacklisting(1, None)
    del live.blacklist.slots[A0]
    assert facts(copy) == before


def test_a_field_missing_from_a_save_takes_its_default_an_unknown_one_is_refused():
    raw = json.loads(state_codec.encode(state_codec.capture(populated(0.0)), now=0.0))
    del raw["standby"], raw["workers"]["a[1]#4"]["log_file"]
    again = state_codec.decode(raw)
    assert again.standby == () and again.workers["a[1]#4"].log_file == ""
    raw["workers"]["a[1]#4"]["colour"] = "blue"
    with pytest.raises(ValueError, match="WorkerRecord: no field colour"):
        state_codec.decode(raw)
    del raw["workers"]["a[1]#4"]["colour"], raw["workers"]["a[1]#4"]["slot"]
    with pytest.raises(ValueError, match="WorkerRecord: slot missing"):
        state_codec.decode(raw)


def test_a_type_the_codec_does_not_know_is_refused_naming_the_field():
    @dataclasses.dataclass
    class Odd:
        fine: int = 0
        skipped: object = transient(default=None)  # transient: never looked at
        lock: object = None

    with pytest.raises(TypeError, match=r"cannot save Odd\.lock: .* mark it transient"):
        state_codec._codec_of(Odd)


def test_large_containers_are_written_a_slice_at_a_time_to_the_same_json():
    state = JobState(target=[SlotAssignment(SlotKey(f"h{i}", 0), i, 600, 1, 0, 600) for i in range(600)])
    for i in range(600):
        state.workers[f"w{i}"] = WorkerRecord(f"w{i}", SlotKey(f"h{i}", 0), float(i))
    text = state_codec.encode(state_codec.capture(state), now=0.0)
    whole = json.dumps(state_codec._codec_of(JobState).encode(state, 0.0))
    assert json.loads(text) == json.loads(whole)  # what one json.dumps call would have written
    assert facts(state_codec.decode(text)) == facts(state)
