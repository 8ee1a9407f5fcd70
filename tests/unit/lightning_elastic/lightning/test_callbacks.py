"""ElasticCallback: commits and host checks on training steps (lightning_elastic/lightning/callbacks.py).

A scripted trainer stands in for Lightning's: the callback reads only ``trainer.strategy``,
``trainer.global_step`` and ``trainer.callbacks``; the fit loop itself is exercised by the
Lightning integration tests.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable

import pytest

from lightning_elastic.errors import HostsUpdatedInterrupt
from lightning_elastic.lightning import callbacks
from lightning_elastic.lightning.callbacks import ElasticCallback, ScaleLearningRate
from tests.unit.fakes import FakeWorker

pytestmark = pytest.mark.timeout(30)


class ScriptedStrategy:
    def __init__(self, worker: FakeWorker, on_commit: Callable[[], None] = lambda: None) -> None:
        self.worker = worker
        self.commits: list[int] = []
        self.batches: list[int] = []
        self.trainer: types.SimpleNamespace | None = None
        self._on_commit = on_commit

    def take_commit(self, trainer: types.SimpleNamespace) -> None:
        self.commits.append(trainer.global_step)
        self._on_commit()

    def record_batch(self, batch_idx: int) -> None:
        self.batches.append(batch_idx)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fit(callback: ElasticCallback, epochs: int, batches: int, steps_per_batch: float = 1.0,
        worker: FakeWorker | None = None, start_step: int = 0) -> ScriptedStrategy:
    """Batch ends of a fit: ``steps_per_batch`` 0.5 is gradient accumulation over 2 batches
    (the epoch's last batch always steps, as Lightning does), 2 is two optimizers."""
    strategy = ScriptedStrategy(worker or FakeWorker())
    trainer = types.SimpleNamespace(strategy=strategy, global_step=start_step, callbacks=[callback], world_size=1,
                                    is_global_zero=True, loggers=[])
    callback.on_train_start(trainer, None)
    for _ in range(epochs):
        for batch_idx in range(batches):
            last_batch = batch_idx == batches - 1
            if steps_per_batch >= 1:
                trainer.global_step += int(steps_per_batch)
            elif (batch_idx + 1) % int(1 / steps_per_batch) == 0 or last_batch:
                trainer.global_step += 1
            callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    return strategy


def test_commits_count_training_steps_across_epochs():
    # 43 batches per epoch: a per-epoch batch count would commit at 10, 20, 30, 40, 53, ...
    strategy = fit(ElasticCallback(commit_every_n_steps=10, check_every_n_steps=1000), epochs=2, batches=43)
    assert strategy.commits == [10, 20, 30, 40, 50, 60, 70, 80]
    assert len(strategy.batches) == 86  # every batch is recorded for the sampler


def test_commit_every_step_and_check_every_step():
    worker = FakeWorker()
    strategy = fit(ElasticCallback(commit_every_n_steps=1), epochs=1, batches=5, worker=worker)
    assert strategy.commits == [1, 2, 3, 4, 5]
    assert worker.checks == 5


def test_the_default_paces_commits_and_checks_every_step(monkeypatch):
    # Steps take 10 ms and a commit 0.5 ms: 1 % of the training time allows one per 5 steps.
    clock = FakeClock()
    monkeypatch.setattr(callbacks.time, "perf_counter", clock)
    worker = FakeWorker()
    callback = ElasticCallback()
    strategy = ScriptedStrategy(worker, on_commit=lambda: clock.advance(0.0005))
    trainer = types.SimpleNamespace(strategy=strategy, global_step=0, callbacks=[callback], world_size=1,
                                    is_global_zero=True, loggers=[])
    callback.on_train_start(trainer, None)
    for batch_idx in range(20):
        clock.advance(0.010)
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    # First step of the attempt, then one step later (nothing timed yet), then every 5.
    assert strategy.commits == [1, 2, 7, 12, 17]
    assert worker.checks == 20
    # A new fit attempt (after a reset) commits at its first step again.
    callback.on_train_start(trainer, None)
    clock.advance(0.010)
    trainer.global_step += 1
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert strategy.commits[-1] == 21


class TogetherStrategy(ScriptedStrategy):
    """A strategy whose commits are collectives (elastic_fsdp): the ranks' decisions are agreed."""

    commits_together = True

    def __init__(self, worker: FakeWorker, others: int, on_commit: Callable[[], None] = lambda: None) -> None:
        super().__init__(worker, on_commit)
        self.others = others  # the largest value the other ranks bring
        self.asked: list[int] = []

    def largest_among_ranks(self, value: int) -> int:
        self.asked.append(value)
        return max(value, self.others)


def test_when_commits_are_collectives_the_paced_interval_is_the_largest_among_the_ranks(monkeypatch):
    # Alone this rank would commit every 5 steps (as above); another rank's timings ask for 8.
    clock = FakeClock()
    monkeypatch.setattr(callbacks.time, "perf_counter", clock)
    strategy = TogetherStrategy(FakeWorker(), others=8, on_commit=lambda: clock.advance(0.0005))
    callback = ElasticCallback()
    trainer = types.SimpleNamespace(strategy=strategy, global_step=0, callbacks=[callback], world_size=1,
                                    is_global_zero=True, loggers=[])
    callback.on_train_start(trainer, None)
    for batch_idx in range(20):
        clock.advance(0.010)
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert strategy.commits == [1, 9, 17]
    assert strategy.asked == [1, 5, 5]  # this rank's own interval at each commit, agreed with the others


def test_a_fixed_interval_needs_no_agreement():
    strategy = TogetherStrategy(FakeWorker(), others=8)
    callback = ElasticCallback(commit_every_n_steps=3)
    trainer = types.SimpleNamespace(strategy=strategy, global_step=0, callbacks=[callback], world_size=1,
                                    is_global_zero=True, loggers=[])
    callback.on_train_start(trainer, None)
    for batch_idx in range(7):
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert strategy.commits == [3, 6] and strategy.asked == []


@pytest.mark.parametrize(
    ("commit_s", "step_s", "budget", "max_redo_s", "expected"),
    [
        (0.0005, 0.010, 0.01, 10.0, 5),   # 1 % of a 10 ms step is 0.1 ms: one commit per 5 steps
        (0.0001, 0.010, 0.01, 10.0, 1),   # cheap enough for every step
        (0.045, 0.36, 0.01, 10.0, 13),    # a large model: 45 ms commits, 0.36 s steps
        (0.045, 0.36, 0.01, 1.0, 2),      # ... but no more than 1 s of training redone
        (5.0, 20.0, 0.01, 10.0, 1),       # steps longer than the redo bound: every step
        (0.001, 0.0, 0.01, 10.0, 1),      # no time measured
    ],
)
def test_paced_interval(commit_s, step_s, budget, max_redo_s, expected):
    assert callbacks.paced_interval(commit_s, step_s, budget, max_redo_s) == expected


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"commit_budget": 0}, "ElasticCallback: commit_budget must be in (0, 1], got 0"),
    ({"commit_budget": 1.5}, "ElasticCallback: commit_budget must be in (0, 1], got 1.5"),
    ({"max_redo_seconds": -1}, "ElasticCallback: max_redo_seconds must be positive, got -1"),
])
def test_bad_pacing_parameters_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ElasticCallback(**kwargs)


