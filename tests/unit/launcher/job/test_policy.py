"""launcher/job/verdict.py: how the job ends, decided from JobView snapshots."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_elastic.launcher.job.verdict import (
    JobView,
    MemberView,
    Verdict,
    check_previous_hosts_remain,
    check_reset_limit,
    decide_verdict,
)
from lightning_elastic.launcher.job.state import WorkerState as S

TIMEOUT = 30.0


def member(i: int, state: S, failure: str = "", reported_done: bool | None = None) -> MemberView:
    return MemberView(f"w{i}", state, failure, state == S.DONE if reported_done is None else reported_done)


def view(*states: S, **overrides) -> JobView:
    fields = dict(
        round_number=2 if states else 0,
        members=tuple(member(i, s, f"boom {i}" if s == S.FAILED else "") for i, s in enumerate(states)),
        live_workers=sum(not s.finished for s in states),
        blacklisted_hosts=(),
        required_slots=2,
        available_slots=2,
        below_required_for=None,
        discovery_error=None,
    )
    fields.update(overrides)
    return JobView(**fields)


# ----- success -------------------------------------------------------------------------


def test_success_when_every_member_of_the_round_is_done():
    assert decide_verdict(view(S.DONE, S.DONE), TIMEOUT) == Verdict(
        True, "training finished on all 2 worker(s) of round 2"
    )


@pytest.mark.parametrize("other", [S.MEMBER, S.WAITING, S.STARTING])
def test_no_verdict_while_a_member_of_a_finishing_round_has_not_exited(other):
    # Training returned on w0: the others are awaited (--exit-timeout bounds it).
    assert decide_verdict(view(S.DONE, other), TIMEOUT) is None


def test_no_success_while_done_members_have_not_exited():
    members = (member(0, S.MEMBER, reported_done=True), member(1, S.DONE))
    assert decide_verdict(view(members=members, round_number=2), TIMEOUT) is None


def test_a_member_that_reported_done_then_exited_non_zero_fails_the_job():
    members = (member(0, S.DONE), member(1, S.FAILED, "exited with status 3 after training returned", True))
    assert decide_verdict(view(members=members, round_number=2), TIMEOUT) == Verdict(
        False, "training returned in round 2 but not every worker finished cleanly: "
        "exited with status 3 after training returned"
    )


def test_a_removed_member_of_a_finishing_round_is_not_a_success():
    verdict = decide_verdict(view(S.DONE, S.REMOVED), TIMEOUT)
    assert verdict == Verdict(
        False, "training returned in round 2 but not every worker finished cleanly: worker w1 was removed"
    )


def test_a_repeated_collective_error_ends_the_job_before_anything_else():
    v = view(S.MEMBER, S.MEMBER, repeated_error="the same collective error ended 3 consecutive rounds")
    assert decide_verdict(v, TIMEOUT) == Verdict(False, "the same collective error ended 3 consecutive rounds")


def test_no_verdict_before_any_round():
    assert decide_verdict(view(), TIMEOUT) is None


def test_no_verdict_while_training_goes_on():
    assert decide_verdict(view(S.MEMBER, S.MEMBER), TIMEOUT) is None


def test_one_failed_member_with_survivors_training_is_not_the_end():
    # Elastic: the survivors re-form the round without it.
    assert decide_verdict(view(S.FAILED, S.MEMBER), TIMEOUT) is None


# ----- failures ------------------------------------------------------------------------


def test_failure_after_other_members_finished_fails_the_job():
    verdict = decide_verdict(view(S.DONE, S.FAILED), TIMEOUT)
    assert verdict == Verdict(
        False, "training returned in round 2 but not every worker finished cleanly: boom 1"
    )


def test_all_members_failed_fails_the_job_with_the_first_failure():
    verdict = decide_verdict(view(S.FAILED, S.FAILED, S.FAILED), TIMEOUT)
    assert verdict == Verdict(False, "all 3 worker(s) of round 2 failed; first: boom 0")


def test_all_failed_is_reported_before_every_host_blacklisted():
    verdict = decide_verdict(view(S.FAILED, blacklisted_hosts=("a",)), TIMEOUT)
    assert verdict is not None and verdict.reason.startswith("all 1 worker(s) of round 2 failed")


# ----- every host blacklisted ----------------------------------------------------------


def test_every_host_blacklisted_with_no_live_worker_fails_the_job():
    v = view(blacklisted_hosts=("a", "b"), live_workers=0, last_failure="worker w0 was killed by SIGKILL")
    assert decide_verdict(v, TIMEOUT) == Verdict(
        False, "every host is blacklisted (a, b); last failure: worker w0 was killed by SIGKILL"
    )


def test_every_host_blacklisted_without_a_known_failure_omits_the_detail():
    verdict = decide_verdict(view(blacklisted_hosts=("a",), live_workers=0), TIMEOUT)
    assert verdict == Verdict(False, "every host is blacklisted (a)")


def test_every_host_blacklisted_is_not_the_end_while_a_worker_lives():
    assert decide_verdict(view(S.MEMBER, blacklisted_hosts=("a",)), TIMEOUT) is None


# ----- elastic timeout -----------------------------------------------------------------


def test_timeout_names_required_and_available_slots():
    v = view(required_slots=4, available_slots=1, below_required_for=TIMEOUT)
    assert decide_verdict(v, TIMEOUT) == Verdict(
        False, "timed out after 30 s waiting for 4 slot(s) (1 available)"
    )


def test_a_fixed_host_list_short_of_slots_fails_at_once_naming_what_was_lost():
    v = view(S.MEMBER, S.FAILED, required_slots=2, available_slots=1, below_required_for=0.0,
             slots_can_grow=False, blacklisted=("127.0.0.2",))
    assert decide_verdict(v, TIMEOUT) == Verdict(
        False, "2 slot(s) needed and 1 left in the fixed host list (127.0.0.2 blacklisted for the rest of the job), "
               "which can never grow: lower --min-np, or give hosts with --host-discovery-script")


def test_slots_that_may_still_appear_are_waited_for():
    v = view(S.MEMBER, S.FAILED, required_slots=2, available_slots=1, below_required_for=0.0)
    assert decide_verdict(v, TIMEOUT) is None


def test_timeout_formats_fractional_seconds_compactly():
    v = view(required_slots=2, available_slots=0, below_required_for=10.0)
    assert decide_verdict(v, 2.5).reason == "timed out after 2.5 s waiting for 2 slot(s) (0 available)"


def test_timeout_includes_the_latest_discovery_error():
    v = view(required_slots=2, available_slots=1, below_required_for=99.0, discovery_error="script exited 3")
    assert decide_verdict(v, TIMEOUT).reason == (
        "timed out after 30 s waiting for 2 slot(s) (1 available); last discovery error: script exited 3"
    )


def test_no_timeout_just_before_the_limit():
    v = view(required_slots=2, available_slots=1, below_required_for=TIMEOUT - 0.001)
    assert decide_verdict(v, TIMEOUT) is None


def test_no_timeout_when_not_below_required():
    assert decide_verdict(view(S.MEMBER, below_required_for=None), TIMEOUT) is None


def test_success_wins_over_timeout():
    v = view(S.DONE, below_required_for=10 * TIMEOUT)
    assert decide_verdict(v, TIMEOUT).success


# ----- check_reset_limit ---------------------------------------------------------------


def test_no_reset_limit_never_stops():
    assert check_reset_limit(10**6, None) is None


def test_reset_limit_zero_refuses_the_first_reset():
    assert check_reset_limit(0, 0) == Verdict(False, "reset limit 0 exceeded")


@pytest.mark.parametrize(("done", "limit", "stops"), [(0, 1, False), (1, 1, True), (2, 3, False), (3, 3, True)])
def test_reset_limit_allows_exactly_limit_resets(done, limit, stops):
    verdict = check_reset_limit(done, limit)
    if stops:
        assert verdict == Verdict(False, f"reset limit {limit} exceeded")
    else:
        assert verdict is None


# ----- check_previous_hosts_remain -----------------------------------------------------


def test_previous_hosts_gone_means_the_state_is_lost():
    verdict = check_previous_hosts_remain(["a", "b"], [], ["c", "d"])
    assert verdict == Verdict(
        False,
        "no host of the previous set remains (previous: a, b; now: c, d): the training state is lost",
    )


def test_previous_hosts_gone_with_no_target_says_none():
    verdict = check_previous_hosts_remain(["a"], [], [])
    assert verdict is not None and "(previous: a; now: none)" in verdict.reason


def test_one_surviving_previous_host_is_enough():
    assert check_previous_hosts_remain(["a", "b"], ["b"], ["b", "c"]) is None


def test_no_previous_round_is_fine():
    assert check_previous_hosts_remain([], [], ["a"]) is None


def test_verdict_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Verdict(True, "x").success = False  # type: ignore[misc]


# ----- a command that never joins the job ----------------------------------------------------


def test_a_worker_that_exited_without_joining_ends_the_job_saying_how_to_join():
    v = view(never_joined="worker localhost[0]#0 exited with status 0 without ever joining the job",
             live_workers=1, below_required_for=0.0, slots_can_grow=False, blacklisted=("localhost[0]",))
    assert decide_verdict(v, TIMEOUT) == Verdict(
        False,
        "worker localhost[0]#0 exited with status 0 without ever joining the job; the script must join it: "
        'call lightning_elastic.init() (before @le.run), or build Trainer(strategy="elastic_hvd") or '
        'Fabric(strategy="elastic_hvd")',
    )


def test_without_a_worker_that_never_joined_the_fixed_list_verdict_stands():
    v = view(live_workers=1, below_required_for=0.0, slots_can_grow=False)
    assert decide_verdict(v, TIMEOUT).reason.startswith("2 slot(s) needed and 2 left in the fixed host list")
