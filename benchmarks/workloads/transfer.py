"""A joiner's state transfer: ``TorchState.sync()`` against a raw ``dist.broadcast`` of the same bytes.

    lightning-elastic launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 \
        python benchmarks/workloads/transfer.py --model 100m --repeats 5 --out-dir D

Rank 0 trains one step (SGD momentum 0.9: its optimizer holds momentum) and commits; every
repeat rank 1 starts as a joiner: a new optimizer with no state and a new
``le.TorchState(model, optimizer)``. Each repeat, interleaved, timed on both ranks after
a barrier:

- ``sync``: ``state.sync()`` (rank 0's state, model and optimizer, onto every rank);
- ``broadcast``: ``dist.broadcast`` from rank 0 of one flat uint8 tensor with as many bytes
  as rank 0's state tensors (allocated and touched beforehand), in the same group;
- ``transfer``: the transfer inside ``sync`` alone (``lightning_elastic.commit.transfer.broadcast_commit``
  of rank 0's commit): into a joiner's new buffers (``transfer_fresh_s``), and a third time
  into the same snapshot, whose spare buffers are reused as a survivor's are
  (``transfer_reused_s``). ``sync`` adds rank 0's save and rank 1's restore to it.

Rank 1 also records its memory during each sync: the peak RSS (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``, and the highest ``/proc/self/statm`` sample of a thread
reading it every ~1 ms), its RSS before the sync (and before the model existed), and the
bytes of its live model and optimizer state before and after the sync. Each rank writes ``rank<r>.json`` to ``--out-dir``. The
measurement runs inside ``@le.run`` (on a state of its own) so that the job ends cleanly.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import _shared as sh
import lightning_elastic as le
from lightning_elastic.commit.buffers import HostSnapshot
from lightning_elastic.commit.transfer import broadcast_commit

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def vm_hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Highest RSS seen by a thread sampling every ``interval`` seconds while running."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.peak, self.samples = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak = rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", choices=sorted(sh.SPECS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    spec = sh.spec(args.model)
    le.init()
    base_rss = rss()  # torch, lightning_elastic and the process group; no model yet
    model = sh.build_model(spec)
    rank = le.rank()
    out: dict = {"rank": rank, "size": le.size(), "model": spec.name, "base_rss": base_rss,
                 "sync_s": [], "broadcast_s": [], "rss_before": [], "peak_hwm": [], "peak_sampled": [],
                 "samples": [], "live_bytes_before": [], "live_bytes": [], "committed_bytes": [],
                 "transfer_fresh_s": [], "transfer_second_s": [], "transfer_reused_s": []}

    def measure(_: le.ObjectState) -> None:
        optimizer = sh.make_optimizer(model, spec, momentum=0.9)
        state = None
        if rank == 0:
            sh.train_step(model, optimizer, *sh.batch_at(sh.random_data(spec), spec, 0, 0, 1))
            state = le.TorchState(model, optimizer)
            state.save()  # a source has committed before a joiner arrives
        state_bytes = sum(t.numel() * t.element_size() for t in sh.state_tensors(model, optimizer))
        box = [state_bytes]
        dist.broadcast_object_list(box, src=0)
        out["state_bytes"] = state_bytes = box[0]
        for _repeat in range(args.repeats):
            if rank != 0:
                optimizer = state = None
                gc.collect()
                optimizer = sh.make_optimizer(model, spec, momentum=0.9)  # a joiner's: no momentum
                state = le.TorchState(model, optimizer)
            out["live_bytes_before"].append(
                sum(t.numel() * t.element_size() for t in sh.state_tensors(model, optimizer)))
            out["rss_before"].append(rss())
            out["hwm_reset"] = reset_hwm()
            dist.barrier()
            with RssSampler() as sampler:
                start = time.perf_counter()
                state.sync()
                out["sync_s"].append(time.perf_counter() - start)
            out["peak_sampled"].append(sampler.peak)
            out["samples"].append(sampler.samples)
            out["peak_hwm"].append(vm_hwm() if out["hwm_reset"] else None)
            out["live_bytes"].append(sum(t.numel() * t.element_size() for t in sh.state_tensors(model, optimizer)))
            out["committed_bytes"].append(state.committed_bytes)
            flat = torch.zeros(state_bytes, dtype=torch.uint8)
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast(flat, src=0)
            out["broadcast_s"].append(time.perf_counter() - start)
            del flat
            # The transfer alone (no save on rank 0, no restore on rank 1): into a joiner's
            # new buffers, then (third time) into buffers reused as a survivor's are.
            snapshot = state._snapshot if rank == 0 else HostSnapshot()
            for key in ("transfer_fresh_s", "transfer_second_s", "transfer_reused_s"):
                dist.barrier()
                start = time.perf_counter()
                broadcast_commit(snapshot, rank, 2, 0, torch.device("cpu"))
                out[key].append(time.perf_counter() - start)
            del snapshot
            dist.barrier()

    le.run(measure)(le.ObjectState())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
