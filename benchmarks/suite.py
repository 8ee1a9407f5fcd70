"""The benchmark suite: lightning-elastic against torchrun (and torchft) on this machine, in one run.

    bash benchmarks/setup-venv.sh                       # once: benchmarks/.venv (torch, project, matplotlib, torchft)
    benchmarks/.venv/bin/python benchmarks/suite.py     # everything (both models; long)
    benchmarks/.venv/bin/python benchmarks/suite.py --quick                   # smoke run: small model, few trials
    benchmarks/.venv/bin/python benchmarks/suite.py --only step,recovery --models small
    benchmarks/.venv/bin/python benchmarks/suite.py --only goodput --goodput-every 10,30 --goodput-trials 3
    benchmarks/.venv/bin/python benchmarks/plot.py benchmarks/results/<date>.json

Measurements (each module's docstring says exactly what it does):

- ``step``      (measure/step.py): steady step time, 3 workers, Lightning ddp vs elastic_hvd and a
  plain DDP loop vs the same loop in ``@le.run``, torchrun vs ``lightning-elastic launch``;
- ``commit``    (measure/commit.py): ``TorchState.save()`` bandwidth vs ``copy_``/``clone``, and
  elastic_hvd's step time committing every step vs never (a world of one);
- ``transfer``  (measure/transfer.py): a joiner's ``state.sync()`` vs a raw broadcast, and its peak RSS;
- ``recovery``  (measure/recovery.py): SIGKILL -> first step after, lightning-elastic vs torchrun
  (and torchft when benchmarks/peers/torchft_recovery.py can run);
- ``goodput``   (measure/goodput.py): a SIGKILL every 10 s (``--goodput-every``) for 90 s of training,
  capacity returned by a fresh host, a spare listed or ``--spares``: samples kept per second
  against the failure-free run, steps redone, time to the next round and back to full size;
  torchrun (restart all, checkpoint every 10 steps) and torchft alike; ``le/loop+preload`` and
  ``le/lightning+preload`` (``--goodput-tools``) run lightning-elastic with ``--preload``.

Trials of the tools being compared are interleaved (trial 1 of each, then trial 2, ...).
Every trial is kept, failed ones with their reason; results go to
``benchmarks/results/<date>.json`` (raw trials + environment) after every section, and the
Markdown tables are printed at the end. Every child process is stopped before exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
from measure import commit, goodput, recovery, step, transfer  # noqa: E402

SECTIONS = ("step", "commit", "transfer", "recovery", "goodput")
MODELS = ("small", "100m")


@dataclasses.dataclass
class Config:
    only: list[str]
    models: list[str]
    step_trials: int
    commit_repeats: int  # save/copy_/clone rounds in the one bandwidth process
    commit_trials: int  # Lightning world-of-one jobs per variant
    transfer_repeats: int
    recovery_trials: int  # lightning-elastic
    peer_trials: int  # torchrun, torchft
    recovery_bound: float
    goodput: goodput.Settings


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small model only, shorter jobs, 2 trials (1 for peers' recovery)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--models", help="comma-separated subset of small,100m (default: both; --quick: small)")
    parser.add_argument("--trials", type=int, help="step and commit jobs per variant (default 5; --quick 2)")
    parser.add_argument("--commit-repeats", type=int, help="timed save/copy_/clone rounds (default 10; --quick 3)")
    parser.add_argument("--transfer-repeats", type=int, help="sync/broadcast repeats (default 5; --quick 2)")
    parser.add_argument("--recovery-trials", type=int, help="lightning-elastic recovery trials (default 10; --quick 2)")
    parser.add_argument("--peer-trials", type=int, help="torchrun/torchft recovery trials (default 3; --quick 1)")
    parser.add_argument("--recovery-bound", type=float, default=120.0,
                        help="seconds to wait for a step after the kill before counting no recovery")
    parser.add_argument("--goodput-every", default="10", metavar="SECONDS[,SECONDS...]",
                        help="goodput: seconds between SIGKILLs, one run per value (default 10); "
                             "the failure-free run is always added")
    parser.add_argument("--goodput-duration", type=float, metavar="SECONDS",
                        help="goodput: seconds of training per run (default 90; --quick 30)")
    parser.add_argument("--goodput-trials", type=int, help="goodput: runs per variant (default 3; --quick 1)")
    parser.add_argument("--goodput-modes", default=",".join(goodput.CAPACITY),
                        help=f"goodput: capacity modes, a subset of {','.join(goodput.CAPACITY)} (default: all)")
    parser.add_argument("--goodput-startup-nice", type=int, metavar="N",
                        help="goodput: lightning-elastic's workers start at nice N and take normal priority once "
                             "joined (root), so a replacement's start-up spares the survivors' cores as another "
                             "machine would (default: no change)")
    parser.add_argument("--goodput-tools", default=",".join(goodput.DEFAULT_TOOLS),
                        help=f"goodput: a subset of {','.join(goodput.TOOLS)} (default: all but the +preload ones: "
                             f"{','.join(goodput.DEFAULT_TOOLS)})")
    parser.add_argument("--goodput-preload-loop", default=goodput.PRELOAD["loop"], metavar="MODULE[,MODULE...]",
                        help=f"goodput: --preload of le/loop+preload (default {goodput.PRELOAD['loop']})")
    parser.add_argument("--goodput-preload-lightning", default=goodput.PRELOAD["lightning"], metavar="MODULE[,MODULE...]",
                        help=f"goodput: --preload of le/lightning+preload (default {goodput.PRELOAD['lightning']})")
    parser.add_argument("--goodput-no-failure-free", action="store_true",
                        help="goodput: skip the failure-free runs (the '/ failure-free' column stays empty; "
                             "'/ own full-world pace' needs none)")
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/results/<date>.json)")
    parser.add_argument("--workdir", type=Path, help="keep every trial's logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if bad := [s for s in only if s not in SECTIONS]:
        parser.error(f"--only: unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    models = args.models.split(",") if args.models else (["small"] if args.quick else list(MODELS))
    if bad := [m for m in models if m not in MODELS]:
        parser.error(f"--models: unknown model(s) {', '.join(bad)}; choose from {', '.join(MODELS)}")

    def pick(value: int | None, full: int, quick: int) -> int:
        return value if value is not None else (quick if args.quick else full)

    try:
        periods = tuple(float(p) for p in args.goodput_every.split(",") if p)
    except ValueError:
        parser.error(f"--goodput-every: expected seconds separated by commas, got {args.goodput_every!r}")
    if not periods or any(p <= 0 for p in periods):
        parser.error(f"--goodput-every: expected positive seconds, got {args.goodput_every!r}")
    modes = tuple(m for m in args.goodput_modes.split(",") if m)
    if bad := [m for m in modes if m not in goodput.CAPACITY]:
        parser.error(f"--goodput-modes: unknown mode(s) {', '.join(bad)}; choose from {', '.join(goodput.CAPACITY)}")
    tools = tuple(t for t in args.goodput_tools.split(",") if t)
    if bad := [t for t in tools if t not in goodput.TOOLS]:
        parser.error(f"--goodput-tools: unknown tool(s) {', '.join(bad)}; choose from {', '.join(goodput.TOOLS)}")

    config = Config(
        only=only, models=models,
        step_trials=pick(args.trials, 5, 2), commit_repeats=pick(args.commit_repeats, 10, 3),
        commit_trials=pick(args.trials, 5, 2), transfer_repeats=pick(args.transfer_repeats, 5, 2),
        recovery_trials=pick(args.recovery_trials, 10, 2), peer_trials=pick(args.peer_trials, 3, 1),
        recovery_bound=args.recovery_bound,
        goodput=goodput.Settings(periods=periods, duration=pick(args.goodput_duration, 90, 30),
                                 trials=pick(args.goodput_trials, 3, 1), modes=modes, bound=args.recovery_bound,
                                 tools=tools, startup_nice=args.goodput_startup_nice,
                                 failure_free=not args.goodput_no_failure_free,
                                 preload={"loop": args.goodput_preload_loop,
                                          "lightning": args.goodput_preload_lightning}),
    )
    return config, args


def results_path(requested: Path | None) -> Path:
    if requested is not None:
        return requested
    directory = BENCH / "results"
    path = directory / f"{time.strftime('%Y-%m-%d')}.json"
    if path.exists():  # never overwrite an earlier run of the same day
        path = directory / f"{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    return path


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    # A SIGTERM ends the run like Ctrl-C: partial results saved, every child stopped (atexit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_path = results_path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lightning-elastic-bench-"))
    document = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:] if argv is None else argv,
        "quick": args.quick,
        "config": dataclasses.asdict(config),
        "environment": harness.environment(),
        "results": {},
    }
    harness.progress(f"results: {out_path}; trial logs: {workdir}")
    started = time.monotonic()
    reports: dict[str, str] = {}
    modules = {"step": step, "commit": commit, "transfer": transfer, "recovery": recovery, "goodput": goodput}
    try:
        for section in config.only:
            section_started = time.monotonic()
            if section == "step":
                result = step.run(config.models, config.step_trials, workdir, args.quick)
            elif section == "commit":
                result = commit.run(config.models, config.commit_repeats, config.commit_trials, workdir, args.quick)
            elif section == "transfer":
                result = transfer.run(config.models, config.transfer_repeats, workdir)
            elif section == "goodput":
                result = goodput.run(config.goodput, workdir)
            else:
                result = recovery.run(config.recovery_trials, config.peer_trials, workdir, config.recovery_bound,
                                      model=config.models[0])
            result["duration_s"] = round(time.monotonic() - section_started, 1)
            document["results"][section] = result
            reports[section] = modules[section].report(result)
            print(f"\n{reports[section]}\n", flush=True)
            _save(document, out_path, started)
    finally:
        harness.stop_all()
        _save(document, out_path, started)
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n## Summary\n")
    env = document["environment"]
    print(f"{document['date']}, torch {env['torch']}, lightning {env['lightning']}, {env['cpu_count']} CPUs, "
          f"commit {(env['git_commit'] or '?')[:10]}{' (dirty)' if env['git_dirty'] else ''}, "
          f"{document['duration_s']:.0f} s\n")
    print("\n\n".join(reports.values()))
    print(f"\nresults: {out_path}")
    return 0


def _save(document: dict, path: Path, started: float) -> None:
    document["duration_s"] = round(time.monotonic() - started, 1)
    document["environment"]["loadavg_end"] = os.getloadavg()
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