def test_with_gradient_accumulation_only_an_optimizer_step_commits_or_checks():
    worker = FakeWorker()
    strategy = fit(ElasticCallback(commit_every_n_steps=2, check_every_n_steps=1), epochs=1, batches=9,
                   steps_per_batch=0.5, worker=worker)
    # 9 batches, accumulating 2: steps at batches 2, 4, 6, 8 and the epoch's last (9).
    assert strategy.commits == [2, 4]
    assert worker.checks == 5


def test_a_step_that_jumps_over_a_multiple_still_commits():
    strategy = fit(ElasticCallback(commit_every_n_steps=3, check_every_n_steps=1000), epochs=1, batches=5,
                   steps_per_batch=2)
    assert strategy.commits == [4, 6, 10]  # crossed 3, 6 and 9


def test_a_resumed_fit_counts_from_the_commits_step():
    strategy = fit(ElasticCallback(commit_every_n_steps=10, check_every_n_steps=1000), epochs=1, batches=15,
                   start_step=41)
    assert strategy.commits == [50]


def test_a_host_change_commits_the_live_state_before_the_interrupt():
    callback = ElasticCallback(commit_every_n_steps=10, check_every_n_steps=1)
    strategy = ScriptedStrategy(FakeWorker(interrupt_at=[3]))
    trainer = types.SimpleNamespace(strategy=strategy, global_step=0, callbacks=[callback], world_size=1,
                                    is_global_zero=True, loggers=[])
    callback.on_train_start(trainer, None)
    with pytest.raises(HostsUpdatedInterrupt):
        for batch_idx in range(5):
            trainer.global_step += 1
            callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert strategy.commits == [3]


