"""An FSDP2 training loop of a ~100M-parameter model, under torchrun or under ``lightning-elastic launch``.

    torchrun --standalone --nnodes 1 --nproc-per-node 4 benchmarks/workloads/sharded_train.py --log-dir D \
        --checkpoint-dir C --checkpoint-every 4
    lightning-elastic launch -np 4 -H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1,127.0.0.4:1 \
        benchmarks/workloads/sharded_train.py --log-dir D --commit-every 2

The model (``build``): ``--blocks`` Linear(width, width) + ReLU blocks and a Linear(width, 10)
head; the default 24 blocks of 2048 are 100.7M parameters (403 MB; AdamW's two moments make
the state 1.2 GB). Each block is sharded with ``fully_shard`` on a 1-D mesh, then the root, as
FSDP2 users write it, with ``reshard_after_forward=False`` by default (the weights gathered
once per step, kept for the backward: on this machine's gloo a second all-gather costs more
than the memory); fp32 unless ``--precision`` says otherwise; AdamW lr 1e-4. Blocks of 2048
rather than 4096: a 64 MB weight is above glibc's largest mmap threshold (32 MB), so every
gather mapped and faulted fresh pages (550k page faults per rank per step, 1.4 s of system
time); 16 MB ones are reused from the heap. The model is built on the meta device, sharded, allocated
(``to_empty``) and its local shards initialised (``init_weights``) at the first start; a
restart or a reset fills them from the checkpoint or the commit instead. Random data from a
fixed seed: step ``s`` of rank ``r`` in a world of ``W`` takes batch ``s * W + r`` (cyclically),
so nothing but the step counter travels across a restart.

The mode follows the environment:

- under the launcher: ``le.ShardedState(build, shard, AdamW, init_weights=..., step=0)`` in
  ``@le.run``; ``state.commit()`` every ``--commit-every`` steps, ``state.check_host_updates()``
  at every other step (a joiner is taken in at a later step, without rollback);
- otherwise (torchrun): ``init_process_group("gloo")``, and with ``--checkpoint-dir`` what a
  torchrun user does to survive a restart: every ``--checkpoint-every`` steps
  ``torch.distributed.checkpoint.save`` of the model's and optimizer's sharded state dicts
  (``get_state_dict``) into ``<dir>/step-<n>`` (complete once DCP wrote its ``.metadata``,
  which it does last; the two newest kept), and at every (re)start ``dcp.load`` of the newest
  complete one (``set_state_dict``), resuming after its step.

Every completed step appends a record to ``--log-dir`` (steplog), before its commit, check or
checkpoint (a host change raised by the check keeps that step), with ``began`` (when the step
started: its own time is ``t - began``), ``rss_mb`` and ``hwm_mb`` (the process's RSS and peak
RSS so far, VmHWM). Under the launcher, lightning-elastic's own lines carry their time
(``lightning-elastic [<unix time>]: ...``).
"""

from __future__ import annotations

import startup_priority  # noqa: I001 - before the heavy imports

startup_priority.lower()

import argparse
import faulthandler
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from steplog import StepLog

ELASTIC = "LIGHTNING_ELASTIC_DRIVER_URL" in os.environ  # lightning_elastic.protocol.ENV_DRIVER_URL
CLASSES = 10
SAMPLES = 512  # random samples, drawn once
LR = 1e-4


class Stack(nn.Module):
    """``blocks`` Linear(width, width) + ReLU, then Linear(width, 10)."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_weights(model: nn.Module) -> None:
    """The local shards' first values (every rank the same seed: DTensor's RNG keeps shards apart)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()


def make_shard(reshard_after_forward: bool, precision: str):
    dtypes = {"fp32": (None, None), "bf16": (torch.bfloat16, torch.float32), "bf16-reduce": (torch.bfloat16,) * 2}
    param_dtype, reduce_dtype = dtypes[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(model: Stack, mesh: object) -> None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return shard


def random_data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, width, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)


