"""A hand-written PyTorch loop made elastic with lightning-elastic's State API.

Run it alone (`python examples/elastic_loop.py`) or elastically:

    lightning-elastic launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 python examples/elastic_loop.py

The model is a small MLP fitting a fixed random linear map; the data set is generated.
With ``--events DIR`` every worker appends JSON lines describing what it did (rounds,
commits, the samples of each committed epoch, parameter checksums after each sync) for the
integration tests to check.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning_elastic as le


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--commit-every", type=int, default=2, help="commit every N batches")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--events", type=Path, help="directory for per-worker JSON-lines event logs")
    parser.add_argument("--fail-at-step", type=int, default=-1,
                        help="raise a ValueError at this global step (with --fail-on-host)")
    parser.add_argument("--fail-on-host", default="all",
                        help="host whose workers raise at --fail-at-step; 'all': every worker")
    return parser.parse_args()


class Events:
    def __init__(self, directory: Path | None) -> None:
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            worker = os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", "standalone").replace("/", "_")
            self._file = open(directory / f"{worker}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, kind: str, **fields: object) -> None:
        if self._file is not None:
            record = {"kind": kind, "pid": os.getpid(), "time": time.time(), "rank": le.rank(),
                      "size": le.size(), "worker": os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", ""),
                      **fields}
            self._file.write(json.dumps(record) + "\n")


@torch.no_grad()
def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    le.init()
    events = Events(args.events)

    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    dataset = TensorDataset(torch.arange(args.samples), inputs, targets)

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * le.size())
    sampler = le.ElasticSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = le.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, seen=[])

    def on_reset() -> None:
        # Linear learning-rate scaling with the world size.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * le.size()

    state.register_reset_callbacks([on_reset])
    slot = le.slot_info()
    events.emit("start", host=socket.gethostname(), local_rank=slot.local_rank, local_size=slot.local_size,
                cross_rank=slot.cross_rank, cross_size=slot.cross_size, master_addr=os.environ.get("MASTER_ADDR"))

    @le.run
    def train(state: le.TorchState) -> None:
        events.emit("synced", epoch=state.epoch, step=state.step, checksum=checksum(model),
                    round=le.current_worker().assignment.round)
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            for batch_idx, (index, x, y) in enumerate(loader):
                if state.step == args.fail_at_step and args.fail_on_host in ("all", le.slot_info().hostname):
                    raise ValueError(f"injected failure at step {state.step} on rank {le.rank()}")
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                for p in model.parameters():  # average gradients across the world
                    dist.all_reduce(p.grad)
                    p.grad /= le.size()
                optimizer.step()
                if args.step_delay:
                    time.sleep(args.step_delay)
                seen: list = [None] * le.size()
                real = index[: sampler.real_in_batch(batch_idx, args.batch_size)]
                dist.all_gather_object(seen, real.tolist())
                state.seen.extend(i for part in seen for i in part)
                sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                events.emit("step", epoch=state.epoch, step=state.step, loss=loss.item(), real=len(real))
                if state.step % args.commit_every == 0:
                    state.commit()
            committed = sorted(state.seen[: sampler.dataset_size])
            events.emit("epoch_end", epoch=state.epoch, samples=len(state.seen), unique=len(set(state.seen)),
                        complete=committed == list(range(sampler.dataset_size)))
            state.epoch += 1
            state.seen = []
            state.commit()
        events.emit("done", step=state.step, checksum=checksum(model))

    train(state)
    if le.rank() == 0:
        print(f"training finished: {state.step} steps, world size {le.size()}", flush=True)


if __name__ == "__main__":
    main()
