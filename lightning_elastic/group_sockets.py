"""Unblocking a gloo collective whose peer vanished without a trace (a partition, a dead host).

A peer that dies sends FIN or RST and gloo fails within milliseconds; a peer behind a
link that went down sends nothing, and gloo waits for its full timeout. Gloo has no abort
(``ProcessGroupGloo.abort()`` and ``_abort_process_group()`` leave a blocked collective
waiting, measured on torch 2.13), but shutting down the group's own TCP sockets makes the
blocked send or receive fail at once ("Connection closed by peer"), after which the group
is destroyed and re-formed as after any lost peer.

The group's sockets are the TCP connections that appeared while the group was formed,
less the connections to the driver: recorded then, so that nothing else of the process
(a logger's HTTP connection, a data stream) is ever touched.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Collection, Iterable

import psutil

log = logging.getLogger(__name__)

Address = tuple[str, int]
Connection = tuple[Address, Address]  # (local, remote)


def _plain(address: Iterable) -> Address:
    host, port = tuple(address)[:2]
    if host.startswith("::ffff:"):  # an IPv4 peer on a dual-stack socket
        host = host[7:]
    return host, int(port)


def established() -> dict[Connection, int]:
    """This process's established TCP connections, mapped to their descriptors."""
    found = {}
    for c in psutil.Process().net_connections("tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd >= 0:
            found[(_plain(c.laddr), _plain(c.raddr))] = c.fd
    return found


def new_connections(
    before: Collection[Connection], after: Collection[Connection], excluded_remotes: Collection[Address]
) -> frozenset[Connection]:
    """Connections the group formation opened: in ``after`` only, to no excluded endpoint."""
    return frozenset(c for c in after if c not in before and c[1] not in excluded_remotes)


def shut_down(connections: Collection[Connection]) -> int:
    """Shut down those of ``connections`` that are still open; returns how many.

    The descriptor is duplicated and its endpoints checked on the duplicate first: gloo may
    have closed it since, and the number may now belong to another socket.
    """
    done = 0
    for conn, fd in established().items():
        if conn not in connections:
            continue
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (_plain(dup.getsockname()), _plain(dup.getpeername())) == conn:
                dup.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
        finally:
            dup.close()  # closes only the duplicate; gloo's descriptor stays its own
    log.debug("Shut down %d of the group's %d connection(s).", done, len(connections))
    return done
