"""A joiner's state transfer: ``TorchState.sync()`` against a raw broadcast of the same bytes.

One job per model: workloads/transfer.py under ``lightning-elastic launch -np 2`` (127.0.0.1
and 127.0.0.2); rank 0 has trained a step (momentum exists), rank 1 is a fresh joiner at
every repeat; ``sync`` and a ``dist.broadcast`` of one flat tensor of the state's bytes
alternate, timed on both ranks. GB/s = state bytes / seconds (1 GB = 1e9 bytes).
Memory (rank 1, the joiner): peak RSS during the sync against its RSS before it plus what
the sync must add: the optimizer state it receives and one commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import Job, Summary, elastic_launch, md_table, progress, trial, workload

MB = 1e6


def run(models: list[str], repeats: int, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    for model in models:
        directory = workdir / "transfer" / model
        record = trial(lambda: _job(model, repeats, directory))
        if record["ok"]:
            r1 = record["value"]["rank1"]
            progress(f"[transfer {model}] rank 1: sync {_rate(r1, 'sync_s').median / 1e9:.2f} GB/s, "
                     f"broadcast {_rate(r1, 'broadcast_s').median / 1e9:.2f} GB/s")
        else:
            progress(f"[transfer {model}] FAILED: {record['error'].splitlines()[0]}")
        out["models"][model] = record
    return out


def _job(model: str, repeats: int, directory: Path) -> dict[str, Any]:
    results = directory / "results"
    command = elastic_launch(2, workload("transfer.py", "--model", model, "--repeats", repeats, "--out-dir", results))
    Job(command, directory).run(timeout=1800)
    return {f"rank{r}": json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)}


def _rate(rank: dict[str, Any], key: str) -> Summary:
    return Summary.of([rank["state_bytes"] / s for s in rank[key]])


def report(result: dict[str, Any]) -> str:
    rows, memory, failed = [], [], []
    for model, record in result["models"].items():
        if not record["ok"]:
            failed.append(f"- {model}: {record['error']}")
            continue
        r0, r1 = record["value"]["rank0"], record["value"]["rank1"]
        def vs_broadcast(key: str) -> str:
            return Summary.of([b / s for s, b in zip(r1[key], r1["broadcast_s"])]).show(fmt="{:.2f}")

        rows.append([model, f"{r1['state_bytes'] / MB:.1f} MB", str(len(r1["sync_s"])),
                     _rate(r1, "broadcast_s").show(1e-9, "{:.2f}"),
                     _rate(r1, "transfer_fresh_s").show(1e-9, "{:.2f}"), vs_broadcast("transfer_fresh_s"),
                     _rate(r1, "transfer_reused_s").show(1e-9, "{:.2f}"), vs_broadcast("transfer_reused_s"),
                     _rate(r1, "sync_s").show(1e-9, "{:.2f}"), vs_broadcast("sync_s")])
        if model != "small":
            memory.append(_memory_row(model, r1))
    text = ("Joiner transfer, 2 workers (GB/s, median (range) over repeats):\n\n"
            + md_table(["model", "state", "repeats", "raw gloo broadcast", "transfer, new buffers (joiner)",
                        "x raw", "transfer, reused buffers (survivor)", "x raw",
                        "sync (save + transfer + restore)", "x raw"], rows)
            + "\n\nRank 1's view; x raw = raw broadcast time / this time (1.00: as fast as the raw broadcast).")
    if memory:
        text += ("\n\nJoiner memory during sync (rank 1; MB = 1e6 bytes; medians over repeats; budget = RSS "
                 "before + optimizer state received + one commit):\n\n"
                 + md_table(["model", "RSS before model", "RSS before sync", "peak RSS (VmHWM)",
                             "peak RSS (1 ms samples)", "budget", "peak - budget",
                             "live model+optimizer after", "commit"], memory))
    if failed:
        text += "\n\nFailed:\n" + "\n".join(failed)
    return text


def _memory_row(model: str, r1: dict[str, Any]) -> list[str]:
    def med(key: str) -> float | None:
        return Summary.of(r1[key]).median

    received = [after - before for after, before in zip(r1["live_bytes"], r1["live_bytes_before"])]
    budget = [before + got + (commit or 0) for before, got, commit in
              zip(r1["rss_before"], received, r1["committed_bytes"])]
    peaks = r1["peak_hwm"] if all(p is not None for p in r1["peak_hwm"]) else r1["peak_sampled"]
    excess = Summary.of([p - b for p, b in zip(peaks, budget)])

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value / MB:.0f}"

    return [model, show(r1["base_rss"]), show(med("rss_before")), show(med("peak_hwm")) if r1.get("hwm_reset") else "n/a",
            show(med("peak_sampled")), show(Summary.of(budget).median), excess.show(1 / MB, "{:.0f}", " MB"),
            show(med("live_bytes")), show(med("committed_bytes"))]
