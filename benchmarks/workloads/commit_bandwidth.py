"""Commit bandwidth in one process: ``le.TorchState.save()`` against plain copies of the same tensors.

    python benchmarks/workloads/commit_bandwidth.py --model 100m --repeats 10 --out result.json

After one optimizer step (so SGD's momentum buffers exist), times, interleaved round by
round after ``--warmup`` rounds (timed too, reported apart: the first saves allocate):

- ``save``: ``state.save()`` of ``le.TorchState(model, optimizer)`` (what ``commit()`` copies);
- ``copy_``: ``dst.copy_(src)`` of every tensor into host tensors allocated once (the floor);
- ``clone``: ``src.clone()`` of every tensor (fresh memory each time, as a commit needs).

Each method keeps its previous result alive while it makes the next (as a commit replaces
the previous one). Bytes are those of the tensors ``save()`` kept; GB/s = 1e9 bytes/s.
Writes ``{"bytes": ..., "seconds": {method: [...]}, ...}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import _shared as sh
import lightning_elastic as le


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", choices=sorted(sh.SPECS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (their times reported apart)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = sh.spec(args.model)
    le.init()  # a world of one outside the launcher
    model = sh.build_model(spec)
    optimizer = sh.make_optimizer(model, spec, momentum=0.9)
    sh.train_step(model, optimizer, *sh.batch_at(sh.random_data(spec), spec, 0, 0, 1))
    state = le.TorchState(model, optimizer)
    sources = sh.state_tensors(model, optimizer)
    floor = [torch.empty_like(t) for t in sources]
    for dst in floor:
        dst.zero_()  # touch the pages once: the floor pays no page faults
    kept: dict[str, object] = {}

    def save() -> None:
        state.save()

    def copy() -> None:
        for dst, src in zip(floor, sources):
            dst.copy_(src)

    def clone() -> None:
        kept["clone"] = [t.clone() for t in sources]  # the previous clones are freed after

    methods = {"save": save, "copy_": copy, "clone": clone}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    warmup: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.warmup + args.repeats):
        for name, method in methods.items():
            start = time.perf_counter()
            method()
            elapsed = time.perf_counter() - start
            (warmup if round_ < args.warmup else seconds)[name].append(elapsed)
    saved = state.committed_bytes
    result = {
        "model": spec.name,
        "bytes": saved,
        "tensor_bytes": sum(t.numel() * t.element_size() for t in sources),
        "tensors": len(sources),
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "warmup_seconds": warmup,
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
