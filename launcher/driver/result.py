"""The job's result: how it ended, and the summary the CLI prints."""

from __future__ import annotations

import dataclasses

from lightning_elastic.launcher.job.history import BoundedHistory


def _listed(items: tuple[str, ...], omitted: int) -> list[str]:
    """Summary lines of a bounded history: its first entries, a count, its newest."""
    lines = [f"    - {item}" for item in items]
    if omitted:
        lines.insert(BoundedHistory.FIRST, f"    ... {omitted} more (events.jsonl in --log-dir has every one)")
    return lines


@dataclasses.dataclass(frozen=True)
class JobResult:
    success: bool
    reason: str
    rounds: tuple[int, ...]  # world size of every round, in order
    failures: tuple[str, ...]
    blacklisted: tuple[str, ...]
    duration: float
    rejected_requests: int
    departures: tuple[str, ...] = ()  # workers that left gracefully on a preemption notice
    # A long job keeps the first and the newest entries of each (launcher/job/history.py):
    # how many in between are counted only (events.jsonl has them all).
    rounds_omitted: int = 0
    failures_omitted: int = 0
    departures_omitted: int = 0
    # Ended by an invalid input found before any worker started (an address this machine
    # does not have, a port in use, no host name resolving): ``launch`` raises it as a
    # ConfigError, which the CLI prints as one line with exit status 2.
    refused: bool = False
    # Durable snapshots (--snapshot-dir): what this launch resumed from ("": started over),
    # and the snapshots written and failed, with the newest failure's reason.
    resumed_from: str = ""
    snapshots: tuple[int, int, str] | None = None

    def _sizes(self) -> str:
        sizes = [str(n) for n in self.rounds]
        if self.rounds_omitted:
            sizes.insert(BoundedHistory.FIRST, f"({self.rounds_omitted} more)")
        return " -> ".join(sizes) or "none"
    outages: tuple[str, ...] = ()  # --state-dir: each restart of the driver that adopted the job
    # --state-dir and SIGTERM: this driver exited and left the job running for the next one
    # (a Kubernetes rolling restart, `systemctl restart`). Exit status 0: nothing failed.
    handed_over: bool = False

    @property
    def exit_code(self) -> int:
        return 0 if self.success or self.handed_over else 1

    @property
    def verdict(self) -> str:
        """The CLI's last line says the job ``succeeded``, ``failed`` or was ``handed over``."""
        return "handed over" if self.handed_over else "succeeded" if self.success else "failed"

    def summary(self) -> str:
        lines = [
            "lightning-elastic job summary",
            f"  result:        {'HANDED OVER' if self.handed_over else 'SUCCESS' if self.success else 'FAILURE'}: "
            f"{self.reason}",
            f"  duration:      {self.duration:.1f} s",
            f"  rounds:        {len(self.rounds) + self.rounds_omitted} (world sizes: {self._sizes()})",
            f"  failures:      {len(self.failures) + self.failures_omitted}",
        ]
        lines += _listed(self.failures, self.failures_omitted)
        if self.departures:
            lines.append(f"  preempted:     {len(self.departures) + self.departures_omitted} (left without rollback)")
            lines += _listed(self.departures, self.departures_omitted)
        lines.append(f"  blacklisted:   {', '.join(self.blacklisted) or 'none'}")
        if self.outages:
            lines.append(f"  driver outages: {len(self.outages)}")
            lines += [f"    - {o}" for o in self.outages]
        if self.rejected_requests:
            lines.append(f"  rejected rendezvous requests: {self.rejected_requests}")
        if self.snapshots is not None:
            lines.append(f"  resumed from:  {self.resumed_from or 'nothing (started over)'}")
            written, failed, error = self.snapshots
            lines.append(f"  snapshots:     {written} written, {failed} failed" + (f" ({error})" if failed else ""))
        return "\n".join(lines)


