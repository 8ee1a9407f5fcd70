"""An elastic_hvd Trainer's durable snapshot: a real Lightning checkpoint, and a resume from it.

In one process, a world of one (no launcher): the strategy's worker writes snapshots as
rank 0 of a launched job does; a plain Trainer and ``load_from_checkpoint`` read them; a new
elastic fit resumes from one mid-epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_elastic as le
from lightning_elastic.durable import files
from lightning_elastic.durable.files import SnapshotSettings
from lightning_elastic.durable.store import ResumePlan
from lightning_elastic.membership.worker import ElasticWorker

pytestmark = pytest.mark.timeout(120)

pl = pytest.importorskip("lightning.pytorch")


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def worker() -> Iterator[ElasticWorker]:
    w = ElasticWorker(None, use_cuda=False)
    w.start()
    yield w
    w.shutdown()


def data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.randn(32, 2, generator=torch.Generator().manual_seed(3))), batch_size=2)


class StopAt(pl.Callback):
    """Ends the fit after ``step`` steps, once a snapshot of a later commit exists."""

    def __init__(self, step: int, worker: ElasticWorker) -> None:
        self.step, self.worker = step, worker

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            writer = self.worker.snapshot_writer
            assert writer is not None
            writer.wait(30)  # commits during a write were skipped: snapshot the newest one now
            trainer.strategy.take_commit(trainer)
            writer.wait(30)
            trainer.should_stop = True


class Record(pl.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((trainer.current_epoch, batch_idx))


def trainer(strategy: Any, *callbacks: pl.Callback, max_epochs: int = 2) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks))


def write_snapshot(tmp_path: Path, worker: ElasticWorker) -> Path:
    """A fit of epoch 0's first 5 of 16 batches, committing every step, snapshotting every commit."""
    worker.configure_snapshots(SnapshotSettings(tmp_path, every=1e-6, keep=5))
    strategy = le.ElasticStrategy(worker=worker)
    fit = trainer(strategy, le.ElasticCallback(commit_every_n_steps=1), StopAt(5, worker))
    fit.fit(Tiny(), data())
    found = files.newest_valid(tmp_path, pytest.fail)
    assert found is not None and found.manifest.kind == "lightning"
    return found.path


def test_the_snapshot_is_a_lightning_checkpoint_a_plain_trainer_loads(tmp_path, worker):
    path = write_snapshot(tmp_path, worker)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["global_step"] == 5 and "state_dict" in checkpoint and "loops" in checkpoint
    model = Tiny.load_from_checkpoint(path)
    assert torch.equal(model.net.weight, checkpoint["state_dict"]["net.weight"])
    record = Record()
    trainer("auto", record, max_epochs=1).fit(Tiny(), data(), ckpt_path=str(path))  # plain, one device
    assert record.batches and record.batches[0][0] == 0 and record.batches[0][1] >= 4  # mid-epoch


def test_a_new_elastic_fit_resumes_from_the_snapshot_mid_epoch(tmp_path, worker):
    path = write_snapshot(tmp_path, worker)
    manifest = files.newest_valid(tmp_path, pytest.fail).manifest
    saved = torch.load(path, weights_only=False)
    worker.configure_snapshots(SnapshotSettings(tmp_path / "next", every=3600), resume_from=None)
    worker.resume_from = ResumePlan(path, tmp_path)
    record = Record()
    module = Tiny()
    trainer(le.ElasticStrategy(worker=worker), record, max_epochs=1).fit(module, data())
    # Epoch 0 went on after the snapshot's step: its finished batches were not run again.
    assert record.batches[0] == (0, manifest.step)
    assert len(record.batches) == 16 - manifest.step
    assert manifest.sampler is not None and manifest.sampler["consumed"] == 2 * manifest.step
    assert saved["lightning_elastic"]["world_size"] == 1


def test_a_state_snapshot_is_refused_by_the_trainer_in_one_line(tmp_path, worker):
    from lightning_elastic.commit.buffers import HostSnapshot
    from lightning_elastic.durable.store import SnapshotInfo, SnapshotWriter

    snapshot = HostSnapshot()
    snapshot.capture({"values": {"step": 1}, "stateful": {}})
    writer = SnapshotWriter(SnapshotSettings(tmp_path, every=1e-6))
    assert writer.offer(snapshot, SnapshotInfo(1, 1, 0, 1, None), force=True) and writer.wait(10)
    worker.configure_snapshots(None)
    worker.resume_from = ResumePlan(None, tmp_path)
    with pytest.raises(ValueError, match="not a snapshot of an elastic_hvd Trainer"):
        trainer(le.ElasticStrategy(worker=worker), max_epochs=1).fit(Tiny(), data())
