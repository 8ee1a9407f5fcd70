"""launcher/agent/workers.py ``Events``: a worker's output the driver has not taken yet is
bounded on the agent; what is dropped is said in the stream where the gap is."""

from __future__ import annotations

import pytest

from lightning_elastic import protocol as p
from lightning_elastic.launcher.agent import workers

pytestmark = pytest.mark.timeout(30)

OUTPUT = p.AgentEventKind.OUTPUT


def outputs(events: workers.Events) -> list[str]:
    return [e.output for e in events.batch(0) if e.kind is OUTPUT]


def test_output_past_the_pending_bound_is_dropped_and_said_once_per_gap(monkeypatch):
    monkeypatch.setattr(workers, "OUTPUT_PENDING", 10)
    events = workers.Events()
    events.add(OUTPUT, "w1", output="12345678")  # held: the driver has not acknowledged it
    events.add(OUTPUT, "w1", output="abcdé\n")  # 14 > 10: dropped (its bytes counted)
    events.add(OUTPUT, "w1", output="xyz\n")  # dropped: the same gap
    events.add(OUTPUT, "w2", output="other\n")  # another worker has its own bound
    assert outputs(events) == ["12345678", "other\n"]
    events.acknowledged(2)  # the driver took them: room again
    events.add(OUTPUT, "w1", output="after\n")
    said = "[11 bytes of output dropped: more than 0 MiB of it not yet taken by the driver]\n"
    assert outputs(events) == ["\n" + said + "after\n"]  # the line on its own, then the rest


def test_a_gap_at_a_workers_end_is_said_before_its_exit(monkeypatch):
    monkeypatch.setattr(workers, "OUTPUT_PENDING", 4)
    events = workers.Events()
    events.add(OUTPUT, "w1", output="ok\n")
    events.add(OUTPUT, "w1", output="too long\n")
    events.add(p.AgentEventKind.EXITED, "w1", status=1)
    kinds = [(e.kind, e.output) for e in events.batch(0)]
    assert kinds == [(OUTPUT, "ok\n"), (OUTPUT, "[9 bytes of output dropped: more than 0 MiB of it not yet taken by "
                                                "the driver]\n"), (p.AgentEventKind.EXITED, "")]
    events.acknowledged(3)
    assert events.batch(0) == () and not events._output_held and not events._gaps and not events._mid_line


def test_a_restart_for_a_new_driver_numbers_the_adopted_workers_events_afresh_and_drops_the_rest():
    events = workers.Events()
    events.add(p.AgentEventKind.STARTED, "w1", pid=11)
    events.add(OUTPUT, "w2", output="gone\n")
    events.add(OUTPUT, "w1", output="while no driver ran\n")
    events.add(p.AgentEventKind.EXITED, "w1", status=0)
    old = events.generation
    events.restart({"w1"})
    assert [(e.number, e.kind, e.worker_id) for e in events.batch(0)] == [
        (1, p.AgentEventKind.STARTED, "w1"), (2, OUTPUT, "w1"), (3, p.AgentEventKind.EXITED, "w1")]
    events.acknowledged(3, old)  # the previous driver's reporter, late: not this numbering's
    assert len(events.batch(0)) == 3
    events.acknowledged(2, events.generation)
    events.add(OUTPUT, "w1", output="next\n")
    assert [(e.number, e.output) for e in events.batch(0)] == [(3, ""), (4, "next\n")]
    events.restart(set())  # a join afresh: nothing of before
    assert events.batch(0) == ()
