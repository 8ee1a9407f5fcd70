"""lightning_elastic/training/recovery.py: the one retry engine, driven by a scripted worker and run.

Each fake records what the engine asked of it, in order, so a test states the whole
recovery sequence: a fault at any step of a recovery must start another recovery.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist

from lightning_elastic import protocol as p
from lightning_elastic.errors import CollectiveError, HostsUpdatedInterrupt, RendezvousError
from lightning_elastic.training.recovery import RetryEngine, describe_error, is_collective_error

pytestmark = pytest.mark.timeout(30)

Step = Callable[[], object]


class FakeMember:
    def __init__(self, decisions: list[p.RoundLostReply] | None = None) -> None:
        self.log: list[str] = []
        self.round = 1
        self.decisions = list(decisions or [])
        self.asked: list[tuple[str, bool]] = []
        self.reports: list[tuple[p.Outcome, str]] = []
        self.reset_faults: list[BaseException] = []

    @property
    def assignment(self) -> p.Assignment:
        return p.Assignment(self.round, 0, 2, 0, 1, 0, 2, "h", "127.0.0.1", 1, 0)

    def reset(self) -> None:
        self.log.append("reset")
        if self.reset_faults:
            raise self.reset_faults.pop(0)
        self.round += 1

    def classify_error(self, error: str, collective: bool) -> p.RoundLostReply:
        self.asked.append((error, collective))
        self.log.append("classify")
        return self.decisions.pop(0) if self.decisions else p.RoundLostReply(True)

    def report(self, outcome: p.Outcome, message: str = "") -> None:
        self.reports.append((outcome, message))


class FakeRecovery:
    """Scripted: ``faults[step]`` is a list of exceptions raised by successive calls of that step."""

    def __init__(self, member: FakeMember, faults: dict[str, list[BaseException]] | None = None) -> None:
        self.member = member
        self.faults = {k: list(v) for k, v in (faults or {}).items()}

    def _step(self, name: str) -> None:
        self.member.log.append(name)
        pending = self.faults.get(name)
        if pending:
            raise pending.pop(0)

    def before_rejoin(self) -> None:
        self._step("before_rejoin")

    def prepare(self, resumed: bool) -> None:
        self._step(f"prepare({'resumed' if resumed else 'first'})")

    def attempt(self) -> str:
        self._step("attempt")
        return "result"

    def keep_live_state(self) -> None:
        self._step("keep")

    def restore_commit(self) -> None:
        self._step("restore")


def run(member: FakeMember, faults: dict[str, list[BaseException]] | None = None) -> str:
    return RetryEngine(member, FakeRecovery(member, faults)).run()


def test_a_clean_attempt_reports_done_once():
    m = FakeMember()
    assert run(m) == "result"
    assert m.log == ["prepare(first)", "attempt"]
    assert m.reports == [(p.Outcome.DONE, "")]


def test_a_host_change_keeps_the_live_state_and_rejoins_without_asking_the_driver():
    m = FakeMember()
    run(m, {"attempt": [HostsUpdatedInterrupt("hosts changed")]})
    assert m.log == ["prepare(first)", "attempt", "keep", "before_rejoin", "reset", "prepare(resumed)", "attempt"]
    assert m.asked == []


def test_a_lost_peer_restores_the_commit_then_rejoins():
    m = FakeMember()
    run(m, {"attempt": [RuntimeError("Connection closed by peer")]})
    assert m.log == ["prepare(first)", "attempt", "classify", "restore", "before_rejoin", "reset",
                     "prepare(resumed)", "attempt"]
    assert m.asked == [("RuntimeError: Connection closed by peer", False)]


@pytest.mark.parametrize("step", ["prepare(resumed)", "reset"])
def test_a_peer_lost_during_recovery_starts_another_recovery(step):
    # A preemption wave: a second peer dies while the group re-forms after the first.
    m = FakeMember()
    faults = {"attempt": [RuntimeError("peer 1 gone")]}
    if step == "reset":
        m.reset_faults = [RuntimeError("peer 2 gone during rendezvous")]
    else:
        faults[step] = [RuntimeError("peer 2 gone")]
    assert run(m, faults) == "result"
    assert m.log.count("restore") == 2
    assert m.log[-2:] == ["prepare(resumed)", "attempt"]
    assert m.reports == [(p.Outcome.DONE, "")]


def test_a_fault_in_the_first_state_broadcast_is_recovered_too():
    m = FakeMember()
    run(m, {"prepare(first)": [dist.DistError("broadcast failed")]})
    assert m.log[:4] == ["prepare(first)", "classify", "restore", "before_rejoin"]
    assert m.asked == [("torch.distributed.DistError: broadcast failed", True)]


def test_a_host_change_during_recovery_keeps_the_state_it_has():
    m = FakeMember()
    run(m, {"attempt": [RuntimeError("peer lost")], "prepare(resumed)": [HostsUpdatedInterrupt("added")]})
    assert m.log == ["prepare(first)", "attempt", "classify", "restore", "before_rejoin", "reset",
                     "prepare(resumed)", "keep", "before_rejoin", "reset", "prepare(resumed)", "attempt"]


def test_the_users_own_error_is_reported_and_reraised():
    m = FakeMember([p.RoundLostReply(False)])
    with pytest.raises(ValueError, match="bad batch"):
        run(m, {"attempt": [ValueError("bad batch")]})
    assert m.reports == [(p.Outcome.FAILED, "ValueError: bad batch")]
    assert "restore" not in m.log


def test_a_repeated_collective_error_is_reported_with_the_drivers_reason():
    m = FakeMember([p.RoundLostReply(False, "the same collective error ended 3 consecutive rounds")])
    with pytest.raises(dist.DistError):
        run(m, {"attempt": [dist.DistError("barrier timed out")]})
    assert m.reports == [(p.Outcome.FAILED, "torch.distributed.DistError: barrier timed out "
                                             "(the same collective error ended 3 consecutive rounds)")]


def test_an_unreachable_driver_is_not_retried():
    m = FakeMember()
    with pytest.raises(RendezvousError):
        run(m, {"attempt": [RendezvousError("driver gone")]})
    assert m.asked == [] and m.reports == []


def test_system_exit_passes_through_untouched():
    # A worker answered "exit" at the rendezvous leaves with sys.exit(0): not an error to classify.
    m = FakeMember()
    m.reset_faults = [SystemExit(0)]
    with pytest.raises(SystemExit):
        run(m, {"attempt": [HostsUpdatedInterrupt("removed")]})
    assert m.asked == [] and m.reports == []


@pytest.mark.parametrize(
    ("err", "collective"),
    [
        (dist.DistError("x"), True),
        (dist.DistBackendError("nccl"), True),
        (CollectiveError("round lost a member"), True),
        (RuntimeError("Connection closed by peer"), False),
        (ValueError("user"), False),
    ],
)
def test_collective_errors_are_known_by_type(err, collective):
    assert is_collective_error(err) is collective


def test_describe_error_is_the_last_traceback_line_bounded():
    assert describe_error(ValueError("a\nb")) == "ValueError: a\nb"
    assert len(describe_error(ValueError("x" * 2000))) == 500


def test_a_long_gloo_error_is_cut_at_a_word_boundary_with_an_ellipsis():
    # What the job's verdict shows after "after raising": no word cut in two (issue 37, item 10).
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
            "[127.0.0.1]:41818 " * 10).strip()
    described = describe_error(RuntimeError(gloo.removeprefix("RuntimeError: ")))
    assert len(described) <= 500 and described.endswith("...")
    kept = described.removesuffix("...")
    assert gloo.startswith(kept) and gloo[len(kept)] == " ", described[-40:]


def test_a_failing_release_does_not_stop_the_worker_from_rejoining():
    # Failing every time, it would otherwise keep the worker in its broken round for ever.
    m = FakeMember()
    run(m, {"attempt": [RuntimeError("peer lost")], "before_rejoin": [RuntimeError("teardown failed")] * 3})
    assert m.log == ["prepare(first)", "attempt", "classify", "restore", "before_rejoin", "reset",
                     "prepare(resumed)", "attempt"]
    assert m.reports == [(p.Outcome.DONE, "")]
