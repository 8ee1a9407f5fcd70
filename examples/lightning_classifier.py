"""A PyTorch Lightning classifier made elastic by one line: ``strategy="elastic_hvd"``.

Run it alone, elastically, or with plain DDP for comparison:

    python examples/lightning_classifier.py
    lightning-elastic launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 python examples/lightning_classifier.py
    python examples/lightning_classifier.py --strategy ddp --devices 2

A snapshot an elastic run wrote (``--snapshot-dir``) is a Lightning checkpoint: plain DDP goes
on from it with ``--strategy ddp --devices 2 --ckpt-path DIR/snapshot-N-step-STEP.pt``.

The data set is generated (three interleaved spirals, 2-D points, 3 classes); the model is
an MLP trained with AdamW and a StepLR schedule, its LR scaled with the world size. The script
needs no import for the strategy name under the launcher; it imports lightning_elastic
only for its callbacks (commit interval, LR scaling).

With ``--events DIR`` every process appends JSON lines describing what it did (each
training step's sample indices, resets, parameter checksums) for the integration tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="elastic_hvd", help="elastic_hvd (default) or ddp")
    parser.add_argument("--devices", default="auto", help="processes per machine for --strategy ddp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.02, help="LR for the world size at the start")
    parser.add_argument("--commit-every", type=int, default=2, help="commit every N batches")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs_example"))
    parser.add_argument("--events", type=Path, help="directory for per-process JSON-lines event logs")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="raise ValueError in training_step at this step (first round only)")
    parser.add_argument("--fail-rank", type=int, default=-1, help="rank that raises (-1: every rank)")
    parser.add_argument("--progress-bar", action="store_true")
    parser.add_argument("--ckpt-path", help="resume the fit from this Lightning checkpoint (an elastic snapshot is one)")
    # Fault injection for the chaos tests (docs/reliability.md).
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--start-delay", type=float, default=0.0,
                        help="seconds a worker spends starting before fit joins the job (as data and GPU set-up "
                             "take on a real fleet)")
    faults.add_argument("--start-delay-on-host", default="all", help="host whose workers start so slowly; 'all': every")
    faults.add_argument("--val-delay", type=float, default=0.0,
                        help="seconds of extra work per validation step in the first round (a long validation pass)")
    faults.add_argument("--reset-delay", type=float, default=0.0,
                        help="seconds on_elastic_reset takes (a window to fault the recovery in)")
    faults.add_argument("--dist-error-at-step", type=int, default=-1,
                        help="raise torch.distributed.DistError in training_step at this step, once per process")
    faults.add_argument("--dist-error-rank", type=int, default=-1, help="rank that raises it (-1: every rank)")
    faults.add_argument("--exit-code", type=int, default=0, help="exit with this status after fit returned")
    faults.add_argument("--exit-rank", type=int, default=-1, help="rank that exits so (-1: every rank)")
    parser.add_argument("--import-lightning-elastic", action="store_true",
                        help="import lightning_elastic even with --strategy ddp (it must change nothing)")
    return parser.parse_args(argv)


class Spirals(Dataset):
    """Three interleaved 2-D spirals; item i is (point, class, i) so steps can log indices."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        labels = torch.arange(samples) % 3
        t = torch.rand(samples, generator=g) * 3 * math.pi + 0.5
        angle = t + labels * (2 * math.pi / 3)
        points = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
        self.x = points + 0.02 * torch.randn(samples, 2, generator=g)
        self.y = labels

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class SpiralData(pl.LightningDataModule):
    def __init__(self, samples: int = 480, batch_size: int = 8) -> None:
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def setup(self, stage: str) -> None:
        self.train_set = Spirals(self.samples, seed=0)
        self.val_set = Spirals(self.samples // 4, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Events:
    def __init__(self, directory: Path | None) -> None:
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            worker = os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", "standalone").replace("/", "_")
            self._file = open(directory / f"{worker}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: str, trainer: pl.Trainer | None = None, **fields: Any) -> None:
        if self._file is None:
            return
        record: dict[str, Any] = {"kind": kind, "pid": os.getpid(), "time": time.time(),
                                  "worker": os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", "")}
        if trainer is not None:
            record.update(rank=trainer.global_rank, size=trainer.world_size, round=_round(), step=trainer.global_step)
        record.update(fields)
        self._file.write(json.dumps(record) + "\n")


def _round() -> int:
    """The elastic round this process is in (0 outside the launcher)."""
    import sys

    le = sys.modules.get("lightning_elastic")
    try:
        return le.current_worker().assignment.round if le else 0
    except RuntimeError:
        return 0


class SpiralClassifier(pl.LightningModule):
    def __init__(self, lr: float, events: Events, fail_at_step: int = -1, fail_rank: int = -1,
                 step_delay: float = 0.0, faults: argparse.Namespace | None = None) -> None:
        super().__init__()
        self.save_hyperparameters("lr")
        self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        self.events, self.fail_at_step, self.fail_rank, self.step_delay = events, fail_at_step, fail_rank, step_delay
        self.faults = faults
        self._dist_error_raised = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, indices = batch
        if self.global_step == self.fail_at_step and self.fail_rank in (-1, self.global_rank) and _round() <= 1:
            raise ValueError(f"bug in the model at step {self.global_step} (rank {self.global_rank})")
        f = self.faults
        if (f is not None and self.global_step == f.dist_error_at_step and f.dist_error_rank in (-1, self.global_rank)
                and not self._dist_error_raised):
            self._dist_error_raised = True
            self.events.emit("dist_error", self.trainer, step=self.global_step)
            raise torch.distributed.DistError(f"injected collective error at step {self.global_step}")
        if self.step_delay:
            time.sleep(self.step_delay)  # stands in for a heavier model
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        # Logged before the optimizer step: a step lost to a failure is logged again, in a
        # later round, when it is redone; the newest round's record of a step is the one kept.
        real = _real_samples(self.trainer, batch_idx, len(indices))
        self.events.emit(
            "step", self.trainer, step=self.global_step + 1, epoch=self.current_epoch, batch_idx=batch_idx,
            indices=[int(i) for i in indices[:real]], lr=self.trainer.optimizers[0].param_groups[0]["lr"],
            progress_bar_world_size=self.trainer.progress_bar_metrics.get("world_size"),
        )
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        if self.faults is not None and self.faults.val_delay and not self.trainer.sanity_checking and _round() <= 1:
            self.events.emit("val_step", self.trainer, epoch=self.current_epoch, batch_idx=batch_idx)
            time.sleep(self.faults.val_delay)
        accuracy = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_accuracy", accuracy, prog_bar=True, sync_dist=True)

    def on_train_start(self) -> None:
        self.events.emit("synced", self.trainer, checksum=checksum(self), lr=self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_elastic_reset(self, old_world_size: int, new_world_size: int) -> None:
        self.events.emit("reset", self.trainer, old=old_world_size, new=new_world_size,
                         lr=self.trainer.optimizers[0].param_groups[0]["lr"])
        if self.faults is not None and self.faults.reset_delay:
            time.sleep(self.faults.reset_delay)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def _real_samples(trainer: pl.Trainer, batch_idx: int, batch_len: int) -> int:
    """Samples of this batch that are not the sampler's end-of-epoch padding."""
    real = getattr(trainer.strategy, "real_samples_in_batch", None)
    return real(batch_idx, batch_len) if real else batch_len


@torch.no_grad()
def checksum(module: nn.Module) -> float:
    return float(sum((p.double() * (i + 1)).sum() for i, p in enumerate(module.parameters())))


def build_callbacks(strategy: str) -> list[pl.Callback]:
    if strategy != "elastic_hvd":
        return []
    import lightning_elastic as le  # only for the LR-scaling callback; the strategy needs no import

    return [le.ScaleLearningRate()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.import_lightning_elastic:
        import lightning_elastic  # noqa: F401
    if args.start_delay and args.start_delay_on_host in ("all", os.environ.get("LIGHTNING_ELASTIC_HOSTNAME")):
        time.sleep(args.start_delay)  # before fit joins: the driver sees a worker still starting
    pl.seed_everything(0, workers=True)
    events = Events(args.events)
    model = SpiralClassifier(args.lr, events, args.fail_at_step, args.fail_rank, args.step_delay, args)
    callbacks = build_callbacks(args.strategy)
    if args.strategy == "elastic_hvd":
        import lightning_elastic as le

        callbacks.insert(0, le.ElasticCallback(commit_every_n_steps=args.commit_every))
    trainer = pl.Trainer(
        strategy=args.strategy,
        devices=args.devices if args.strategy != "elastic_hvd" else "auto",
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=CSVLogger(args.log_dir, name="spirals"),
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    events.emit("start", trainer)
    trainer.fit(model, datamodule=SpiralData(args.samples, args.batch_size), ckpt_path=args.ckpt_path)
    optimizer = trainer.optimizers[0]
    state = next(iter(optimizer.state.values()), {})
    events.emit(
        "done", trainer, checksum=checksum(model), lr=optimizer.param_groups[0]["lr"],
        optimizer_steps=int(state["step"]) if "step" in state else None,
        scheduler_epoch=trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        log_dir=str(trainer.logger.log_dir) if trainer.logger else None,
        val_accuracy=float(trainer.callback_metrics.get("val_accuracy", float("nan"))),
    )
    if args.exit_code and args.exit_rank in (-1, trainer.global_rank):
        events.emit("exiting", trainer, code=args.exit_code)
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
