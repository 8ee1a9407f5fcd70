"""Exception root of the worker side."""


class ElasticError(Exception):
    """Root of lightning-elastic's worker-side errors."""


class CollectiveError(ElasticError):
    """A collective failed because the round lost a member; ``@run`` restores the last commit."""


class HostsUpdatedInterrupt(ElasticError):
    """The driver announced a host change; raised on every rank at the same step.

    Not a failure: ``@run`` keeps the live state, re-forms the group and goes on.
    """


class RendezvousError(ElasticError):
    """The driver could not be reached, or no round was formed in time."""


class DriverUnreachable(RendezvousError):
    """The driver could not be reached for as long as this worker waits for one (2 x the
    heartbeat timeout, or ``--driver-patience`` with ``--state-dir``): the worker exits
    with ``protocol.EXIT_DRIVER_GONE``."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited  # seconds the request was retried for
