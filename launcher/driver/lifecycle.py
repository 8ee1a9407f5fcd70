"""The driver's life cycle: its service up, the hand-over to the next driver (SIGTERM with
``--state-dir``), the shutdown that stops every worker, and the result."""

from __future__ import annotations

import logging
import resource

from lightning_elastic.launcher.driver.result import JobResult
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.job import verdict as policy
from lightning_elastic.launcher.processes.base import stop_all
from lightning_elastic.launcher.restart import adoption
from lightning_elastic.launcher.restart import resume as snapshots
from lightning_elastic.launcher.service.rendezvous_server import (
    RendezvousServer,
    limits_for,
    listen_queue_for,
)

log = logging.getLogger("lightning_elastic.driver")


class Lifecycle:
    """Part of ``Driver`` (driver/driver.py): see the module docstring."""

    def _wake_loop(self) -> None:
        """A worker process exited: reap it now, not at the next tick (a survivor's
        recovery waits for the driver to see its peer gone)."""
        with self._registry.cond:
            self._registry.cond.notify_all()

    def _listen(self) -> None:
        """One listening socket, on the job's address only: the signed rendezvous service,
        which also serves the process-group store (see launcher/service/store_service.py)."""
        workers = self._config.max_np + self._config.spares
        port = self._config.port
        not_before = None
        if self._adopting:
            previous = self._keeping.previous  # type: ignore[union-attr]
            # Where the adopted workers look for their driver first: the same address and
            # port, unless this driver serves elsewhere (--port, another machine).
            if not port and self._address == previous.address:  # type: ignore[union-attr]
                port = previous.port  # type: ignore[union-attr]
            not_before = adoption.not_before(self._keeping.started)  # type: ignore[union-attr]
        self._server = RendezvousServer(self._registry, self._secret, host=self._address,
                                        listen_queue=listen_queue_for(workers), limits=limits_for(workers),
                                        port=port or 0, not_before=not_before, agents=self._agents)
        try:
            self._server.listen()
        except OSError as err:
            if port:
                raise ConfigError(f"--port: cannot serve on {self._address}:{port}: {err.strerror or err}") from None
            raise ConfigError(f"cannot serve on {self._address}: {err.strerror or err}") from None

    def _start_services(self) -> None:
        """Serve on the socket ``_listen`` opened (opened here unless an adoption did)."""
        if self._server is None:
            self._listen()
        assert self._server is not None
        # Where every round's members find the store (an adopted state says where the previous
        # driver served: this one may serve elsewhere).
        self._state.address, self._state.port = self._address, self._server.port
        self._server.start()
        log.info("Rendezvous service and process-group store at %s.", self._server.url)
        if self._keeping is not None:
            # Workers that cannot reach their driver look here (another address, another
            # machine): written before the loop, which never waits on the disk.
            try:
                self._keeping.dir.write_url(self._server.url)
            except OSError as err:
                log.warning("--state-dir: cannot write %s (%s): workers find this driver only at the address "
                            "they were started with.", self._keeping.dir.url_file, err.strerror or err)

    def _can_hand_over(self) -> bool:
        """SIGTERM with --state-dir ends the driver alone: a Kubernetes rolling restart or
        `systemctl restart` replaces the driver, not the job. SIGINT (Ctrl-C) still stops it.
        Only once there is a job to leave: served (its state saved) or adopted."""
        return (self._stop_signal == "SIGTERM" and self._keeping is not None
                and (self._server is not None or self._adopting))

    def _hand_over_reason(self) -> str:
        running = sum(p_.poll() is None for p_ in self._processes.values())
        return (f"SIGTERM: the driver exited and left {running} worker(s) running; the next driver started with "
                f"--state-dir {self._keeping.dir.path} adopts them (they wait --driver-patience "  # type: ignore[union-attr]
                f"{self._config.driver_patience:g} s for it)")

    def _take_over_failed_reason(self, err: BaseException) -> str:
        return (f"the driver failed while taking over the job in --state-dir {self._keeping.dir.path}: "  # type: ignore[union-attr]
                f"{type(err).__name__}: {err}; the job is left as it was (its state kept, its workers running "
                f"for --driver-patience {self._config.driver_patience:g} s): start the same command again")

    def _hand_over(self) -> None:
        """Exit without touching a worker: the state saved (the writer flushed), every
        connection to a worker closed as a crash would close it, nothing signalled."""
        if self._server is not None:
            with self._registry.cond:
                self._save_state()  # the newest state, whatever the last pass saved
        self._discovery.close()
        if self._server is not None:
            self._server.close()  # no new request answered: the workers wait for the next driver
        for proc in self._processes.values():
            detach = getattr(proc, "detach", None)  # an ssh session: its supervisor keeps the worker
            if detach is not None:
                detach()
        if self._exit_watcher is not None:
            self._exit_watcher.close()
        self._gc.stop()
        self._keeping.finish(job_over=False)  # type: ignore[union-attr]
        log.info("Handed the job over: %d worker(s) left running for the next driver on --state-dir %s.",
                 sum(p_.poll() is None for p_ in self._processes.values()), self._keeping.dir.path)  # type: ignore[union-attr]

    def _shutdown(self) -> None:
        if self._handed_over:
            self._hand_over()
            return
        with self._registry.cond:
            self._state.closing = True  # a SIGTERM from stop_all below means "exit now"
            self._registry.wake_all()
        self._discovery.close()
        if self._taking_over:
            # This driver could not take the job over (its port is taken, a worker's file is
            # missing, the state dir cannot be written...): the job is left as it found it,
            # the state and the secret in the state dir, every worker running (an ssh one's
            # supervisor keeps it), for the next driver within the workers' patience.
            if self._server is not None:
                self._server.close()
            for proc in self._processes.values():
                detach = getattr(proc, "detach", None)
                if detach is not None:
                    detach()
            self._keeping.finish(job_over=False)  # type: ignore[union-attr]
            if self._exit_watcher is not None:
                self._exit_watcher.close()
            self._gc.stop()
            return
        procs = [*self._processes.values(), *self._retired]
        if any(p_.poll() is None for p_ in procs):
            log.info("Stopping %d worker process(es).", sum(p_.poll() is None for p_ in procs))
        stop_all(procs, self._config.timeouts.stop_grace)
        if self._agents is not None:
            # Every agent's poll says the job is over before the service closes (a poll
            # comes every heartbeat period): else they would go on waiting for a driver.
            self._agents.close(timeout=self._config.timeouts.heartbeat_period + 1.0)
        if self._exit_watcher is not None:
            self._exit_watcher.close()
        self._gc.stop()
        if self._server is not None:
            self._server.close()
        if self._keeping is not None:
            self._keeping.finish(job_over=True)

    def _result(self, verdict: policy.Verdict, refused: bool = False) -> JobResult:
        if self._handed_over:  # the job goes on: the next driver's timeline continues this one
            self._events.emit("driver_handed_over", reason=verdict.reason)
        elif self._taking_over and not refused:  # the job goes on too, without a driver for now
            self._events.emit("driver_take_over_failed", reason=verdict.reason)
        else:
            self._events.emit("job_ended", success=verdict.success, reason=verdict.reason)
        self._events.close()
        return JobResult(
            success=verdict.success,
            reason=verdict.reason,
            rounds=tuple(self._state.tally.rounds),
            rounds_omitted=self._state.tally.rounds.omitted,
            failures=tuple(self._state.tally.failures),
            failures_omitted=self._state.tally.failures.omitted,
            blacklisted=tuple(self._state.tally.blacklisted),
            duration=self._clock() - self._started_at,
            rejected_requests=self._server.rejected if self._server else 0,
            departures=tuple(self._state.tally.departures),
            departures_omitted=self._state.tally.departures.omitted,
            refused=refused,
            resumed_from=str(self._resume.found.path) if self._resume and self._resume.found else "",
            snapshots=snapshots.totals(self._state.workers.values()) if self._config.snapshots else None,
            outages=tuple(self._state.tally.outages),
            handed_over=self._handed_over,
        )


def raise_descriptor_limit() -> None:
    """Raise the soft limit on open descriptors to the hard one. The driver holds up to
    four per worker (its three connections and its output pipe; six for an ssh worker, whose
    client has three pipes; README, "Large jobs"): the usual soft limit of 1024 ends a job
    of a few hundred workers with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the kernel refuses "unlimited" here
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:
            log.warning("Could not raise the open-file limit from %d to %d: %s.", soft, wanted, err)
