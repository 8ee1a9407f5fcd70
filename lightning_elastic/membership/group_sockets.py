"""Unblocking a gloo collective whose peer vanished without a trace (a partition, a dead host).

A peer that dies sends FIN or RST and gloo fails within milliseconds; a peer behind a
link that went down sends nothing, and gloo waits for its full timeout. Gloo has no abort
(``ProcessGroupGloo.abort()`` and ``_abort_process_group()`` leave a blocked collective
waiting: docs/performance.md), but shutting down the group's own TCP sockets makes the
blocked send or receive fail at once ("Connection closed by peer"), after which the group
is destroyed and re-formed as after any lost peer.

The group's sockets are the TCP connections that appeared while the group was formed,
less the connections to the driver, and of those only the ones with an end at a listening
address that the group's ranks published through the store (gloo's own listeners: a
peer's, for a connection this rank opened; this rank's, for one it accepted). Recorded
then, so that nothing else of the process is ever touched: a connection another thread
opens during the formation (a logger's HTTPS stream) goes to no published address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import struct
from collections.abc import Collection, Iterable

log = logging.getLogger(__name__)

Address = tuple[str, int]
Connection = tuple[Address, Address]  # (local, remote)

FD_DIRECTORY = "/proc/self/fd"
TCP_ESTABLISHED = 1  # Linux's tcp_states.h
TCP_CLOSE_WAIT = 8  # the peer has closed its end; ours is still open


def _plain(address: Iterable) -> Address:
    host, port = tuple(address)[:2]
    if host.startswith("::ffff:"):  # an IPv4 peer on a dual-stack socket
        host = host[7:]
    return host, int(port)


def established(states: Collection[int] = (TCP_ESTABLISHED,)) -> dict[Connection, int]:
    """This process's connected TCP sockets (in ``states``), mapped to their descriptors.

    Read from the process's own descriptors (each socket's endpoints asked on a duplicate),
    not from the system's connection table, whose walk costs milliseconds three times in
    each recovery (docs/performance.md). Only established connections count (the state is the first byte of
    the kernel's ``tcp_info``): not a listener, nor one shut down or closed by its peer.
    """
    found = {}
    for name in os.listdir(FD_DIRECTORY):
        try:
            if not os.readlink(f"{FD_DIRECTORY}/{name}").startswith("socket:"):
                continue
            duplicate = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue  # closed since it was listed, or not a socket Python can wrap
        try:
            if (duplicate.type == socket.SOCK_STREAM and duplicate.family in (socket.AF_INET, socket.AF_INET6)
                    and duplicate.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in states):
                found[(_plain(duplicate.getsockname()), _plain(duplicate.getpeername()))] = int(name)
        except OSError:
            pass  # not connected: a listener, or not yet connected
        finally:
            duplicate.close()  # closes only the duplicate
    return found


def new_connections(
    before: Collection[Connection], after: Collection[Connection], excluded_remotes: Collection[Address]
) -> frozenset[Connection]:
    """Connections the group formation opened: in ``after`` only, to no excluded endpoint."""
    return frozenset(c for c in after if c not in before and c[1] not in excluded_remotes)


def published_by(connections: Collection[Connection], published: Collection[bytes]) -> frozenset[Connection]:
    """Those of ``connections`` with an end at an address found in ``published``.

    gloo publishes each rank's listening address as a ``sockaddr`` inside an opaque value;
    rather than parse gloo's layout, an address is found as ``sockaddr`` lays it out: the
    port in network order, then (IPv4) the address, or (IPv6) 4 bytes of flow label and
    the address.
    """
    return frozenset(c for c in connections if _in(c[0], published) or _in(c[1], published))


def _in(address: Address, published: Collection[bytes]) -> bool:
    try:
        ip = ipaddress.ip_address(address[0])
    except ValueError:
        return False
    port = struct.pack("!H", address[1])
    if ip.version == 4:
        needle = port + ip.packed
        return any(needle in value for value in published)
    pattern = re.compile(re.escape(port) + b".{4}" + re.escape(ip.packed), re.DOTALL)
    return any(pattern.search(value) for value in published)


def shut_down(connections: Collection[Connection]) -> int:
    """Shut down those of ``connections`` that are still open; returns how many.

    The descriptor is duplicated and its endpoints checked on the duplicate first: gloo may
    have closed it since, and the number may now belong to another socket. One whose peer
    has already closed its end (the peer left the round first) is shut down too: gloo does
    not always fail an operation pending on it (docs/reliability.md), and its own end shut down wakes gloo's poll on it.
    """
    done = 0
    for conn, fd in established((TCP_ESTABLISHED, TCP_CLOSE_WAIT)).items():
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
