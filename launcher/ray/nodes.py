"""A Ray cluster's node table as the job's host source.

A host is an alive Ray node that is not being drained; its slots are how many workers its
total resources fit (``--cpus-per-worker``, ``--gpus-per-worker``). A node that leaves the
table, or starts draining (Ray's ``drain-node``, a spot preemption notice), is a host
removed: its workers leave without rollback. A node that dies under its workers is a lost
worker, as a SIGKILL is.

Hosts are named ``ray-`` and the first 12 hex digits of the node id: nodes of one machine
share its address (a local test cluster, several raylets per box), and a node id is what
``ray list nodes`` shows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Mapping

import ray

from lightning_elastic.launcher.config import RaySettings
from lightning_elastic.launcher.errors import DiscoveryError
from lightning_elastic.launcher.job.slots import HostSlots
from lightning_elastic.launcher.hosts.network import HostClassifier

log = logging.getLogger(__name__)

HOST_PREFIX = "ray-"


def host_name(node_id: str) -> str:
    return f"{HOST_PREFIX}{node_id[:12]}"


def slots_on(resources: Mapping[str, float], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many workers a node's total resources fit; 0 for a node without the resources."""
    fits = []
    for name, need in (("CPU", cpus_per_worker), ("GPU", gpus_per_worker)):
        if need > 0:
            # Ray keeps resources as multiples of 1/10000: round before flooring so that
            # 0.3 + 0.3 + 0.3 of a CPU fit 0.9.
            fits.append(math.floor(round(resources.get(name, 0.0) / need, 4)))
    return min(fits) if fits else 0


@dataclasses.dataclass(frozen=True)
class RayNode:
    node_id: str
    address: str  # the node's IP, as Ray reports it
    slots: int


def draining_node_ids() -> set[str]:
    """Ids of the nodes Ray is draining. Ray's only reader of this is private: if it moves,
    draining nodes are seen when they leave the table instead (a fault, not a removal)."""
    try:
        from ray._private.state import state  # noqa: PLC0415

        return set(state.get_draining_nodes())
    except Exception:  # noqa: BLE001 - any failure only loses the early notice
        return set()


class RayNodeDiscovery:
    """``HostDiscovery`` over ``ray.nodes()``; also tells the launcher which node a host is."""

    def __init__(self, settings: RaySettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._nodes: dict[str, RayNode] = {}  # every node seen in this job, by host name
        self._classifier = HostClassifier()

    def discover(self) -> list[HostSlots]:
        try:
            table = ray.nodes()
            draining = draining_node_ids()
        except Exception as err:  # noqa: BLE001 - Ray raises many kinds; the driver retries
            raise DiscoveryError(f"Ray's node table cannot be read: {type(err).__name__}: {err}") from None
        hosts = []
        with self._lock:
            for entry in table:
                if not entry.get("Alive") or entry["NodeID"] in draining:
                    continue
                s = self._settings
                node = RayNode(entry["NodeID"], entry.get("NodeManagerAddress", ""),
                               slots_on(entry.get("Resources", {}), s.cpus_per_worker, s.gpus_per_worker))
                name = host_name(node.node_id)
                if name not in self._nodes:
                    log.info("Ray node %s (%s) is host %s with %d slot(s).", node.node_id, node.address, name, node.slots)
                self._nodes[name] = node
                if node.slots > 0:
                    hosts.append(HostSlots(name, node.slots))
        return hosts

    def cancel(self) -> None:
        pass

    def node(self, host: str) -> RayNode:
        with self._lock:
            return self._nodes[host]

    def is_local(self, host: str) -> bool:
        """Is the node on this machine (its address is one of ours)?"""
        with self._lock:
            node = self._nodes.get(host)
        return node is not None and self._classifier.is_local(node.address)
