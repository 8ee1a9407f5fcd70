"""``lightning-elastic``: a thin argparse front that builds a LaunchConfig and calls launch().

Every ``launch`` option can also come from the environment, as ``LIGHTNING_ELASTIC_<NAME>``
(the long option's name: ``--min-np`` is ``LIGHTNING_ELASTIC_MIN_NP``); the command line
wins. No user input ends in a traceback: an invalid one is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_elastic import __version__
from lightning_elastic.launcher.command import check_command, check_script, with_python
from lightning_elastic.launcher.config import (
    STATE_DIR_WITH_SLURM,
    AgentsSettings,
    LaunchConfig,
    RaySettings,
    SlurmSettings,
    SshSettings,
    Timeouts,
)
from lightning_elastic.launcher.hosts.discovery import SCRIPT_TIMEOUT
from lightning_elastic.launcher.driver.launch import launch
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.secret_source import ENV_SECRET, read_secret
from lightning_elastic.launcher.job.slots import HostSlots, count_slots, parse_host_list, parse_hostfile
from lightning_elastic.launcher.observe.log_writer import BackgroundStreamHandler
from lightning_elastic.launcher.hosts.network import explicit_driver_address
from lightning_elastic.launcher.processes.output import WRITE_ERRORS, flush_or_discard
from lightning_elastic.durable.files import SnapshotError, SnapshotSettings, is_url

PROG = "lightning-elastic"
ENV_PREFIX = "LIGHTNING_ELASTIC_"
# The host sources, one of which a job has: one given on the command line overrides every
# source in the environment (not only its own variable). The same for the driver's address.
SOURCES = ("host_discovery_script", "hosts", "hostfile", "ray", "slurm")
ALTERNATIVES = (SOURCES, ("driver_address", "network_interface"))
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

log = logging.getLogger("lightning_elastic.cli")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False, here and on each verb: argparse looks at every argument, the
    # training command's too, before it knows where the command starts, and with
    # abbreviations on it refuses ``train.py --n 96`` (--n: an ambiguous prefix of --num-proc
    # and --network-interface). Without them, everything from the command on is the
    # command's (REMAINDER), whatever it looks like.
    parser = argparse.ArgumentParser(prog=PROG, description="Elastic, fault-tolerant training for PyTorch.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True)
    timeline = sub.add_parser(
        "timeline",
        help="draw a job's membership timeline (from launch --log-dir) as a PNG",
        allow_abbrev=False,
        description="Draw LOGDIR/events.jsonl: world size over time, a lane per host, faults, joins and "
                    "recovery times. Needs matplotlib.",
    )
    timeline.add_argument("log_dir", type=Path, metavar="LOGDIR", help="the --log-dir of a launch")
    timeline.add_argument("-o", "--output", type=Path, metavar="PNG", help="where to write (default: LOGDIR/timeline.png)")
    add_agent_parser(sub)
    run = sub.add_parser(
        "launch",
        help="run a training command elastically",
        allow_abbrev=False,
        description="Run COMMAND on every slot of the discovered hosts, elastically. A COMMAND that is a "
                    ".py file runs with this Python, as torchrun does.",
        epilog=f"Every option can also be set in the environment as {ENV_PREFIX}<NAME>, NAME being the long "
               f"option's name in capitals with _ for - ({ENV_PREFIX}MIN_NP=2, {ENV_PREFIX}VERBOSE=1; "
               "repeatable options as a shell-quoted list); the command line wins.",
    )
    run.add_argument("-np", "--num-proc", dest="np", type=int, help="number of workers to start with "
                     "(default: the slots of -H or --hostfile; the allocation's tasks with --slurm; 1, on localhost, "
                     "with no host source; required with --host-discovery-script or --ray)")
    run.add_argument("--min-np", type=int, help="fewest workers to keep training with (default: -np)")
    run.add_argument("--max-np", type=int, help="most workers to run (default: -np)")
    run.add_argument("--spares", type=int, default=0, metavar="K",
                     help="keep K more workers started and waiting (hot spares) on the slots after the first "
                          "--max-np, so a lost worker is replaced at the next re-formation, not after a start-up "
                          "(default: 0)")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--host-discovery-script", type=Path, metavar="PATH",
                        help="executable that prints the available hosts, one HOST[:SLOTS] per line")
    source.add_argument("-H", "--hosts", metavar="HOST:SLOTS[,HOST:SLOTS...]", help="fixed list of hosts")
    source.add_argument("--hostfile", type=Path, metavar="PATH",
                        help="fixed list of hosts in a file, one a line: HOST slots=N (as mpirun, horovodrun and "
                             "DeepSpeed write it) or HOST:SLOTS; # starts a comment")
    source.add_argument("--ray", metavar="ADDRESS",
                        help="run on a Ray cluster: its alive nodes are the hosts, each worker a Ray actor; "
                             "ADDRESS as ray.init takes it (auto, HOST:PORT), or local for a private one-node Ray "
                             "(needs the ray extra)")
    source.add_argument("--slurm", action="store_true",
                        help="run inside a Slurm allocation (sbatch, salloc): its nodes are the hosts, each worker "
                             "an srun step; a node that leaves the allocation leaves the job")
    run.add_argument("--agents", action="store_true",
                     help="hosts also come from agents that connect by themselves (lightning-elastic agent, e.g. "
                          "one per Kubernetes pod); the job may start with none and wait for them; needs --port, "
                          "--driver-address or --network-interface, and the job secret (--secret-file)")
    run.add_argument("--secret-file", type=Path, metavar="PATH",
                     help="with --agents: the job secret the agents hold too, from this file (a mounted Kubernetes "
                          "Secret) or from LIGHTNING_ELASTIC_SECRET; never printed")
    run.add_argument("--slurm-jobs", metavar="JOB[,JOB...]",
                     help="with --slurm: the nodes of these other allocations are hosts too, once they run "
                          "(capacity that arrives as more jobs); a JOB is an id, or a name that takes in "
                          "every running job of yours so named")
    run.add_argument("--slots-per-host", "--slots", type=int, metavar="S",
                     help="slots of a discovered host that gives no count")
    run.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="how long to wait for enough slots before failing (default: 600)")
    run.add_argument("--reset-limit", type=int, metavar="K", help="fail after K resets (default: no limit)")
    run.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                     help="let a blacklisted host back after MIN seconds, doubling up to MAX on repeats "
                          "(default: blacklisted for the rest of the job)")
    run.add_argument("--discovery-interval", type=float, default=1.0, metavar="SECONDS",
                     help="how often to run the discovery script (default: 1)")
    on_ray = run.add_argument_group("Ray (with --ray)")
    on_ray.add_argument("--cpus-per-worker", type=float, metavar="C",
                        help="CPUs a worker reserves; a node's slots are how many workers it fits (default: 1)")
    on_ray.add_argument("--gpus-per-worker", type=float, metavar="G", help="GPUs a worker reserves (default: 0)")
    bounds = run.add_argument_group("bounds (seconds)")
    bounds.add_argument("--heartbeat-timeout", type=float, default=Timeouts.heartbeat_timeout, metavar="SECONDS",
                        help="a worker silent this long (hung, stopped, or its host unreachable) is lost "
                             f"(default: {Timeouts.heartbeat_timeout:g})")
    bounds.add_argument("--start-timeout", type=float, default=Timeouts.worker_arrival, metavar="SECONDS",
                        help="how long a worker may take from its start (or a reset) to the rendezvous: imports, "
                             f"data preparation, compilation (default: {Timeouts.worker_arrival:g})")
    bounds.add_argument("--collective-timeout", type=float, default=Timeouts.process_group, metavar="SECONDS",
                        help="torch.distributed timeout of a collective whose peers are alive "
                             f"(default: {Timeouts.process_group:g})")
    bounds.add_argument("--exit-timeout", type=float, default=Timeouts.exit, metavar="SECONDS",
                        help="once training returned and a worker exited, how long the others may take to exit "
                             f"(default: {Timeouts.exit:g})")
    bounds.add_argument("--preemption-grace", type=float, default=Timeouts.preemption_grace, metavar="SECONDS",
                        help="a worker sent SIGTERM leaves at its next check without rollback; after this long "
                             f"it exits anyway (default: {Timeouts.preemption_grace:g}, as Kubernetes)")
    bounds.add_argument("--stop-grace", type=float, default=Timeouts.stop_grace, metavar="SECONDS",
                        help="when the driver stops a worker (the job's end, Ctrl-C, its host blacklisted): "
                             f"SIGTERM, then SIGKILL after this long (default: {Timeouts.stop_grace:g})")
    bounds.add_argument("--error-wait", type=float, default=Timeouts.lost_member_wait, metavar="SECONDS",
                        help="a worker that raised waits at most this long to learn whether its round lost a "
                             "member before the error counts as its own; usually the answer comes once every peer "
                             "has shown the driver it is alive (about a second), and the peers wait for it that long "
                             f"in their next collective (default: {Timeouts.lost_member_wait:g})")
    bounds.add_argument("--discovery-timeout", type=float, default=SCRIPT_TIMEOUT, metavar="SECONDS",
                        help="a run of the discovery script still going after this long has failed and is "
                             f"killed (default: {SCRIPT_TIMEOUT:g})")
    run.add_argument("--repeated-error-limit", type=int, default=3, metavar="N",
                     help="fail when the same collective error ends N consecutive rounds with no commit "
                          "(default: 3; 0: never)")
    remote = run.add_argument_group("multiple machines")
    remote.add_argument("--ssh-port", type=int, metavar="PORT", help="ssh port of the hosts (default: ssh's own)")
    remote.add_argument("--ssh-identity-file", type=Path, metavar="PATH", help="private key for ssh")
    remote.add_argument("--ssh-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an ssh -o option; repeatable")
    remote.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="give every worker this variable (its value on the driver, or VALUE); repeatable")
    remote.add_argument("--driver-address", metavar="ADDRESS",
                        help="address the driver serves workers on (default: the one that routes to the hosts)")
    remote.add_argument("--network-interface", metavar="NAME",
                        help="serve workers on this interface's address")
    remote.add_argument("--port", type=int, metavar="PORT",
                        help="the one TCP port the driver serves workers on (rendezvous and store), for a "
                             "firewall to let through (default: any free port)")
    durable = run.add_argument_group("durable snapshots")
    durable.add_argument("--snapshot-dir", metavar="DIR",
                         help="write the newest commit to DIR in the background (rank 0, atomic, checksummed) and "
                              "resume a new launch from the newest valid snapshot there; a local or shared file "
                              "system, or an fsspec URL such as s3://bucket/prefix (extra lightning-elastic[snapshots-s3])")
    durable.add_argument("--snapshot-every", type=float, metavar="SECONDS",
                         help="seconds between snapshots (default: 60; with --snapshot-dir)")
    durable.add_argument("--snapshot-keep", type=int, metavar="K",
                         help="complete snapshots to keep, older ones are deleted (default: 2)")
    durable.add_argument("--no-resume", action="store_true",
                         help="start over even if --snapshot-dir holds snapshots (new ones are still written)")
    durable.add_argument("--resume-other-command", action="store_true",
                         help="resume from the newest snapshot of --snapshot-dir even when another command wrote it "
                              "(other arguments, another script); without it such a snapshot is refused")
    run.add_argument("--log-dir", type=Path, metavar="DIR",
                     help="also write each worker's output, and the job's events.jsonl timeline, to DIR")
    run.add_argument("--state-dir", type=Path, metavar="DIR",
                     help="keep the job's state in DIR: local workers then outlive the driver, and the same "
                          "command run again with the same DIR adopts them; SIGTERM then ends the driver alone "
                          "and leaves the job to the next one (default: workers die with the driver)")
    run.add_argument("--driver-patience", type=float, default=120.0, metavar="SECONDS",
                     help="with --state-dir, how long workers wait for an unreachable driver before they exit "
                          "(default: 120)")
    run.add_argument("--preload", metavar="MODULE[,MODULE...]",
                     help="import these modules once per machine in a fork server and fork every worker there from "
                          "it (e.g. torch,lightning.pytorch): a replacement starts in a fraction of a second instead "
                          "of importing for seconds; every listed host gets its server as soon as it is listed")
    run.add_argument("--verbose", action="store_true", help="log the driver's decisions in detail")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]")
    return parser


def add_agent_parser(sub: Any) -> None:
    agent = sub.add_parser(
        "agent",
        help="offer this machine's slots to a job (launch --agents) and run its workers here",
        allow_abbrev=False,
        description="Connect to the driver of a job started with launch --agents, offer this host and its slots, "
                    "and run the workers the driver assigns here. Outbound connections only (no sshd). SIGTERM is a "
                    f"graceful leave. The job secret comes from --secret-file or {ENV_SECRET}.",
    )
    agent.add_argument("--driver", required=True, metavar="HOST:PORT",
                       help="where the driver serves (its --driver-address or a name for it, and its --port)")
    agent.add_argument("--slots", type=int, default=1, metavar="N", help="workers to run here (default: 1)")
    agent.add_argument("--host-name", metavar="NAME",
                       help="this host's name in the job, unique among its agents (default: the machine's host name)")
    agent.add_argument("--secret-file", type=Path, metavar="PATH",
                       help=f"the job secret (a mounted Kubernetes Secret); default: {ENV_SECRET}")
    agent.add_argument("--leave-timeout", type=float, default=20.0, metavar="SECONDS",
                       help="after SIGTERM, how long the workers have to leave the job before the agent stops them "
                            "(default: 20; a pod's terminationGracePeriodSeconds must be longer)")
    agent.add_argument("--verbose", action="store_true", help="log in detail")


def agent_settings(args: argparse.Namespace) -> Any:
    """The agent's settings from its command line; ConfigError in one line for a bad input."""
    import socket  # noqa: PLC0415

    from lightning_elastic.launcher.agent.run import AgentSettings  # noqa: PLC0415

    host, sep, port = args.driver.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--driver: expected HOST:PORT (the driver's address and its --port), got {args.driver!r}")
    if args.slots < 1:
        raise ConfigError(f"--slots: expected 1 or more, got {args.slots}")
    if not (args.leave_timeout > 0 and args.leave_timeout < float("inf")):
        raise ConfigError(f"--leave-timeout: expected a positive number of seconds, got {args.leave_timeout}")
    return AgentSettings(driver_host=host.strip("[]"), driver_port=int(port), slots=args.slots,
                         host_name=args.host_name or socket.gethostname(), secret=read_secret(args.secret_file),
                         leave_timeout=args.leave_timeout)


def run_agent_verb(args: argparse.Namespace) -> int:
    from lightning_elastic.launcher.agent.run import run_agent  # noqa: PLC0415

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="lightning-elastic agent %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        settings = agent_settings(args)
    except ConfigError as err:
        print(f"{PROG} agent: error: {err}", file=sys.stderr)
        return 2
    return run_agent(settings)


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]  # the user marked where the command starts: no hint below
    else:
        hint_misplaced_options(command)
    hosts: list[HostSlots] | None = None
    script = args.host_discovery_script.absolute() if args.host_discovery_script else None
    if args.hosts is not None:
        hosts = parse_host_list(args.hosts, args.slots_per_host)
    if args.hostfile is not None:
        hosts = read_hostfile(args.hostfile, args.slots_per_host)
    if args.slots_per_host is not None and args.slots_per_host < 1:
        raise ConfigError(f"--slots-per-host: must be at least 1, got {args.slots_per_host}")
    ray = ray_settings(args)
    slurm = slurm_from_args(args)
    np_ = args.np
    agents = None
    if args.agents:
        agents = AgentsSettings(secret=read_secret(args.secret_file))
        if np_ is None:
            raise ConfigError("-np: required with --agents")
    elif args.secret_file is not None:
        raise ConfigError("--secret-file: only with --agents (otherwise the driver draws the job's secret itself)")
    if np_ is None:
        if script is not None:
            raise ConfigError("-np: required with --host-discovery-script")
        if ray is not None:
            raise ConfigError("-np: required with --ray")
        if slurm is not None:
            np_ = slurm_slots(slurm, os.environ)
        else:
            np_ = count_slots(hosts) if hosts is not None else 1
    if hosts is None and script is None and ray is None and slurm is None and agents is None:
        hosts = [HostSlots("localhost", np_)]
    if script is not None and not (script.is_file() and os.access(script, os.X_OK)):
        raise ConfigError(f"--host-discovery-script: {script} is not an executable file")
    command = prepare_command(command, on_ray=ray is not None)
    # Checked here, not once the driver runs: a bad value is then one line, and nothing started.
    explicit_driver_address(args.driver_address, args.network_interface)
    notices = []
    if args.min_np is None and np_ > 1:
        notices.append(f"Not elastic below -np: without --min-np, training needs all {np_} workers of -np (after a "
                       "lost worker it waits, up to --elastic-timeout, for a replacement); pass --min-np to train on "
                       "with fewer.")
    return LaunchConfig(
        timeouts=Timeouts(
            heartbeat_timeout=args.heartbeat_timeout,
            worker_arrival=args.start_timeout,
            process_group=args.collective_timeout,
            exit=args.exit_timeout,
            preemption_grace=args.preemption_grace,
            stop_grace=args.stop_grace,
            lost_member_wait=args.error_wait,
            discovery=args.discovery_timeout,
        ),
        repeated_error_limit=args.repeated_error_limit,
        ssh=SshSettings(
            port=args.ssh_port,
            identity_file=args.ssh_identity_file,
            options=tuple(args.ssh_option),
        ),
        env=tuple(resolve_env(entry) for entry in args.env),
        driver_address=args.driver_address,
        network_interface=args.network_interface,
        port=args.port,
        command=tuple(command),
        np=np_,
        min_np=args.min_np if args.min_np is not None else np_,
        max_np=args.max_np if args.max_np is not None else np_,
        spares=args.spares,
        hosts=tuple(hosts) if hosts is not None else None,
        discovery_script=script,
        ray=ray,
        slurm=slurm,
        slots_per_host=args.slots_per_host,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        blacklist_cooldown=tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None,
        discovery_interval=args.discovery_interval,
        log_dir=args.log_dir,
        state_dir=args.state_dir,
        notices=tuple(notices),
        driver_patience=args.driver_patience,
        preload=tuple(name.strip() for name in args.preload.split(",")) if args.preload is not None else (),
        verbose=args.verbose,
        snapshots=snapshot_settings(args),
        agents=agents,
    )


