"""The driver's decisions when agents come and go, through the one pure step.

An agent's arrival is its host listed (``driver/host_intake.py`` adds the hosts agents offer
to discovery's); its graceful leave is its host no longer listed; its loss is its workers'
exits with ``host_gone`` (``launcher/service/agent_board.py``). No driver, no process, no
clock: the step's effects and the state tell what the driver decided.
"""

from __future__ import annotations

import signal

from lightning_elastic.launcher.job.effects import Announced, RoundFormed, Signal, Start
from lightning_elastic.launcher.job.exits import ExitFacts, ExitKind, classify_exit
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.job.state import WorkerState
from lightning_elastic.launcher.job.step import Exited, HostsListed
from tests.unit.launcher.job.test_step import Job

LOST = "its agent on pod-c was lost (silent for 4.1 s)"


def agents_job(np: int = 3, max_np: int = 4) -> Job:
    """A job of -np NP that starts with no host at all: every host comes from an agent."""
    # (The config's hosts only satisfy LaunchConfig: what the step sees is ``listed``.)
    job = Job((HostSlots("config-only", max_np),), np=np, min_np=1, max_np=max_np)
    job.listed = HostsListed(())
    return job


def test_a_job_with_no_host_waits_for_agents_until_np_slots_have_joined():
    job = agents_job()
    fx = job.turn()
    assert not fx.of(Start) and job.state.below_since is not None  # waits (--elastic-timeout) for slots
    job.listed = HostsListed((HostSlots("pod-a", 1), HostSlots("pod-b", 1)))
    assert not job.turn().of(Start)  # the first round is -np's size
    job.listed = HostsListed((HostSlots("pod-a", 1), HostSlots("pod-b", 1), HostSlots("pod-c", 1)))
    assert [s.slot.slot.host for s in job.turn().of(Start)] == ["pod-a", "pod-b", "pod-c"]
    job.arrive(*job.started())
    assert [len(r.members) for r in job.turn().of(RoundFormed)] == [3]


def formed_on_three_agents(max_np: int = 4) -> tuple[Job, list[str]]:
    job = agents_job(max_np=max_np)
    job.listed = HostsListed(tuple(HostSlots(h, 1) for h in ("pod-a", "pod-b", "pod-c")))
    return job, job.formed()


def test_a_fourth_agent_is_a_joiner_announced_without_rollback():
    job, members = formed_on_three_agents()
    job.listed = HostsListed(tuple(HostSlots(h, 1) for h in ("pod-a", "pod-b", "pod-c", "pod-d")))
    [joiner] = job.turn().of(Start)
    assert joiner.slot.slot.host == "pod-d"
    job.arrive(joiner.worker_id)
    fx = job.turn()
    assert fx.of(Announced) and job.state.generation == 1
    assert not job.state.broken_rounds  # a host change: live state kept, nothing rolled back
    job.arrive(*members, after_round=1)
    fx = job.turn()
    assert job.state.round.members == (*members, joiner.worker_id)


def test_an_agent_leaving_gracefully_takes_its_host_off_without_rollback_or_blacklist():
    job, (a, b, c) = formed_on_three_agents()
    job.listed = HostsListed((HostSlots("pod-a", 1), HostSlots("pod-b", 1)))  # pod-c's agent got SIGTERM
    fx = job.turn()
    assert fx.of(Announced) and job.state.workers[c].leave  # it leaves at its next check
    assert not [s for s in fx.of(Signal) if s.worker_id == c]  # nobody is killed
    assert not job.state.broken_rounds
    job.arrive(a, b, after_round=1)
    job.turn()
    assert job.state.round.members == (a, b)
    job.turn((Exited(c, 0),))
    assert job.state.workers[c].state is WorkerState.REMOVED
    assert not job.state.hosts.is_blacklisted("pod-c") and not job.state.tally.failures


def test_an_agent_lost_is_its_hosts_loss_recovered_by_the_survivors_and_nothing_blacklisted():
    job, (a, b, c) = formed_on_three_agents()
    # The turn its agent is lost: its host is off the list and its worker's exit reaped.
    job.listed = HostsListed((HostSlots("pod-a", 1), HostSlots("pod-b", 1)))
    fx = job.turn((Exited(c, -signal.SIGKILL, LOST, host_gone=True),))
    lost = job.state.workers[c]
    assert lost.state is WorkerState.FAILED and lost.failure == f"worker {c} was lost: {LOST}"
    assert 1 in job.state.broken_rounds  # the survivors restore their commit and re-form
    assert not job.state.hosts.is_blacklisted("pod-c") and not job.state.hosts.blacklisted_slots()
    assert not fx.of(Start)  # no new worker on a host that is gone
    job.arrive(a, b, after_round=1)
    job.turn()
    assert job.state.round.members == (a, b)
    # Its agent back (a pod restarted under the same name): a host added, a joiner.
    job.listed = HostsListed((HostSlots("pod-a", 1), HostSlots("pod-b", 1), HostSlots("pod-c", 1)))
    [back] = job.turn().of(Start)
    assert back.slot.slot.host == "pod-c"


def test_a_worker_lost_with_its_agent_fails_its_round_but_blacklists_nothing():
    verdict = classify_exit(ExitFacts("w", -signal.SIGKILL, LOST, joined=True, in_round=True, host_gone=True))
    assert verdict.kind is ExitKind.FAILED and verdict.break_round and not verdict.blacklist
    pushed = classify_exit(ExitFacts("w", 255, "ssh to h failed", joined=True, in_round=True))
    assert pushed.blacklist and pushed.host_failed  # a pushed host that fails is still the host's fault
