"""ElasticStrategy(timeout=..., process_group_backend=...): checked at once, applied to the worker."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_elastic.worker import ElasticWorker

pytest.importorskip("lightning")
from lightning_elastic.lightning.strategy import ElasticStrategy  # noqa: E402


def test_timeout_and_backend_reach_the_workers_process_group():
    worker = ElasticWorker(None)  # a world of one: no launcher
    ElasticStrategy(worker=worker, timeout=timedelta(minutes=5), process_group_backend="gloo")
    assert worker.collective_timeout == 300.0
    worker.start()
    try:
        assert worker.backend == "gloo"
    finally:
        worker.shutdown()


def test_without_options_the_launchers_bound_applies():
    worker = ElasticWorker(None)
    ElasticStrategy(worker=worker)
    assert worker.collective_timeout == 1800.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(timeout=timedelta(seconds=-1)), "timeout: expected a positive, finite number of seconds, got -1.0"),
        (dict(timeout="10 minutes"), "ElasticStrategy: timeout must be a datetime.timedelta, got '10 minutes'"),
        (dict(process_group_backend="mpi"), "process_group_backend: expected one of 'gloo', 'nccl', got 'mpi'"),
    ],
)
def test_invalid_options_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError) as info:
        ElasticStrategy(**kwargs)
    assert str(info.value) == message
