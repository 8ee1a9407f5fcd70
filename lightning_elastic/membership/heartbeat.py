"""The heartbeat thread: tells the driver this worker lives, learns what changed, cuts a
round that lost a member.

Each beat is a long poll carrying what the worker knows (the newest host generation and
broken round it saw, its round's first step, its snapshot writer's counts). The reply's
generation makes ``check_host_updates`` raise at the next common check; a newly broken
round has its group's connections cut (gloo) or its communicator aborted (NCCL), so that a
collective waiting for the lost member raises now instead of at the group's timeout.

The thread never raises into the training thread: what it cannot mend it ends with
``os._exit(1)`` and one line on stderr (docs/troubleshooting.md has a row for each); a
driver unreachable for longer than this worker waits ends it with
``protocol.EXIT_DRIVER_GONE``, which a restarted driver does not count as a failure.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from lightning_elastic.errors import RendezvousError
from lightning_elastic.membership import group_sockets
from lightning_elastic.membership.client import (
    RETRY_FOR,
    DriverClient,
    exit_driver_gone,
    heartbeat_hold,
    heartbeat_retry_delay,
)
from lightning_elastic.membership.process_group import destroy_round_group
from lightning_elastic.membership.settings import WorkerSettings
from lightning_elastic.membership.shared import NO_GROUP, SharedState
from lightning_elastic.membership.stuck_round import Action, StuckRoundWatch, stack_of


class Heartbeat:
    """The heartbeat thread of a launched worker: ``start()``, then ``stop()`` at the exit.

    ``client`` is the worker's one driver client, which the training thread uses too;
    ``stuck`` is this thread's alone.
    """

    def __init__(self, settings: WorkerSettings, client: DriverClient, shared: SharedState) -> None:
        self.settings = settings
        self.client = client
        self.shared = shared
        self.stuck = StuckRoundWatch()  # the watch on a broken round this worker stays in
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="elastic-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop (it does at its next beat; nothing waits for it)."""
        self._stop.set()

    def run(self) -> None:
        shared, interval = self.shared, self.settings.heartbeat_interval
        last_ok = time.monotonic()
        first = True
        failures = 0  # in a row
        while not self._stop.is_set():
            try:
                known, known_broken = shared.known()
                # Held for a random part of the interval: a fleet's heartbeats must not
                # reach the driver in waves (see heartbeat_hold).
                hold = heartbeat_hold(interval, first)
                first = False
                writer = shared.snapshot_writer
                stats = writer.stats if writer is not None else None
                reply = self.client.heartbeat(known, known_broken, hold, shared.stepped, stats)
            except RendezvousError as err:
                if "(409)" in str(err):
                    # The driver counts this worker as gone (it missed heartbeats behind a
                    # partition, say) while it still runs: nobody will answer it again.
                    print("lightning-elastic: the driver no longer counts this worker in the job: exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
                # Training goes on meanwhile: collectives run peer to peer. With --state-dir
                # a restarted driver adopts this worker within the patience.
                lost_after = self.settings.driver_lost_after
                if time.monotonic() - last_ok > lost_after:
                    exit_driver_gone(lost_after)  # status EXIT_DRIVER_GONE: gone for the driver's absence
                self._stop.wait(heartbeat_retry_delay(interval, failures))
                failures += 1
                continue
            failures = 0
            last_ok = time.monotonic()
            if shared.learn(reply.generation, reply.last_broken_round):
                self.unblock_collectives(reply.last_broken_round)
            self.watch_broken_round()

    def unblock_collectives(self, broken_round: int) -> None:
        """The round lost a member: make a collective stuck waiting for it raise now.

        A dead peer usually fails a gloo collective within milliseconds, but one behind a
        partition sends nothing, and NCCL often hangs rather than fails: without this the
        survivors would wait for the process-group timeout.
        """
        shared = self.shared
        with shared.lock:
            # The group that exists now, read under the lock: the training thread may have
            # left the broken round and formed the next one since this thread learned of
            # it, and that group is healthy (going by the assignment instead could abort it).
            group = shared.group
            if group.round != broken_round:
                return
            self.stuck.cut(broken_round, time.monotonic())
            if group.nccl:
                # Aborted under the lock: the training thread marks the group gone under it
                # before it destroys or replaces it, so the group aborted here is the
                # broken round's. @run re-forms.
                shared.group = NO_GROUP
                destroy_round_group(abort=True)
                return
        group_sockets.shut_down(group.connections)

    def watch_broken_round(self) -> None:
        """Still in a round whose connections were cut long ago: cut again and say where
        the training thread is, then exit (see stuck_round)."""
        shared = self.shared
        if shared.reported is not None:
            return  # training returned (or the worker left): what it does now is its own
        group = shared.current_group()
        now = time.monotonic()
        action = self.stuck.check(group.round, now)
        if action is Action.NONE:
            return
        waited = self.stuck.waited(now)  # the watch acts only while the group is still the cut round's
        if action is Action.REPORT:
            cut = group_sockets.shut_down(group.connections)
            print(f"lightning-elastic: round {group.round} lost a member {waited:.0f} s ago and this worker is still "
                  f"in it ({cut} of its {len(group.connections)} connection(s) cut again); its training thread is at:\n"
                  f"{stack_of(shared.training_thread)}", file=sys.stderr, end="", flush=True)
            return
        print(f"lightning-elastic: still in round {group.round} {waited:.0f} s after it lost a member: exiting, "
              "so that the job goes on without this worker", file=sys.stderr, flush=True)
        os._exit(1)


def send_first_step(settings: WorkerSettings, shared: SharedState, stepped: tuple[int, float]) -> threading.Thread:
    """Tell the driver at once when training resumed in this round, for the timeline.

    Heartbeats carry it too, but a round that ends within a heartbeat interval (a kill or a
    join shortly before training returns) would end without it, and the timeline without
    that recovery's duration. Rank 0 alone sends it (all ranks step together: one request
    per round, not a fleet's wave), from a thread of its own: the training loop never waits
    on the driver. A failure is left to the next heartbeat. Returns the started thread.
    """

    def send() -> None:
        client = settings.client(RETRY_FOR)  # the others' may be mid-request
        try:
            known, known_broken = shared.known()
            client.heartbeat(known, known_broken, 0.0, stepped)
        except RendezvousError:
            pass
        finally:
            client.close()

    sender = threading.Thread(target=send, name="elastic-first-step", daemon=True)
    sender.start()
    return sender
