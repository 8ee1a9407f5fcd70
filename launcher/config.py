"""The launch configuration: one frozen dataclass, validated with messages that carry the values."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from launcher.errors import ConfigError
from launcher.hosts import HostSlots


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Every bound the driver and workers wait with, in seconds, in one place."""

    # A worker sends a heartbeat this often (from a thread, so long steps do not matter).
    heartbeat_interval: float = 1.0
    # A worker whose last heartbeat is older than this is wedged (e.g. SIGSTOPped): the
    # driver kills it, which turns a hang of its peers into a prompt collective error.
    heartbeat_timeout: float = 10.0
    # From spawn (or from the start of a round's formation) to a worker's arrival at the
    # rendezvous; importing torch and Lightning on a loaded machine takes several seconds.
    worker_arrival: float = 120.0
    # How long a worker that caught an exception waits to learn whether its round lost a
    # member (collective failure) before treating the error as its own.
    lost_member_wait: float = 5.0
    # SIGTERM, then SIGKILL after this long, when the driver stops workers.
    stop_grace: float = 5.0
    # torch.distributed process-group timeout: bounds a collective whose peer hangs.
    process_group: float = 60.0
    # Driver loop tick: how often it reaps processes and re-evaluates its decision.
    tick: float = 0.05


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    command: tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    hosts: tuple[HostSlots, ...] | None = None
    discovery_script: Path | None = None
    slots_per_host: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    blacklist_cooldown: tuple[float, float] | None = None
    discovery_interval: float = 1.0
    log_dir: Path | None = None
    verbose: bool = False
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("COMMAND: missing, expected the training command, e.g. python train.py")
        if self.np < 1:
            raise ConfigError(f"-np: must be at least 1, got {self.np}")
        if self.min_np < 1 or self.min_np > self.np:
            raise ConfigError(f"--min-np: must be between 1 and -np ({self.np}), got {self.min_np}")
        if self.max_np < self.np:
            raise ConfigError(f"--max-np: must be at least -np ({self.np}), got {self.max_np}")
        if (self.hosts is None) == (self.discovery_script is None):
            raise ConfigError("give exactly one host source: -H/--hosts or --host-discovery-script")
        # Written as "not > 0" so NaN fails too (every comparison with NaN is False); inf is
        # allowed: it means wait for slots for ever.
        if not self.elastic_timeout > 0:
            raise ConfigError(f"--elastic-timeout: must be positive, got {self.elastic_timeout}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit: must be 0 or more, got {self.reset_limit}")
        if not math.isfinite(self.discovery_interval):  # NaN and inf pass "<= 0"; inf breaks Event.wait
            raise ConfigError(f"--discovery-interval: must be a finite number, got {self.discovery_interval}")
        if self.discovery_interval <= 0:
            raise ConfigError(f"--discovery-interval: must be positive, got {self.discovery_interval}")
        if self.blacklist_cooldown is not None:
            low, high = self.blacklist_cooldown
            if not (math.isfinite(low) and math.isfinite(high)):  # NaN passes the checks below
                raise ConfigError(f"--blacklist-cooldown-range: expected finite numbers, got {low} {high}")
            if low < 0 or high < low:
                raise ConfigError(
                    f"--blacklist-cooldown-range: expected 0 <= MIN <= MAX, got {low} {high}"
                )