def test_only_the_committing_callback_commits():
    first, second = ElasticCallback(), ScaleLearningRate()
    strategy = ScriptedStrategy(FakeWorker())
    trainer = types.SimpleNamespace(strategy=strategy, global_step=1, callbacks=[second, first], world_size=1,
                                    is_global_zero=True, loggers=[])
    second.on_train_batch_end(trainer, None, None, None, 0)
    assert strategy.commits == []
    first.on_train_batch_end(trainer, None, None, None, 0)
    assert strategy.commits == [1]


def test_the_old_batch_names_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="commit_every_n_batches is deprecated, use commit_every_n_steps"):
        callback = ElasticCallback(commit_every_n_batches=5)
    assert callback.commit_every_n_steps == 5


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_a_bad_interval_is_a_one_line_error(value):
    with pytest.raises(ValueError, match=f"ElasticCallback: commit_every_n_steps must be a positive integer, got {value!r}"):
        ElasticCallback(commit_every_n_steps=value)


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


@pytest.mark.parametrize("global_zero", [True, False])
def test_elastic_metrics_go_to_the_loggers_once_per_fit_attempt_from_rank_zero(global_zero):
    worker = FakeWorker(rank=0 if global_zero else 1, size=3)
    worker.resets, worker.last_recovery_s = 2, 0.125
    logger = RecordingLogger()
    callback = ElasticCallback(commit_every_n_steps=1)
    epoch_loop = types.SimpleNamespace(_batches_that_stepped=0)
    trainer = types.SimpleNamespace(strategy=ScriptedStrategy(worker), global_step=0, callbacks=[callback],
                                    world_size=3, is_global_zero=global_zero, loggers=[logger],
                                    fit_loop=types.SimpleNamespace(epoch_loop=epoch_loop))
    for attempt in range(2):
        callback.on_train_start(trainer, None)
        for batch_idx in range(3):
            epoch_loop._batches_that_stepped = trainer.global_step  # Lightning counts it after the batch end
            trainer.global_step += 1
            callback.on_train_batch_end(trainer, None, None, None, batch_idx)
    expected = {"elastic/world_size": 3.0, "elastic/resets": 2.0, "elastic/last_recovery_s": 0.125}
    # At the step Lightning logs the batch's own rows at (one less than the global step after it).
    assert logger.logged == ([(expected, 0), (expected, 3)] if global_zero else [])


_FIT_WITH_VALIDATION = r"""
import sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import lightning_elastic as le
from lightning_elastic.membership import worker as worker_module

checks = []  # (validating, global_step, step of the newest commit) at each host check
original = worker_module.ElasticWorker.check_host_updates

def counting(self):
    committed = trainer.strategy.snapshot.committed()
    checks.append((trainer.validating, trainer.global_step, committed.meta.global_step if committed else None))
    return original(self)

worker_module.ElasticWorker.check_host_updates = counting

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
val = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
trainer = pl.Trainer(strategy="elastic_hvd", accelerator="cpu", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0,
                     callbacks=[le.ElasticCallback(commit_every_n_steps=100, commit_budget=float(sys.argv[1]))])
trainer.fit(Module(), data, val)
print(checks)
"""


@pytest.mark.parametrize(("budget", "epochs_checked"), [(1.0, 2), (1e-9, 1)], ids=["cheap", "too-costly"])
def test_long_phases_are_checked_after_a_commit_of_the_batch_before_them(tmp_path, budget, epochs_checked):
    # A real Trainer (a world of one): 4 training batches and 2 validation batches per
    # epoch, commits on a grid of 100 steps (none falls before a validation pass). The
    # commit before a phase is taken before the first, then only when it costs at most
    # commit_budget of the last phase (never, at 1e-9).
    import ast
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FIT_WITH_VALIDATION, str(budget)], capture_output=True, text=True,
                          timeout=80, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    in_validation = [c for c in checks if c[0]]
    # Per epoch checked: each validation batch end and the validation's end (3), then the
    # epoch's end (1); every training batch end too (4 per epoch).
    assert len(in_validation) == 3 * epochs_checked, checks
    assert len(checks) == 2 * 4 + 4 * epochs_checked, checks
    # Every check in a phase comes with a commit of the batch before it (steps 4 and 8):
    # a change found there resumes from the live state.
    assert {(step, committed) for _, step, committed in in_validation} == {(4, 4), (8, 8)} - (
        set() if epochs_checked == 2 else {(8, 8)})
