"""A plain PyTorch DDP training loop, under torchrun or under ``lightning-elastic launch``.

    python -m torch.distributed.run --standalone --nproc-per-node 3 benchmarks/workloads/loop.py --log-dir D
    lightning-elastic launch -np 3 -H 127.0.0.1:1,127.0.0.2:1,127.0.0.3:1 \
        python benchmarks/workloads/loop.py --log-dir D --commit-every 10 --check-every 1

The mode follows the environment: under the launcher the loop runs inside ``@le.run`` with a
``le.TorchState(model, optimizer, step=0)``, calls ``state.commit()`` every
``--commit-every`` steps and ``state.check_host_updates()`` every ``--check-every`` steps
(a commit checks too); otherwise it is the same loop on a process group of its own
(``init_process_group("gloo")``). Nothing else differs: model, data, batches, torch's DDP
(``le.DistributedDataParallel`` under the launcher: the same torch DDP, rebuilt after a reset).
Every completed step (after its commit or check) appends a record to ``--log-dir`` (steplog).

Without the launcher, ``--checkpoint-dir D`` is what a torchrun user does to survive a
restart: rank 0 ``torch.save``s model, optimizer and step to ``D/last.pt`` every
``--checkpoint-every`` steps (written aside, then renamed: a kill mid-write leaves the
previous one whole), and every rank of a (re)started job resumes from it when it exists.
"""

from __future__ import annotations

import startup_priority  # noqa: I001 - before the heavy imports

startup_priority.lower()

import argparse
import faulthandler
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _shared as sh
from steplog import StepLog

ELASTIC = "LIGHTNING_ELASTIC_DRIVER_URL" in os.environ  # lightning_elastic.protocol.ENV_DRIVER_URL


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a hung worker's stacks: kill -USR1 <pid>
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(sh.SPECS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--commit-every", type=int, default=10, help="elastic only")
    parser.add_argument("--check-every", type=int, default=1, help="elastic only")
    parser.add_argument("--checkpoint-dir", type=Path, help="not elastic: checkpoint to, and resume from, D/last.pt")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="with --checkpoint-dir: steps between saves")
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args()
    spec = sh.spec(args.model)
    log = StepLog(args.log_dir)
    model = sh.build_model(spec)
    optimizer = sh.make_optimizer(model, spec)
    data = sh.random_data(spec)

    if ELASTIC:
        import lightning_elastic as le

        le.init()
        startup_priority.restore()  # joined: as any worker from here on
        state = le.TorchState(model, optimizer, step=0)
        ddp = le.DistributedDataParallel(model)  # torch's DDP, rebuilt on each new group

        @le.run
        def train(state: le.TorchState) -> None:
            while state.step < args.steps:
                rank, size = le.rank(), le.size()
                sh.train_step(ddp, optimizer, *sh.batch_at(data, spec, state.step, rank, size))
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()  # includes the host-update check
                elif state.step % args.check_every == 0:
                    state.check_host_updates()
                log.step(state.step, rank, size)

        train(state)
    else:
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        ddp = DDP(model)
        checkpoint = args.checkpoint_dir / "last.pt" if args.checkpoint_dir else None
        step = load_checkpoint(checkpoint, model, optimizer) if checkpoint else 0
        while step < args.steps:
            sh.train_step(ddp, optimizer, *sh.batch_at(data, spec, step, rank, size))
            step += 1
            if checkpoint and rank == 0 and step % args.checkpoint_every == 0:
                save_checkpoint(checkpoint, model, optimizer, step)
            log.step(step, rank, size)
        # Without the barrier and the DDP wrapper gone first, a worker hung at exit here now
        # and then (after its last step, in DDP / gloo teardown), so torchrun never returned.
        del ddp
        dist.barrier()
        dist.destroy_process_group()


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Model, optimizer and step to ``path``, atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step to resume after (0 without a checkpoint), model and optimizer loaded from ``path``."""
    if not path.exists():
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"])


if __name__ == "__main__":
    main()
