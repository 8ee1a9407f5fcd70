"""Every use of a private Lightning name, in one place.

The elastic strategy needs a few of Lightning's internals (a launcher of its own, the
full checkpoint dict, the fit entry point). They are private APIs and may change in any
release, so ``pyproject.toml`` pins the supported range (``lightning>=2.6,<2.7``) and a
Lightning upgrade is checked and fixed here. Everything else in ``lightning_elastic``
uses public Lightning APIs only.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.csv_logs import CSVLogger, ExperimentWriter
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import RunningStage, TrainerStatus
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = [
    "Launcher",
    "batch_progress",
    "callbacks_deciding_state",
    "collect_rng_states",
    "committed_logging_step",
    "computed_callback_metrics",
    "continue_csv_logs",
    "ddp_kwargs",
    "ddp_kwargs_replaced",
    "drop_csv_rows_after",
    "dump_checkpoint",
    "finish_epoch",
    "fit_loop_state_dict",
    "flush_csv_logs",
    "forget_dataloaders",
    "is_fit_function",
    "logger_version",
    "logging_step",
    "long_phase_follows",
    "loops_state_dict",
    "prepare_to_fit_again",
    "replace_sampler",
    "restore_callback_metrics",
    "restore_callbacks_deciding_state",
    "route_sigterm",
    "set_logger_version",
    "set_device_mesh",
    "set_rng_states",
    "step_plateau_schedulers_at_epoch_end",
]

# Lightning's abstract launcher: ``launch(function, *args, trainer=..., **kwargs)`` and ``kill``.
Launcher = _Launcher


def is_fit_function(function: Callable[..., Any], trainer: pl.Trainer | None) -> bool:
    """Is ``function`` the trainer's fit entry point (the only stage we retry)?"""
    return trainer is not None and getattr(function, "__func__", None) is type(trainer)._fit_impl


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint dict: model, optimizers, schedulers, loops, callbacks (live tensors).

    Lightning's own loop state is built with ``dataclasses.asdict``, which deep-copies every
    counter: two thirds of the dump's time for a small model, paid at every commit. The
    trainer's connector gets ``loops_state_dict`` instead, which gives the same dict (a
    unit test compares them) at a fraction of the cost; checkpoints the trainer writes to
    disk are unchanged.
    """
    connector = trainer._checkpoint_connector
    if "_get_loops_state_dict" not in vars(connector):
        connector._get_loops_state_dict = functools.partial(loops_state_dict, trainer)
    return connector.dump_checkpoint(weights_only=False)


_LOOP_NAMES = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


def loops_state_dict(trainer: pl.Trainer) -> dict[str, Any]:
    """``{"fit_loop": ..., ...}`` as Lightning's ``_get_loops_state_dict`` builds it."""
    return {name: _loop_state(getattr(trainer, name), {}, "") for name in _LOOP_NAMES}


def fit_loop_state_dict(trainer: pl.Trainer, copy_loop_state: Callable[[Any], Any]) -> dict[str, Any]:
    """``loops_state_dict(trainer)["fit_loop"]``: the only loop whose state changes during a fit.

    Progress counters come out as fresh dicts of numbers; what the loops' own
    ``on_save_checkpoint`` returns (data loader states: anything) goes through ``copy_loop_state``.
    """
    return _loop_state(trainer.fit_loop, {}, "", copy_loop_state)


