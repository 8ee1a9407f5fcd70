"""lightning_elastic/lightning/capture.py: a per-step commit holds what a full dump holds.

Each test fits a real Trainer in a world of one and, at every batch end, compares what
``CheckpointCapture`` gives (joined back into a tree) with Lightning's own checkpoint dict.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_elastic.lightning import compat
from lightning_elastic.lightning.capture import CheckpointCapture
from lightning_elastic.commit.buffers import join

pytestmark = pytest.mark.timeout(90)


def assert_same_tree(ours: Any, theirs: Any, path: str = "") -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs), path
        assert ours.data_ptr() != theirs.data_ptr(), f"{path}: the commit holds the live tensor"
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{path}: {list(ours)} != {list(theirs)}"
        for key in theirs:
            assert_same_tree(ours[key], theirs[key], f"{path}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_tree(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def committed_tree(capture: CheckpointCapture, trainer: Any) -> Any:
    skeleton, sources = capture.capture(trainer)
    return join(skeleton, [s.clone() for s in sources], clone=False)  # what a commit would hold


def fit_and_compare(module: Any, callbacks: list[Any] = (), mutate: Any = None, epochs: int = 2,
                    datamodule: type | None = None) -> CheckpointCapture:
    """Fit ``module``; at every batch end compare a capture with a full dump."""
    import lightning.pytorch as pl  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    capture = CheckpointCapture()
    compared: list[int] = []

    class Compare(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            capture.new_attempt()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if mutate is not None:
                mutate(trainer)
            ours = committed_tree(capture, trainer)
            theirs = compat.dump_checkpoint(trainer)
            assert_same_tree(ours, theirs)
            compared.append(trainer.global_step)

    data = DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 1)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, val_check_interval=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, Compare()],
    )
    if datamodule is None:
        trainer.fit(module, data, data)
    else:

        class Data(datamodule):
            def train_dataloader(self) -> DataLoader:
                return data

            def val_dataloader(self) -> DataLoader:
                return data

        trainer.fit(module, datamodule=Data())
    assert compared == list(range(1, 6 * epochs + 1))
    return capture


def rich_module(base: type | None = None) -> Any:
    """BatchNorm buffers, Adam (tensor step counters), a step-wise scheduler, hyper-parameters."""
    import lightning.pytorch as pl  # noqa: PLC0415

    class Rich(base or pl.LightningModule):
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Rich()


class Counting:
    """A callback whose state changes every batch (built lazily: Lightning imported in the test)."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl  # noqa: PLC0415

        class Counter(pl.Callback):
            def __init__(self) -> None:
                self.batches = 0

            def on_train_batch_end(self, *args: Any) -> None:
                self.batches += 1

            def state_dict(self) -> dict[str, Any]:
                return {"batches": self.batches}

        return Counter()


def test_every_per_step_commit_equals_a_full_dump():
    capture = fit_and_compare(rich_module(), [Counting.make()])
    assert capture._recipe is not None, "the per-step path was never taken"


def test_a_replaced_parameter_makes_the_commit_dump_in_full_again():
    replaced: list[int] = []

    def replace_at_step_4(trainer: Any) -> None:
        if trainer.global_step == 4:
            layer = trainer.lightning_module.net[0]
            layer.weight = torch.nn.Parameter(layer.weight.detach() + 1.0)  # a new tensor object
            replaced.append(4)

    fit_and_compare(rich_module(), mutate=replace_at_step_4)
    assert replaced == [4]


def test_a_module_saving_more_in_on_save_checkpoint_is_dumped_in_full_at_every_commit():
    import lightning.pytorch as pl  # noqa: PLC0415

    class Saving(pl.LightningModule):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["seen_step"] = self.trainer.global_step  # changes at every step

    capture = fit_and_compare(rich_module(Saving))
    assert capture._recipe is None and capture._full_dumps_only


def test_a_callback_with_on_save_checkpoint_makes_every_commit_a_full_dump():
    import lightning.pytorch as pl  # noqa: PLC0415

    class Extra(pl.Callback):
        def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
            checkpoint["extra_step"] = trainer.global_step

    capture = fit_and_compare(rich_module(), [Extra()])
    assert capture._recipe is None and capture._full_dumps_only


def test_a_plain_datamodule_keeps_the_per_step_path():
    import lightning.pytorch as pl  # noqa: PLC0415

    capture = fit_and_compare(rich_module(), datamodule=pl.LightningDataModule)
    assert capture._recipe is not None


def test_a_stateful_datamodule_makes_every_commit_a_full_dump():
    import lightning.pytorch as pl  # noqa: PLC0415

    class Stateful(pl.LightningDataModule):
        def state_dict(self) -> dict[str, Any]:
            return {"step": self.trainer.global_step}

    capture = fit_and_compare(rich_module(), datamodule=Stateful)
    assert capture._recipe is None and capture._full_dumps_only
