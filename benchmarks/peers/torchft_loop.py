"""benchmarks/loop.py's training loop, made fault tolerant the way torchft's docs do it.

One process is one replica group of size 1 (torchft's README: "for DDP we can use replica
groups of size 1"). As in torchft's train_ddp.py example: a ``torchft.Manager`` per replica
group, talking to a lighthouse (``TORCHFT_LIGHTHOUSE`` or ``--lighthouse``) that decides the
quorum at every step; ``ProcessGroupGloo`` reconfigured at every quorum change;
``torchft.DistributedDataParallel`` (gradient all-reduce through the manager) and
``torchft.Optimizer`` (``zero_grad`` starts the quorum, ``step`` steps only if the replicas
agree the step may commit); ``torchft.DistributedSampler`` shards the data over the replica
groups. The per-group TCPStore that torchrun would provide is started here.

``--ddp patched`` (the default) fixes one bug of torchft 0.2.0's DistributedDataParallel:
when a peer dies during the gradient all-reduce (gloo: "Connection reset by peer"), the
manager records the error as designed, but the comm hook then fails ``assert fut._fut``
(the managed future is only set up when the wait succeeds) and the AssertionError kills
every survivor. The patched hook hands DDP the bucket unchanged instead; the step is
discarded anyway (``should_commit`` is False after an error) and the next step forms a new
quorum. ``--ddp stock`` runs torchft's class as shipped.

The model, data, batch size and optimizer are benchmarks/loop.py's (its ``build``).
Every committed step (the optimizer really stepped) appends a JSON line to --log-dir:
``{"t", "step", "rank" (replica id), "size" (replicas in this step's quorum), "pid"}``.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 benchmarks/.venv/bin/python \\
        benchmarks/peers/torchft_loop.py --replica-id 0 --num-replicas 3 --log-dir /tmp/steps
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loop import build  # noqa: E402  (benchmarks/loop.py: the same model and data)

from torchft import (  # noqa: E402
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)


class PatchedDistributedDataParallel(DistributedDataParallel):
    """torchft.DistributedDataParallel whose comm hook survives a failed all-reduce."""

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        if work.wait():  # False: the all-reduce failed and the manager recorded the error
            fut = work.get_future()
            return getattr(fut, "_fut", None) or fut  # a _DummyWork's future is a plain one
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())  # discarded: should_commit() is False for this step
        return fut


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--num-replicas", type=int, required=True,
                        help="replica groups the data is sharded over (torchft's num_replica_groups)")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"))
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="Manager min_replica_size: fewest replicas a step may commit with")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="Manager timeout, seconds (collectives, should_commit, recovery)")
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout, seconds")
    parser.add_argument("--ddp", choices=("patched", "stock"), default="patched",
                        help="stock: torchft.DistributedDataParallel as shipped (see the docstring)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.lighthouse:
        parser.error("--lighthouse or TORCHFT_LIGHTHOUSE is required")

    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.log_dir / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    model, dataset = build(args.samples)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(state_dict: dict) -> None:  # a healing replica gets a peer's state
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    # What torchrun would start for a replica group: its TCPStore (group size 1 here).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"torchft_loop_{args.replica_id}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    ddp = (PatchedDistributedDataParallel if args.ddp == "patched" else DistributedDataParallel)(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    sampler = DistributedSampler(dataset, replica_rank=args.replica_id, num_replica_groups=args.num_replicas,
                                 group_rank=0, num_replicas=1, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    epoch = 0
    try:
        while manager.current_step() < args.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                ft_optimizer.zero_grad()               # starts this step's quorum (async)
                torch.nn.functional.mse_loss(ddp(x), y).backward()  # all-reduce via the manager
                before = manager.current_step()        # quorum done (a healer's step is set)
                ft_optimizer.step()                    # steps only if should_commit
                if manager.current_step() > before:
                    log.write(json.dumps({"t": time.time(), "step": manager.current_step(),
                                          "rank": args.replica_id, "size": manager.num_participants(),
                                          "pid": os.getpid()}) + "\n")
                if manager.current_step() >= args.steps:
                    break
            epoch += 1
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
