"""One decision pass: the wedged workers, the job's verdict, the planned world and its
announcement, and the next round.

Called by ``job/step.py`` when something changed or a decision waits on time. The views
the pure rules decide on (``membership.MembershipView``, ``verdict.JobView``) are O(N) to
build: each is built once per pass, and the membership view again only after the pass
itself changed the job (a new plan, an announcement).
"""

from __future__ import annotations

from lightning_elastic.launcher.job import membership, rounds
from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.job.effects import Announced, Effects, PrepareHost, RoundFormed, Start
from lightning_elastic.launcher.job.enforce import check_time
from lightning_elastic.launcher.job.rules import Rules
from lightning_elastic.launcher.job.slots import SlotAssignment, count_slots
from lightning_elastic.launcher.job.state import JobState, WorkerRecord
from lightning_elastic.launcher.job.wording import listing


def decision_pass(state: JobState, now: float, rules: Rules, fx: Effects) -> policy.Verdict | None:
    """The job's verdict if it has ended, else None (and the world planned, announced, formed)."""
    check_time(state, now, rules, fx)
    view = membership_view(state, now, rules)
    verdict = _verdict(state, view, now, rules, fx)
    if verdict is None:
        verdict, view = _plan(state, view, now, rules, fx)
    if verdict is None:
        verdict, view = _maybe_form_round(state, view, now, rules, fx)
    if verdict is None:
        _prepare_hosts(state, rules, fx)
        state.awaited = _awaited(membership.awaited_arrivals(view))
    return verdict


def _awaited(groups: tuple[set[str], ...]) -> list[set[str]] | None:
    """See ``Registry.await_arrivals``: no groups, every arrival wakes the loop."""
    return [set(g) for g in groups if g] if groups else None


def required_slots(state: JobState, rules: Rules) -> int:
    return rules.config.min_np if state.round is not None else rules.config.np


def membership_view(state: JobState, now: float, rules: Rules) -> membership.MembershipView:
    """What the membership rules decide on (O(N))."""

    def view_of(record: WorkerRecord) -> membership.WorkerView:
        return membership.WorkerView(
            record.worker_id, record.slot, record.state, record.leave, bool(record.departing),
            record.arrived_after_round,
        )

    current = state.round
    return membership.MembershipView(
        hosts=tuple(state.hosts.available()),
        max_np=rules.config.max_np,
        workers=tuple(view_of(w) for w in state.live_workers()),
        target=tuple(state.target),
        round_number=current.number if current else 0,
        round_members=tuple(view_of(state.workers[w]) for w in current.members) if current else (),
        round_broken=state.round_broken(),
        announced_for=state.announced_for,
        required_slots=required_slots(state, rules),
        held=frozenset(slot for slot, until in state.held_until.items() if now < until)
        | state.hosts.blacklisted_slots(),
        spares=rules.config.spares,
        standby=state.standby,
    )


def _verdict(state: JobState, view: membership.MembershipView, now: float, rules: Rules,
             fx: Effects) -> policy.Verdict | None:
    config = rules.config
    members = ()
    if state.round is not None:
        workers = state.workers
        members = tuple(policy.MemberView(w, workers[w].state, workers[w].failure, workers[w].reported_done)
                        for w in state.round.members)
    hosts = state.hosts.available()
    vacant = membership.vacant_slots(view)
    slots_of_host = {h.host: h.slots for h in hosts}
    available = count_slots(hosts) - sum(s.local_rank < slots_of_host.get(s.host, 0) for s in vacant)
    required = required_slots(state, rules)
    if available < required:
        if state.below_since is None:
            state.below_since = now
    else:
        state.below_since = None
        state.short_of_slots_said_at = 0.0
    job = policy.JobView(
        round_number=state.round.number if state.round else 0,
        members=members,
        live_workers=len(state.live_workers()),
        blacklisted_hosts=state.hosts.all_blacklisted_hosts(),
        required_slots=required,
        available_slots=available,
        below_required_for=None if state.below_since is None else now - state.below_since,
        discovery_error=state.discovery_error,
        last_failure=state.tally.failures.last or "",
        repeated_error=state.repeated_error,
        slots_can_grow=(available >= required or not rules.fixed_hosts or bool(state.held_until)
                        or _members_training(state)),
        blacklisted=tuple(state.tally.blacklisted),
        never_joined=state.never_joined if state.never_joined and not _anyone_joined(state) else "",
        start_failures=_start_failures(state),
    )
    verdict = policy.decide_verdict(job, config.elastic_timeout, config.timeouts.start_failure_grace)
    if (verdict is None and state.below_since is not None and job.slots_can_grow
            and now - state.short_of_slots_said_at >= config.timeouts.progress_every):
        # Every few seconds, not once: a wait of minutes must not look like a hang. Not when
        # the job has failed already, nor when the slots can never come (it is about to).
        state.short_of_slots_said_at = now
        left = config.elastic_timeout - (now - state.below_since)
        fx.warning("Waiting for %d slot(s): %d available on %s; the job fails in %.0f s without them.",
                   required, available, listing(hosts, lambda h: f"{h.host}:{h.slots}") or "no host", left)
    return verdict