def hint_misplaced_options(command: Sequence[str]) -> None:
    """A launch option among the command's arguments (``launch train.py -np 2``) goes to the
    command, as everything after it does; said in one line, in case it was meant for launch."""
    options = {o for a in launch_options(build_parser()) for o in a.option_strings}
    misplaced = [a for a in command[1:] if a.split("=", 1)[0] in options]
    if misplaced:
        one = len(misplaced) == 1
        log.info("Passing %s to the command, as everything after it: if %s meant for launch, put %s before the "
                 "command (-- before the command silences this).", " ".join(misplaced), "it is" if one else "they are",
                 "it" if one else "them")


def snapshot_settings(args: argparse.Namespace) -> SnapshotSettings | None:
    if args.snapshot_dir is None:
        for option, value in (("--snapshot-every", args.snapshot_every), ("--snapshot-keep", args.snapshot_keep),
                              ("--no-resume", args.no_resume or None),
                              ("--resume-other-command", args.resume_other_command or None)):
            if value is not None:
                raise ConfigError(f"{option}: only with --snapshot-dir")
        return None
    defaults = SnapshotSettings(Path("."))
    try:
        return SnapshotSettings(
            # A URL (s3://bucket/prefix) is the object store's, as it is; a path is made absolute.
            directory=args.snapshot_dir if is_url(args.snapshot_dir) else Path(args.snapshot_dir).absolute(),
            every=args.snapshot_every if args.snapshot_every is not None else defaults.every,
            keep=args.snapshot_keep if args.snapshot_keep is not None else defaults.keep,
            resume=not args.no_resume,
            resume_other_command=args.resume_other_command,
        )
    except SnapshotError as err:
        raise ConfigError(str(err)) from None


