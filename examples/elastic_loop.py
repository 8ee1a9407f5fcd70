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
import atexit
import copy
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
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
    parser.add_argument("--check-replicas", action="store_true",
                        help="after every step, compare the model's checksum across the world with a "
                             "collective and raise if the replicas differ")
    # Fault injection for the chaos tests (docs/reliability.md).
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--start-delay", type=float, default=0.0,
                        help="seconds a worker spends starting before it joins the job (as imports, data and "
                             "GPU set-up take on a real fleet)")
    faults.add_argument("--start-delay-on-host", default="all", help="host whose workers start so slowly; 'all': every")
    faults.add_argument("--dist-error-at-step", type=int, default=-1,
                        help="raise torch.distributed.DistError at this global step (with --dist-error-on-host)")
    faults.add_argument("--dist-error-on-host", default="all", help="host that raises it; 'all': every worker")
    faults.add_argument("--dist-error-once", action="store_true", help="raise it once per process only")
    faults.add_argument("--reset-delay", type=float, default=0.0,
                        help="seconds the reset callback takes (a window to fault the recovery in)")
    faults.add_argument("--ballast-mb", type=int, default=0,
                        help="megabytes of extra state, so that the state broadcast takes a while")
    faults.add_argument("--exit-code", type=int, default=0,
                        help="exit with this status after training returned (with --exit-on-host)")
    faults.add_argument("--exit-on-host", default="all", help="host that exits so; 'all': every worker")
    faults.add_argument("--end-in-round", type=int, nargs=2, metavar=("ROUND", "STEPS"),
                        help="from round ROUND on, training returns after STEPS steps of the round (a short "
                             "last round)")
    faults.add_argument("--hang-after-done-on-host", default="",
                        help="after training returned, this host's workers never exit")
    faults.add_argument("--snapshot-gate", type=Path,
                        help="a file: snapshots written on --snapshot-gate-on-host wait while it exists (at most 60 s)")
    faults.add_argument("--snapshot-gate-on-host", default="", help="host whose snapshot writes wait at the gate")
    faults.add_argument("--child", action="store_true",
                        help="start a child process that sleeps (as a data loader's worker or a tool would); it "
                             "must not outlive the worker")
    faults.add_argument("--slow-exit", type=float, default=0.0,
                        help="seconds every worker's exit takes after it left the job (a busy machine's teardown)")
    return parser.parse_args()


class SnapshotGate:
    """A value of the state whose pickling waits while a file exists, in a snapshot writer's
    thread on one host only: the test holds a snapshot write there (its temporary file
    open, its commit taken) while training goes on. Deep copies (commits) and the state's
    broadcast pass at once, and so does the writer's copy of the tree before its file is open."""

    def __init__(self, path: str, host: str) -> None:
        self.path, self.host = path, host

    def __reduce__(self) -> tuple:
        copying = sys._getframe(1).f_code.co_filename == copy.__file__  # the writer's deep copy, not its pickle
        if (threading.current_thread().name == "elastic-snapshot" and not copying
                and os.environ.get("LIGHTNING_ELASTIC_HOSTNAME") == self.host):
            deadline = time.monotonic() + 60
            while os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.02)
        return (SnapshotGate, (self.path, self.host))


def on_host(host: str) -> bool:
    return host in ("all", le.slot_info().hostname)


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


