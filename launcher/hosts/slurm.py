"""A Slurm allocation as the host source: its nodes are the hosts, refreshed while the job runs.

``lightning-elastic launch --slurm`` runs inside an allocation (an ``sbatch`` script or
``salloc``): ``SLURM_JOB_ID`` names it. Every ``discover()`` (in the discovery thread, never
the driver's loop) asks Slurm which of the named jobs run and on which nodes (``squeue``,
``scontrol show hostnames``): a node removed from a ``--no-kill`` allocation disappears, a
second allocation (``--slurm-jobs``) that starts brings its nodes. ``SlurmNodes`` remembers
which job each node belongs to: a worker's step must be started in that job.

Slurm notices a lost node only after 25–30 s; the driver's own heartbeats stay the detector
of a lost worker, this only keeps the host list in step with the allocation.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping

from lightning_elastic.launcher.config import SlurmSettings
from lightning_elastic.launcher.errors import ConfigError, DiscoveryError
from lightning_elastic.launcher.job.slots import HostSlots

log = logging.getLogger(__name__)

JOB_ID = re.compile(r"\d+")  # the raw id, as SLURM_JOB_ID gives it (an array task's too)
# A --slurm-jobs entry that is not an id: a job name, as `sbatch -J` sets it. Kept to what a
# name needs, so that nothing a shell or squeue's output format reads specially gets through.
JOB_NAME = re.compile(r"[A-Za-z0-9_.+@:-]+")
TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")  # one entry of SLURM_TASKS_PER_NODE: 2 or 2(x3)


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]``, as Slurm writes SLURM_TASKS_PER_NODE."""
    counts: list[int] = []
    for entry in text.split(","):
        match = TASKS.fullmatch(entry.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: expected entries like 2 or 2(x3), got {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_settings(
    environ: Mapping[str, str], jobs: str | None, slots_per_host: int | None
) -> SlurmSettings:
    """The allocations to run in: this one (``SLURM_JOB_ID``) and ``--slurm-jobs`` (ids, or
    names: every running job of this user with that name, so that capacity can arrive as
    more jobs submitted under one name); one-line errors."""
    own = environ.get("SLURM_JOB_ID", "").strip()
    if own and not JOB_ID.fullmatch(own):
        raise ConfigError(f"SLURM_JOB_ID: expected a Slurm job id like 1234, got {own!r}")
    entries = tuple(j.strip() for j in (jobs or "").split(",") if j.strip())
    for entry in entries:
        if not JOB_ID.fullmatch(entry) and not JOB_NAME.fullmatch(entry):
            raise ConfigError(f"--slurm-jobs: expected Slurm job ids like 1234 or job names like more-gpus, "
                              f"got {entry!r}")
    others = tuple(e for e in entries if JOB_ID.fullmatch(e))
    names = tuple(dict.fromkeys(e for e in entries if not JOB_ID.fullmatch(e)))
    if not own:
        raise ConfigError("--slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set): run it in an "
                          "sbatch script or under salloc")
    if shutil.which("srun") is None or shutil.which("squeue") is None:
        raise ConfigError("--slurm: srun and squeue are not on PATH: run it on a node of the Slurm cluster")
    tasks = environ.get("SLURM_TASKS_PER_NODE", "").strip()
    return SlurmSettings(
        job_ids=tuple(dict.fromkeys((own, *others))),
        job_names=names,
        slots_per_host=slots_per_host,
        tasks_per_node=tuple(expand_tasks_per_node(tasks)) if tasks else (),
        nodelist=environ.get("SLURM_JOB_NODELIST", "").strip(),
    )


class SlurmNodes:
    """Which allocation each node belongs to (written by discovery, read at each start)."""

    def __init__(self, default_job: str) -> None:
        self._lock = threading.Lock()
        self._job_of: dict[str, str] = {}
        self._default = default_job

    def update(self, job_of: dict[str, str]) -> None:
        with self._lock:
            self._job_of.update(job_of)  # a node that left keeps its job: its workers' steps still need it
            if len(self._job_of) > 65_536:  # bounded: a job of weeks sees nodes come and go
                self._job_of = dict(job_of)

    def job_of(self, node: str) -> str:
        with self._lock:
            return self._job_of.get(node, self._default)


@dataclasses.dataclass
class SlurmDiscovery:
    settings: SlurmSettings
    nodes: SlurmNodes
    timeout: float = 30.0  # of one Slurm command (--discovery-timeout)
    # node -> tasks of this allocation, from its environment; expanded at the first discovery
    _slots: dict[str, int] | None = dataclasses.field(default=None, init=False)

    def discover(self) -> list[HostSlots]:
        # This user's running jobs, filtered here: `squeue -j` fails as a whole once one of
        # the ids is purged (a second allocation that ended), which would blind discovery to
        # the others. %A is the raw job id, as SLURM_JOB_ID gives it (array tasks included);
        # the name comes last, where a space in it cannot shift the other fields.
        out = self._run(["squeue", "-h", "--me", "-t", "RUNNING", "-o", "%A %N %j"])
        by_job: dict[str, list[str]] = {}
        named: list[str] = []  # the running jobs --slurm-jobs names, in squeue's order
        for line in out.splitlines():
            job, nodelist, name = (line.strip().split(" ", 2) + ["", ""])[:3]
            wanted = job in self.settings.job_ids or name in self.settings.job_names
            if wanted and nodelist:
                by_job[job] = self._expand(nodelist)
                if job not in self.settings.job_ids:
                    named.append(job)
        if self._slots is None:
            self._slots = self._allocation_slots()
        hosts: list[HostSlots] = []
        job_of: dict[str, str] = {}
        # This allocation's nodes first, in Slurm's order; then the other ids', then the named jobs'.
        for job in (*self.settings.job_ids, *sorted(named, key=int)):
            for node in by_job.get(job, []):
                if node not in job_of:
                    job_of[node] = job
                    hosts.append(HostSlots(node, self._slots_of(node)))
        self.nodes.update(job_of)
        return hosts

    def cancel(self) -> None:
        pass  # each command is bounded by ``timeout``

    def _slots_of(self, node: str) -> int:
        if self.settings.slots_per_host is not None:
            return self.settings.slots_per_host
        assert self._slots is not None
        return self._slots.get(node, 1)

    def _allocation_slots(self) -> dict[str, int]:
        """Tasks per node of this allocation, as its environment says (SLURM_TASKS_PER_NODE
        against SLURM_JOB_NODELIST); a node it does not name gets 1 (or --slots-per-host)."""
        s = self.settings
        if not s.tasks_per_node or not s.nodelist:
            return {}
        nodes = self._expand(s.nodelist)
        if len(nodes) != len(s.tasks_per_node):
            log.warning("SLURM_TASKS_PER_NODE names %d nodes, SLURM_JOB_NODELIST %d: one slot per node.",
                        len(s.tasks_per_node), len(nodes))
            return {}
        return dict(zip(nodes, s.tasks_per_node))

    def _expand(self, nodelist: str) -> list[str]:
        if not any(c in nodelist for c in "[,"):
            return [nodelist]
        return self._run(["scontrol", "show", "hostnames", nodelist]).split()

    def _run(self, argv: list[str]) -> str:
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout,
                                    stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"{argv[0]} did not answer within {self.timeout:g} s (--discovery-timeout)") from None
        except OSError as err:
            raise DiscoveryError(f"cannot run {argv[0]}: {err.strerror or err}") from None
        if result.returncode != 0:
            said = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise DiscoveryError(f"{' '.join(argv[:2])} exited with status {result.returncode}: {said}")
        return result.stdout
