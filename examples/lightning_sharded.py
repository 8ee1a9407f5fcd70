"""A LightningModule sharded with FSDP2 in ``configure_model``, made elastic by one line:
``strategy="elastic_fsdp"`` instead of Lightning's ``ModelParallelStrategy``.

Run it alone, elastically, or with Lightning's own strategy for comparison:

    python examples/lightning_sharded.py
    lightning-elastic launch -np 4 --min-np 2 -H 127.0.0.1:2,127.0.0.2:2 python examples/lightning_sharded.py
    torchrun --nproc-per-node 2 examples/lightning_sharded.py --strategy model_parallel --devices 2

The model is a stack of linear blocks; ``configure_model`` applies ``fully_shard`` to each
block and then to the stack, on ``self.device_mesh["data_parallel"]``, as with
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``. AdamW's moments are
sharded with the parameters. A lost worker's rows come back from the copy a peer on another
host keeps; the survivors go on in the same processes, re-sharded to the new world.

With ``--events DIR`` every process appends JSON lines (each training step's sample
indices, resets, and with ``--digests`` a digest of the whole model and optimizer state
after every commit and at every fit attempt's start) for the integration tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="elastic_fsdp", help="elastic_fsdp (default) or model_parallel")
    parser.add_argument("--devices", type=int, default=1, help="processes per machine for --strategy model_parallel")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1, help="end the fit after this many steps (-1: epochs)")
    parser.add_argument("--samples", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=64, help="features of each block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--commit-every", type=int, default=4,
                        help="commit every N training steps (0: paced by the commits' measured cost)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--log-dir", type=Path, default=Path("lightning_logs_sharded"))
    parser.add_argument("--events", type=Path, help="directory for per-process JSON-lines event logs")
    parser.add_argument("--digests", action="store_true",
                        help="log a digest of the whole state after every commit and at every start (gathers it)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--sigkill-at-step", type=int, default=-1,
                        help="the ranks of --sigkill-rank send themselves SIGKILL after this step")
    faults.add_argument("--sigkill-rank", type=int, action="append", default=[], help="a rank that dies (repeatable)")
    faults.add_argument("--sigkill-in-round", type=int, default=1, help="the round in which they die")
    return parser.parse_args(argv)


class Regression(Dataset):
    """16 features, one target; item i is (i, x, y) so that steps can log their indices."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(samples, 16, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Blocks(torch.nn.Module):
    """Linear blocks with a residual; the last maps to one output."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


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


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


@torch.no_grad()
def state_digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The whole model's and optimizer's bytes, hashed (a collective: every rank gathers every tensor)."""
    h = hashlib.sha256()
    for name, param in module.named_parameters():
        h.update(name.encode())
        h.update(_full(param).detach().contiguous().view(torch.uint8).numpy().tobytes())
        for _, value in sorted(optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                h.update(_full(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_steps(optimizer: torch.optim.Optimizer) -> list[float]:
    return sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})


class ShardedRegressor(pl.LightningModule):
    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        super().__init__()
        self.save_hyperparameters({"lr": args.lr, "width": args.width, "blocks": args.blocks})
        self.model = Blocks(args.width, args.blocks)
        self.args, self.events = args, events

    def configure_model(self) -> None:
        # Your FSDP2 code as ModelParallelStrategy runs it; after a reset it runs again on the
        # new round's mesh, on fresh copies of the unsharded blocks.
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        indices, x, y = batch
        if self.args.step_delay:
            time.sleep(self.args.step_delay)  # stands in for a heavier model
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.log("train_loss", loss)
        # Logged before the optimizer step: a step lost to a failure is logged again, in a
        # later round, when it is redone; the newest round's record of a step is the one kept.
        real = _real_samples(self.trainer, batch_idx, len(indices))
        self.events.emit("step", self.trainer, step=self.global_step + 1, epoch=self.current_epoch,
                         batch_idx=batch_idx, indices=[int(i) for i in indices[:real]])
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def on_train_start(self) -> None:
        optimizer = self.trainer.optimizers[0]
        self.events.emit("synced", self.trainer, digest=self._digest(), optimizer_steps=optimizer_steps(optimizer),
                         lr=optimizer.param_groups[0]["lr"])

    def on_train_end(self) -> None:
        optimizer = self.trainer.optimizers[0]
        self.events.emit("done", self.trainer, digest=self._digest(), optimizer_steps=optimizer_steps(optimizer),
                         lr=optimizer.param_groups[0]["lr"],
                         scheduler_epoch=self.trainer.lr_scheduler_configs[0].scheduler.last_epoch)

    def on_elastic_reset(self, old_world_size: int, new_world_size: int) -> None:
        self.events.emit("reset", self.trainer, old=old_world_size, new=new_world_size,
                         lr=self.trainer.optimizers[0].param_groups[0]["lr"])

    def _digest(self) -> str:
        return state_digest(self, self.trainer.optimizers[0]) if self.args.digests else ""


class CommitProbe(pl.Callback):
    """After the elastic callback at each batch end: the digest of a commit just taken, and
    the fault injection (a rank that kills itself once its step is committed or not)."""

    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        self.args, self.events = args, events

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        args, step = self.args, trainer.global_step
        if args.digests and args.commit_every and step % args.commit_every == 0:
            self.events.emit("commit", trainer, digest=state_digest(pl_module, trainer.optimizers[0]))
        if step == args.sigkill_at_step and _round() == args.sigkill_in_round and trainer.global_rank in args.sigkill_rank:
            self.events.emit("sigkill", trainer)
            os.kill(os.getpid(), signal.SIGKILL)


def _real_samples(trainer: pl.Trainer, batch_idx: int, batch_len: int) -> int:
    """Samples of this batch that are not the sampler's end-of-epoch padding."""
    real = getattr(trainer.strategy, "real_samples_in_batch", None)
    return real(batch_idx, batch_len) if real else batch_len


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(0, workers=True)
    events = Events(args.events)
    callbacks: list[pl.Callback] = []
    strategy: Any = args.strategy
    if args.strategy == "elastic_fsdp":
        import lightning_elastic as le  # for the callbacks; the strategy name needs no import under the launcher

        callbacks = [le.ElasticCallback(commit_every_n_steps=args.commit_every or None), le.ScaleLearningRate()]
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    callbacks.append(CommitProbe(args, events))
    trainer = pl.Trainer(
        strategy=strategy,
        devices=args.devices if args.strategy != "elastic_fsdp" else "auto",
        accelerator="cpu",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=CSVLogger(args.log_dir, name="sharded"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    events.emit("start", trainer)
    loader = DataLoader(Regression(args.samples), batch_size=args.batch_size, shuffle=True)
    trainer.fit(ShardedRegressor(args, events), train_dataloaders=loader)
    if trainer.global_rank == 0:
        print(f"training finished: {trainer.global_step} steps, world size {trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
