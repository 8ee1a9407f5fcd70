"""Driver side of lightning-elastic: ``lightning-elastic launch`` and its parts.

Nothing here is imported by worker code; the two sides share only
``lightning_elastic.protocol``. The names below load lazily so that importing a small
part of the package (the ssh supervisor on a remote host) does not load the driver and,
through it, torch.
"""

from typing import Any

__all__ = ["JobResult", "LaunchConfig", "Timeouts", "launch"]


def __getattr__(name: str) -> Any:
    if name in ("LaunchConfig", "Timeouts"):
        from launcher import config

        return getattr(config, name)
    if name in ("JobResult", "launch"):
        from launcher import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