@torch.no_grad()
def digest(model: torch.nn.Module) -> str:
    """The parameters' exact bytes, hashed: two runs' models are equal bit for bit or not."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def check_replicas(model: torch.nn.Module) -> None:
    """Every rank's parameters agree (one all-gather of their checksums), or raise."""
    mine = torch.tensor([checksum(model)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(le.size())]
    dist.all_gather(every, mine)
    if any(not torch.equal(other, mine) for other in every):
        raise ValueError(f"replicas differ on rank {le.rank()}: {[float(t) for t in every]}")


def main() -> None:
    args = parse_args()
    if args.start_delay and args.start_delay_on_host in ("all", os.environ.get("LIGHTNING_ELASTIC_HOSTNAME")):
        time.sleep(args.start_delay)  # before joining: the driver sees a worker still starting
    torch.manual_seed(0)
    if args.child:
        # Its command line names the events directory: the tests' check for processes left
        # behind finds it. Never waited for: it ends with the worker's process group.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", str(args.events)])  # noqa: S603
    if args.slow_exit:
        # Registered before le.init()'s own exit handler, so run after it: the worker has
        # reported and left the job, and sends no more heartbeats.
        atexit.register(time.sleep, args.slow_exit)
    le.init()
    events = Events(args.events)

    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator)
    dataset = TensorDataset(torch.arange(args.samples), inputs, targets)

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    # torch's DDP (bucketed gradient all-reduce, overlapped with backward), rebuilt on the
    # new process group after every reset. The state holds the module itself.
    ddp_model = le.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * le.size())
    sampler = le.ElasticSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = le.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, seen=[])
    if args.ballast_mb:
        state.ballast = torch.zeros(args.ballast_mb * 2**18)  # float32: 4 bytes each
    if args.snapshot_gate is not None:
        state.gate = SnapshotGate(str(args.snapshot_gate), args.snapshot_gate_on_host)
    injected = {"dist_error": False}

    def on_reset() -> None:
        events.emit("reset", round=le.current_worker().assignment.round)
        if args.reset_delay:
            time.sleep(args.reset_delay)
        # Linear learning-rate scaling with the world size.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * le.size()

    state.register_reset_callbacks([on_reset])
    slot = le.slot_info()
    events.emit("start", host=socket.gethostname(), local_rank=slot.local_rank, local_size=slot.local_size,
                cross_rank=slot.cross_rank, cross_size=slot.cross_size, master_addr=os.environ.get("MASTER_ADDR"))

    @le.run
    def train(state: le.TorchState) -> None:
        round_number = le.current_worker().assignment.round
        events.emit("synced", epoch=state.epoch, step=state.step, checksum=checksum(model), round=round_number)
        # The same on every rank: the round, and the steps taken in it since the sync.
        ends_after = args.end_in_round[1] if args.end_in_round and round_number >= args.end_in_round[0] else None
        steps_in_round = 0
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            for batch_idx, (index, x, y) in enumerate(loader):
                if state.step == args.fail_at_step and on_host(args.fail_on_host):
                    raise ValueError(f"injected failure at step {state.step} on rank {le.rank()}")
                if (state.step == args.dist_error_at_step and on_host(args.dist_error_on_host)
                        and not (args.dist_error_once and injected["dist_error"])):
                    injected["dist_error"] = True
                    events.emit("dist_error", step=state.step, round=le.current_worker().assignment.round)
                    raise dist.DistError(f"injected collective error at step {state.step}")
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(ddp_model(x), y)
                loss.backward()  # DDP averages the gradients across the world
                optimizer.step()
                if args.step_delay:
                    time.sleep(args.step_delay)
                seen: list = [None] * le.size()
                real = index[: sampler.real_in_batch(batch_idx, args.batch_size)]
                dist.all_gather_object(seen, real.tolist())
                if args.check_replicas:
                    check_replicas(model)
                state.seen.extend(i for part in seen for i in part)
                sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                events.emit("step", epoch=state.epoch, step=state.step, loss=loss.item(), real=len(real))
                if state.step % args.commit_every == 0:
                    state.commit()
                steps_in_round += 1
                if ends_after is not None and steps_in_round >= ends_after:
                    events.emit("done", step=state.step, checksum=checksum(model))
                    return
            committed = sorted(state.seen[: sampler.dataset_size])
            events.emit("epoch_end", epoch=state.epoch, samples=len(state.seen), unique=len(set(state.seen)),
                        complete=committed == list(range(sampler.dataset_size)))
            state.epoch += 1
            state.seen = []
            state.commit()
        events.emit("done", step=state.step, checksum=checksum(model), digest=digest(model))

    train(state)
    if le.rank() == 0:
        print(f"training finished: {state.step} steps, world size {le.size()}", flush=True)
    if args.hang_after_done_on_host and on_host(args.hang_after_done_on_host):
        events.emit("hanging")
        while True:
            time.sleep(1)
    if args.exit_code and on_host(args.exit_on_host):
        events.emit("exiting", code=args.exit_code)
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
