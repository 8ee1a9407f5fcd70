"""What a commit carries besides Lightning's checkpoint, and what a resumed fit does with it
(issue 37): callback state that decides collectives, monitored metrics, the CSV log, and
the warning for a training DataLoader the elastic sampler cannot stand in for."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from tests.troubleshooting_rows import assert_documented

pytest.importorskip("lightning")
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, Sampler  # noqa: E402

from lightning_elastic.lightning import compat  # noqa: E402
from lightning_elastic.lightning.sampling import _unsampled_warning  # noqa: E402


def test_model_checkpoints_per_process_state_travels_to_a_joiner():
    member = ModelCheckpoint(every_n_train_steps=10, save_last=True)
    member._last_global_step_saved, member._last_checkpoint_saved = 230, "/ckpt/epoch=7-step=230.ckpt"
    state = compat.callbacks_deciding_state(SimpleNamespace(callbacks=[member, EarlyStopping(monitor="x")]))
    assert state == {member.state_key: {"_last_global_step_saved": 230,
                                        "_last_checkpoint_saved": "/ckpt/epoch=7-step=230.ckpt",
                                        "_defer_save_until_validation": False}}
    joiner = ModelCheckpoint(every_n_train_steps=10, save_last=True)
    assert (joiner._last_global_step_saved, joiner._last_checkpoint_saved) == (0, "")  # would save at the end alone
    compat.restore_callbacks_deciding_state(SimpleNamespace(callbacks=[joiner]), state)
    assert (joiner._last_global_step_saved, joiner._last_checkpoint_saved) == (230, "/ckpt/epoch=7-step=230.ckpt")


def test_lightning_clis_config_callback_state_travels_to_a_joiner():
    from lightning.pytorch.cli import SaveConfigCallback  # noqa: PLC0415

    member, joiner = SaveConfigCallback(None, None), SaveConfigCallback(None, None)
    member.already_saved = True  # else setup() broadcasts the log directory: a collective the members skip
    state = compat.callbacks_deciding_state(SimpleNamespace(callbacks=[member]))
    compat.restore_callbacks_deciding_state(SimpleNamespace(callbacks=[joiner]), state)
    assert joiner.already_saved is True


def test_computed_metrics_are_committed_as_numbers_and_restored():
    computed = {"val_loss": torch.tensor(0.25), "vector": torch.tensor([1.0, 2.0]), "epoch": 3}
    trainer = SimpleNamespace(_logger_connector=SimpleNamespace(_callback_metrics=computed))
    values = compat.computed_callback_metrics(trainer)
    assert values == {"val_loss": 0.25, "epoch": 3.0}
    fresh = SimpleNamespace(_logger_connector=SimpleNamespace(_callback_metrics={}))
    compat.restore_callback_metrics(fresh, values)
    assert float(fresh._logger_connector._callback_metrics["val_loss"]) == 0.25


def _rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_new_rank_0_goes_on_with_the_jobs_metrics_csv_without_the_redone_steps(tmp_path):
    old = CSVLogger(tmp_path, name="run", version=0)
    for step in range(10):
        old.log_metrics({"loss": float(step)}, step=step)
    old.save()
    metrics = tmp_path / "run" / "version_0" / "metrics.csv"
    assert [r["step"] for r in _rows(metrics)] == [str(s) for s in range(10)]

    new = CSVLogger(tmp_path, name="run", version=0)  # the new rank 0's, its version pinned
    trainer = SimpleNamespace(loggers=[new])
    compat.continue_csv_logs(trainer)
    new.log_hyperparams({"lr": 0.1})  # creating the writer no longer deletes the file
    compat.drop_csv_rows_after(trainer, 6)  # resumed from the commit of step 6: 7-9 are redone
    for step in (7, 8):
        new.log_metrics({"loss": 0.0, "elastic/world_size": 2.0}, step=step)
    new.save()
    rows = _rows(metrics)
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4", "5", "6", "7", "8"]
    assert rows[0]["loss"] == "0.0" and rows[-1]["elastic/world_size"] == "2.0"

    # Lightning's own writer, as a new process creates it, starts the file anew: the cause.
    CSVLogger(tmp_path, name="run", version=0).experiment  # noqa: B018
    assert not metrics.exists()


def test_the_old_rank_0_writes_what_it_buffered_before_a_reset(tmp_path):
    logger = CSVLogger(tmp_path, name="run", version=0, flush_logs_every_n_steps=100)
    logger.log_metrics({"loss": 1.0}, step=3)
    compat.flush_csv_logs(SimpleNamespace(loggers=[logger]))
    assert [r["step"] for r in _rows(tmp_path / "run" / "version_0" / "metrics.csv")] == ["3"]


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


class EveryOther(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))


@pytest.mark.parametrize(
    ("loader", "expected"),
    [
        (DataLoader(Stream(), batch_size=2),
         "lightning-elastic: the training dataset Stream is an IterableDataset, whose position cannot be restored: "
         "after a reset its stream starts again from its beginning on every rank"),
        (DataLoader(list(range(8)), sampler=EveryOther(8), batch_size=2),
         "lightning-elastic: the training DataLoader of list uses the sampler EveryOther, which the elastic sampler "
         "cannot stand in for"),
    ],
)
def test_a_loader_the_elastic_sampler_cannot_stand_in_for_is_named_in_one_line(loader, expected):
    message = _unsampled_warning(loader)
    assert message.startswith(expected) and "\n" not in message
    assert_documented(message)
