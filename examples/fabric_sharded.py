"""A Lightning Fabric FSDP2 loop made elastic: ``le.ElasticFabricFSDPStrategy(parallelize_fn=...)``
and ``le.FabricShardedState``.

Run it alone (a world of one) or elastically:

    lightning-elastic launch -np 4 --min-np 2 -H 127.0.0.1:2,127.0.0.2:2 python examples/fabric_sharded.py

The Fabric code is the ``ModelParallelStrategy`` pattern: a ``parallelize`` function applies
``fully_shard`` on ``device_mesh["data_parallel"]``; only the strategy differs. The state builds
the model on every round's mesh (FSDP2 binds a module to its mesh), so it takes the model's
and optimizer's constructors. A lost rank's rows come back from the copy its peer holds; the
survivors continue in the same processes, re-sharded. With ``--events DIR`` every worker
appends JSON lines (rounds, commits with a digest of the whole state, each step's samples)
for the integration tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_elastic as le


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--width", type=int, default=64, help="features of each block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--commit-every", type=int, default=4, help="commit every N steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--events", type=Path, help="directory for per-worker JSON-lines event logs")
    parser.add_argument("--digests", action="store_true",
                        help="after every commit and sync, log a digest of the whole state (gathers it: tests only)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--sigkill-at-step", type=int, default=-1,
                        help="--sigkill-rank sends itself SIGKILL after this step")
    faults.add_argument("--sigkill-rank", type=int, default=-1, help="the rank that dies (in the first round)")
    return parser.parse_args()


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


def parallelize(model: Blocks, device_mesh: object) -> Blocks:
    """Fabric's parallelize_fn, as for ModelParallelStrategy: each block, then the root."""
    mesh = device_mesh["data_parallel"]  # type: ignore[index]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


@torch.no_grad()
def state_digest(state: le.FabricShardedState) -> str:
    """The whole state's bytes, hashed (a collective: every rank gathers every tensor)."""
    h = hashlib.sha256()
    for name, param in state.model.named_parameters():
        h.update(name.encode())
        h.update(full(param).contiguous().view(torch.uint8).numpy().tobytes())
        for _, value in sorted(state.optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                h.update(full(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_steps(state: le.FabricShardedState) -> list[float]:
    return sorted({float(s["step"]) for s in state.optimizer.state.values() if "step" in s})


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(strategy=le.ElasticFabricFSDPStrategy(parallelize_fn=parallelize), accelerator="cpu", devices=1)
    fabric.launch()  # joins the elastic job (the launcher started this process)
    fabric.seed_everything(0)
    events = Events(args.events, fabric)

    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dataset = TensorDataset(torch.arange(args.samples), inputs, targets)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))

    state = le.FabricShardedState(
        fabric,
        model=lambda: Blocks(args.width, args.blocks),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        loader=loader, epoch=0, step=0, seen=[],
    )

    def on_reset() -> None:
        events.emit("reset", round=le.current_worker().assignment.round)

    state.register_reset_callbacks([on_reset])
    events.emit("start")

    @le.run
    def train(state: le.FabricShardedState) -> None:
        model, optimizer = state.setup()  # this round's model, sharded by parallelize, in Fabric's wrappers
        round_number = le.current_worker().assignment.round
        events.emit("synced", epoch=state.epoch, step=state.step, round=round_number,
                    digest=state_digest(state) if args.digests else "", optimizer_steps=optimizer_steps(state))
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            for batch_idx, (index, x, y) in enumerate(state.loader):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)  # FSDP2 reduce-scatters the gradients into each rank's shard
                optimizer.step()
                if args.step_delay:
                    time.sleep(args.step_delay)
                seen: list = [None] * fabric.world_size
                real = index[: state.sampler.real_in_batch(batch_idx, args.batch_size)]
                dist.all_gather_object(seen, real.tolist())
                state.seen.extend(i for part in seen for i in part)
                state.record_batch(batch_idx)
                state.step += 1
                events.emit("step", epoch=state.epoch, step=state.step, round=round_number, indices=real.tolist())
                if state.step % args.commit_every == 0:
                    state.commit()
                    if args.digests:
                        events.emit("commit", step=state.step, digest=state_digest(state), round=round_number,
                                    optimizer_steps=optimizer_steps(state))
                if state.step == args.sigkill_at_step and round_number == 1 and fabric.global_rank == args.sigkill_rank:
                    events.emit("sigkill", step=state.step)
                    os.kill(os.getpid(), signal.SIGKILL)
            committed = sorted(state.seen[: state.sampler.dataset_size])
            events.emit("epoch_end", epoch=state.epoch, samples=len(state.seen), unique=len(set(state.seen)),
                        complete=committed == list(range(state.sampler.dataset_size)))
            state.epoch += 1
            state.seen = []
            state.commit()
        events.emit("done", step=state.step, digest=state_digest(state) if args.digests else "",
                    optimizer_steps=optimizer_steps(state))

    train(state)
    if fabric.global_rank == 0:
        print(f"training finished: {state.step} steps, world size {fabric.world_size}", flush=True)


if __name__ == "__main__":
    main()
