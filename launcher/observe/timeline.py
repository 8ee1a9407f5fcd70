"""``lightning-elastic timeline LOGDIR``: a job's ``events.jsonl`` drawn as a PNG.

Top: the world size over time (each formed round's size from its formation), with every
recovery's duration written where the new round's training resumed. Below: one lane per
host, a bar for each worker's life, colored by how it ended; faults are red crosses, joins
(workers started after the first round) green triangles, host changes announced dashed
lines. matplotlib is needed only here (the ``timeline`` extra).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lightning_elastic.launcher.observe.events import read_events

_ENDED_COLOR = {"worker_done": "tab:green", "worker_failed": "tab:red", "worker_left": "tab:gray"}


@dataclasses.dataclass(frozen=True)
class WorkerSpan:
    worker: str
    host: str
    start: float  # seconds since the job started
    end: float
    ended: str  # the event kind that ended it ("running" if none did)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The events in the form the plot needs; times in seconds since ``job_started``."""

    duration: float
    world: tuple[tuple[float, int], ...]  # (time, size) at each round formed
    spans: tuple[WorkerSpan, ...]
    faults: tuple[tuple[float, str], ...]  # (time, host)
    joins: tuple[tuple[float, str], ...]  # (time, host): workers started after the first round formed
    announcements: tuple[float, ...]
    recoveries: tuple[tuple[float, float, str], ...]  # (time of the first step, duration, after what)
    success: bool | None
    reason: str
    outages: tuple[tuple[float, float], ...] = ()  # (from, to): no driver ran (--state-dir)

    @property
    def hosts(self) -> list[str]:
        """In order of their first worker."""
        return list(dict.fromkeys(s.host for s in self.spans))


def build_timeline(events: list[dict[str, Any]]) -> Timeline:
    if not events or events[0].get("kind") != "job_started":
        raise ValueError("events: expected a job_started event first (an events.jsonl written by the driver)")
    t0 = events[0]["time"]
    starts: dict[str, tuple[str, float]] = {}
    started_order: dict[str, int] = {}
    spans: list[WorkerSpan] = []
    world, faults, joins, announcements, recoveries, outages = [], [], [], [], [], []
    success, reason = None, ""
    end = t0
    for e in events:
        t = e["time"] - t0
        end = max(end, e["time"])
        kind = e["kind"]
        if kind == "worker_started":
            starts[e["worker"]] = (e["host"], t)
            started_order.setdefault(e["worker"], len(started_order))
            if world:
                joins.append((t, e["host"]))
        elif kind in _ENDED_COLOR and e["worker"] in starts:
            host, began = starts.pop(e["worker"])
            spans.append(WorkerSpan(e["worker"], host, began, t, kind))
            if kind == "worker_failed":
                faults.append((t, host))
        elif kind == "round_formed":
            world.append((t, e["size"]))
        elif kind == "reset_announced":
            announcements.append(t)
        elif kind == "recovery":
            recoveries.append((e["since"] - t0 + e["duration_s"], e["duration_s"], e["after"]))
        elif kind == "driver_restarted":
            outages.append((t - e["outage_s"], t))
        elif kind == "job_ended":
            success, reason = e["success"], e["reason"]
    duration = end - t0
    spans += [WorkerSpan(w, host, began, duration, "running") for w, (host, began) in starts.items()]
    spans.sort(key=lambda s: started_order[s.worker])  # as the workers were started
    return Timeline(duration, tuple(world), tuple(spans), tuple(faults), tuple(joins), tuple(announcements),
                    tuple(recoveries), success, reason, tuple(outages))


def draw(timeline: Timeline, out: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise RuntimeError("timeline: needs matplotlib (pip install 'lightning-elastic[timeline]')") from None
    hosts = timeline.hosts
    fig, (top, lanes) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 2.5 + 0.45 * max(len(hosts), 1)),
        gridspec_kw={"height_ratios": [2, max(len(hosts), 1) * 0.6]},
    )
    end = max(timeline.duration, 1e-3)
    if timeline.world:
        xs = [t for t, _ in timeline.world] + [end]
        ys = [size for _, size in timeline.world] + [timeline.world[-1][1]]
        top.step(xs, ys, where="post", color="tab:blue", linewidth=2)
        top.set_ylim(0, max(ys) + 1)
    for at, seconds, after in timeline.recoveries:
        top.axvline(at, color="tab:orange", linewidth=0.8, alpha=0.6)
        top.annotate(f"{'recovered' if after == 'fault' else 're-formed'} in {seconds:.2f} s", (at, 0.3),
                     rotation=90, fontsize=8, ha="right", va="bottom", color="tab:orange")
    top.set_ylabel("world size")
    verdict = "" if timeline.success is None else ("succeeded" if timeline.success else "failed")
    top.set_title(f"lightning-elastic job {verdict}: {timeline.reason}" if verdict else "lightning-elastic job",
                  fontsize=9)
    for lane, host in enumerate(hosts):
        for s in (s for s in timeline.spans if s.host == host):
            lanes.barh(lane, s.end - s.start, left=s.start, height=0.5,
                       color=_ENDED_COLOR.get(s.ended, "tab:blue"), alpha=0.8)
    for t, host in timeline.faults:
        lanes.plot(t, hosts.index(host), marker="x", color="red", markersize=10, mew=2)
    for t, host in timeline.joins:
        lanes.plot(t, hosts.index(host), marker=">", color="tab:green", markersize=8)
    for since, until in timeline.outages:  # workers trained on; no driver ran
        for axis in (top, lanes):
            axis.axvspan(since, until, color="gray", alpha=0.15)
        top.annotate(f"no driver for {until - since:.1f} s", (since, 0.3), fontsize=8, color="dimgray")
    for t in timeline.announcements:
        lanes.axvline(t, color="gray", linestyle="--", linewidth=0.8)
        top.axvline(t, color="gray", linestyle="--", linewidth=0.8)
    lanes.set_yticks(range(len(hosts)), hosts)
    lanes.invert_yaxis()
    lanes.set_xlabel("seconds since the job started")
    lanes.set_xlim(0, end)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.8) for c in ("tab:green", "tab:red", "tab:gray", "tab:blue")]
    lanes.legend(handles, ["done", "failed", "left", "running"], fontsize=7, loc="upper right", ncols=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_log_dir(log_dir: Path, out: Path | None = None) -> Path:
    """Read ``log_dir/events.jsonl`` and write the PNG (default: ``log_dir/timeline.png``)."""
    events_path = log_dir / "events.jsonl" if log_dir.is_dir() else log_dir
    if not events_path.is_file():
        raise FileNotFoundError(f"timeline: {events_path} not found (run lightning-elastic launch with --log-dir)")
    timeline = build_timeline(read_events(events_path))
    out = out or events_path.parent / "timeline.png"
    draw(timeline, out)
    return out
