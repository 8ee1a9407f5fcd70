"""What a job on Ray needs around the driver: the connection, the discovery, the launcher.

``ray_backend(config)`` connects (``--ray auto``, ``HOST:PORT``, ``local``; or uses the
caller's connection for the Python API), chooses the address the driver serves on (the one
that routes to the cluster's head, so every node can reach the rendezvous service and the
store), and on leaving releases every actor and disconnects what it connected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket
from collections.abc import Iterator

import ray

from lightning_elastic.launcher.config import LaunchConfig, RaySettings
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.hosts.network import resolve, route_source
from lightning_elastic.launcher.processes.output import OutputSink
from lightning_elastic.launcher.ray.launcher import RayLauncher, first_line
from lightning_elastic.launcher.ray.nodes import RayNodeDiscovery

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0  # to open a TCP connection to the cluster's address


@dataclasses.dataclass(frozen=True)
class RayBackend:
    config: LaunchConfig  # with the driver address chosen for the cluster
    nodes: RayNodeDiscovery
    launcher: RayLauncher


def connect(settings: RaySettings) -> bool:
    """Connect as ``settings.address`` says; True when this call connected (and must disconnect)."""
    if settings.address is None:
        if not ray.is_initialized():
            raise ConfigError("ElasticRayExecutor: Ray is not connected: call ray.init(...) first")
        return False
    if ray.is_initialized():
        return False  # this process is connected already: use that cluster
    if settings.address not in ("auto", "local"):
        check_reachable(settings.address)
    # Workers' output comes back through the agents, rank-prefixed: Ray's own copy of the
    # actors' output would repeat nothing useful.
    options = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if settings.address == "local":  # Ray's "local": a new instance, even if one runs here
            ray.init(address="local", include_dashboard=False, **options)
        else:
            ray.init(address=settings.address, **options)
    except Exception as err:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError...
        if settings.address == "auto" and isinstance(err, ConnectionError):
            raise ConfigError("--ray auto: no running Ray cluster found from this machine; start one "
                              "(ray start --head), give its HOST:PORT, or use --ray local") from None
        raise ConfigError(f"--ray: cannot connect to the Ray cluster at {settings.address}: {first_line(err)}") from None
    return True


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Fail fast on an address nothing listens on: ``ray.init`` retries it for minutes."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--ray: expected auto, local or the cluster's HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ConfigError(f"--ray: cannot connect to the Ray cluster at {address}: {reason}") from None


def head_address() -> str | None:
    """The IP of the cluster's head (its GCS), as this process reaches it."""
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a Ray client connection has no GCS address here
        return None
    host = gcs.rpartition(":")[0] if gcs else ""
    return resolve(host) if host else None


def driver_address(config: LaunchConfig) -> str | None:
    """The address to serve workers on: the user's, else the route to the head node."""
    if config.driver_address is not None or config.network_interface is not None:
        return config.driver_address  # choose_driver_address applies the user's choice
    head = head_address()
    source = route_source(head) if head else None
    if source is None:
        raise ConfigError("--ray: no route to the Ray cluster's head: pass --driver-address or --network-interface")
    return source


@contextlib.contextmanager
def ray_backend(config: LaunchConfig, sink: OutputSink, function: bytes | None = None) -> Iterator[RayBackend]:
    assert config.ray is not None
    connected_here = connect(config.ray)
    launcher: RayLauncher | None = None
    try:
        nodes = RayNodeDiscovery(config.ray)
        job = secrets.token_hex(4)  # names this job's actors apart from another job's
        launcher = RayLauncher(config.ray, nodes, job, sink, function)
        chosen = dataclasses.replace(config, driver_address=driver_address(config))
        log.info("Running on Ray (job %s): workers reach the driver at %s.", job, chosen.driver_address)
        yield RayBackend(chosen, nodes, launcher)
    finally:
        if launcher is not None:
            launcher.close()
        if connected_here:
            ray.shutdown()
