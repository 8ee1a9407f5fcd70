"""One training loop, run either elastically (under lightning-elastic launch) or under torchrun.

The same MLP, data, batch size and DDP gradient sync in both modes, so step times and
recovery times compare like with like. Every step appends a JSON line to --log-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ELASTIC = "LIGHTNING_ELASTIC_DRIVER_URL" in os.environ


def build(samples: int) -> tuple[torch.nn.Module, TensorDataset]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 128, generator=g)
    y = x @ torch.randn(128, 1, generator=g)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )
    return model, TensorDataset(x, y)


class StepLog:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def step(self, step: int, rank: int, size: int) -> None:
        self._file.write(json.dumps({"t": time.time(), "step": step, "rank": rank, "size": size,
                                     "pid": os.getpid()}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()
    log = StepLog(args.log_dir)
    model, dataset = build(args.samples)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    if ELASTIC:
        import lightning_elastic as le

        le.init()
        sampler = le.ElasticSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        state = le.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)

        @le.run
        def train(state: le.TorchState) -> None:
            ddp = DDP(model)
            while state.step < args.steps:
                sampler.set_epoch(state.epoch)
                for batch_idx, (x, y) in enumerate(loader):
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                    optimizer.step()
                    sampler.record_batch(batch_idx, args.batch_size)
                    state.step += 1
                    log.step(state.step, le.rank(), le.size())
                    if state.step % args.commit_every == 0:
                        state.commit()
                    if state.step >= args.steps:
                        return
                state.epoch += 1

        train(state)
    else:
        dist.init_process_group("gloo")
        sampler = DistributedSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        ddp = DDP(model)
        step, epoch = 0, 0
        while step < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
                step += 1
                log.step(step, dist.get_rank(), dist.get_world_size())
                if step >= args.steps:
                    break
            epoch += 1
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