def read_hostfile(path: Path, default_slots: int | None) -> list[HostSlots]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"--hostfile: {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--hostfile: {path}: not a text file") from None
    return parse_hostfile(text, default_slots, f"--hostfile {path}")


def prepare_command(command: list[str], on_ray: bool) -> list[str]:
    """``train.py`` runs with this Python, as with torchrun; the program must be one a worker
    can execute (not checked on Ray, whose nodes may lay files out otherwise)."""
    runnable = list(with_python(command))
    if not on_ray:
        if runnable != command:
            check_script(runnable, os.getcwd())
        else:
            check_command(command, os.getcwd(), os.environ.get("PATH", os.defpath))
    if runnable != command:
        log.info("Running %s with this Python, as torchrun does: %s.", command[0], " ".join(runnable[:2]))
    return runnable


def ray_settings(args: argparse.Namespace) -> RaySettings | None:
    if args.ray is None:
        for option, value in (("--cpus-per-worker", args.cpus_per_worker), ("--gpus-per-worker", args.gpus_per_worker)):
            if value is not None:
                raise ConfigError(f"{option}: only with --ray")
        return None
    from lightning_elastic.launcher.ray import require_ray  # noqa: PLC0415 - Ray itself is not imported

    require_ray()
    defaults = RaySettings()
    return RaySettings(
        address=args.ray,
        cpus_per_worker=args.cpus_per_worker if args.cpus_per_worker is not None else defaults.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker if args.gpus_per_worker is not None else defaults.gpus_per_worker,
    )


