"""One Lightning script with the features of tests/integration/test_lightning_matrix.py.

Run under ``lightning-elastic launch`` (``--strategy elastic_hvd``) or under Lightning's own
``ddp`` (``--strategy ddp --devices 2``) with the same options; each process appends JSON
lines to ``--events DIR`` (a record per training step, validation pass, epoch end and
evaluation, and a ``done`` record with the final state), which the test compares.

    --config fit         accumulation + clipping, bf16-mixed, torchmetrics, val_check_interval
                         + EarlyStopping + sync_dist, StepLR + ReduceLROnPlateau,
                         ModelCheckpoint(every_n_train_steps, save_last) with fit(ckpt_path="last"),
                         CSVLogger
    --config manual      manual optimization with two optimizers, max_steps + limit_train_batches,
                         validate / test / predict after fit
    --config iterable    an IterableDataset with state_dict() / load_state_dict()
    cli fit ...          Lightning's LightningTransformer demo (on generated tokens) behind
                         LightningCLI: ``python lightning_features.py cli fit --trainer.strategy ...``

``--kill-at-step N --kill-rank R``: the process of rank R SIGKILLs itself at the end of the
batch that made global step N, in the first round of an elastic launch (never under ddp).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.transformer import LightningTransformer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

SAMPLES, VAL_SAMPLES, BATCH = 480, 120, 8


class Events:
    """Per-process JSON lines; every record says the round (0 outside an elastic launch)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", "ddp").replace("/", "_")
        self._file = open(directory / f"{worker}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: str, trainer: pl.Trainer | None = None, **fields: Any) -> None:
        record: dict[str, Any] = {"kind": kind, "pid": os.getpid(), "round": current_round()}
        if trainer is not None:
            record.update(rank=trainer.global_rank, size=trainer.world_size, step=trainer.global_step,
                          epoch=trainer.current_epoch)
        record.update(fields)
        self._file.write(json.dumps(record) + "\n")


def current_round() -> int:
    le = sys.modules.get("lightning_elastic")
    try:
        return le.current_worker().assignment.round if le else 0
    except RuntimeError:
        return 0


class Points(Dataset):
    """Three interleaved 2-D spirals; item i is (point, class, i)."""

    def __init__(self, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        labels = torch.arange(samples) % 3
        t = torch.rand(samples, generator=g) * 3 * math.pi + 0.5
        angle = t + labels * (2 * math.pi / 3)
        self.x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
        self.y = labels

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class PointStream(IterableDataset):
    """``Points`` as a stream, sharded as users shard one: rank r reads samples r, r + size, ..."""

    def __init__(self, samples: int) -> None:
        self.points = Points(samples, seed=0)

    def __iter__(self) -> Any:
        rank, size = _rank_and_size()
        for i in range(rank, len(self.points), size):
            yield self.points[i]


def _rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Classifier(pl.LightningModule):
    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        super().__init__()
        self.args, self.events = args, events
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3))
        self.extra = nn.Linear(3, 3)  # the second optimizer's (manual optimization)
        if args.config == "manual":
            self.automatic_optimization = False
        if args.config == "fit":
            import torchmetrics

            self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
            self.val_seen = torchmetrics.SumMetric()
        self._max_norm = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, indices = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.events.emit("step", self.trainer, batch_idx=batch_idx, indices=[int(i) for i in indices],
                         dtype=str(logits.dtype))
        if self.args.step_delay:
            time.sleep(self.args.step_delay)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        first, second = self.optimizers()
        for optimizer in (first, second):
            optimizer.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self(x), y))
            optimizer.step()
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        a = self.args
        if (a.kill_at_step >= 0 and self.trainer.global_step == a.kill_at_step and self.global_rank == a.kill_rank
                and current_round() == 1):
            self.events.emit("killed", self.trainer)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        if norms:
            self._max_norm = max(self._max_norm, float(torch.linalg.vector_norm(torch.stack(norms))))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        logits = self(x).float()
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        # The same on every rank: EarlyStopping's threshold on it stops at a known step.
        self.log("val_progress", float(self.global_step), sync_dist=True)
        if self.args.config == "fit":
            self.val_accuracy(logits, y)
            self.val_seen(torch.ones(len(y)))
            self.log("val_accuracy", self.val_accuracy)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        fields: dict[str, Any] = {"fn": str(self.trainer.state.fn)}
        if self.args.config == "fit":
            fields["seen"] = float(self.val_seen.compute())
            self.val_seen.reset()
        self.events.emit("validated", self.trainer, **fields)

    def on_train_epoch_end(self) -> None:
        self.events.emit("epoch_end", self.trainer)

    def on_train_start(self) -> None:
        self.events.emit("train_start", self.trainer)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)
        self.events.emit("tested", self.trainer, samples=len(y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, indices = batch
        self.events.emit("predicted", self.trainer, indices=[int(i) for i in indices])
        return self(x).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        if self.args.config == "manual":
            return (torch.optim.SGD(self.net.parameters(), lr=0.05), torch.optim.SGD(self.extra.parameters(), lr=0.05))
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedulers = [{"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)}]
        if self.args.config == "fit":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1000)
            schedulers.append({"scheduler": plateau, "monitor": "val_loss"})
        return [optimizer], schedulers


class Data(pl.LightningDataModule):
    def __init__(self, config: str) -> None:
        super().__init__()
        self.config = config

    def train_dataloader(self) -> DataLoader:
        if self.config == "iterable":
            return DataLoader(PointStream(SAMPLES), batch_size=BATCH)
        return DataLoader(Points(SAMPLES, seed=0), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Points(VAL_SAMPLES, seed=1), batch_size=BATCH)

    test_dataloader = predict_dataloader = val_dataloader


class Tokens(Dataset):
    """Generated token sequences for the transformer: item i is (inputs, next tokens, i)."""

    def __init__(self, samples: int = 192, length: int = 16, vocab: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (samples, length + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.data[i, :-1], self.data[i, 1:], i


class TokenData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=self.batch_size, shuffle=True)


class Transformer(LightningTransformer):
    """Lightning's LightningTransformer demo, unchanged but for its data and the events."""

    def __init__(self, events_dir: str, vocab_size: int = 32, kill_at_step: int = -1, kill_rank: int = 0) -> None:
        super().__init__(vocab_size=vocab_size)
        self.events = Events(Path(events_dir))
        self.kill_at_step, self.kill_rank = kill_at_step, kill_rank

    def prepare_data(self) -> None:
        pass  # the demo downloads WikiText-2; the tokens here are generated

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target, indices = batch
        self.events.emit("step", self.trainer, batch_idx=batch_idx, indices=[int(i) for i in indices])
        return super().training_step((inputs, target), batch_idx)

    def on_train_start(self) -> None:
        self.events.emit("train_start", self.trainer)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.kill_at_step and self.global_rank == self.kill_rank and current_round() == 1:
            self.events.emit("killed", self.trainer)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_end(self) -> None:
        self.events.emit("epoch_end", self.trainer)

    def on_fit_end(self) -> None:
        self.events.emit("done", self.trainer, after={}, scheduler_epochs=[], optimizer_steps=[])


def cli_main(argv: list[str]) -> None:
    LightningCLI(Transformer, TokenData, args=argv, seed_everything_default=0, save_config_kwargs={"overwrite": True})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("fit", "manual", "iterable"), required=True)
    parser.add_argument("--strategy", default="elastic_hvd")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True, help="the Trainer's default_root_dir")
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--import-lightning-elastic", action="store_true",
                        help="import lightning_elastic under --strategy ddp too (it must change nothing)")
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> pl.Trainer:
    callbacks: list[pl.Callback] = []
    if args.strategy == "elastic_hvd":
        import lightning_elastic as le

        callbacks.append(le.ElasticCallback(commit_every_n_steps=5))
    options: dict[str, Any] = {"max_epochs": 3, "log_every_n_steps": 5}
    checkpointing = False
    if args.config == "fit":
        checkpointing = True
        callbacks += [
            ModelCheckpoint(every_n_train_steps=10, save_last=True),
            EarlyStopping(monitor="val_progress", mode="max", stopping_threshold=44, patience=1000),
        ]
        options.update(max_epochs=5, accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed",
                       val_check_interval=0.5)
    elif args.config == "manual":
        options.update(max_epochs=-1, max_steps=70, limit_train_batches=20)
    elif args.config == "iterable":
        options.update(max_epochs=1)
    return pl.Trainer(
        strategy=args.strategy, devices=args.devices if args.strategy != "elastic_hvd" else "auto",
        accelerator="cpu", callbacks=callbacks, default_root_dir=args.root,
        logger=CSVLogger(args.root, name="csv", flush_logs_every_n_steps=10),
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **options,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.import_lightning_elastic:
        import lightning_elastic  # noqa: F401
    pl.seed_everything(0, workers=True)
    events = Events(args.events)
    model, data = Classifier(args, events), Data(args.config)
    trainer = build_trainer(args)
    events.emit("start", trainer, worker=os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", ""))
    trainer.fit(model, datamodule=data, ckpt_path="last" if args.config == "fit" else None)
    after: dict[str, Any] = {}
    if args.config == "manual":
        after["validate"] = trainer.validate(model, datamodule=data, verbose=False)
        after["test"] = trainer.test(model, datamodule=data, verbose=False)
        after["predicted"] = sum(len(p) for p in trainer.predict(model, datamodule=data))
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
    early = next((cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)), None)
    checkpoint = trainer.checkpoint_callback if args.config == "fit" else None
    events.emit(
        "done", trainer, after=after, max_grad_norm=model._max_norm,
        scheduler_epochs=[getattr(s, "last_epoch", None) for s in schedulers],
        optimizer_steps=[_optimizer_steps(o) for o in trainer.optimizers],
        stopped_epoch=early.stopped_epoch if early else None,
        last_model_path=Path(checkpoint.last_model_path).name if checkpoint else None,
        log_dir=str(trainer.logger.log_dir) if trainer.logger else None,
        lightning_elastic_imported="lightning_elastic" in sys.modules,
    )


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> int | None:
    state = next(iter(optimizer.state.values()), {})
    return int(state["step"]) if "step" in state else None


if __name__ == "__main__":
    if sys.argv[1:2] == ["cli"]:
        cli_main(sys.argv[2:])
    else:
        main()
