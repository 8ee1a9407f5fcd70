"""Jobs on a Ray cluster: its alive nodes are the hosts, and each worker runs in a Ray actor.

The driver is the same as for ssh or local hosts; only where hosts come from
(``nodes.RayNodeDiscovery``) and how a worker is started (``launcher.RayLauncher``, through
``agent.WorkerAgent``) differ. Only the submodules import Ray, and only when a job asks
for it: the core install does not have Ray.
"""

from __future__ import annotations

import importlib.util

from lightning_elastic.launcher.errors import ConfigError

INSTALL_HINT = "pip install 'lightning-elastic[ray]'"


def require_ray(what: str = "--ray") -> None:
    """Raise a one-line ConfigError naming ``what`` when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"{what}: Ray is not installed; install the extra with {INSTALL_HINT}")
