"""What the rules need besides the job's state: the user's settings and two facts of the set-up."""

from __future__ import annotations

import dataclasses

from lightning_elastic.launcher.config import LaunchConfig


@dataclasses.dataclass(frozen=True)
class Rules:
    """Frozen for the job's life: built once by the shell."""

    config: LaunchConfig
    # A fixed host list with no blacklist cooldown never grows: waiting for slots is hopeless.
    fixed_hosts: bool = False
    # --preload: every usable host gets a fork server before a worker needs it.
    prepare_hosts: bool = False
