"""Durable snapshots against no snapshots, torch.save from the loop and DCP async_save, in one run.

    python benchmarks/snapshot_cost.py --model 100m --seconds 40 --every 10 --trials 1 \
        --out benchmarks/results/<date>-snapshot-cost.json

Each variant of workloads/snapshot_cost.py runs in a process of its own (its peak RSS is
its own), trials interleaved (trial 1 of every variant, then trial 2, ...). Then the time
to the first step: from a process's start, resuming from the snapshot the ``snapshot``
variant left and starting afresh (an empty directory) for reference; and from the start of
a new ``lightning-elastic launch -np 1 --snapshot-dir`` (the driver picks the snapshot and
verifies its checksum before the worker starts; the worker loads it), resuming and afresh.
Prints a Markdown table; writes every trial's raw numbers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "workloads" / "snapshot_cost.py"
LAUNCHER = Path(sys.executable).parent / "lightning-elastic"
VARIANTS = ("none", "snapshot", "torch_save", "dcp_async")
RESUMES = ("resume", "fresh", "launch_resume", "launch_fresh")


def run(variant: str, args: argparse.Namespace, directory: Path, out: Path, launch: bool = False) -> dict:
    """One workload process; with ``launch``, started by a new launch of one worker whose
    ``--snapshot-dir`` is ``directory`` (``--t0`` is then the launch's start)."""
    command = [sys.executable, str(WORKLOAD), "--variant", variant, "--model", args.model, "--seconds",
               str(args.seconds), "--every", str(args.every), "--dir", str(directory), "--out", str(out),
               "--t0", repr(time.time())]
    if launch:
        command = [str(LAUNCHER), "launch", "-np", "1", "-H", "127.0.0.1:1", "--snapshot-dir", str(directory),
                   "--snapshot-every", str(args.every), *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.seconds * 10 + 300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        return {"variant": variant, "error": done.stderr[-2000:]}
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--resume-trials", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in (*VARIANTS, *RESUMES)}
    with tempfile.TemporaryDirectory(prefix="snapshot-cost-") as tmp:
        root = Path(tmp)
        for t in range(args.trials):
            for variant in VARIANTS:
                directory = root / f"{variant}-{t}"
                results[variant].append(run(variant, args, directory, root / f"{variant}-{t}.json"))
                print(f"[{variant} trial {t}] done", file=sys.stderr, flush=True)
        snapshots = root / f"snapshot-{args.trials - 1}"
        for t in range(args.resume_trials):
            results["resume"].append(run("resume", args, snapshots, root / f"resume-{t}.json"))
            results["fresh"].append(run("resume", args, root / f"empty-{t}", root / f"fresh-{t}.json"))
            results["launch_resume"].append(run("resume", args, snapshots, root / f"launch-resume-{t}.json", True))
            results["launch_fresh"].append(run("resume", args, root / f"launch-empty-{t}",
                                               root / f"launch-fresh-{t}.json", True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1))
    print(report(results))


def report(results: dict[str, list[dict]]) -> str:
    base = [statistics.mean(r["step_s"]) for r in results["none"] if "step_s" in r]
    rows = ["| variant | steps | median step | mean step | max step | mean / none | save in loop | peak RSS |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for variant in VARIANTS:
        for r in results[variant]:
            if "error" in r:
                rows.append(f"| {variant} | FAILED: {r['error'].strip().splitlines()[-1][:80]} |||||||")
                continue
            s = r["step_s"]
            ratio = statistics.mean(s) / base[0] if base else float("nan")
            saves = ", ".join(f"{x:.2f}" for x in r["save_s"]) or "-"
            extra = f" ({r['snapshots']['written']} written)" if "snapshots" in r else ""
            rows.append(f"| {variant}{extra} | {len(s)} | {statistics.median(s) * 1000:.0f} ms | "
                        f"{statistics.mean(s) * 1000:.0f} ms | {max(s) * 1000:.0f} ms | {ratio:.3f} | {saves} s | "
                        f"{r['peak_rss_mb']:.0f} MB |")
    for name in RESUMES:
        for r in results.get(name, []):
            if "error" in r:
                rows.append(f"\nStart to first step, {name}: FAILED: {r['error'].strip().splitlines()[-1][:80]}")
        ok = [r for r in results.get(name, []) if r.get("to_first_step_s") is not None]
        if ok:
            times = ", ".join(f"{r['to_first_step_s']:.2f}" for r in ok)
            peak = max(r["peak_rss_mb"] for r in ok)
            rows.append(f"\nStart to first step, {name} (resumed at step {ok[0].get('resumed_step')}): {times} s; "
                        f"worker peak RSS {peak:.0f} MB")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
