"""The launch configuration: one frozen dataclass, validated with messages that carry the values."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job.slots import HostSlots, count_slots
from lightning_elastic.durable.files import SnapshotSettings


# The longest a worker's question about an error is held by the driver (one long poll)
# before the error counts as its own...
MAX_LOST_MEMBER_WAIT = 60.0
# ... and, while a peer has been silent since the question, for the driver's verdict on it
# (the worker asks for its --heartbeat-timeout plus protocol.VERDICT_GRACE).
MAX_VERDICT_WAIT = 3600.0
# Driver restart needs workers that outlive the driver: local ones (under keepers) or ssh
# ones (under supervisors). An srun step ends with the driver's allocation step, so none.
STATE_DIR_WITH_SLURM = ("--state-dir: not supported with --slurm (driver restart needs workers started here or "
                        "over ssh: -H, --hostfile or --host-discovery-script)")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Every bound the driver and workers wait with, in seconds, in one place."""

    # How often a worker's heartbeat reaches the driver (from a thread, so long steps do not
    # matter): a long poll of this length, answered at once when something changed (a host
    # change, a broken round), so only liveness depends on it. None: a quarter of the
    # heartbeat timeout, between 1 and 2.5 s (see ``heartbeat_period``).
    heartbeat_interval: float | None = None
    # A worker whose last heartbeat is older than this is wedged (e.g. SIGSTOPped): the
    # driver kills it, which turns a hang of its peers into a prompt collective error.
    heartbeat_timeout: float = 10.0
    # --start-timeout: from spawn (or from a reset) to a worker's arrival at the rendezvous.
    # A script may import Lightning, prepare data and compile before it builds the Trainer
    # that joins the job: minutes, not seconds.
    worker_arrival: float = 600.0
    # --error-wait: how long a worker that caught an exception (not a collective
    # error by its type) waits to learn whether its round lost a member before the error
    # counts as its own. Meanwhile its peers wait for it in their next collective: this is
    # the pause one rank's exception costs. It must cover the driver seeing a peer's exit
    # (a tick, locally) and, for an error every rank raises at the same step, the spread
    # of the ranks' arrival there (up to a step): shorter than a step, that error would be
    # taken for one rank's, one worker failing after the other.
    lost_member_wait: float = 5.0
    # --stop-grace: SIGTERM, then SIGKILL after this long, when the driver stops workers (at
    # the job's end, on Ctrl-C, a blacklisted host's siblings). Long enough for a worker to
    # flush its logs; a checkpoint on SIGTERM may need more.
    stop_grace: float = 5.0
    # --collective-timeout: torch.distributed's process-group timeout. It bounds only a
    # collective whose peer is alive but never joins (a lost peer is detected without it),
    # so it is long, like torch's own default: a rank may validate or checkpoint meanwhile.
    process_group: float = 1800.0
    # --exit-timeout: once training returned everywhere and a worker exited, how long the
    # others may take to exit (post-training work, teardown) before they are stopped.
    exit: float = 60.0
    # --preemption-grace: a worker sent SIGTERM has this long to leave gracefully.
    preemption_grace: float = 30.0
    # --discovery-timeout: a discovery script still running after this long has failed
    # (killed with everything it started); a cluster API behind it may be slow.
    discovery: float = 30.0

    def __post_init__(self) -> None:
        for option, value in (
            ("--start-timeout", self.worker_arrival),
            ("--collective-timeout", self.process_group),
            ("--exit-timeout", self.exit),
            ("--preemption-grace", self.preemption_grace),
            ("--stop-grace", self.stop_grace),
            ("--error-wait", self.lost_member_wait),
            ("--discovery-timeout", self.discovery),
        ):
            # "not > 0" so NaN fails too; inf would turn a bound into none.
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{option}: expected a positive, finite number of seconds, got {value}")
        if self.lost_member_wait > MAX_LOST_MEMBER_WAIT:
            raise ConfigError(f"--error-wait: expected at most {MAX_LOST_MEMBER_WAIT:g} seconds, "
                              f"got {self.lost_member_wait}")
    # Driver loop tick: how often it reaps processes. It re-decides when something changed,
    # and at least this often (its timers: wedged workers, timeouts, cooldowns).
    tick: float = 0.05
    decide_every: float = 0.25
    # While the job waits for slots, a line saying what is missing this often.
    progress_every: float = 5.0
    # A worker that failed before joining the job is explained by its last output line (an
    # import error's): the loop waits at most this long in a turn for such workers' output
    # to end (it ends with the process, unless something it started holds the pipe).
    last_output: float = 0.5
    # The job cannot start any more (its slots are gone) and every worker that ended failed
    # before joining: the verdict waits this long for the workers still starting, so that
    # it can say whether the script fails on every host (they fail the same way within
    # milliseconds of each other) or not.
    start_failure_grace: float = 5.0

    @property
    def heartbeat_period(self) -> float:
        """The heartbeat interval in use. Each heartbeat costs the driver a request (~0.4 ms
        of CPU): the longer the period the larger the fleet one driver serves, while a
        quarter of the timeout still leaves a wedged verdict three missed heartbeats away."""
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        if not math.isfinite(self.heartbeat_timeout):
            return 1.0  # refused by LaunchConfig; the floor keeps its message plain
        return min(2.5, max(1.0, self.heartbeat_timeout / 4))


