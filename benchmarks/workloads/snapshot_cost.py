"""What a durable snapshot costs the training loop, in one process (a world of one).

    python benchmarks/workloads/snapshot_cost.py --variant snapshot --model 100m --seconds 60 --every 10 \
        --dir /tmp/snaps --out result.json

The loop trains the model of ``_shared`` (``le.TorchState(model, optimizer, step=...)``,
one intra-op thread as the distributed workers have) and commits every ``--commit-every``
steps in every variant; what differs is how the state reaches the disk every ``--every``
seconds:

- ``none``: it does not (the baseline);
- ``snapshot``: ``le.init(snapshot_dir=..., snapshot_every=...)``: rank 0's background
  writer persists the newest commit;
- ``torch_save``: ``torch.save({"model": ..., "optimizer": ...})`` from the training loop;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the same state dicts (the
  previous save waited for before the next, as its docs ask);
- ``resume``: no training beyond one step: the time from this process's start (``--t0``,
  the caller's wall clock at spawn) to the end of the first step after ``@le.run``
  resumed from the newest snapshot in ``--dir`` (or started afresh if there is none).

Every step's wall time (the step, its commit and any save made in it) is recorded after
``--warmup`` steps. Writes ``{"step_s": [...], "peak_rss_mb": ..., ...}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

import _shared as sh
import lightning_elastic as le


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=["none", "snapshot", "torch_save", "dcp_async", "resume"])
    parser.add_argument("--model", default="100m", choices=sorted(sh.SPECS))
    parser.add_argument("--seconds", type=float, default=60.0, help="steady training time after the warm-up")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between saves")
    parser.add_argument("--commit-every", type=int, default=5, help="in-memory commit every N steps (all variants)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--t0", type=float, default=None, help="wall clock when the caller spawned this process")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = sh.spec(args.model)
    if args.variant in ("snapshot", "resume"):
        le.init(snapshot_dir=args.dir, snapshot_every=args.every, snapshot_keep=2)
    else:
        le.init()
    model = sh.build_model(spec)
    optimizer = sh.make_optimizer(model, spec)
    data = sh.random_data(spec)
    state = le.TorchState(model, optimizer, step=0)
    times: list[float] = []
    saves: list[float] = []
    result: dict[str, object] = {"variant": args.variant, "model": args.model, "every_s": args.every,
                                 "commit_every": args.commit_every}
    pending = None
    last_save = time.monotonic()

    def save_from_loop() -> None:
        nonlocal pending, last_save
        if args.variant not in ("torch_save", "dcp_async") or time.monotonic() - last_save < args.every:
            return
        last_save = time.monotonic()
        started = time.perf_counter()
        tree = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if args.variant == "torch_save":
            path = args.dir / f"save-{state.step}.pt"
            torch.save(tree, path)
        else:
            import torch.distributed.checkpoint as dcp  # noqa: PLC0415

            if pending is not None:
                pending.result()
            pending = dcp.async_save(tree, checkpoint_id=str(args.dir / f"dcp-{state.step}"))
        saves.append(time.perf_counter() - started)

    @le.run
    def train(state: le.TorchState) -> None:
        if args.variant == "resume":
            result["resumed_step"] = state.step
            sh.train_step(model, optimizer, *sh.batch_at(data, spec, state.step, 0, 1))
            result["to_first_step_s"] = time.time() - args.t0 if args.t0 else None
            return
        deadline = None
        while deadline is None or time.monotonic() < deadline:
            started = time.perf_counter()
            sh.train_step(model, optimizer, *sh.batch_at(data, spec, state.step, 0, 1))
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
            save_from_loop()
            elapsed = time.perf_counter() - started
            if state.step > args.warmup:
                times.append(elapsed)
                if deadline is None:
                    deadline = time.monotonic() + args.seconds

    args.dir.mkdir(parents=True, exist_ok=True)
    train(state)
    if pending is not None:
        pending.result()
    writer = le.current_worker().snapshot_writer
    if writer is not None:
        writer.wait(120)
        result["snapshots"] = {"written": writer.stats.written, "failed": writer.stats.failed}
    result.update(step_s=times, save_s=saves, peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
