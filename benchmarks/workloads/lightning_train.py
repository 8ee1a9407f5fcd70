"""The same models trained by Lightning: ``ddp`` under torchrun, or ``elastic_hvd`` under the launcher.

    python -m torch.distributed.run --standalone --nproc-per-node 3 \
        benchmarks/workloads/lightning_train.py --strategy ddp --log-dir D
    lightning-elastic launch -np 3 -H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1 \
        python benchmarks/workloads/lightning_train.py --strategy elastic_hvd --log-dir D [--commit-every 10]
    python benchmarks/workloads/lightning_train.py --strategy elastic_hvd --commit-every 1   # a world of one

With ``elastic_hvd`` the trainer gets one ``le.ElasticCallback``: the default one (paced commits,
host check every step) unless ``--commit-every`` / ``--check-every`` are given. Every
completed training step (``on_train_batch_end``, after the elastic callback's commit or
check) appends a record to ``--log-dir`` (steplog). No logger, checkpointing, progress bar
or validation; the training DataLoader has no shuffle, the strategy installs its sampler.

With ``ddp``, ``--checkpoint-dir D`` is what a torchrun user does to survive a restart: a
``ModelCheckpoint(dirpath=D, every_n_train_steps=--checkpoint-every, save_last=True,
save_top_k=0)`` (only ``D/last.ckpt``), and ``fit(ckpt_path=D/last.ckpt)`` when it exists.
"""

from __future__ import annotations

import startup_priority  # noqa: I001 - before the heavy imports

startup_priority.lower()

import argparse
import faulthandler
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import _shared as sh
from steplog import StepLog


def elastic_callback(commit_every: int | None, check_every: int | None) -> pl.Callback:
    """``le.ElasticCallback`` with these intervals (None: the callback's default)."""
    import lightning_elastic as le

    kwargs: dict[str, int] = {}
    if commit_every is not None:
        kwargs["commit_every_n_steps"] = commit_every
    if check_every is not None:
        kwargs["check_every_n_steps"] = check_every
    return le.ElasticCallback(**kwargs)


class StepRecorder(pl.Callback):
    def __init__(self, directory: Path) -> None:
        self.steps = StepLog(directory)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps.step(trainer.global_step, trainer.global_rank, trainer.world_size)


class Module(pl.LightningModule):
    def __init__(self, spec: sh.ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.net = sh.build_model(spec)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        import torch.nn.functional as F

        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return sh.make_optimizer(self.net, self.spec)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a hung worker's stacks: kill -USR1 <pid>
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="elastic_hvd", choices=["ddp", "elastic_hvd"])
    parser.add_argument("--model", default="small", choices=sorted(sh.SPECS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--commit-every", type=int, help="elastic_hvd: commit every N steps (default: the callback's)")
    parser.add_argument("--check-every", type=int, help="elastic_hvd: check hosts every N steps (default: the callback's)")
    parser.add_argument("--checkpoint-dir", type=Path, help="ddp: checkpoint to, and resume from, D/last.ckpt")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="with --checkpoint-dir: steps between saves")
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()
    spec = sh.spec(args.model)
    callbacks: list[pl.Callback] = []
    if args.strategy == "elastic_hvd":
        callbacks.append(elastic_callback(args.commit_every, args.check_every))
    callbacks.append(StepRecorder(args.log_dir))
    resume = None
    if args.checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every,
                                         save_last=True, save_top_k=0))
        last = args.checkpoint_dir / "last.ckpt"
        resume = str(last) if last.exists() else None
    # ddp under torchrun: one device per process torchrun started on this machine.
    devices: Any = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if args.strategy == "ddp" else "auto"
    trainer = pl.Trainer(
        strategy=args.strategy, accelerator="cpu", devices=devices, max_steps=args.steps, callbacks=callbacks,
        logger=False, enable_checkpointing=args.checkpoint_dir is not None, enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    startup_priority.restore()  # joined: as any worker from here on
    loader = DataLoader(TensorDataset(*sh.random_data(spec)), batch_size=spec.batch, shuffle=False)
    trainer.fit(Module(spec), train_dataloaders=loader, ckpt_path=resume)


if __name__ == "__main__":
    main()
