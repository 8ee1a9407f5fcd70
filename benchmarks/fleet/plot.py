"""Plot fleet simulation results: times and driver CPU against the number of workers.

    benchmarks/.venv/bin/python benchmarks/fleet/plot.py AFTER.json [--before BEFORE.json ...] -o docs/images/fleet.png

Left: first round, re-formation after a loss and the NCCL bootstrap through the store
(log-log; a missing point is a phase that did not finish). Right: the driver's steady CPU
(share of one core). ``--before`` files (an older driver, same benchmark) are drawn dashed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TIMES = (("first_round_s", "first round"), ("reform_s", "re-formed after a loss"))


def load(paths: list[Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows += json.loads(path.read_text())["results"]
    return rows


def series(rows: list[dict[str, Any]], value: Any) -> tuple[list[int], list[float]]:
    """(N, median of the runs at that N) for the runs where ``value(row)`` is known."""
    by_n: dict[int, list[float]] = {}
    for row in rows:
        v = value(row)
        if v is not None:
            by_n.setdefault(row["workers"], []).append(v)
    ns = sorted(by_n)
    return ns, [sorted(by_n[n])[len(by_n[n]) // 2] for n in ns]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("after", type=Path, nargs="+")
    parser.add_argument("--before", type=Path, nargs="*", default=[])
    parser.add_argument("-o", "--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    after, before = load(args.after), load(args.before)
    fig, (times, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (key, label), color in zip(TIMES, ("tab:blue", "tab:orange")):
        times.plot(*series(after, lambda r, k=key: r.get(k)), "o-", color=color, label=label)
        if before:
            times.plot(*series(before, lambda r, k=key: r.get(k)), "x--", color=color, alpha=0.6,
                       label=f"{label} (thread per connection)")
    never = sorted({r["workers"] for r in before if r.get("first_round_s") is None})
    for n in never:
        times.annotate(f"thread per connection:\nno round at {n}", (n, 3.0), fontsize=7, ha="right", color="grey")
    times.plot(*series(after, lambda r: (r.get("store_nccl") or {}).get("seconds")), "s-", color="tab:green",
               label="NCCL bootstrap via the store")
    times.set(xscale="log", yscale="log", xlabel="workers", ylabel="seconds",
              title="Rounds formed (1 core for the driver)")
    cpu.plot(*series(after, lambda r: r.get("steady_driver_cpu") and 100 * r["steady_driver_cpu"]), "o-",
             color="tab:purple", label="asyncio service")
    if before:
        cpu.plot(*series(before, lambda r: r.get("steady_driver_cpu") and 100 * r["steady_driver_cpu"]), "x--",
                 color="tab:purple", alpha=0.6, label="thread per connection")
    cpu.axhline(50, color="grey", lw=0.8, ls=":")
    cpu.set(xscale="log", xlabel="workers", ylabel="% of one core", ylim=(0, 100),
            title="Driver CPU, steady heartbeats")
    for ax in (times, cpu):
        ax.set_xticks([64, 256, 1024, 2048, 4096], ["64", "256", "1024", "2048", "4096"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
