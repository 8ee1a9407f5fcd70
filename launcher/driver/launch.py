"""``launch(config)``: one job, its parts wired for the host source asked for (fixed hosts or a
discovery script, ssh, Ray, Slurm), SIGINT and SIGTERM turned into a stop."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import IO

from lightning_elastic import protocol as p
from lightning_elastic.launcher.config import LaunchConfig
from lightning_elastic.launcher.driver.driver import Driver
from lightning_elastic.launcher.driver.result import JobResult
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.hosts.discovery import FixedHosts, HostDiscovery, ScriptDiscovery
from lightning_elastic.launcher.hosts.network import HostClassifier
from lightning_elastic.launcher.observe.events import prepare_log_dir
from lightning_elastic.launcher.processes.agent import AgentLauncher
from lightning_elastic.launcher.processes.base import HostRouter, WorkerLauncher, WorkerProcess
from lightning_elastic.launcher.processes.detached import DetachedLauncher
from lightning_elastic.launcher.processes.local import LocalLauncher
from lightning_elastic.launcher.processes.output import OutputSink
from lightning_elastic.launcher.processes.ssh import SshLauncher
from lightning_elastic.launcher.processes.warm_start import WarmStarts
from lightning_elastic.launcher.restart import adoption
from lightning_elastic.launcher.job.state import WorkerRecord
from lightning_elastic.launcher.restart.state_dir import StateDir
from lightning_elastic.launcher.service.agent_board import AgentBoard

log = logging.getLogger("lightning_elastic.driver")


def make_discovery(config: LaunchConfig) -> HostDiscovery:
    if config.discovery_script is not None:
        return ScriptDiscovery(config.discovery_script, config.slots_per_host, config.timeouts.discovery)
    # --agents alone: every host comes from an agent (driver/host_intake.py).
    return FixedHosts(config.hosts if config.hosts is not None else ())


def launch(config: LaunchConfig, out: IO[str] | None = None) -> JobResult:
    """Run one elastic job to its end; SIGINT and SIGTERM stop it and every worker (with
    --state-dir, SIGTERM ends the driver alone and leaves the job to the next one).

    Raises ConfigError only before any worker started: an input found invalid only here (a
    --log-dir that cannot be written, a Ray cluster that cannot be reached, an address or
    port the driver cannot serve on, no host name that resolves, another driver holding
    --state-dir).
    """
    state_dir = None
    if config.state_dir is not None:
        state_dir = StateDir(config.state_dir)
        state_dir.lock()  # another driver runs this job: ConfigError, exit 2
    for notice in config.notices:
        log.info("%s", notice)
    try:
        return _launch(config, out, state_dir)
    finally:
        if state_dir is not None:
            state_dir.release()


def _launch(config: LaunchConfig, out: IO[str] | None, state_dir: StateDir | None) -> JobResult:
    sink = OutputSink(out)  # one for every worker's output: a broken stdout is said once
    agents_secret = config.agents.secret if config.agents is not None else None
    keeping = adoption.StateKeeping(state_dir, secret=agents_secret) if state_dir else None
    # An adopted job goes on writing its --log-dir: its timeline continues.
    if config.log_dir is not None and not (keeping and keeping.previous):
        moved = prepare_log_dir(config.log_dir)
        if moved:
            log.info("%s.", moved)
    if config.ray is not None:
        from lightning_elastic.launcher.ray.backend import ray_backend  # noqa: PLC0415 - Ray only when asked

        with ray_backend(config, sink) as backend:
            result = run_driver(Driver(backend.config, backend.nodes, backend.launcher, backend.nodes.is_local))
    elif config.slurm is not None:
        from lightning_elastic.launcher.processes.slurm import SlurmLauncher  # noqa: PLC0415 - only when asked
        from lightning_elastic.launcher.hosts.slurm import SlurmDiscovery, SlurmNodes  # noqa: PLC0415

        # Every worker is an srun step, on this node too: a step is what Slurm accounts,
        # signals and cleans up with the allocation.
        classifier = HostClassifier()
        nodes = SlurmNodes(config.slurm.job_ids[0])
        slurm_launcher = SlurmLauncher(nodes, sink)
        try:
            result = run_driver(Driver(config, SlurmDiscovery(config.slurm, nodes, config.timeouts.discovery),
                                       slurm_launcher, classifier.is_local, resolves=classifier.resolves))
        finally:
            slurm_launcher.close()
    else:
        classifier = HostClassifier()
        ssh = SshLauncher(config.ssh, sink, state_dir, secret=keeping.secret if keeping is not None else "")
        if keeping is not None:  # workers that outlive the driver, and finding them again
            detached = DetachedLauncher(state_dir, sink, secret=keeping.secret)  # type: ignore[arg-type]
            local: WorkerLauncher = detached

            def adopt(record: WorkerRecord, prefix: Callable[[], str]) -> WorkerProcess:
                return (detached if classifier.is_local(record.slot.host) else ssh).adopt(record, prefix)

            keeping.adopt = adopt
        else:
            local = LocalLauncher(sink)
        router: WorkerLauncher = HostRouter(local, ssh, classifier.is_local)
        board = None
        if config.agents is not None:  # hosts an agent serves get their workers through it
            t = config.timeouts
            # With --state-dir an agent keeps its workers for --driver-patience while it has
            # no driver, for a restarted one to adopt (service/agent_board.py).
            board = AgentBoard(config.max_np, t.heartbeat_timeout, t.heartbeat_period,
                               patience=config.driver_patience if keeping is not None else 0.0)
            agent_launcher = AgentLauncher(board, router, sink)
            router = agent_launcher
            if keeping is not None:
                others = keeping.adopt

                def adopt_via_agents(record: WorkerRecord, prefix: Callable[[], str]) -> WorkerProcess:
                    if record.via_agent:
                        return agent_launcher.adopt(record, prefix)
                    return others(record, prefix)  # type: ignore[misc]

                keeping.adopt = adopt_via_agents
        # --preload over every route: an agent's host gets its fork server through its agent,
        # as an ssh host through ssh.
        warm = WarmStarts(router, config.preload, classifier.is_local, p.ENV_SECRET_FD) if config.preload else None
        try:
            result = run_driver(Driver(config, make_discovery(config), warm or router, classifier.is_local,
                                       resolves=classifier.resolves, keeping=keeping, agents=board,
                                       secret=agents_secret))
        finally:
            if warm is not None:
                warm.close()  # the fork servers, after the driver stopped their workers
    if result.refused:
        raise ConfigError(result.reason)
    return result


def run_driver(driver: Driver) -> JobResult:
    """``driver.run()``, with SIGINT and SIGTERM asking it to stop (from the main thread)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda s, _f: driver.request_stop(signal.Signals(s).name))
    try:
        return driver.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.stdout.flush()
