"""Plot a results file of benchmarks/suite.py as one PNG (one panel per measured section).

    benchmarks/.venv/bin/python benchmarks/plot.py benchmarks/results/<date>.json [-o out.png]

Bars are medians over trials, whiskers the range; recovery shows every trial as a dot
(failed trials as crosses at the bound); goodput shows each run with kills against the same
tool's failure-free run of the same trial. Needs matplotlib (in benchmarks/.venv).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: run it with benchmarks/.venv/bin/python "
                         "(bash benchmarks/setup-venv.sh creates it) or pip install matplotlib") from None
    return plt


def _ok(trials: list[dict], get) -> list[float]:
    return [get(t["value"]) for t in trials if t["ok"]]


def _bars(ax: Any, labels: list[str], samples: list[list[float]], unit: str, title: str) -> None:
    medians = [statistics.median(s) if s else 0.0 for s in samples]
    low = [m - min(s) if s else 0.0 for m, s in zip(medians, samples)]
    high = [max(s) - m if s else 0.0 for m, s in zip(medians, samples)]
    positions = range(len(labels))
    ax.barh(positions, medians, xerr=[low, high], color="tab:blue", alpha=0.8, capsize=3)
    for y, (m, s) in enumerate(zip(medians, samples)):
        ax.text(max(s) if s else 0.0, y, f"  {m:.3g}" if s else " failed", va="center", fontsize=7)
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def _step(results: dict) -> list[tuple]:
    panels = []
    for model, data in results["models"].items():
        labels, samples = [], []
        for v in data["variants"].values():
            labels.append(v["label"])
            samples.append(_ok(v["trials"], lambda x: x["median_s"] * 1000))
        panels.append((labels, samples, "ms per step", f"steady step, {model}, 3 workers"))
    return panels


def _commit(results: dict) -> list[tuple]:
    panels = []
    for model, data in results["models"].items():
        b = data["bandwidth"]
        if b["ok"]:
            v = b["value"]
            labels = list(v["seconds"])
            samples = [[v["bytes"] / s / 1e9 for s in v["seconds"][m]] for m in labels]
            panels.append((labels, samples, "GB/s", f"commit bandwidth, {model}"))
        lt = data["lightning"]
        panels.append((["commit every step", "never"],
                       [_ok(lt["every-step"], lambda x: x["median_s"] * 1000), _ok(lt["never"], lambda x: x["median_s"] * 1000)],
                       "ms per step", f"elastic_hvd world of one, {model}"))
    return panels


def _transfer(results: dict) -> list[tuple]:
    labels, samples = [], []
    for model, record in results["models"].items():
        if not record["ok"]:
            continue
        r = record["value"]["rank1"]  # the receiver's view
        for key, name in (("broadcast_s", "raw broadcast"), ("transfer_fresh_s", "transfer, new buffers"),
                          ("transfer_reused_s", "transfer, reused buffers"), ("sync_s", "sync")):
            if r.get(key):
                labels.append(f"{model}: {name}")
                samples.append([r["state_bytes"] / s / 1e9 for s in r[key]])
    return [(labels, samples, "GB/s", "joiner transfer, 2 workers (rank 1)")] if labels else []


def _goodput(results: dict) -> list[tuple]:
    """Goodput / the same tool's failure-free run, paired by trial (measure/goodput.py's report)."""
    runs = results["runs"]
    labels, samples = [], []
    for key, run in runs.items():
        if not run["period"] or not run["trials"]:
            continue
        # The same tool's failure-free run: le/loop/fresh/every-10s -> le/loop/none/none,
        # torchft/every-10s -> torchft/none (measure/goodput.py's baseline_key).
        elastic = run["tool"].startswith("le/")
        base = key.rsplit("/", 2)[0] + "/none/none" if elastic else key.rsplit("/", 1)[0] + "/none"
        baseline = runs.get(base, {}).get("trials", [])
        ratios = [a["value"]["goodput"] / b["value"]["goodput"] for a, b in zip(run["trials"], baseline)
                  if a["ok"] and b["ok"]]
        labels.append(f"{run['label']}, SIGKILL every {run['period']:g} s")
        samples.append(ratios)
    return [(labels, samples, "goodput / failure-free run", f"goodput, {results['workers']} workers, "
             f"{results['run_s']:.0f} s runs")] if labels else []


def _recovery(ax: Any, results: dict) -> None:
    bound = results["bound_s"]
    tools = list(results["tools"].items())
    for y, (_, tool) in enumerate(tools):
        ok = _ok(tool["trials"], lambda x: x["seconds"])
        failed = sum(not t["ok"] for t in tool["trials"])
        ax.scatter(ok, [y] * len(ok), color="tab:blue", s=14)
        if failed:
            ax.scatter([bound] * failed, [y] * failed, color="tab:red", marker="x", s=20)
        if ok:
            ax.text(statistics.median(ok), y - 0.3, f"{statistics.median(ok):.2f} s", fontsize=7, ha="center")
        if tool.get("skipped") and not tool["trials"]:
            ax.text(0.02, y, "skipped: " + tool["skipped"][:80], fontsize=7, va="center",
                    transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(tools)), [tool["label"] for _, tool in tools], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("s from SIGKILL to the next step (x: none within the bound)")
    ax.set_title("recovery, 3 workers", fontsize=9)


def plot(document: dict, out: Path) -> None:
    plt = _pyplot()
    results = document["results"]
    panels: list[tuple] = []
    for name, build in (("step", _step), ("commit", _commit), ("transfer", _transfer), ("goodput", _goodput)):
        if name in results:
            panels += build(results[name])
    count = len(panels) + ("recovery" in results)
    if count == 0:
        raise SystemExit("the results file has no measured section")
    heights = [0.6 + 0.3 * len(p[0]) for p in panels] + ([2.4] if "recovery" in results else [])
    fig, axes = plt.subplots(count, 1, figsize=(9, sum(heights) + 1), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (labels, samples, unit, title) in zip(axes[:, 0], panels):
        _bars(ax, labels, samples, unit, title)
    if "recovery" in results:
        _recovery(axes[-1, 0], results["recovery"])
    env = document.get("environment", {})
    fig.suptitle(f"lightning-elastic benchmarks {document.get('date', '')[:10]}: torch {env.get('torch')}, "
                 f"lightning {env.get('lightning')}, {env.get('cpu_count')} CPUs, "
                 f"commit {(env.get('git_commit') or '?')[:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("-o", "--out", type=Path, help="PNG path (default: the results path with .png)")
    args = parser.parse_args(argv)
    document = json.loads(args.results.read_text())
    plot(document, args.out or args.results.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
