"""Steady step time, 3 workers on this machine: lightning-elastic against the same work under torchrun.

Per model, seven variants, each a whole job run to its end (trials interleaved):

- ``lightning/ddp``: workloads/lightning_train.py, Lightning ``ddp`` under
  ``torchrun --standalone --nproc-per-node 3`` (the peer);
- ``lightning/elastic-default``: ``elastic_hvd`` under ``lightning-elastic launch -np 3`` on
  127.0.0.1-3 with ``le.ElasticCallback()`` (commits paced by their cost, a host check
  every step);
- ``lightning/elastic-every-step``: the same with a commit at every step;
- ``lightning/elastic-commit10``: the same with a commit every 10 steps, a check every step;
- ``loop/torchrun``: workloads/loop.py, a plain DDP loop under torchrun (the peer);
- ``loop/le.run``: the same loop in ``@le.run`` under the launcher, ``state.commit()`` every
  10 steps and ``state.check_host_updates()`` every step;
- ``loop/le.run-bare``: the same loop in ``@le.run`` with no commit and no check (what the
  launcher itself costs).

Steady step: median interval between rank 0's consecutive completed steps after the
warm-up steps. A trial's ratio is elastic / peer of the same trial index.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from harness import (Summary, elastic_launch, failures, interleave, md_table, steady_step, torchrun, values,
                     workload)

WORKERS = 3


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    warmup: int
    timeout: float  # seconds for one job


PLANS = {"small": Plan(steps=400, warmup=100, timeout=600), "100m": Plan(steps=30, warmup=6, timeout=1800)}
QUICK_PLANS = {"small": Plan(steps=200, warmup=50, timeout=300), "100m": Plan(steps=12, warmup=4, timeout=900)}


def plan_for(model: str, quick: bool) -> Plan:
    return (QUICK_PLANS if quick else PLANS)[model]


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    peer: str | None  # the key of the variant this one is compared with (None: a peer itself)
    script: str
    args: tuple[str, ...]
    elastic: bool

    def command(self, model: str, plan: Plan, directory: Path) -> list[str]:
        inner = workload(self.script, "--model", model, "--steps", plan.steps, "--log-dir", directory / "steps",
                         *self.args)
        return elastic_launch(WORKERS, inner) if self.elastic else torchrun(WORKERS, inner)


VARIANTS = [
    Variant("lightning/ddp", "Lightning ddp, torchrun", None, "lightning_train.py", ("--strategy", "ddp"), False),
    Variant("lightning/elastic-default", "elastic_hvd, ElasticCallback() (paced commits, check every step)",
            "lightning/ddp", "lightning_train.py", ("--strategy", "elastic_hvd"), True),
    Variant("lightning/elastic-every-step", "elastic_hvd, commit + check every step", "lightning/ddp",
            "lightning_train.py", ("--strategy", "elastic_hvd", "--commit-every", "1", "--check-every", "1"), True),
    Variant("lightning/elastic-commit10", "elastic_hvd, commit every 10 steps, check every step", "lightning/ddp",
            "lightning_train.py", ("--strategy", "elastic_hvd", "--commit-every", "10", "--check-every", "1"), True),
    Variant("loop/torchrun", "DDP loop, torchrun", None, "loop.py", (), False),
    Variant("loop/le.run", "@le.run loop, commit every 10 steps, check every step", "loop/torchrun", "loop.py",
            ("--commit-every", "10", "--check-every", "1"), True),
    # The same loop under the launcher with no elastic call in it: what the launcher, the
    # worker's heartbeat thread and the round's process group cost by themselves.
    Variant("loop/le.run-bare", "@le.run loop, no commit or check", "loop/torchrun", "loop.py",
            ("--commit-every", "1000000000", "--check-every", "1000000000"), True),
]


def ms(value: dict[str, Any]) -> str:
    return f"{value['median_s'] * 1000:.1f} ms"


def run(models: list[str], trials: int, workdir: Path, quick: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": WORKERS, "models": {}}
    for model in models:
        plan = plan_for(model, quick)
        jobs = {v.key: (trials, _measure(v, model, plan)) for v in VARIANTS}
        results, skipped = interleave(f"step {model}", jobs, workdir, ms)
        out["models"][model] = {
            "plan": dataclasses.asdict(plan),
            "variants": {v.key: {"label": v.label, "peer": v.peer, "command": v.command(model, plan, Path("<trial dir>")),
                                 "trials": results[v.key], "skipped": skipped.get(v.key)} for v in VARIANTS},
        }
    return out


def _measure(variant: Variant, model: str, plan: Plan):
    return lambda index, directory: steady_step(variant.command(model, plan, directory), directory, plan.warmup,
                                                plan.timeout)


def paired_ratios(trials: list[dict], peer_trials: list[dict], get=lambda v: v["median_s"]) -> list[float | None]:
    """elastic / peer per trial index (None where either failed)."""
    mine, theirs = values(trials, get), values(peer_trials, get)
    return [a / b if a is not None and b else None for a, b in zip(mine, theirs)]


def report(result: dict[str, Any]) -> str:
    parts = []
    for model, data in result["models"].items():
        plan = data["plan"]
        rows = []
        notes = []
        for key, v in data["variants"].items():
            steps = Summary.of(values(v["trials"], lambda x: x["median_s"]))
            ratio = "peer"
            if v["peer"]:
                ratio = Summary.of(paired_ratios(v["trials"], data["variants"][v["peer"]]["trials"])).show(fmt="{:.3f}")
            rows.append([v["label"], steps.show(1000, "{:.1f}", " ms"), ratio])
            notes += [f"- {key}: {e.splitlines()[0]}" for e in failures(v["trials"])]
            if v["skipped"]:
                notes.append(f"- {key}: skipped ({v['skipped']})")
        parts.append(
            f"Steady step, model {model}, {result['workers']} workers ({plan['steps']} steps, "
            f"{plan['warmup']} warm-up; median over trials of rank 0's median interval, range):\n\n"
            + md_table(["variant", "steady step", "elastic/peer (paired by trial)"], rows)
            + ("\n\nFailed trials:\n" + "\n".join(notes) if notes else ""))
    return "\n\n".join(parts)