def _loop_state(loop: _Loop, destination: dict[str, Any], prefix: str,
                copy_loop_state: Callable[[Any], Any] = lambda state: state) -> dict[str, Any]:
    """``_Loop.state_dict`` with a progress dataclass turned into a dict without deep copies."""
    if type(loop).state_dict is not _Loop.state_dict:
        # A loop with its own state: trust it, copied whole.
        own = copy_loop_state(loop.state_dict({}, prefix))
        destination.update(own)
        return destination
    destination[prefix + "state_dict"] = copy_loop_state(loop.on_save_checkpoint())
    for key, value in loop.__dict__.items():
        if isinstance(value, _BaseProgress):
            destination[prefix + key] = _progress_state(value)
        elif isinstance(value, _Loop):
            _loop_state(value, destination, prefix + key + ".", copy_loop_state)
    return destination


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def _progress_state(progress: Any) -> dict[str, Any]:
    result = {}
    for name in _field_names(type(progress)):
        value = getattr(progress, name)
        if isinstance(value, _BaseProgress):
            value = _progress_state(value)
        elif type(value) not in (int, float, bool, type(None)):
            value = copy.deepcopy(value)  # as asdict does
        result[name] = value
    return result


# Per-process attributes of Lightning's callbacks that decide whether a collective runs, and
# that their ``state_dict`` leaves out. ModelCheckpoint saves (a barrier, and ``file_exists``'s
# all-reduce) unless ``_last_global_step_saved`` is the current step, and saves "last" at the
# end of training unless ``_last_checkpoint_saved`` is set; LightningCLI's SaveConfigCallback
# broadcasts the log directory in ``setup`` unless ``already_saved``. A joiner holding the
# defaults would enter a collective its peers skip, and wait there for ever.
def _deciding_attributes() -> list[tuple[type, tuple[str, ...]]]:
    kinds: list[tuple[type, tuple[str, ...]]] = [
        (ModelCheckpoint, ("_last_global_step_saved", "_last_checkpoint_saved", "_defer_save_until_validation")),
    ]
    cli = sys.modules.get("lightning.pytorch.cli")  # imported by a LightningCLI script only (jsonargparse: 40 ms)
    if cli is not None:
        kinds.append((cli.SaveConfigCallback, ("already_saved",)))
    return kinds


