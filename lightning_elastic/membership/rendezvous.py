"""Waiting at the driver's rendezvous for the next round, and announcing it to libraries.

``next_assignment`` decides nothing beyond the wait: it returns the round the driver
assigned, or ``None`` when the driver says this worker is no longer part of the job (the
worker then reports and leaves; see ``ElasticWorker``).
"""

from __future__ import annotations

import logging
import os
import time

from lightning_elastic import protocol as p
from lightning_elastic.errors import RendezvousError
from lightning_elastic.membership.client import DriverClient, first_request_spread
from lightning_elastic.membership.settings import WorkerSettings

log = logging.getLogger(__name__)

# How much longer than --elastic-timeout a worker waits for a round before it gives up:
# the driver's own wait ends first and says why.
WAIT_BEYOND_ELASTIC_TIMEOUT_S = 60.0


def next_assignment(client: DriverClient, settings: WorkerSettings, after: int) -> p.Assignment | None:
    """The round after round ``after`` (0: the first), once the driver has formed it.

    A hot spare waits until a change needs it, however long the job runs; any other worker
    raises ``RendezvousError`` when no round was formed within the elastic timeout.
    """
    deadline = time.monotonic() + settings.elastic_timeout + WAIT_BEYOND_ELASTIC_TIMEOUT_S
    if after == 0:
        time.sleep(first_request_spread(settings.world_size))  # the launch's WORLD_SIZE
    standby_said = False
    while True:
        reply = client.rendezvous(after)
        if reply.status == p.RendezvousStatus.ASSIGNED:
            assert reply.assignment is not None
            return reply.assignment
        if reply.status == p.RendezvousStatus.EXIT:
            return None
        if reply.standby:
            if not standby_said:
                log.info("Worker %s is a hot spare: waiting at the rendezvous until the job needs it.",
                         settings.worker_id)
                standby_said = True
            deadline = time.monotonic() + settings.elastic_timeout + WAIT_BEYOND_ELASTIC_TIMEOUT_S
        if time.monotonic() > deadline:
            raise RendezvousError(f"no round was formed within {settings.elastic_timeout:g} s")


def publish_environment(a: p.Assignment) -> None:
    """Libraries that read torch's usual variables see the current round."""
    os.environ.update(
        {
            "MASTER_ADDR": a.store_host,
            "MASTER_PORT": str(a.store_port),
            "RANK": str(a.rank),
            "WORLD_SIZE": str(a.size),
            "LOCAL_RANK": str(a.local_rank),
            "LOCAL_WORLD_SIZE": str(a.local_size),
            "GROUP_RANK": str(a.cross_rank),
        }
    )
