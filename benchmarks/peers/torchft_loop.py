"""benchmarks/workloads/loop.py's training loop, made fault tolerant the way torchft's docs do it.

One process is one replica group of size 1 (torchft's README: "for DDP we can use replica
groups of size 1"). As in torchft's train_ddp.py example: a ``torchft.Manager`` per replica
group, talking to a lighthouse (``TORCHFT_LIGHTHOUSE`` or ``--lighthouse``) that decides the
quorum at every step; ``ProcessGroupGloo`` reconfigured at every quorum change;
``torchft.DistributedDataParallel`` (gradient all-reduce through the manager) and
``torchft.Optimizer`` (``zero_grad`` starts the quorum, ``step`` steps only if the replicas
agree the step may commit). The per-group TCPStore that torchrun would provide is started here.

``--ddp patched`` (the default) fixes one bug of torchft 0.2.0's DistributedDataParallel:
when a peer dies during the gradient all-reduce (gloo: "Connection reset by peer"), the
manager records the error as designed, but the comm hook then fails ``assert fut._fut``
(the managed future is only set up when the wait succeeds) and the AssertionError kills
every survivor. The patched hook hands DDP the bucket unchanged instead; the step is
discarded anyway (``should_commit`` is False after an error) and the next step forms a new
quorum. ``--ddp stock`` runs torchft's class as shipped.

The model, data, batch size, optimizer and loss are workloads/loop.py's (workloads/_shared.py,
``--model small`` by default: MLP 256 -> 1024 -> 10, batch 64, SGD lr 0.01, cross-entropy).
The batch of step ``s`` on replica ``r`` is ``_shared.batch_at(data, spec, s, r, --num-replicas)``,
``s`` being the manager's step before the step starts: the data stay sharded over all the
replica groups, as torchft's ``DistributedSampler(num_replica_groups=...)`` shards them.
Every committed step (the optimizer really stepped) appends a record to --log-dir through
workloads/steplog.py: ``{"t", "step", "rank" (replica id), "size" (replicas in this step's
quorum), "pid"}``.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 benchmarks/.venv/bin/python \\
        benchmarks/peers/torchft_loop.py --replica-id 0 --num-replicas 3 --log-dir /tmp/steps
"""

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workloads"))
import _shared as sh  # noqa: E402  (workloads/loop.py's model, data, batches and optimizer)
from steplog import StepLog  # noqa: E402

from torchft import (  # noqa: E402
    DistributedDataParallel,
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
    parser.add_argument("--model", default="small", choices=sorted(sh.SPECS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.lighthouse:
        parser.error("--lighthouse or TORCHFT_LIGHTHOUSE is required")

    spec = sh.spec(args.model)
    log = StepLog(args.log_dir)
    model = sh.build_model(spec)
    optimizer = sh.make_optimizer(model, spec)
    data = sh.random_data(spec)

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

    try:
        while manager.current_step() < args.steps:
            # _shared.train_step, with the commit check between backward and step.
            x, y = sh.batch_at(data, spec, manager.current_step(), args.replica_id, args.num_replicas)
            ft_optimizer.zero_grad()                   # starts this step's quorum (async)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()  # all-reduce via the manager
            before = manager.current_step()            # quorum done (a healer's step is set)
            ft_optimizer.step()                        # steps only if should_commit
            if manager.current_step() > before:
                log.step(manager.current_step(), args.replica_id, manager.num_participants())
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