def batch_at(data: tuple[torch.Tensor, torch.Tensor], batch: int, step: int, rank: int, world: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    start = ((step * world + rank) % (SAMPLES // batch)) * batch
    x, y = data
    return x[start:start + batch], y[start:start + batch]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # FSDP2 reduce-scatters into each rank's shard
    optimizer.step()


def memory_mb() -> dict[str, int]:
    """``rss_mb`` and ``hwm_mb`` (peak RSS so far) of this process, MiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                found["rss_mb" if line.startswith("VmRSS") else "hwm_mb"] = int(line.split()[1]) // 1024
    return found


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a hung worker's stacks: kill -USR1 <pid>
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10**6)
    parser.add_argument("--reshard-after-forward", type=int, default=0, choices=(0, 1),
                        help="FSDP2's reshard_after_forward (0: keep the gathered weights for the backward)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "bf16-reduce"),
                        help="FSDP2's MixedPrecisionPolicy: bf16 weights gathered (bf16-reduce: gradients "
                             "reduced in bf16 too)")
    parser.add_argument("--commit-every", type=int, default=10, help="elastic only")
    parser.add_argument("--checkpoint-dir", type=Path, help="not elastic: DCP checkpoints to, and resume from, here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="with --checkpoint-dir: steps between saves")
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()
    log = StepLog(args.log_dir)
    data = random_data(args.width)
    shard = make_shard(bool(args.reshard_after_forward), args.precision)

    def build() -> Stack:
        return Stack(args.width, args.blocks)

    def optimizer_of(params) -> torch.optim.Optimizer:  # noqa: ANN001
        return torch.optim.AdamW(params, lr=LR)

    if ELASTIC:
        import lightning_elastic as le

        # lightning-elastic's lines with their time (the benchmark places restores after a kill).
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("lightning-elastic [%(created).3f]: %(message)s"))
        logging.getLogger("lightning_elastic").addHandler(handler)
        logging.getLogger("lightning_elastic").setLevel(logging.INFO)
        le.init()
        startup_priority.restore()  # joined: as any worker from here on
        state = le.ShardedState(build, shard, optimizer_of, init_weights=init_weights, step=0)

        @le.run
        def train(state: le.ShardedState) -> None:
            model, optimizer = state.model, state.optimizer
            committed = None  # seconds the previous step's commit took (logged with the next step)
            while state.step < args.steps:
                began = time.time()
                rank, size = le.rank(), le.size()
                train_step(model, optimizer, *batch_at(data, args.batch, state.step, rank, size))
                state.step += 1
                # Logged before the commit or check: a host change raised there keeps this step.
                log.step(state.step, rank, size, began=began, commit_s=committed, **memory_mb())
                committed = None
                if state.step % args.commit_every == 0:
                    started = time.perf_counter()
                    state.commit()  # includes the host-update check
                    committed = round(time.perf_counter() - started, 4)
                else:
                    state.check_host_updates()

        train(state)
        return

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = build()
    shard(model, mesh)
    model.to_empty(device="cpu")
    optimizer = optimizer_of(model.parameters())
    step = load_checkpoint(args.checkpoint_dir, model, optimizer) if args.checkpoint_dir else None
    if step is None:
        init_weights(model)
        step = 0
    while step < args.steps:
        began = time.time()
        train_step(model, optimizer, *batch_at(data, args.batch, step, rank, size))
        step += 1
        log.step(step, rank, size, began=began, **memory_mb())
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, model, optimizer, step, rank)
    dist.barrier()
    dist.destroy_process_group()


# ----- torchrun's checkpoints: torch.distributed.checkpoint ----------------------------------

def _complete(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob("step-*"):
        if (path / ".metadata").exists():
            found.append((int(path.name.split("-", 1)[1]), path))
    return sorted(found)


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / f"step-{step:08d}"))
    print(f"rank {rank}: saved checkpoint step {step} in {time.perf_counter() - started:.3f} s", flush=True)
    if rank == 0:  # the two newest complete ones are kept; anything older (or torn) goes
        keep = {path for _, path in _complete(directory)[-2:]}
        for path in directory.glob("step-*"):
            if path not in keep and int(path.name.split("-", 1)[1]) < step:
                shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """The step of the newest complete checkpoint, loaded into ``model`` and ``optimizer``; None without one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    complete = _complete(directory)
    if not complete:
        return None
    step, path = complete[-1]
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    tree = {"model": model_sd, "optim": optim_sd}
    dcp.load(tree, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    read = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    print(f"rank {dist.get_rank()}: loaded checkpoint step {step} in {time.perf_counter() - started:.3f} s "
          f"({read / 1e6:.1f} MB in the checkpoint)", flush=True)
    return step


if __name__ == "__main__":
    main()