@dataclasses.dataclass(frozen=True)
class SshSettings:
    """How the driver reaches hosts that are not this machine (the system OpenSSH client)."""

    port: int | None = None
    identity_file: Path | None = None
    options: tuple[str, ...] = ()  # each as ssh's -o takes it: "Name=value"
    connect_timeout: float = 10.0
    # Keep-alives make a client on a dead link exit (255) instead of waiting for TCP.
    server_alive_interval: float = 5.0
    server_alive_count: int = 3

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"--ssh-port: expected a port number 1..65535, got {self.port}")
        if self.identity_file is not None and not self.identity_file.is_file():
            raise ConfigError(f"--ssh-identity-file: {self.identity_file} is not a readable file")
        for option in self.options:
            name, sep, _ = option.partition("=")
            if not sep or not name.strip() or any(c.isspace() for c in name):
                raise ConfigError(f"--ssh-option: expected NAME=VALUE as ssh's -o takes it, got {option!r}")


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """A Ray cluster as the host source: its alive nodes are the hosts, workers run in actors."""

    # What ray.init(address=...) takes: "auto", "HOST:PORT", "ray://HOST:PORT"; "local"
    # starts a private one-node Ray; None: the caller is connected already (the Python API).
    address: str | None = "auto"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    def __post_init__(self) -> None:
        for option, value in (("--cpus-per-worker", self.cpus_per_worker), ("--gpus-per-worker", self.gpus_per_worker)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{option}: expected a number of 0 or more, got {value}")
        if self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ConfigError("--cpus-per-worker, --gpus-per-worker: a worker must need some CPU or GPU, both are 0")
        if self.address is not None and not self.address.strip():
            raise ConfigError("--ray: expected auto, local or the cluster's HOST:PORT, got an empty address")


@dataclasses.dataclass(frozen=True)
class SlurmSettings:
    """Slurm allocations as the host source (--slurm): their nodes are the hosts, each worker
    an srun step on its node."""

    job_ids: tuple[str, ...]  # this allocation (SLURM_JOB_ID) first, then --slurm-jobs' ids
    job_names: tuple[str, ...] = ()  # --slurm-jobs' names: every running job of this user so named
    slots_per_host: int | None = None  # --slots-per-host; None: the allocation's tasks per node
    tasks_per_node: tuple[int, ...] = ()  # SLURM_TASKS_PER_NODE, expanded: one count per node
    nodelist: str = ""  # SLURM_JOB_NODELIST, the nodes those counts are of

    def __post_init__(self) -> None:
        if not self.job_ids:
            raise ConfigError("--slurm: no Slurm job to run in")


@dataclasses.dataclass(frozen=True)
class AgentsSettings:
    """--agents: hosts also come from agents that connect by themselves (``lightning-elastic
    agent``), with the job's secret, which they hold too (``--secret-file``)."""

    secret: str = dataclasses.field(repr=False)  # never in a log line or a traceback


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    command: tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    hosts: tuple[HostSlots, ...] | None = None
    # --spares: workers kept started and waiting at the rendezvous beyond --max-np, on the
    # next slots in host order, so a lost worker is replaced at the next re-formation
    # instead of after a start-up.
    spares: int = 0
    discovery_script: Path | None = None
    ray: RaySettings | None = None  # --ray: the hosts are a Ray cluster's nodes
    slurm: SlurmSettings | None = None  # --slurm: the hosts are Slurm allocations' nodes
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    blacklist_cooldown: tuple[float, float] | None = None
    discovery_interval: float = 1.0
    log_dir: Path | None = None
    verbose: bool = False
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)
    ssh: SshSettings = dataclasses.field(default_factory=SshSettings)
    # -x/--env: variables every worker gets, resolved to values on the driver.
    env: tuple[tuple[str, str], ...] = ()
    driver_address: str | None = None  # --driver-address; None: detected from the hosts
    network_interface: str | None = None  # --network-interface
    # --port: the one TCP port the driver serves on (rendezvous and store), for a firewall
    # that must let it through; None: any free port.
    port: int | None = None
    # --repeated-error-limit: end the job when the same collective error ends this many
    # consecutive rounds with no commit in between (0: never).
    repeated_error_limit: int = 3
    # --snapshot-dir/--snapshot-every/--snapshot-keep/--no-resume: durable snapshots of the
    # newest commit, and the one a launch resumes from (lightning_elastic.durable.files).
    snapshots: SnapshotSettings | None = None
    # --state-dir: where the driver keeps what a restarted driver needs to adopt the job
    # (launcher/restart/state_dir.py); local workers then outlive the driver. None: they die with it.
    state_dir: Path | None = None
    # Lines the driver says at its start (after it holds --state-dir, so a refused second
    # driver says nothing but the refusal): what the options mean for this job.
    notices: tuple[str, ...] = ()
    # --driver-patience: with --state-dir, how long workers wait for an unreachable driver.
    driver_patience: float = 120.0
    # --preload: modules each machine's fork server imports once; the workers there are
    # forked from it instead of importing them each (launcher/processes/warm_start.py).
    preload: tuple[str, ...] = ()
    # --agents: agents that connect by themselves are hosts of the job too (the only ones
    # when no other host source is given).
    agents: AgentsSettings | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("COMMAND: missing, expected the training command, e.g. python train.py")
        if self.np < 1:
            raise ConfigError(f"-np: must be at least 1, got {self.np}")
        if self.min_np < 1 or self.min_np > self.np:
            raise ConfigError(f"--min-np: must be between 1 and -np ({self.np}), got {self.min_np}")
        if self.max_np < self.np:
            raise ConfigError(f"--max-np: must be at least -np ({self.np}), got {self.max_np}")
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"--port: expected a port number 1..65535, got {self.port}")
        if self.log_dir is not None and self.log_dir.exists() and not self.log_dir.is_dir():
            raise ConfigError(f"--log-dir: {self.log_dir} is a file, expected a directory")
        if self.state_dir is not None and self.state_dir.exists() and not self.state_dir.is_dir():
            raise ConfigError(f"--state-dir: {self.state_dir} is a file, expected a directory")
        if self.state_dir is not None and self.ray is not None:
            raise ConfigError("--state-dir: not supported with --ray (Ray actors belong to the driver's job)")
        if self.state_dir is not None and self.slurm is not None:
            raise ConfigError(STATE_DIR_WITH_SLURM)
        if not (math.isfinite(self.driver_patience) and self.driver_patience > 0):
            raise ConfigError(f"--driver-patience: expected a positive number of seconds, got {self.driver_patience}")
        for name in self.preload:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ConfigError(f"--preload: {name!r} is not a module name, expected e.g. lightning.pytorch")
        if self.preload and self.state_dir is not None:
            raise ConfigError("--preload: not supported with --state-dir yet (workers that outlive the driver "
                              "cannot be forked from a server that dies with it)")
        if self.preload and (self.ray is not None or self.slurm is not None):
            raise ConfigError("--preload: only for workers the driver starts itself (here or through ssh), "
                              "not with --ray or --slurm")
        if self.preload and not os.path.basename(self.command[0]).startswith("python"):
            raise ConfigError(f"--preload: COMMAND must start with a Python interpreter (python, python3, ...) "
                              f"to fork from, got {self.command[0]!r}")
        if self.spares < 0:
            raise ConfigError(f"--spares: expected 0 or more workers, got {self.spares}")
        if self.agents is not None:
            self._check_agents()
        if self.hosts is not None and count_slots(self.hosts) < self.np and self.agents is None:
            listed = ",".join(f"{h.host}:{h.slots}" for h in self.hosts)
            raise ConfigError(
                f"-np {self.np}: the fixed host list {listed} has {count_slots(self.hosts)} slot(s) and can never "
                "grow; give more hosts, a smaller -np, or a --host-discovery-script"
            )
        sources = (self.hosts, self.discovery_script, self.ray, self.slurm)
        given = sum(source is not None for source in sources)
        if given != 1 and not (self.agents is not None and given == 0):
            raise ConfigError("give exactly one host source: -H/--hosts, --hostfile, --host-discovery-script, "
                              "--ray or --slurm")
        # Written as "not > 0" so NaN fails too (every comparison with NaN is False); inf is
        # allowed: it means wait for slots for ever.
        if not self.elastic_timeout > 0:
            raise ConfigError(f"--elastic-timeout: must be positive, got {self.elastic_timeout}")
        if self.repeated_error_limit < 0:
            raise ConfigError(f"--repeated-error-limit: must be 0 (off) or more, got {self.repeated_error_limit}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit: must be 0 or more, got {self.reset_limit}")
        if not math.isfinite(self.discovery_interval):  # NaN and inf pass "<= 0"; inf breaks Event.wait
            raise ConfigError(f"--discovery-interval: must be a finite number, got {self.discovery_interval}")
        if self.discovery_interval <= 0:
            raise ConfigError(f"--discovery-interval: must be positive, got {self.discovery_interval}")
        hb = self.timeouts.heartbeat_timeout
        # A heartbeat is a long poll of one interval: allow at least two before calling a
        # worker wedged, or a busy machine produces false verdicts.
        if not (math.isfinite(hb) and hb >= 2 * self.timeouts.heartbeat_period):
            raise ConfigError(
                f"--heartbeat-timeout: expected a finite number of seconds, at least twice the "
                f"heartbeat interval ({2 * self.timeouts.heartbeat_period:g}), got {hb}"
            )
        for name, _ in self.env:
            if not name.isidentifier():
                raise ConfigError(f"-x/--env: {name!r} is not a valid variable name")
        if self.blacklist_cooldown is not None:
            low, high = self.blacklist_cooldown
            if not (math.isfinite(low) and math.isfinite(high)):  # NaN passes the checks below
                raise ConfigError(f"--blacklist-cooldown-range: expected finite numbers, got {low} {high}")
            if low < 0 or high < low:
                raise ConfigError(
                    f"--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got {low} {high}"
                )

    def _check_agents(self) -> None:
        """What --agents needs: a known place to connect to, and workers it can serve."""
        if self.port is None:
            raise ConfigError("--agents: needs --port (the one port the agents connect to, e.g. --port 29400)")
        if self.driver_address is None and self.network_interface is None:
            raise ConfigError("--agents: needs --driver-address or --network-interface (the address the agents "
                              "and their workers reach the driver at)")
        for option, given in (("--ray", self.ray), ("--slurm", self.slurm)):
            if given is not None:
                raise ConfigError(f"--agents: not supported with {option} yet")
