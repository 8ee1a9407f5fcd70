"""A Lightning Fabric loop made elastic: ``Fabric(strategy="elastic_hvd")`` and ``le.FabricState``.

Run it alone (a world of one) or elastically:

    lightning-elastic launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 python examples/fabric_loop.py

The same small regression as ``examples/elastic_loop.py``. With ``--events DIR`` every
worker appends JSON lines describing what it did (rounds, the samples of each committed
epoch, parameter checksums after each sync) for the integration tests to check.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_elastic as le


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--commit-every", type=int, default=2, help="commit every N steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--eval", action="store_true", help="after every epoch, evaluate on the whole dataset")
    parser.add_argument("--csv-dir", type=Path, help="log the loss with Fabric's CSVLogger under this directory")
    parser.add_argument("--events", type=Path, help="directory for per-worker JSON-lines event logs")
    return parser.parse_args()


class Events:
    def __init__(self, directory: Path | None, fabric: L.Fabric) -> None:
        self._fabric = fabric
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            worker = os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", "standalone").replace("/", "_")
            self._file = open(directory / f"{worker}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: str, **fields: object) -> None:
        if self._file is not None:
            record = {"kind": kind, "pid": os.getpid(), "time": time.time(), "rank": self._fabric.global_rank,
                      "size": self._fabric.world_size, "worker": os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", ""),
                      **fields}
            self._file.write(json.dumps(record) + "\n")


@torch.no_grad()
def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def main() -> None:
    args = parse_args()
    # One logger version (run) for the whole job, whichever rank is rank 0 (FabricState.setup).
    loggers = [CSVLogger(args.csv_dir, flush_logs_every_n_steps=1)] if args.csv_dir else []
    fabric = L.Fabric(strategy="elastic_hvd", accelerator="cpu", devices=1, loggers=loggers)
    fabric.launch()  # joins the elastic job (the launcher started this process)
    fabric.seed_everything(0)
    events = Events(args.events, fabric)

    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    dataset = TensorDataset(torch.arange(args.samples), inputs, targets)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))
    # Every rank evaluates on the whole dataset, as with Fabric's ddp: no sampler is installed.
    eval_loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=64), use_distributed_sampler=False)

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * fabric.world_size)
    state = le.FabricState(fabric, model=model, optimizer=optimizer, loader=loader, epoch=0, step=0, seen=[])

    def on_reset() -> None:
        events.emit("reset", round=le.current_worker().assignment.round)
        for group in optimizer.param_groups:  # linear learning-rate scaling with the world size
            group["lr"] = args.lr * fabric.world_size

    state.register_reset_callbacks([on_reset])
    events.emit("start")

    @le.run
    def train(state: le.FabricState) -> None:
        ddp_model, ddp_optimizer = state.setup()  # fabric.setup on this round's process group
        events.emit("synced", epoch=state.epoch, step=state.step, checksum=checksum(model),
                    round=le.current_worker().assignment.round)
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            for batch_idx, (index, x, y) in enumerate(state.loader):
                ddp_optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp_model(x), y)
                fabric.backward(loss)
                ddp_optimizer.step()
                if args.step_delay:
                    time.sleep(args.step_delay)
                seen: list = [None] * fabric.world_size
                real = index[: state.sampler.real_in_batch(batch_idx, args.batch_size)]
                dist.all_gather_object(seen, real.tolist())
                state.seen.extend(i for part in seen for i in part)
                state.record_batch(batch_idx)
                state.step += 1
                events.emit("step", epoch=state.epoch, step=state.step, loss=loss.item(), real=len(real))
                fabric.log("loss", loss.item(), step=state.step)  # rank 0's, as with any Fabric logger
                if state.step % args.commit_every == 0:
                    state.commit()
            committed = sorted(state.seen[: state.sampler.dataset_size])
            events.emit("epoch_end", epoch=state.epoch, samples=len(state.seen), unique=len(set(state.seen)),
                        complete=committed == list(range(state.sampler.dataset_size)))
            if args.eval:
                with torch.no_grad():
                    evaluated = [int(i) for index, _, _ in eval_loader for i in index]
                events.emit("eval", epoch=state.epoch, round=le.current_worker().assignment.round,
                            samples=len(evaluated), whole=sorted(evaluated) == list(range(args.samples)))
            state.epoch += 1
            state.seen = []
            state.commit()
        events.emit("done", step=state.step, checksum=checksum(model))

    train(state)
    if fabric.global_rank == 0:
        print(f"training finished: {state.step} steps, world size {fabric.world_size}", flush=True)


if __name__ == "__main__":
    main()
