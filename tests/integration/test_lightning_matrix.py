"""What works with ``strategy="elastic_hvd"``: Lightning's features, each beside plain ``ddp``.

Every row of the matrix (docs: README "What works with elastic_hvd") is a test here. A row
reads one of four launches of ``lightning_features.py`` (tests/integration/), each enabling
the features that do not interfere with one another:

- ``fit``: accumulation + clipping, bf16-mixed, torchmetrics, val_check_interval +
  EarlyStopping + sync_dist, StepLR + ReduceLROnPlateau, ModelCheckpoint with
  ``fit(ckpt_path="last")``, CSVLogger; rank 0 SIGKILLed at step 41 of 45;
- ``manual``: two optimizers in manual optimization, max_steps + limit_train_batches,
  validate / test / predict after the fit; rank 1 SIGKILLed;
- ``iterable``: an IterableDataset; rank 1 SIGKILLed;
- ``cli``: Lightning's LightningTransformer demo behind LightningCLI; rank 1 SIGKILLed.

Each elastic launch runs 2 workers on 3 loopback hosts (``-np 2 --min-np 2``): the killed
worker's replacement joins on the third, so the world is 2 throughout, as the same script's
run under Lightning's own ``ddp`` with 2 CPU processes, started beside it. A launch and
its ddp run happen once per module, when a row first needs them. The elastic run is read
as its committed history: an event of round r is kept unless a later round resumed from a
commit at or before its step (that part was redone).
"""

from __future__ import annotations

import collections
import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.harness import Job, wait_for
from tests.integration.test_lightning import ddp_ended_well

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().with_name("lightning_features.py")
HOSTS = "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"
SAMPLES, VAL_SAMPLES = 480, 120
# (kill rank, kill step) per configuration: rank 0 in the fit run (its CSV and checkpoints
# move to a new process), a step after which no periodic checkpoint is due before the end.
KILLS = {"fit": (0, 41), "manual": (1, 48), "iterable": (1, 20), "cli": (1, 30)}
CLI_ARGS = ["--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.logger", "false"]


@dataclass
class Run:
    """One launch's events and files; ``history`` is the committed history (all of a ddp run)."""

    dir: Path
    events: list[dict[str, Any]]
    output: str
    history: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.history if e["kind"] == kind and (rank is None or e["rank"] == rank)]

    def done(self) -> list[dict[str, Any]]:
        return sorted((e for e in self.events if e["kind"] == "done"), key=lambda e: e["rank"])


def read_events(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()
            if line.strip()]


def committed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events not redone later: round r's event at step s is kept unless a later round started at step <= s."""
    starts: dict[int, int] = {}
    for e in events:
        if e["kind"] == "train_start":
            starts[e["round"]] = min(e["step"], starts.get(e["round"], e["step"]))
    kept = []
    for e in events:
        later = [s for r, s in starts.items() if r > e["round"]]
        if "step" in e and all(e["step"] < s for s in later):
            kept.append(e)
    return kept


def command(config: str, directory: Path, *extra: str) -> list[str]:
    base = [sys.executable, str(SCRIPT)]
    if config == "cli":
        return [*base, "cli", "fit", *CLI_ARGS, "--trainer.default_root_dir", str(directory / "root"),
                "--model.events_dir", str(directory / "events"), *extra]
    return [*base, "--config", config, "--events", str(directory / "events"), "--root", str(directory / "root"), *extra]


def start_ddp(config: str, directory: Path) -> subprocess.Popen[str]:
    directory.mkdir(parents=True)
    extra = ["--trainer.strategy", "ddp", "--trainer.devices", "2"] if config == "cli" else ["--strategy", "ddp", "--devices", "2"]
    if config == "manual":
        extra.append("--import-lightning-elastic")  # importing it must change nothing for ddp
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ELASTIC_")}
    return subprocess.Popen(command(config, directory, *extra), cwd=directory, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=open(directory / "stderr", "w"))  # noqa: SIM115


