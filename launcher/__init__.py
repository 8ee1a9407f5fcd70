"""Driver side of lightning-elastic: ``lightning-elastic launch`` and its parts.

Installed as ``lightning_elastic.launcher`` (kept in the repository's ``launcher/`` folder,
apart from the worker side). Nothing here is imported by worker code; the two sides share
only ``lightning_elastic.protocol``. The names below load lazily, as do the parent
package's, so that importing a small part (the ssh supervisor on a remote host) loads
neither the driver nor torch.
"""

from typing import Any

__all__ = ["JobResult", "LaunchConfig", "Timeouts", "launch"]


def __getattr__(name: str) -> Any:
    if name in ("LaunchConfig", "Timeouts"):
        from lightning_elastic.launcher import config

        return getattr(config, name)
    if name in ("JobResult", "launch"):
        from lightning_elastic.launcher.driver import launch as driver

        return getattr(driver, name)
    raise AttributeError(f"module 'lightning_elastic.launcher' has no attribute {name!r}")
