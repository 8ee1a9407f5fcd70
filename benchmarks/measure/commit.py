"""What a commit costs, in one process (no launcher: a world of one).

- Bandwidth: workloads/commit_bandwidth.py times ``le.TorchState(model, optimizer).save()``
  against ``copy_`` into preallocated host tensors (the floor) and ``clone()`` of the same
  tensors, interleaved round by round after warm-up rounds (reported apart: the first
  saves allocate the commit's buffers). GB/s = bytes saved / second (1 GB = 1e9 bytes).
- Lightning: workloads/lightning_train.py with ``elastic_hvd`` as a world of one (one
  intra-op thread, as the distributed workers have), committing
  every step against never (``commit every 10**9 steps``), both checking every step;
  steady step as in the step-time measurement; ratio paired by trial.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import Job, Summary, failures, interleave, md_table, steady_step, trial, values, workload, progress
from measure.step import paired_ratios, plan_for

NEVER = 10**9
# Like the distributed workers (both launchers set it): two intra-op threads on a busy
# 2-core machine made a step of the small model 15x slower, in noise.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
METHODS = {"save": "TorchState.save()", "copy_": "copy_ into preallocated (floor)", "clone": "clone() of every tensor"}


def run(models: list[str], repeats: int, trials: int, workdir: Path, quick: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    for model in models:
        directory = workdir / "commit" / model / "bandwidth"
        bandwidth = trial(lambda: _bandwidth(model, repeats, directory))
        if bandwidth["ok"]:
            v = bandwidth["value"]
            progress(f"[commit {model}] bandwidth: " + ", ".join(
                f"{m} {Summary.of([v['bytes'] / s for s in v['seconds'][m]]).median / 1e9:.2f} GB/s" for m in METHODS))
        else:
            progress(f"[commit {model}] bandwidth: FAILED: {bandwidth['error'].splitlines()[0]}")
        plan = plan_for(model, quick)

        def lightning(commit_every: int):
            def measure(index: int, directory: Path) -> dict[str, Any]:
                command = workload("lightning_train.py", "--strategy", "elastic_hvd", "--model", model, "--steps",
                                   plan.steps, "--log-dir", directory / "steps", "--commit-every", commit_every,
                                   "--check-every", 1)
                return steady_step(command, directory, plan.warmup, plan.timeout, env=ONE_THREAD)
            return trials, measure

        results, _ = interleave(f"commit {model}", {"every-step": lightning(1), "never": lightning(NEVER)}, workdir,
                                lambda v: f"{v['median_s'] * 1000:.1f} ms")
        out["models"][model] = {"bandwidth": bandwidth, "lightning": results, "plan": {
            "steps": plan.steps, "warmup": plan.warmup, "never": NEVER}}
    return out


def _bandwidth(model: str, repeats: int, directory: Path) -> dict[str, Any]:
    result = directory / "result.json"
    Job(workload("commit_bandwidth.py", "--model", model, "--repeats", repeats, "--warmup", 2, "--out", result),
        directory).run(timeout=1800)
    return json.loads(result.read_text())


def report(result: dict[str, Any]) -> str:
    parts = []
    for model, data in result["models"].items():
        b = data["bandwidth"]
        if b["ok"]:
            v = b["value"]
            rows = []
            for m, label in METHODS.items():
                rates = Summary.of([v["bytes"] / s for s in v["seconds"][m]])
                times = Summary.of(v["seconds"][m])
                first = ", ".join(f"{s * 1000:.0f}" for s in v.get("warmup_seconds", {}).get(m, []))
                rows.append([label, rates.show(1e-9, "{:.2f}", " GB/s"), times.show(1000, "{:.1f}", " ms"),
                             f"{first} ms" if first else "-"])
            parts.append(f"Commit bandwidth, model {model}, one process ({v['bytes'] / 1e6:.1f} MB in "
                         f"{v['tensors']} tensors, {v['threads']} torch threads, {len(v['seconds']['save'])} "
                         "rounds; median (range)):\n\n"
                         + md_table(["method", "bandwidth", "time", "warm-up rounds"], rows))
        else:
            parts.append(f"Commit bandwidth, model {model}: FAILED: {b['error']}")
        lt = data["lightning"]
        every = Summary.of(values(lt["every-step"], lambda x: x["median_s"]))
        never = Summary.of(values(lt["never"], lambda x: x["median_s"]))
        ratio = Summary.of(paired_ratios(lt["every-step"], lt["never"]))
        notes = [f"- {k}: {e.splitlines()[0]}" for k in lt for e in failures(lt[k])]
        parts.append(f"Lightning elastic_hvd, world of one, OMP_NUM_THREADS=1, model {model} (steady step, "
                     f"{data['plan']['steps']} steps, {data['plan']['warmup']} warm-up; median (range) over trials):\n\n"
                     + md_table(["commit every step", "never", "ratio (paired by trial)"],
                                [[every.show(1000, "{:.1f}", " ms"), never.show(1000, "{:.1f}", " ms"),
                                  ratio.show(fmt="{:.3f}")]])
                     + ("\n\nFailed trials:\n" + "\n".join(notes) if notes else ""))
    return "\n\n".join(parts)