def slurm_from_args(args: argparse.Namespace) -> SlurmSettings | None:
    if args.slurm and args.state_dir is not None:  # said before the allocation is looked at
        raise ConfigError(STATE_DIR_WITH_SLURM)
    if not args.slurm:
        if args.slurm_jobs is not None:
            raise ConfigError("--slurm-jobs: only with --slurm")
        return None
    from lightning_elastic.launcher.hosts.slurm import slurm_settings  # noqa: PLC0415

    return slurm_settings(os.environ, args.slurm_jobs, args.slots_per_host)


def slurm_slots(slurm: SlurmSettings, environ: Mapping[str, str]) -> int:
    """-np's default under --slurm: the allocation's tasks (its nodes times --slots-per-host)."""
    if slurm.slots_per_host is not None and environ.get("SLURM_JOB_NUM_NODES", "").strip().isdigit():
        return slurm.slots_per_host * int(environ["SLURM_JOB_NUM_NODES"])
    if slurm.tasks_per_node:
        return sum(slurm.tasks_per_node)
    raise ConfigError("-np: required with --slurm when the allocation's SLURM_TASKS_PER_NODE is not set")


def resolve_env(entry: str) -> tuple[str, str]:
    """``NAME=VALUE`` as given; ``NAME`` takes the driver's own value, which must exist."""
    name, sep, value = entry.partition("=")
    if sep:
        return name, value
    if name not in os.environ:
        raise ConfigError(f"-x/--env: {name} is not set in the driver's environment; write {name}=VALUE")
    return name, os.environ[name]


