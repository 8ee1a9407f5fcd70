"""lightning_elastic/commit/collectives.py: the reset's small collectives, on real gloo ranks.

Each is asynchronous and handed to a ``wait``: a worker's ``wait_collective`` gives one up
once its round is broken, where torch's blocking forms would wait for the group's timeout.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_elastic.commit import collectives
from tests.unit.fakes import FakeWorker, run_ranks

pytestmark = pytest.mark.timeout(90)
CPU = torch.device("cpu")


class GiveUp(Exception):
    pass


def counting_wait(calls: list[str]) -> collectives.Wait:
    def wait(work: dist.Work) -> None:
        calls.append("wait")
        work.wait()

    return wait


def broadcast_and_gather(rank: int, worker: FakeWorker) -> dict[str, Any]:
    calls: list[str] = []
    value = {"skeleton": [1, 2.5, "three"], "tensor": torch.arange(4) * 10} if rank == 1 else None
    received = collectives.broadcast_object(value, rank, 1, CPU, counting_wait(calls))
    rows = collectives.all_gather(torch.tensor([rank, -rank]), CPU, counting_wait(calls))
    return {"received": received, "rows": [r.tolist() for r in rows], "waits": len(calls)}


def test_broadcast_object_and_all_gather_give_every_rank_the_same_and_go_through_wait():
    results = run_ranks(3, broadcast_and_gather)
    for result in results:
        assert result["received"]["skeleton"] == [1, 2.5, "three"]
        assert result["received"]["tensor"].tolist() == [0, 10, 20, 30]
        assert result["rows"] == [[0, 0], [1, -1], [2, -2]]
        assert result["waits"] == 3  # the length, the bytes, the gather: each handed to wait


def wait_for_a_silent_source(rank: int, worker: FakeWorker) -> str:
    # Rank 0 never joins the broadcast (its round broke); rank 1's wait gives the receive up.
    if rank == 0:
        time.sleep(3)
        return "silent"

    def give_up_after_a_second(work: dist.Work) -> None:
        deadline = time.monotonic() + 1
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise GiveUp
            time.sleep(0.01)

    try:
        collectives.broadcast_object(None, rank, 0, CPU, give_up_after_a_second)
    except GiveUp:
        return "given up"
    return "received"


def test_a_broadcast_whose_source_never_sends_is_given_up_by_wait():
    assert run_ranks(2, wait_for_a_silent_source) == ["silent", "given up"]
