"""One decision pass: the verdict (``job/verdict.py``), the planned world and the
announcement (``job/membership.py``), and the next round, over views built once per pass."""

from __future__ import annotations

import logging

from lightning_elastic.launcher.driver.result import listing
from lightning_elastic.launcher.job import membership
from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.job.slots import count_slots
from lightning_elastic.launcher.job.state import WorkerRecord

log = logging.getLogger("lightning_elastic.driver")


class Decisions:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _timers_pending(self, now: float) -> bool:
        """Does a decision depend on time alone now (the elastic timeout while slots are
        missing, a preempted slot's hold or its end)? Otherwise an unchanged job needs none."""
        ended = [slot for slot, until in self._state.held_until.items() if until <= now]
        for slot in ended:
            del self._state.held_until[slot]
        return self._state.below_since is not None or bool(self._state.held_until) or bool(ended)

    def _decide(self, now: float) -> policy.Verdict | None:
        reg = self._registry
        self._invalidate_view()
        self._kill_wedged(now)
        self._enforce_exit_timeout(now)
        verdict = self._verdict(now)
        if verdict is None:
            verdict = self._plan()
        if verdict is None:
            verdict = self._maybe_form_round()
        if verdict is None:
            self._prepare_hosts()
        self._events.observe(reg.state.breaks, reg.state.first_steps, reg.state.round.number if reg.state.round else 0)
        if verdict is None:
            reg.await_arrivals(*membership.awaited_arrivals(self._membership_view()))
        if self._state.reset_pending_since is not None:
            self._gc.reforming()  # no collection while the members come back (gc_policy.py)
        return verdict

    def _verdict(self, now: float) -> policy.Verdict | None:
        reg = self._registry
        members = ()
        if reg.state.round is not None:
            members = tuple(
                policy.MemberView(
                    w, reg.state.workers[w].state, reg.state.workers[w].failure, reg.state.workers[w].reported_done
                )
                for w in reg.state.round.members
            )
        hosts = self._state.hosts.available()
        vacant = membership.vacant_slots(self._membership_view())
        slots_of_host = {h.host: h.slots for h in hosts}
        available = count_slots(hosts) - sum(s.local_rank < slots_of_host.get(s.host, 0) for s in vacant)
        required = self._required_slots()
        if available < required:
            if self._state.below_since is None:
                self._state.below_since = now
            if now - self._state.short_of_slots_said_at >= self._config.timeouts.progress_every:
                # Every few seconds, not once: a wait of minutes must not look like a hang.
                self._state.short_of_slots_said_at = now
                left = self._config.elastic_timeout - (now - self._state.below_since)
                log.warning("Waiting for %d slot(s): %d available on %s; the job fails in %.0f s without them.",
                            required, available, listing(hosts, lambda h: f"{h.host}:{h.slots}") or "no host", left)
        else:
            self._state.below_since = None
            self._state.short_of_slots_said_at = 0.0
        view = policy.JobView(
            round_number=reg.state.round.number if reg.state.round else 0,
            members=members,
            live_workers=len(reg.live_workers()),
            blacklisted_hosts=self._state.hosts.all_blacklisted_hosts(),
            required_slots=required,
            available_slots=available,
            below_required_for=None if self._state.below_since is None else now - self._state.below_since,
            discovery_error=self._state.discovery_error,
            last_failure=self._state.tally.failures.last or "",
            repeated_error=reg.state.repeated_error,
            slots_can_grow=(available >= required or not self._fixed_hosts or bool(self._state.held_until)
                            or self._members_training()),
            blacklisted=tuple(self._state.tally.blacklisted),
            never_joined=self._state.never_joined if self._state.never_joined and not self._anyone_joined() else "",
        )
        return policy.decide_verdict(view, self._config.elastic_timeout)

    def _members_training(self) -> bool:
        """Is a member of the current round still in it? Then the round's end is not known
        yet: it may fail in a more telling way (every member raising the same error)."""
        reg = self._registry
        return any(reg.current_member(w) for w in reg.live_workers())

    def _anyone_joined(self) -> bool:
        """Has any worker of the job reached the rendezvous (O(N): asked after a worker that
        never joined exited, not every pass)?"""
        return bool(self._state.tally.rounds) or any(w.joined for w in self._registry.state.workers.values())

    def _required_slots(self) -> int:
        return self._config.min_np if self._registry.state.round is not None else self._config.np

    def _membership_view(self) -> membership.MembershipView:
        """The snapshot this decision pass decides on: built once per pass (it is O(N)),
        again only after the pass itself changed the job (``_invalidate_view``)."""
        if self._view is None:
            self._view = self._build_membership_view()
        return self._view

    def _invalidate_view(self) -> None:
        self._view = None

    def _build_membership_view(self) -> membership.MembershipView:
        reg = self._registry

        def view_of(record: WorkerRecord) -> membership.WorkerView:
            return membership.WorkerView(
                record.worker_id, record.slot, record.state, record.leave, bool(record.departing),
                record.arrived_after_round,
            )

        current = reg.state.round
        return membership.MembershipView(
            hosts=tuple(self._state.hosts.available()),
            max_np=self._config.max_np,
            workers=tuple(view_of(w) for w in reg.live_workers()),
            target=tuple(self._state.target),
            round_number=current.number if current else 0,
            round_members=tuple(view_of(reg.state.workers[w]) for w in current.members) if current else (),
            round_broken=current is not None and current.number in reg.state.broken_rounds,
            announced_for=self._state.announced_for,
            required_slots=self._required_slots(),
            held=frozenset(slot for slot, until in self._state.held_until.items() if self._clock() < until)
            | self._state.hosts.blacklisted_slots(),
            spares=self._config.spares,
            standby=self._state.standby,
        )

    def _plan(self) -> policy.Verdict | None:
        view = self._membership_view()
        if self._state.below_since is not None and not membership.vacant_slots(view):
            return None  # wait for hosts; the elastic timeout bounds this
        if self._finishing():
            return None  # training has returned in this round: no new round, only exits to await
        new = membership.plan(view)
        if new is not None:
            verdict = membership.check_plan_keeps_state(view, new)
            if verdict is not None:
                return verdict
            self._apply(new)
            self._invalidate_view()
            view = self._membership_view()
        if view.round_broken and self._state.reset_pending_since is None:
            self._state.reset_pending_since = self._clock()
        if membership.announcement_due(view):
            generation = self._registry.bump_generation()
            self._state.announced_for = membership.slots_of(self._state.target)
            self._invalidate_view()
            self._state.reset_pending_since = self._clock()
            log.info("Announced host change to the workers of round %d (generation %d).", view.round_number, generation)
            self._events.host_change_announced(view.round_number, generation)
        return None

    def _apply(self, new: membership.Plan) -> None:
        reg = self._registry
        self._state.target = list(new.target)
        self._state.standby = new.standby
        log.info("Target world: %d slot(s): %s%s.", len(new.target), listing(new.target, lambda a: str(a.slot)),
                 f"; standby: {listing(new.standby)}" if new.standby else "")
        for worker_id in new.leave:
            reg.state.workers[worker_id].leave = True  # answered EXIT at its next rendezvous
            reg.wake(reg.state.workers[worker_id])
        standby = set(new.standby)
        for record in reg.live_workers():
            record.standby = record.slot in standby
        reg.note_change()  # decide again next tick, on the world just planned
        for a in new.spawn:
            self._spawn(a)

    def _maybe_form_round(self) -> policy.Verdict | None:
        reg = self._registry
        if self._finishing():
            return None  # training returned: the job ends with this round
        view = self._membership_view()
        chosen = membership.round_to_form(view)
        if chosen is None:
            return None
        if reg.state.round is not None:
            verdict = policy.check_reset_limit(self._state.tally.rounds.total - 1, self._config.reset_limit)
            if verdict is not None:
                return verdict
        assert self._server is not None
        members = [(reg.state.workers[worker_id], a) for worker_id, a in chosen]
        info = reg.form_round(members, (self._address, self._server.port))
        self._gc.round_formed()
        for worker_id in reg.forget_finished({r.worker_id for r, _ in members}):
            # Its process was reaped; its output may still be draining: wait for that at the end.
            proc = self._processes.pop(worker_id, None)
            if proc is not None:
                self._retired.append(proc)
        self._invalidate_view()
        self._state.tally.rounds.append(len(members))
        self._state.announced_for = None
        self._state.reset_pending_since = None
        later = len(view.target) - len(members)
        log.info(
            "Round %d formed with %d worker(s): %s%s.",
            info.number, len(members), listing(members, lambda m: f"rank {m[1].rank}={m[0].worker_id}"),
            f"; {later} more still starting will join the next round" if later else "",
        )
        self._events.round_formed(
            info.number, [{"rank": a.rank, "worker": r.worker_id, "host": r.slot.host} for r, a in members])
        return None