def callbacks_deciding_state(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """``{state_key: {attribute: value}}`` of the attributes above, for every callback that has
    them: the source rank's are set on every rank as a new world forms, before its fit attempt."""
    states: dict[str, dict[str, Any]] = {}
    kinds = _deciding_attributes()
    for callback in trainer.callbacks:
        for kind, names in kinds:
            if isinstance(callback, kind):
                states[callback.state_key] = {name: getattr(callback, name) for name in names if hasattr(callback, name)}
    return states


def restore_callbacks_deciding_state(trainer: pl.Trainer, states: dict[str, dict[str, Any]]) -> None:
    """Set what ``callbacks_deciding_state`` returned (on the source rank) on this rank's callbacks."""
    for callback in trainer.callbacks:
        for name, value in states.get(callback.state_key, {}).items():
            setattr(callback, name, value)


def computed_callback_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """The scalar ``trainer.callback_metrics`` already computed, as numbers (what a plateau
    scheduler or a callback monitors). Read without ``callback_metrics``, whose getter may
    compute a ``sync_dist`` value, a collective: a commit is not one."""
    values = {}
    for name, value in trainer._logger_connector._callback_metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            values[name] = float(value.item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = float(value)
    return values


def restore_callback_metrics(trainer: pl.Trainer, values: dict[str, float]) -> None:
    """Put a commit's ``computed_callback_metrics`` back (Lightning empties them at every fit start)."""
    trainer._logger_connector._callback_metrics.update({name: torch.tensor(v) for name, v in values.items()})


def step_plateau_schedulers_at_epoch_end(trainer: pl.Trainer) -> None:
    """Called at train start of a fit resumed from a commit: the resumed epoch's end steps
    ``ReduceLROnPlateau`` schedulers as an uninterrupted epoch's does.

    Lightning skips them at the end of an epoch resumed mid-way (its fit loop is
    "restarting" until that epoch ends), because a checkpoint file does not hold the
    monitored metrics; a commit does (``computed_callback_metrics``). Only the fit loop's
    own flag is cleared: after train start it decides nothing else.
    """
    trainer.fit_loop._restarting = False


def batch_progress(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The training epoch loop's batch progress inside a checkpoint dict (mutable), if any."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")


def finish_epoch(checkpoint: dict[str, Any]) -> bool:
    """Turn a checkpoint taken at the end of an epoch's last training batch into the state at
    the next epoch's start (the epoch counted done, its last batch completed). Returns whether
    it was such a checkpoint.

    Lightning resumes a checkpoint of that batch on a special path that counts the epoch done
    but then does not count the next one as started: its checkpoints are one epoch behind, and
    a later resume from one of them is not seen as mid-epoch (the epoch replays from its first
    batch, or an epoch-interval LR scheduler misses its step). The state of a finished epoch
    resumes on the ordinary path. What the epoch's end would still have run (its validation,
    plateau schedulers) is skipped, as on Lightning's own path.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    batches, epochs = fit_loop.get("epoch_loop.batch_progress"), fit_loop.get("epoch_progress")
    if batches is None or epochs is None or not batches.get("is_last_batch"):
        return False
    if int(batches["current"]["processed"]) - int(batches["current"]["completed"]) != 1:
        return False  # not taken at a training batch end
    for counters in (batches["current"], batches["total"]):
        counters["completed"] = counters["processed"]
    for counters in (epochs["current"], epochs["total"]):
        counters["processed"] = counters["completed"] = counters["started"]
    own = fit_loop.get("epoch_loop.state_dict")
    if isinstance(own, dict) and "_batches_that_stepped" in own:
        own["_batches_that_stepped"] += 1  # counted only after the batch-end hooks
    return True


def long_phase_follows(trainer: pl.Trainer) -> bool:
    """Called at a training batch end: will a validation pass or the epoch's end run before
    the next training batch? (Lightning decides validation in ``on_advance_end``, after the
    batch-end hooks, with the same function asked here.)"""
    try:
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop.batch_progress.is_last_batch:
            return True
        return bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except (AttributeError, TypeError):  # another Lightning: no checks in long phases
        return False


def prepare_to_fit_again(trainer: pl.Trainer) -> None:
    """Undo what an interrupted ``_fit_impl`` left behind so the same trainer can fit again.

    Lightning's own error path (``_interrupt``) would also finalise loggers as failed and
    call ``on_exception`` hooks; a reset is not the end of the run, so only the teardown
    that releases the model, data fetchers and signal handlers is done.
    """
    trainer._teardown()
    forget_dataloaders(trainer)
    trainer.should_stop = False
    trainer.state.status = TrainerStatus.RUNNING
    trainer.state.stage = RunningStage.TRAINING


def forget_dataloaders(trainer: pl.Trainer) -> None:
    """Make the next fit build its data loaders anew (their samplers know the world size)."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop._data_fetcher = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def route_sigterm(trainer: pl.Trainer, elastic: bool) -> None:
    """Take SIGTERM handling away from Lightning's collectives.

    Lightning (>= 2.6) broadcasts a SIGTERM flag from rank 0 at every step, and its SIGTERM
    handler itself calls ``dist.broadcast``: a SIGTERM to any rank but 0 makes that rank
    enter a collective nobody else is in, and the whole group fails. In an elastic job the
    worker's own handler (``lightning_elastic.membership.preemption``, chained by Lightning's) turns a
    SIGTERM into a graceful leave, so both are replaced by no-ops. Outside a launch (a world
    of one) a SIGTERM ends the fit as Lightning would end it, checked locally.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if elastic:
        epoch_loop._broadcast_sigterm_tensor = lambda: None
        trainer._signal_connector._sigterm_notifier_fn = lambda signum, frame: None
        return

    def local_check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    epoch_loop._broadcast_sigterm_tensor = local_check


def ignore_mid_epoch_resume_warning() -> None:
    """Lightning warns that a mid-epoch resume may repeat data; the elastic sampler ensures it does not."""
    warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")


def replace_sampler(dataloader: Any, sampler: Any) -> Any:
    """A copy of the user's training ``dataloader`` (same class and arguments) with ``sampler``."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def collect_rng_states() -> dict[str, Any]:
    return _collect_rng_states(include_cuda=True)


def set_rng_states(states: dict[str, Any]) -> None:
    _set_rng_states(states)


def logger_version(logger: Any) -> Any:
    """The version a logger has already settled on, without making it pick one."""
    return getattr(logger, "_version", None)


def set_logger_version(logger: Any, version: Any) -> None:
    """Pin a logger's version so that a new rank 0 keeps writing the same run."""
    if hasattr(logger, "_version") and version is not None:
        logger._version = version


# ----- CSV logs across resets -------------------------------------------------------------
#
# A CSVLogger's writer (rank 0's) buffers rows and appends them to metrics.csv every
# ``flush_logs_every_n_steps``. Lightning's writer deletes an existing metrics.csv when it
# is created: a new rank 0 would start the job's file anew. Across a reset the file is
# kept as the committed history: the old rank 0 flushes what it buffered, the new rank 0
# goes on with the same file, and the rows of steps the new world redoes are dropped.


class _ContinuedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer going on with the job's metrics.csv (its columns included)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])


def continue_csv_logs(trainer: pl.Trainer) -> None:
    """Called on the new rank 0 of a resumed fit, once the loggers' versions are pinned and
    before anything is logged: its CSV loggers go on with the job's metrics.csv."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger) and logger._experiment is None:
            logger._experiment = _ContinuedExperimentWriter(log_dir=logger.log_dir)


def flush_csv_logs(trainer: pl.Trainer) -> None:
    """Called before a reset, on every rank: the rank 0 of the ending world writes the rows it buffered."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger) and logger._experiment is not None:
            logger.save()  # rank-zero-only: the old world's rank 0


def drop_csv_rows_after(trainer: pl.Trainer, step: int) -> None:
    """Called on rank 0 as a resumed fit starts: metrics.csv keeps the rows logged at steps up
    to ``step`` (the committed batch's), those of the steps redone from here are dropped."""
    for logger in trainer.loggers:
        writer = logger._experiment if isinstance(logger, CSVLogger) else None
        if writer is None or not writer._fs.isfile(writer.metrics_file_path):
            continue
        with writer._fs.open(writer.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            rows = [row for row in reader if _row_step(row) is not None and _row_step(row) <= step]
        with writer._fs.open(writer.metrics_file_path, "w", newline="") as file:
            out = csv.DictWriter(file, fieldnames=header)
            out.writeheader()
            out.writerows(rows)
        writer.metrics = [row for row in writer.metrics if row.get("step", 0) <= step]
        writer.metrics_keys = sorted(set(writer.metrics_keys) | set(header))


def _row_step(row: dict[str, Any]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None  # a line a killed writer left half written


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs this training batch's metrics at (batches that stepped the
    optimizer before it): a logger row written with it sorts with the batch's own rows."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def committed_logging_step(checkpoint: dict[str, Any]) -> int | None:
    """``logging_step`` at the batch a checkpoint dict was taken at."""
    own = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict")
    if isinstance(own, dict) and isinstance(own.get("_batches_that_stepped"), int):
        return own["_batches_that_stepped"]
    return None


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` gives torch's DDP (the user's, as passed)."""
    return dict(strategy._ddp_kwargs)


@contextmanager
def ddp_kwargs_replaced(strategy: Any, kwargs: dict[str, Any]) -> Iterator[None]:
    """The strategy builds its torch DDP with ``kwargs`` inside the block, then the user's again."""
    saved = strategy._ddp_kwargs
    strategy._ddp_kwargs = kwargs
    try:
        yield
    finally:
        strategy._ddp_kwargs = saved


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """What ``self.device_mesh`` gives ``configure_model`` (as Lightning's ``ModelParallelStrategy`` sets it)."""
    module._device_mesh = mesh