def start_elastic(config: str, job: Job) -> None:
    rank, step = KILLS[config]
    kill = ([f"--model.kill_at_step={step}", f"--model.kill_rank={rank}", "--trainer.strategy", "elastic_hvd"]
            if config == "cli" else ["--kill-at-step", str(step), "--kill-rank", str(rank)])
    job.start(["-np", "2", "--min-np", "2", "-H", HOSTS], command=command(config, job.dir, *kill))


class Launches:
    """Each configuration's elastic launch and ddp run, made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, tuple[Run, Run] | AssertionError] = {}
        self.jobs: list[Job] = []

    def get(self, config: str) -> tuple[Run, Run]:
        if config not in self.runs:
            try:
                self.runs[config] = self._launch(config)
            except AssertionError as failed:  # every row of it fails with it, without launching again
                self.runs[config] = failed
        found = self.runs[config]
        if isinstance(found, AssertionError):
            raise found
        return found

    def _launch(self, config: str) -> tuple[Run, Run]:
        job_dir = self.root / config / "elastic"
        job_dir.mkdir(parents=True)
        job = Job(job_dir)
        self.jobs.append(job)
        start_elastic(config, job)
        ddp_dir = self.root / config / "ddp"
        ddp = start_ddp(config, ddp_dir)  # beside the launch: its imports overlap the joiner's
        try:
            status = job.wait(150)
            ddp.wait(60)  # it ran beside the launch: 210 s in all, within pytest-timeout
        finally:
            if ddp.poll() is None:
                ddp.kill()
        ddp_err = (ddp_dir / "stderr").read_text(errors="replace")
        assert status == 0, f"{config}: the elastic job failed:\n{job.stderr()[-4000:]}"
        assert job.world_sizes() == [2, 2], f"{config}: world sizes {job.world_sizes()}:\n{job.stderr()[-3000:]}"
        elastic_events = read_events(job.events_dir)
        assert [e["step"] for e in elastic_events if e["kind"] == "killed"] == [KILLS[config][1]], config
        elastic = Run(job_dir, elastic_events, job.stdout() + job.stderr(), committed(elastic_events))
        ddp_events = read_events(ddp_dir / "events")
        reference = Run(ddp_dir, ddp_events, ddp_err, ddp_events)
        assert len(reference.done()) == 2 and ddp_ended_well(subprocess.CompletedProcess([], ddp.returncode, "", ddp_err)), \
            f"{config}: the ddp reference failed (exit {ddp.returncode}):\n{ddp_err[-3000:]}"
        assert len(elastic.done()) == 2, f"{config}: {len(elastic.done())} workers finished"
        return elastic, reference

    def close(self) -> None:
        for job in self.jobs:
            job.kill()
            try:
                wait_for(lambda job=job: not job.stray_processes(), 15, "the job's processes to exit")
            except AssertionError:
                for proc in job.stray_processes():
                    proc.kill()
                raise


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launches]:
    made = Launches(tmp_path_factory.mktemp("matrix"))
    yield made
    made.close()


def same_final_state(elastic: Run, ddp: Run, *fields: str) -> None:
    for name in ("step", "epoch", *fields):
        got, want = [d[name] for d in elastic.done()], [d[name] for d in ddp.done()]
        assert got == want, f"{name}: elastic {got}, ddp {want}"


def batches_per_epoch(run: Run) -> dict[int, collections.Counter[int]]:
    """For each rank, how many training batches each epoch ran (committed)."""
    per_rank: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for e in run.of("step"):
        per_rank[e["rank"]][e["epoch"]] += 1
    return dict(per_rank)


def samples_per_epoch(run: Run) -> dict[int, collections.Counter[int]]:
    counts: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for e in run.of("step"):
        counts[e["epoch"]].update(e["indices"])
    return dict(counts)


def assert_exactly_once(run: Run, samples: int) -> None:
    for epoch, counts in samples_per_epoch(run).items():
        assert sorted(counts) == list(range(samples)) and set(counts.values()) == {1}, \
            f"epoch {epoch}: repeated {[i for i, c in counts.items() if c > 1][:10]}, missing {samples - len(counts)}"


# ----- fit: rank 0 SIGKILLed at step 41 of 45 -------------------------------------------


def test_accumulation_and_clipping(launches: Launches) -> None:
    elastic, ddp = launches.get("fit")
    same_final_state(elastic, ddp, "optimizer_steps")
    assert batches_per_epoch(elastic) == batches_per_epoch(ddp) == {r: {0: 30, 1: 30, 2: 30} for r in (0, 1)}
    assert_exactly_once(elastic, SAMPLES)
    for run in (elastic, ddp):
        assert all(d["max_grad_norm"] <= 0.5 + 1e-3 for d in run.done()), [d["max_grad_norm"] for d in run.done()]


def test_bf16_mixed(launches: Launches) -> None:
    elastic, ddp = launches.get("fit")
    for run in (elastic, ddp):
        assert {e["dtype"] for e in run.events if e["kind"] == "step"} == {"torch.bfloat16"}


def test_val_check_interval_early_stopping_sync_dist(launches: Launches) -> None:
    elastic, ddp = launches.get("fit")
    same_final_state(elastic, ddp, "stopped_epoch")
    for rank in (0, 1):
        got = [(e["epoch"], e["step"]) for e in elastic.of("validated", rank)]
        assert got == [(e["epoch"], e["step"]) for e in ddp.of("validated", rank)], f"rank {rank}: {got}"
        assert [e["step"] for e in elastic.of("epoch_end", rank)] == [e["step"] for e in ddp.of("epoch_end", rank)]


def test_reduce_lr_on_plateau(launches: Launches) -> None:
    # StepLR and ReduceLROnPlateau(monitor="val_loss"), stepped once per epoch (issue 37, point 2).
    elastic, ddp = launches.get("fit")
    same_final_state(elastic, ddp, "scheduler_epochs")
    assert ddp.done()[0]["scheduler_epochs"] == [3, 3]


def test_model_checkpoint_with_rank0_killed_and_a_late_joiner(launches: Launches) -> None:
    # fit(ckpt_path="last") and ModelCheckpoint(every_n_train_steps=10, save_last=True): the
    # replacement of rank 0 joins at step 40 and the fit ends at 45 with no periodic save in
    # between; it once waited in a collective its peer skipped (issue 37, point 1).
    elastic, ddp = launches.get("fit")
    same_final_state(elastic, ddp, "last_model_path")
    folders = [run.dir / "root" / "csv" / "version_0" / "checkpoints" for run in (elastic, ddp)]
    files = [sorted(p.name for p in folder.iterdir()) for folder in folders]
    assert files == [["epoch=2-step=40.ckpt", "last.ckpt"]] * 2, files
    for folder in folders:
        assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 40


def test_torchmetrics(launches: Launches) -> None:
    elastic, ddp = launches.get("fit")
    for run in (elastic, ddp):
        seen = {e["seen"] for e in run.of("validated")}
        assert seen == {float(VAL_SAMPLES)}, f"validation samples counted by torchmetrics: {seen}"


def csv_rows(run: Run) -> list[dict[str, str]]:
    with (run.dir / "root" / "csv" / "version_0" / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_after_rank0_is_lost(launches: Launches) -> None:
    # The new rank 0 goes on with the job's metrics.csv: the rows logged before the kill
    # stay, redone steps appear once, elastic/* rows sort with their step (issue 37, point 4).
    # Rank 0 flushed its rows at step 40 (flush_logs_every_n_steps=10) and died at 41.
    elastic, ddp = launches.get("fit")

    def shape(rows: list[dict[str, str]]) -> list[tuple[int, frozenset[str]]]:
        out = []
        for row in rows:
            keys = frozenset(k for k, v in row.items() if v != "" and k != "step" and not k.startswith("elastic/"))
            if keys:
                out.append((int(row["step"]), keys))
        return sorted(out, key=lambda r: (r[0], sorted(r[1])))

    rows = csv_rows(elastic)
    assert shape(rows) == shape(csv_rows(ddp))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps), f"rows out of step order: {steps}"
    elastic_rows = [(int(r["step"]), float(r["elastic/world_size"]), float(r["elastic/resets"]))
                    for r in rows if r.get("elastic/world_size")]
    assert elastic_rows and elastic_rows[-1][1:] == (2.0, 1.0), elastic_rows


# ----- manual: rank 1 SIGKILLed at step 48 of 70 ----------------------------------------


def test_manual_optimization_two_optimizers(launches: Launches) -> None:
    elastic, ddp = launches.get("manual")
    same_final_state(elastic, ddp)
    assert [d["step"] for d in ddp.done()] == [70, 70]  # each batch steps both optimizers
    assert_exactly_once_within_limit(elastic)


def assert_exactly_once_within_limit(run: Run) -> None:
    for epoch, counts in samples_per_epoch(run).items():
        assert set(counts.values()) == {1}, f"epoch {epoch}: repeated {[i for i, c in counts.items() if c > 1][:10]}"


def test_max_steps_and_limit_train_batches(launches: Launches) -> None:
    elastic, ddp = launches.get("manual")
    assert batches_per_epoch(elastic) == batches_per_epoch(ddp) == {r: {0: 20, 1: 15} for r in (0, 1)}


def test_validate_test_predict_after_fit(launches: Launches) -> None:
    elastic, ddp = launches.get("manual")
    for got, want in zip(elastic.done(), ddp.done()):
        assert got["after"]["predicted"] == want["after"]["predicted"]
        assert [sorted(m) for m in got["after"]["validate"]] == [sorted(m) for m in want["after"]["validate"]]
        assert [sorted(m) for m in got["after"]["test"]] == [sorted(m) for m in want["after"]["test"]]
    for run in (elastic, ddp):
        predicted = sorted(i for e in run.events if e["kind"] == "predicted" for i in e["indices"])
        assert predicted == list(range(VAL_SAMPLES)), f"predicted samples: {predicted}"
        assert sum(e["samples"] for e in run.events if e["kind"] == "tested") == VAL_SAMPLES
        assert len([e for e in run.events if e["kind"] == "validated" and "VALIDATING" in e["fn"]]) == 2  # a pass per rank


def test_importing_lightning_elastic_changes_nothing_for_plain_ddp(launches: Launches) -> None:
    # The manual configuration's ddp run imports it (the launcher's variables left out): it
    # ran to its end, and every row above found it equal to the elastic run.
    _, ddp = launches.get("manual")
    assert [d["lightning_elastic_imported"] for d in ddp.done()] == [True, True]


# ----- iterable: rank 1 SIGKILLed at step 20 of 30 --------------------------------------


def test_iterable_dataset_is_explained_by_name(launches: Launches) -> None:
    # Its position cannot be restored: the stream starts again after the reset, which the
    # warning says naming the dataset (issue 37, point 3); the epoch still ends, validated.
    elastic, ddp = launches.get("iterable")
    assert "the training dataset PointStream is an IterableDataset, whose position cannot be restored" in elastic.output
    for rank in (0, 1):
        assert len(elastic.of("epoch_end", rank)) == len(ddp.of("epoch_end", rank)) == 1
        assert len(elastic.of("validated", rank)) == len(ddp.of("validated", rank)) == 1
    ddp_counts = samples_per_epoch(ddp)[0]
    assert sorted(ddp_counts) == list(range(SAMPLES)) and set(ddp_counts.values()) == {1}
    counts = samples_per_epoch(elastic)[0]
    assert sorted(counts) == list(range(SAMPLES)), "every sample of the stream is read"
    repeated = sorted(i for i, c in counts.items() if c == 2)
    assert len(repeated) == 20 * 8 * 2, "the 20 committed steps' samples are read again"


# ----- cli: rank 1 SIGKILLed at step 30 of 48 -------------------------------------------


def test_lightning_transformer_behind_lightning_cli(launches: Launches) -> None:
    elastic, ddp = launches.get("cli")
    same_final_state(elastic, ddp)
    assert [d["step"] for d in ddp.done()] == [48, 48]
    assert batches_per_epoch(elastic) == batches_per_epoch(ddp)
    assert_exactly_once(elastic, 192)