def _start_failures(state: JobState) -> policy.StartFailuresView | None:
    """What the verdict knows of workers that failed before joining, while none ever joined
    (O(N), only then: such a job has at most its first workers)."""
    failures = state.start_failures
    if failures.first is None or _anyone_joined(state):
        return None
    worker_id, status, last_line = failures.first
    starting = sum(1 for w in state.live_workers() if not w.joined)
    return policy.StartFailuresView(failures.count, tuple(sorted(failures.hosts)), worker_id, status, last_line,
                                    starting)


def _members_training(state: JobState) -> bool:
    """Is a member of the current round still in it? Then the round's end is not known yet:
    it may fail in a more telling way (every member raising the same error)."""
    return any(state.current_member(w) for w in state.live_workers())


def _anyone_joined(state: JobState) -> bool:
    """Has any worker of the job reached the rendezvous (O(N): asked after a worker that
    never joined exited, not every pass)?"""
    return bool(state.tally.rounds) or any(w.joined for w in state.workers.values())


def _plan(state: JobState, view: membership.MembershipView, now: float, rules: Rules,
          fx: Effects) -> tuple[policy.Verdict | None, membership.MembershipView]:
    if state.below_since is not None and not membership.vacant_slots(view):
        return None, view  # wait for hosts; the elastic timeout bounds this
    if state.finishing():
        return None, view  # training has returned in this round: no new round, only exits to await
    new = membership.plan(view)
    if new is not None:
        verdict = membership.check_plan_keeps_state(view, new)
        if verdict is not None:
            return verdict, view
        _apply(state, new, now, fx)
        view = membership_view(state, now, rules)
    if view.round_broken and state.reset_pending_since is None:
        state.reset_pending_since = now
    if membership.announcement_due(view):
        generation = rounds.bump_generation(state, fx)
        state.announced_for = membership.slots_of(state.target)
        state.reset_pending_since = now
        fx.info("Announced host change to the workers of round %d (generation %d).", view.round_number, generation)
        fx.add(Announced(view.round_number, generation))
        view = membership_view(state, now, rules)
    return None, view


def _apply(state: JobState, new: membership.Plan, now: float, fx: Effects) -> None:
    state.target = list(new.target)
    state.standby = new.standby
    fx.info("Target world: %d slot(s): %s%s.", len(new.target), listing(new.target, lambda a: str(a.slot)),
            f"; standby: {listing(new.standby)}" if new.standby else "")
    for worker_id in new.leave:
        state.workers[worker_id].leave = True  # answered EXIT at its next rendezvous
        fx.wake(worker_id)
    standby = set(new.standby)
    for record in state.live_workers():
        record.standby = record.slot in standby
    fx.changed()  # decide again next turn, on the world just planned
    for a in new.spawn:
        _spawn(state, a, now, fx)


def _spawn(state: JobState, slot: SlotAssignment, now: float, fx: Effects) -> None:
    """A new worker for ``slot``: numbered (ids are never reused), recorded, started by the
    shell after the pass."""
    number = state.tally.next_worker
    state.tally.next_worker += 1
    worker_id = f"{slot.slot}#{number}"
    rounds.add_worker(state, worker_id, slot.slot, now, fx)
    fx.add(Start(worker_id, slot, number))


def _maybe_form_round(state: JobState, view: membership.MembershipView, now: float, rules: Rules,
                      fx: Effects) -> tuple[policy.Verdict | None, membership.MembershipView]:
    if state.finishing():
        return None, view  # training returned: the job ends with this round
    chosen = membership.round_to_form(view)
    if chosen is None:
        return None, view
    if state.round is not None:
        verdict = policy.check_reset_limit(state.tally.rounds.total - 1, rules.config.reset_limit)
        if verdict is not None:
            return verdict, view
    members = [(state.workers[worker_id], a) for worker_id, a in chosen]
    info = rounds.form_round(state, members, fx)
    forgotten = rounds.forget_finished(state, {r.worker_id for r, _ in members})
    state.tally.rounds.append(len(members))
    state.announced_for = None
    state.reset_pending_since = None
    later = len(view.target) - len(members)
    fx.info("Round %d formed with %d worker(s): %s%s.",
            info.number, len(members), listing(members, lambda m: f"rank {m[1].rank}={m[0].worker_id}"),
            f"; {later} more still starting will join the next round" if later else "")
    fx.add(RoundFormed(info.number, tuple({"rank": a.rank, "worker": r.worker_id, "host": r.slot.host}
                                          for r, a in members), tuple(forgotten)))
    return None, membership_view(state, now, rules)


def _prepare_hosts(state: JobState, rules: Rules, fx: Effects) -> None:
    """With ``--preload``: every host the job may use gets its fork server before a worker
    needs it (a listed spare's replacement then forks at once); once per host while it
    stays listed."""
    if not rules.prepare_hosts:
        return
    available = {h.host for h in state.hosts.available()}
    state.prepared &= available  # bounded by the hosts listed now; one that comes back is prepared again
    for host in sorted(available - state.prepared):
        state.prepared.add(host)
        fx.add(PrepareHost(host))
