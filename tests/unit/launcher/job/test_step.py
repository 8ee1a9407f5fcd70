"""The driver's rules through the one step: ``step(state, turn, rules) -> effects``.

No driver, no processes, no clock: a ``JobState`` is built, a ``Turn`` says what the loop
observed, and the test reads the state and the effects. The registry is used only as the
service would (a worker's rendezvous, heartbeat and report recorded into the state).
"""

from __future__ import annotations

import signal

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.config import LaunchConfig, Timeouts
from lightning_elastic.launcher.job.blacklist import HostManager
from lightning_elastic.launcher.job.effects import Announced, Emit, End, Log, RoundFormed, Signal, Start, Wake
from lightning_elastic.launcher.job.liveness import Absences
from lightning_elastic.launcher.job.rules import Rules
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.job.state import JobState, WorkerState
from lightning_elastic.launcher.job.step import Exited, HostsListed, Turn, step
from lightning_elastic.launcher.service.registry import Registry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Job:
    """A JobState with the registry the service would record into, and a clock the test moves."""

    def __init__(self, hosts: tuple[HostSlots, ...], np: int, min_np: int | None = None, max_np: int | None = None,
                 fixed: bool = False, **timeouts: float) -> None:
        """``fixed``: a fixed host list without a blacklist cooldown (``-H``): it never grows."""
        self.clock = Clock()
        config = LaunchConfig(command=("x",), np=np, min_np=min_np or np, max_np=max_np or np, hosts=hosts,
                              timeouts=Timeouts(**timeouts), blacklist_cooldown=None if fixed else (10.0, 20.0))
        self.rules = Rules(config, fixed_hosts=fixed)
        self.state = JobState(hosts=HostManager(config.blacklist_cooldown, self.clock), address="h", port=1)
        self.state.absences = Absences.starting(self.clock.now, config.timeouts.heartbeat_period)
        self.registry = Registry(self.clock, state=self.state)
        self.listed = HostsListed(hosts)

    def turn(self, exits: tuple[Exited, ...] = (), decide: bool = True, advance: float = 0.0):
        self.clock.now += advance
        self.state.absences.turn(self.clock.now)
        result = step(self.state, Turn(self.clock.now, exits, self.listed, requests_changed=decide, timer_due=True),
                      self.rules)
        self.listed = None
        return result.effects

    def run_for(self, seconds: float) -> None:
        """The driver running (turning every 0.05 s) with nothing to decide."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + 0.05)
            self.state.absences.turn(self.clock.now)

    def arrive(self, *worker_ids: str, after_round: int = 0) -> None:
        for worker_id in worker_ids:
            self.registry.rendezvous_poll(p.RendezvousRequest(worker_id, after_round), timeout=0)

    def started(self) -> list[str]:
        return [w for w, r in self.state.workers.items() if not r.state.finished]

    def formed(self) -> list[str]:
        """Start the job: every planned worker arrives, round 1 forms."""
        fx = self.turn()
        ids = [s.worker_id for s in fx.of(Start)]
        self.arrive(*ids)
        fx = self.turn()
        assert fx.of(RoundFormed), "round 1 did not form"
        return ids


def signals(fx, worker_id: str) -> list[signal.Signals]:
    return [s for e in fx.of(Signal) if e.worker_id == worker_id for s in e.signals]


def test_the_first_turn_plans_the_world_and_starts_a_worker_per_slot():
    job = Job((HostSlots("a", 2), HostSlots("b", 1)), np=3)
    fx = job.turn()
    starts = fx.of(Start)
    assert [str(s.slot.slot) for s in starts] == ["a[0]", "a[1]", "b[0]"]
    assert [s.number for s in starts] == [0, 1, 2]  # ids are never reused: numbered in order
    assert all(job.state.workers[s.worker_id].state is WorkerState.STARTING for s in starts)
    assert not fx.of(RoundFormed)  # nobody waits at the rendezvous yet


def test_a_round_forms_once_every_target_worker_waits_and_each_member_is_woken():
    job = Job((HostSlots("a", 2),), np=2)
    ids = [s.worker_id for s in job.turn().of(Start)]
    job.arrive(ids[0])
    assert not job.turn().of(RoundFormed)  # the first round waits for its whole world
    job.arrive(ids[1])
    fx = job.turn()
    formed = fx.of(RoundFormed)
    assert [m["worker"] for m in formed[0].members] == ids
    assert set(ids) <= {w for e in fx.of(Wake) for w in e.worker_ids}
    assert job.state.round.number == 1 and list(job.state.tally.rounds) == [2]


def test_a_member_killed_mid_training_breaks_its_round_and_takes_out_its_slot_only():
    job = Job((HostSlots("a", 2), HostSlots("b", 1)), np=3, min_np=1)
    ids = job.formed()
    fx = job.turn((Exited(ids[1], -signal.SIGKILL),))
    lost = job.state.workers[ids[1]]
    assert lost.state is WorkerState.FAILED and lost.failure == f"worker {ids[1]} was killed by SIGKILL"
    assert 1 in job.state.broken_rounds
    assert job.state.hosts.blacklisted_slots() == {lost.slot}  # a[1] only: a[0] goes on
    assert not signals(fx, ids[0])  # its healthy sibling is not stopped
    assert [e.fields["reason"] for e in fx.of(Emit) if e.kind == "worker_failed"] == [lost.failure]
    assert list(job.state.tally.failures) == [lost.failure]


def test_a_failure_of_the_host_itself_blacklists_it_and_stops_its_other_workers():
    job = Job((HostSlots("a", 2), HostSlots("b", 1)), np=3, min_np=1)
    ids = job.formed()
    fx = job.turn((Exited(ids[0], 255, "the ssh connection to a was lost"),))
    assert job.state.hosts.is_blacklisted("a")
    assert signals(fx, ids[1]) == [signal.SIGTERM, signal.SIGCONT]
    assert job.state.workers[ids[1]].leave and job.state.workers[ids[1]].stopping
    assert not signals(fx, ids[2])
    # Not gone after --stop-grace: SIGKILL.
    job.run_for(job.rules.config.timeouts.stop_grace)
    fx = job.turn()
    assert signal.SIGKILL in signals(fx, ids[1])


def test_training_returned_everywhere_and_every_member_exited_0_is_success():
    job = Job((HostSlots("a", 2),), np=2)
    ids = job.formed()
    for worker_id in ids:
        job.registry.report(p.Report(worker_id, 1, p.Outcome.DONE))
    fx = job.turn((Exited(ids[0], 0),))
    assert not fx.of(End)  # the other member has not exited yet
    fx = job.turn((Exited(ids[1], 0),))
    [end] = fx.of(End)
    assert end.verdict.success and "training finished on all 2 worker(s) of round 1" in end.verdict.reason


def test_a_worker_that_reported_the_end_of_training_is_given_the_exit_timeout_not_the_heartbeat_timeout():
    # Its exit (the last host check, the group's teardown, the interpreter's end) sends no
    # heartbeat and takes seconds on a busy machine (docs/reliability.md, chaos matrix row 57).
    job = Job((HostSlots("a", 2),), np=2, heartbeat_timeout=4.0, exit=30.0)
    a, b = job.formed()
    job.registry.report(p.Report(a, 1, p.Outcome.DONE))
    job.run_for(10.0)  # both silent for more than the heartbeat timeout
    fx = job.turn()
    assert not signals(fx, a)  # reported: exiting, not wedged
    assert signals(fx, b) == [signal.SIGKILL]  # still training and silent: wedged
    assert "no heartbeat for 4 s" in job.state.workers[b].kill_reason
    job.run_for(21.0)  # 31 s after its report: past --exit-timeout
    fx = job.turn()
    assert signals(fx, a) == [signal.SIGKILL]
    assert job.state.workers[a].kill_reason == "it reported done but did not exit within 30 s"


def test_the_drivers_own_absence_is_no_workers_silence():
    # Stopped (Ctrl-Z, a suspended machine) for longer than the heartbeat timeout: when it
    # runs again, the heartbeats waiting for it have not been read yet (chaos matrix row 58).
    job = Job((HostSlots("a", 2),), np=2, heartbeat_timeout=4.0)
    a, b = job.formed()
    for _ in range(20):
        job.turn(decide=False, advance=0.05)
    fx = job.turn(decide=False, advance=15.0)  # stopped, then a turn
    assert not fx.of(Signal)
    for turn in range(1, int(4.1 / 0.05) + 1):  # running again, past the timeout
        fx = job.turn(decide=False, advance=0.05)
        if turn % 20 == 0:
            job.state.workers[a].last_heartbeat = job.clock.now  # a heartbeats every second; b never again
    assert not signals(fx, a)
    assert signals(fx, b) == [signal.SIGKILL]


def test_a_host_added_during_training_starts_a_joiner_announced_once_it_waits_and_a_removal_at_once():
    job = Job((HostSlots("a", 1), HostSlots("b", 1)), np=1, max_np=2)
    job.listed = HostsListed((HostSlots("a", 1),))
    [member] = job.formed()
    job.listed = HostsListed((HostSlots("a", 1), HostSlots("b", 1)))
    fx = job.turn()
    [joiner] = fx.of(Start)
    assert joiner.slot.slot.host == "b" and not fx.of(Announced)  # the members train on while it starts
    job.arrive(joiner.worker_id)
    fx = job.turn()
    assert fx.of(Announced) and job.state.generation == 1  # every member re-forms at its next check
    job.arrive(member, after_round=1)
    fx = job.turn()
    assert fx.of(RoundFormed) and job.state.round.number == 2 and job.state.round.members == (member, joiner.worker_id)
    # b removed: announced at once (no rollback), its worker told to leave.
    job.listed = HostsListed((HostSlots("a", 1),))
    fx = job.turn()
    assert fx.of(Announced) and job.state.generation == 2
    assert job.state.workers[joiner.worker_id].leave


@pytest.mark.parametrize("status", [0, 1])
def test_a_preempted_worker_that_left_cleanly_holds_its_slot_and_is_no_failure(status):
    job = Job((HostSlots("a", 2),), np=2, min_np=1)
    a, b = job.formed()
    job.registry.leave(p.LeaveRequest(b, "a preemption notice"))
    job.registry.report(p.Report(b, 1, p.Outcome.REMOVED))
    job.turn((Exited(b, status),))
    record = job.state.workers[b]
    if status == 0:
        assert record.state is WorkerState.REMOVED and record.slot in job.state.held_until
        assert list(job.state.tally.departures) == [f"worker {b} left on a preemption notice"]
        assert not job.state.tally.failures
    else:  # left its round cleanly, then crashed on its way out: a failure, but no round to break
        assert record.state is WorkerState.FAILED and 1 not in job.state.broken_rounds


def test_a_rolling_move_keeps_the_member_that_holds_the_state_until_the_joiner_has_it():
    # Chaos matrix rows 60, 61: H1 -> H1,H2 -> H2,H3 -> H3, H2 removed before H3's worker joined.
    job = Job((HostSlots("h1", 1), HostSlots("h2", 1), HostSlots("h3", 1)), np=1, max_np=2)
    job.listed = HostsListed((HostSlots("h2", 1),))
    [holder] = job.formed()
    job.listed = HostsListed((HostSlots("h2", 1), HostSlots("h3", 1)))
    [joiner] = job.turn().of(Start)
    job.listed = HostsListed((HostSlots("h3", 1),))
    fx = job.turn()
    assert not fx.of(End) and not job.state.workers[holder].leave  # the holder stays
    assert [a.slot.host for a in job.state.target] == ["h2", "h3"]
    job.arrive(joiner.worker_id)
    assert job.turn().of(Announced)
    # The holder's request stays pending across the next two passes: under load the driver
    # lets the holder go before the service has sent it its new round.
    pending = job.registry.rendezvous_poll(p.RendezvousRequest(holder, 1), timeout=30)
    fx = job.turn()
    assert job.state.round.members == (holder, joiner.worker_id)
    fx = job.turn()  # the joiner holds the state now: the holder is let go
    assert job.state.workers[holder].leave and [a.slot.host for a in job.state.target] == ["h3"]
    assert fx.of(Announced)  # at once: both members stop at the same check of round 2
    # ... but only after round 2 has given the joiner the state: the holder is sent round 2
    # (with EXIT it left, and the joiner, waiting for rank 0's state, failed the job).
    reply = pending.answer_now()
    assert reply is not None and reply.status is p.RendezvousStatus.ASSIGNED and reply.assignment.round == 2
    gone = job.registry.rendezvous_poll(p.RendezvousRequest(holder, 2), timeout=30).answer_now()
    assert gone is not None and gone.status is p.RendezvousStatus.EXIT


def test_a_rounds_members_are_told_where_the_driver_serves_the_store():
    job = Job((HostSlots("a", 1),), np=1)
    job.state.address, job.state.port = "10.0.0.7", 29500
    [worker] = job.formed()
    a = job.state.workers[worker].assignment
    assert (a.store_host, a.store_port) == ("10.0.0.7", 29500)


# ----- a script that fails before it joins (issue 37, item 7) --------------------------------

IMPORT_ERROR = "ModuleNotFoundError: No module named 'nosuchmodule'"


def ends(fx) -> list[str]:
    return [e.verdict.reason for e in fx.of(End)]


def waiting_lines(fx) -> list[str]:
    return [e.message for e in fx.of(Log) if e.message.startswith("Waiting for")]


def test_a_script_that_fails_on_every_slot_before_joining_ends_the_job_naming_its_error_not_the_hosts():
    job = Job((HostSlots("a", 2),), np=2, min_np=1, fixed=True)
    ids = [s.worker_id for s in job.turn().of(Start)]
    fx = job.turn((Exited(ids[0], 1, last_line=IMPORT_ERROR),))
    # The fixed list can no longer give 2 slots, but the other worker runs the same script:
    # its end is awaited, and no "the job fails in 600 s" is said of a job that cannot wait.
    assert not ends(fx) and not waiting_lines(fx)
    assert job.state.workers[ids[0]].failure == f"worker {ids[0]} exited with status 1 before joining the job: " \
                                               f"{IMPORT_ERROR}"
    fx = job.turn((Exited(ids[1], 1, last_line=IMPORT_ERROR),), advance=0.05)
    assert ends(fx) == [f"the script failed on every host before joining the job (2 worker(s) on a): worker {ids[0]} "
                        f"exited with status 1: {IMPORT_ERROR}"]


def test_a_script_failure_before_joining_waits_for_the_others_only_start_failure_grace():
    job = Job((HostSlots("a", 1), HostSlots("b", 1)), np=2, fixed=True, start_failure_grace=5.0)
    ids = [s.worker_id for s in job.turn().of(Start)]
    assert not ends(job.turn((Exited(ids[1], 2),)))  # b's worker; nothing printed: no last line
    assert not ends(job.turn(advance=4.9))
    assert ends(job.turn(advance=0.2)) == [
        f"the script failed before joining the job (1 worker(s) on b; none joined, 1 still starting): worker {ids[1]} "
        "exited with status 2"]


def test_once_a_worker_joined_a_failure_before_joining_is_its_hosts_and_the_slots_verdict_stands():
    job = Job((HostSlots("a", 1), HostSlots("b", 1)), np=2, fixed=True)
    ids = [s.worker_id for s in job.turn().of(Start)]
    job.arrive(ids[0])  # joined: the script can join, b's failure is b's
    fx = job.turn((Exited(ids[1], 1, last_line=IMPORT_ERROR),))
    assert ends(fx) == ["2 slot(s) needed and 1 left in the fixed host list (b blacklisted for the rest of the job), "
                        "which can never grow: lower --min-np, or give hosts with --host-discovery-script"]


def test_a_worker_stopped_by_the_driver_before_joining_is_no_script_failure():
    job = Job((HostSlots("a", 1),), np=1)
    (worker,) = [s.worker_id for s in job.turn().of(Start)]
    job.state.workers[worker].kill_reason = "it did not reach the rendezvous within 600 s"
    job.turn((Exited(worker, -signal.SIGKILL),))
    assert job.state.start_failures.count == 0


def test_no_wait_is_announced_in_the_turn_the_job_fails():
    # Issue 37, item 10: "the job fails in 600 s without them" came just before the verdict.
    job = Job((HostSlots("a", 1),), np=1)
    (worker,) = job.formed()
    fx = job.turn((Exited(worker, -signal.SIGKILL),))
    assert ends(fx) == [f"all 1 worker(s) of round 1 failed; first: worker {worker} was killed by SIGKILL"]
    assert not waiting_lines(fx)


def test_a_wait_for_slots_that_may_still_appear_is_announced():
    job = Job((HostSlots("a", 1), HostSlots("b", 1)), np=2, min_np=2)
    ids = job.formed()
    fx = job.turn((Exited(ids[1], -signal.SIGKILL),))
    assert not ends(fx)
    assert waiting_lines(fx) == ["Waiting for %d slot(s): %d available on %s; the job fails in %.0f s without them."]
