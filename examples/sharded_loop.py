"""A hand-written FSDP2 loop made elastic with ``le.ShardedState``.

Run it alone (`python examples/sharded_loop.py`) or elastically:

    lightning-elastic launch -np 4 --min-np 2 -H 127.0.0.1:2,127.0.0.2:2 python examples/sharded_loop.py

The model is a stack of linear blocks, each sharded with ``fully_shard`` on the mesh the
state gives; AdamW's moments are sharded with it. A lost rank's rows come back from the
copy its holder keeps; the survivors continue in the same processes, re-sharded to the
new world. With ``--events DIR`` every worker appends JSON lines (rounds, commits with a
digest of the whole state, the samples of each epoch) for the integration tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_elastic as le
from lightning_elastic.sharded import faults as commit_faults  # test-only fault injection


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--width", type=int, default=64, help="features of each block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--commit-every", type=int, default=4, help="commit every N batches")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--meta-init", action="store_true",
                        help="build on the meta device and initialise the shards (a model too large for one device)")
    parser.add_argument("--events", type=Path, help="directory for per-worker JSON-lines event logs")
    parser.add_argument("--memory", action="store_true",
                        help="log this process's peak resident memory around commits and restores (Linux)")
    parser.add_argument("--digests", action="store_true",
                        help="after every commit and sync, log a digest of the whole state (gathers it: tests only)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--sigkill-at-step", type=int, default=-1,
                        help="the worker on --sigkill-on-host sends itself SIGKILL after this step (once per host)")
    faults.add_argument("--sigkill-on-host", default="", help="the host (LIGHTNING_ELASTIC_HOSTNAME) whose worker dies")
    faults.add_argument("--sigkill-rank", type=int, action="append", default=[],
                        help="with --sigkill-at-step: the ranks that die then instead (repeatable)")
    faults.add_argument("--sigkill-in-round", type=int, default=1, help="the round in which they die")
    faults.add_argument("--sigkill-in-commit", choices=commit_faults.PHASES,
                        help="die inside the commit of --sigkill-at-step instead of after it: in its swap (half of "
                             "the copy sent), once it is agreed, or once it is promoted")
    args = parser.parse_args()
    if args.sigkill_in_commit and args.sigkill_at_step % args.commit_every:
        parser.error(f"--sigkill-in-commit: step {args.sigkill_at_step} commits no state; expected "
                     f"--sigkill-at-step a multiple of --commit-every ({args.commit_every})")
    return args


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

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, torch.nn.Linear):
                module.reset_parameters()


def shard(model: Blocks, mesh: object) -> None:
    """The FSDP2 code a user already has: each block, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


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
                      "size": le.size(), "worker": os.environ.get("LIGHTNING_ELASTIC_WORKER_ID", ""), **fields}
            self._file.write(json.dumps(record) + "\n")


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


@torch.no_grad()
def state_digest(state: le.ShardedState) -> str:
    """The whole state's bytes, hashed (a collective: every rank gathers every tensor)."""
    h = hashlib.sha256()
    for name, param in state.model.named_parameters():
        h.update(name.encode())
        h.update(full(param).contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(state.optimizer.state.get(param, {}).items()):
            if isinstance(value, torch.Tensor):
                h.update(full(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def peak_rss(field: str = "VmHWM") -> int:
    """This process's peak resident bytes since the last ``reset_peak`` (VmHWM), or its
    resident bytes now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current size


def optimizer_steps(state: le.ShardedState) -> list[float]:
    return [float(s["step"]) for s in state.optimizer.state.values() if "step" in s]


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    le.init()
    events = Events(args.events)
    hostname = os.environ.get("LIGHTNING_ELASTIC_HOSTNAME", "")

    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dataset = TensorDataset(torch.arange(args.samples), inputs, targets)
    sampler = le.ElasticSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    state = le.ShardedState(
        lambda: Blocks(args.width, args.blocks),
        shard,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        init_weights=Blocks.init_weights if args.meta_init else None,
        sampler=sampler, epoch=0, step=0, seen=[],
    )

    def on_reset() -> None:
        events.emit("reset", round=le.current_worker().assignment.round)

    state.register_reset_callbacks([on_reset])
    events.emit("start", host=hostname, local_rank=le.local_rank())

    # --memory: the peak since the end of the previous step (or commit), with the resident
    # size then and the commit's size: what a commit and a restore add to the live state.
    memory: dict[str, int] = {"before": 0, "committed": 0}

    def mark() -> None:
        reset_peak()
        memory["before"] = peak_rss("VmRSS")

    @le.run
    def train(state: le.ShardedState) -> None:
        model, optimizer = state.model, state.optimizer
        round_number = le.current_worker().assignment.round
        if args.memory:
            if memory["committed"]:  # since the end of the last step: its failure and the restore
                events.emit("memory", phase="restore", peak=peak_rss(), before=memory["before"],
                            committed_bytes=memory["committed"], round=round_number)
            mark()
        events.emit("synced", epoch=state.epoch, step=state.step, round=round_number,
                    digest=state_digest(state) if args.digests else "", optimizer_steps=optimizer_steps(state))
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            for batch_idx, (index, x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()  # FSDP2 reduce-scatters the gradients into each rank's shard
                optimizer.step()
                if args.step_delay:
                    time.sleep(args.step_delay)
                seen: list = [None] * le.size()
                real = index[: sampler.real_in_batch(batch_idx, args.batch_size)]
                dist.all_gather_object(seen, real.tolist())
                state.seen.extend(i for part in seen for i in part)
                sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                events.emit("step", epoch=state.epoch, step=state.step, loss=loss.item(), real=len(real),
                            round=round_number)
                if args.memory:
                    mark()
                dies = (state.step == args.sigkill_at_step and round_number == args.sigkill_in_round
                        and (le.rank() in args.sigkill_rank if args.sigkill_rank else hostname == args.sigkill_on_host))
                if state.step % args.commit_every == 0:
                    if args.digests:  # the state this commit holds, should a loss inside it leave it whole
                        events.emit("committing", step=state.step, digest=state_digest(state), round=round_number)
                    if dies and args.sigkill_in_commit:
                        events.emit("sigkill", step=state.step, phase=args.sigkill_in_commit)
                        os.environ[commit_faults.ENV] = args.sigkill_in_commit
                    state.commit()
                    if args.memory:
                        memory["committed"] = state.committed_bytes
                        events.emit("memory", phase="commit", peak=peak_rss(), before=memory["before"],
                                    committed_bytes=state.committed_bytes, round=round_number)
                        mark()
                    if args.digests:
                        events.emit("commit", step=state.step, digest=state_digest(state),
                                    optimizer_steps=optimizer_steps(state), round=round_number)
                if dies and not args.sigkill_in_commit:
                    events.emit("sigkill", step=state.step)
                    os.kill(os.getpid(), signal.SIGKILL)
            committed = sorted(state.seen[: sampler.dataset_size])
            events.emit("epoch_end", epoch=state.epoch, samples=len(state.seen), unique=len(set(state.seen)),
                        complete=committed == list(range(sampler.dataset_size)))
            state.epoch += 1
            state.seen = []
            state.commit()
        events.emit("done", step=state.step, digest=state_digest(state) if args.digests else "")

    train(state)
    if le.rank() == 0:
        print(f"training finished: {state.step} steps, world size {le.size()}", flush=True)


if __name__ == "__main__":
    main()