# ----- LIGHTNING_ELASTIC_* ----------------------------------------------------------------


def verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """The sub-command ``verb``'s own parser (argparse keeps a parser's actions in ``_actions``)."""
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return verbs.choices[verb]


def launch_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The ``launch`` sub-command's options."""
    return [a for a in verb_parser(parser, "launch")._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001


def unrecognized(arguments: Sequence[str], options: Sequence[str]) -> str:
    """argparse's "unrecognized arguments", each option with the one it is closest to."""
    said = []
    for argument in arguments:
        name = argument.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75) if name.startswith("-") else []
        said.append(f"{argument} (did you mean {close[0]}?)" if close else argument)
    return f"unrecognized arguments: {' '.join(said)}"


def environment_name(action: argparse.Action) -> str:
    """``LIGHTNING_ELASTIC_`` and the long option's name: ``-np/--num-proc`` is ``..._NUM_PROC``."""
    longest = max((o for o in action.option_strings if o.startswith("--")), key=len)
    return ENV_PREFIX + longest[2:].upper().replace("-", "_")


def environment_options() -> dict[str, str]:
    """Every variable ``launch`` reads, to the option it stands for (for the docs and tests)."""
    return {environment_name(a): "/".join(a.option_strings) for a in launch_options(build_parser())}


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The command line, with each ``launch`` option it does not give taken from the environment."""
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Said by the verb's own parser (its usage, not the top level's), with the option
        # the user may have meant: --np is -np, --num_proc is --num-proc.
        verb = verb_parser(parser, args.verb)
        verb.error(unrecognized(unknown, [o for a in verb._actions for o in a.option_strings]))  # noqa: SLF001
    if args.verb != "launch":
        return args
    # Which options the command line gave: parsed again with no defaults, only they are set.
    probe = build_parser()
    for action in launch_options(probe):
        action.default = argparse.SUPPRESS
    given = set(vars(probe.parse_args(argv)))
    from_environment = {}
    for action in launch_options(parser):
        name = environment_name(action)
        text = environ.get(name, "")
        if action.dest not in given and text.strip():  # an empty variable counts as unset
            from_environment[action.dest] = (name, environment_value(action, name, text))
    for group in ALTERNATIVES:
        if given & set(group):
            for dest in group:
                from_environment.pop(dest, None)
    # A flag set false (LIGHTNING_ELASTIC_SLURM=0) is no source.
    sources = [name for dest, (name, value) in from_environment.items() if dest in SOURCES and value is not False]
    if len(sources) > 1:
        raise ConfigError(f"{', '.join(sources)}: give exactly one host source: -H/--hosts, --hostfile, "
                          "--host-discovery-script, --ray or --slurm")
    for dest, (_, value) in from_environment.items():
        setattr(args, dest, value)
    return args


def environment_value(action: argparse.Action, name: str, text: str) -> Any:
    """``text`` converted as the command line converts the option's value(s)."""
    option = "/".join(action.option_strings)
    if action.nargs == 0:  # a flag: --verbose
        if text.strip().lower() in TRUE:
            return True
        if text.strip().lower() in FALSE:
            return False
        raise ConfigError(f"{name} ({option}): expected 1, true, yes or on (0, false, no or off), got {text!r}")
    convert = action.type if callable(action.type) else str
    several = isinstance(action, argparse._AppendAction) or isinstance(action.nargs, int)  # noqa: SLF001
    if several:  # a repeatable option, or one of several values: a shell-quoted list
        try:
            values = shlex.split(text)
        except ValueError as err:
            raise ConfigError(f"{name} ({option}): {err}, in {text!r}") from None
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise ConfigError(f"{name} ({option}): expected {action.nargs} values, got {text!r}")
    else:
        values = [text.strip()]
    try:
        converted = [convert(v) for v in values]
    except (TypeError, ValueError):
        kind = getattr(convert, "__name__", "")
        raise ConfigError(f"{name} ({option}): invalid {kind} value: {text.strip()!r}") from None
    return converted if several else converted[0]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    try:
        args = parse_args(argv, environ)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if args.verb == "timeline":
        return draw_timeline(args.log_dir, args.output)
    if args.verb == "agent":
        return run_agent_verb(args)
    # Written by a thread of its own: the driver logs while the service waits on it, and a
    # stderr that stops draining must not stop the driver (launcher/observe/log_writer.py).
    log_output = BackgroundStreamHandler(sys.stderr)
    log_output.setFormatter(logging.Formatter("lightning-elastic %(asctime)s %(levelname)s %(message)s",
                                              datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[log_output])
    if not args.verbose:
        # A snapshot store's SDK (--snapshot-dir s3://...) logs where it found credentials
        # at INFO on every launch; its warnings still show.
        for sdk in ("botocore", "aiobotocore", "s3fs", "fsspec"):
            logging.getLogger(sdk).setLevel(logging.WARNING)
    try:
        config = config_from_args(args)
    except ConfigError as err:
        log_output.flush_within(10.0)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    try:
        result = launch(config)
    except ConfigError as err:  # found before any worker started: nothing ran
        log_output.flush_within(10.0)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    verdict = result.verdict
    log_output.flush_within(10.0)  # the log's last lines before the summary
    try:
        print(result.summary(), file=sys.stderr)
        print(f"{PROG}: job {verdict}: {result.reason}", file=sys.stderr)
    except WRITE_ERRORS:
        pass  # stderr is gone too (`2>&1 | head`): only the exit status is left to tell
    # The reader of our output may be gone (`| head`). Python flushes stdout and stderr at
    # exit, and a failed flush there prints "Exception ignored ... BrokenPipeError" and makes
    # the exit status 120: flush now, and point a dead stream at /dev/null, so that the
    # status stays the job's.
    flush_or_discard(sys.stdout)
    flush_or_discard(sys.stderr)
    return result.exit_code


def draw_timeline(log_dir: Path, output: Path | None) -> int:
    from lightning_elastic.launcher.observe.timeline import draw_log_dir  # noqa: PLC0415 - matplotlib only here

    try:
        written = draw_log_dir(log_dir, output)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{PROG}: timeline written to {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
