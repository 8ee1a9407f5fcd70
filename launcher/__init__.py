"""Driver side of lightning-elastic: ``lightning-elastic launch`` and its parts.

Nothing here is imported by worker code; the two sides share only
``lightning_elastic.protocol``.
"""

from launcher.config import LaunchConfig, Timeouts
from launcher.driver import JobResult, launch

__all__ = ["JobResult", "LaunchConfig", "Timeouts", "launch"]
