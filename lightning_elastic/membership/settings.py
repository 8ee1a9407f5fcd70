"""What a worker is told at its start: ``WorkerSettings`` (the launcher's environment) and
``SlotInfo`` (its place in the current round, ``le.slot_info()``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from lightning_elastic import protocol as p
from lightning_elastic.errors import RendezvousError
from lightning_elastic.membership.client import RETRY_FOR, DriverClient
from lightning_elastic.membership.driver_locator import DriverLocator

# A worker that has not reached its driver for this many heartbeat timeouts leaves: by
# then the driver has declared it lost (a partition, or the driver is gone) and killed it
# as far as it could, so lingering could only leave a stray process on its host.
DRIVER_LOST_AFTER_TIMEOUTS = 2.0


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where a worker stands in the current round (``le.slot_info()``).

    ``hostname``: the host the launcher started it on, as discovery or ``-H`` names it;
    ``rank`` and ``size``: ``le.rank()`` and ``le.size()``; ``local_rank`` and
    ``local_size``: its slot on the host and the round's workers there; ``cross_rank``
    and ``cross_size``: its host among the hosts with a worker of the same local rank.
    """

    hostname: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    size: int


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    driver_url: str
    secret: str = dataclasses.field(repr=False)  # never in a log line or a traceback
    worker_id: str
    hostname: str
    heartbeat_interval: float
    heartbeat_timeout: float
    elastic_timeout: float
    lost_member_wait: float
    process_group_timeout: float
    preemption_grace: float
    cuda_device: int | None = None  # pinned by the launcher; None: cuda:LOCAL_RANK
    # How long the driver may be unreachable before this worker exits (--driver-patience,
    # with --state-dir: a restarted driver adopts it); 0: DRIVER_LOST_AFTER_TIMEOUTS.
    driver_patience: float = 0.0
    # --state-dir: the file a restarted driver writes its URL to (protocol.ENV_DRIVER_URL_FILE).
    driver_url_file: Path | None = None
    world_size: int = 1  # at the start: bounds how often a fleet re-reads driver_url_file
    # Where the driver is now, shared by every client of this worker (built from the two above).
    locator: DriverLocator = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "locator", DriverLocator(self.driver_url, self.driver_url_file,
                                                          world_size=self.world_size))

    @property
    def verdict_wait(self) -> float:
        """How long a question about an error may wait for the driver's verdict on a peer
        silent since it was asked: that peer's heartbeat timeout, and the driver's pass."""
        return self.heartbeat_timeout + p.VERDICT_GRACE

    @property
    def driver_lost_after(self) -> float:
        return max(self.driver_patience, DRIVER_LOST_AFTER_TIMEOUTS * self.heartbeat_timeout)

    def client(self, retry_for: float | None = None) -> DriverClient:
        """A client whose requests wait out an unreachable driver for as long as this worker
        does (``retry_for``: less, for a request that must not wait that long)."""
        return DriverClient(self.driver_url, self.secret, self.worker_id,
                            retry_for=max(RETRY_FOR, self.driver_patience) if retry_for is None else retry_for,
                            locator=self.locator)

    @classmethod
    def from_environment(cls, environ: os._Environ | dict[str, str]) -> WorkerSettings | None:
        if p.ENV_DRIVER_URL not in environ:
            return None
        try:
            return cls(
                driver_url=environ[p.ENV_DRIVER_URL],
                secret=_read_secret(environ),
                worker_id=environ[p.ENV_WORKER_ID],
                hostname=environ[p.ENV_HOSTNAME],
                heartbeat_interval=float(environ.get(p.ENV_HEARTBEAT_INTERVAL, "1")),
                heartbeat_timeout=float(environ.get(p.ENV_HEARTBEAT_TIMEOUT, "10")),
                elastic_timeout=float(environ.get(p.ENV_ELASTIC_TIMEOUT, "600")),
                lost_member_wait=float(environ.get(p.ENV_LOST_MEMBER_WAIT, "5")),
                process_group_timeout=float(environ.get(p.ENV_PROCESS_GROUP_TIMEOUT, "1800")),
                preemption_grace=float(environ.get(p.ENV_PREEMPTION_GRACE, "30")),
                cuda_device=int(environ[p.ENV_CUDA_DEVICE]) if environ.get(p.ENV_CUDA_DEVICE) else None,
                driver_patience=float(environ.get(p.ENV_DRIVER_PATIENCE, "0")),
                driver_url_file=Path(environ[p.ENV_DRIVER_URL_FILE]) if environ.get(p.ENV_DRIVER_URL_FILE) else None,
                world_size=_int_or(environ.get("WORLD_SIZE"), 1),
            )
        except KeyError as err:
            raise RendezvousError(
                f"environment variable {err.args[0]} is missing: start workers with lightning-elastic launch"
            ) from None


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _read_secret(environ: os._Environ | dict[str, str]) -> str:
    """Read the job secret from the pipe the launcher passed (once: the pipe is then closed).

    The variable is removed so that processes this worker starts do not look for a closed
    descriptor.
    """
    text = environ[p.ENV_SECRET_FD]
    if not text.isdigit():
        environ.pop(p.ENV_SECRET_FD, None)
        raise RendezvousError(f"{p.ENV_SECRET_FD}={text!r} is not a file descriptor: start workers with lightning-elastic launch")
    fd = int(text)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except OSError as err:
        raise RendezvousError(
            f"cannot read the job secret from descriptor {fd} ({err}): start workers with lightning-elastic launch"
        ) from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
        environ.pop(p.ENV_SECRET_FD, None)
    return b"".join(chunks).decode()
