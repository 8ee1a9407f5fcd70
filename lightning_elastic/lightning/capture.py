"""What a Lightning commit reads at every step, and what it reads once per fit attempt.

Lightning's ``dump_checkpoint`` builds the whole checkpoint dict (model and optimizer state
dicts, four loops' progress, callbacks, hyper-parameters), and a commit then walks all of
it to find the tensors: about 0.4 ms of CPU for a small model, a tenth of its step. Most
of that dict cannot change between two steps of one fit attempt. So the first commit of
an attempt takes the full dump and keeps its split form as a template (a
``CaptureRecipe``); later commits copy the model's live tensors into their slots and
rebuild only the parts a step can change: epoch and step, the fit loop's progress,
callback states, optimizer states, LR schedulers, the precision plugin.

The template is only trusted while every model tensor is still the one it was taken
from; otherwise (a parameter replaced) the commit takes a full dump again and a new
template. Optimizer states are dumped at every commit: an optimizer may create or replace
its state tensors at any step. A run whose checkpoint can hold anything else that changes
(an ``on_save_checkpoint`` hook of the LightningModule, a callback or the precision
plugin, a stateful datamodule, a custom ``state_dict``) takes a full dump at every commit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning_elastic.lightning import compat
from lightning_elastic.commit.buffers import TensorSlot, split

# Checkpoint keys a commit rebuilds at every step; every other key comes from the template
# ("loops" partly: the validate, test and predict loops do not run during a fit).
_PER_STEP_KEYS = ("epoch", "global_step", "callbacks", "optimizer_states", "lr_schedulers")
MODEL_KEY = "state_dict"


@dataclasses.dataclass(frozen=True)
class _ModelTensor:
    """A model tensor as the template saw it: ``owner[name] is tensor`` while it is current."""

    owner: dict[str, Any]  # a module's _parameters or _buffers
    name: str
    tensor: torch.Tensor


@dataclasses.dataclass(frozen=True)
class CaptureRecipe:
    """A full dump's split form and what each per-step commit needs to refresh it."""

    template: dict[str, Any]  # the skeleton: model weights in slots 0..len(model)-1
    model: tuple[_ModelTensor, ...]
    precision_key: str

    @classmethod
    def build(cls, trainer: pl.Trainer, skeleton: Any, sources: list[torch.Tensor]) -> CaptureRecipe | None:
        """The recipe for this trainer, or None when only full dumps are safe."""
        if not _only_standard_hooks(trainer) or not isinstance(skeleton, dict):
            return None
        model = _model_tensors(trainer.lightning_module)
        weights = skeleton.get(MODEL_KEY)
        if model is None or not isinstance(weights, dict) or list(weights) != [name for name, _ in model]:
            return None
        # The template's model slots must be the first ones, in state_dict order.
        if [weights[name] for name, _ in model] != [TensorSlot(i) for i in range(len(model))]:
            return None
        if any(not _same_storage(sources[i], entry.tensor) for i, (_, entry) in enumerate(model)):
            return None
        loops = skeleton.get("loops")
        if not isinstance(loops, dict) or not _no_slots(
            {k: v for k, v in skeleton.items() if k not in _PER_STEP_KEYS and k != MODEL_KEY}
        ):
            return None  # a static part holding tensors: its slots would not be refreshed
        # Per-step keys stay in the template (each refresh overwrites them): same key order.
        template = dict(skeleton)
        return cls(template, tuple(entry for _, entry in model), type(trainer.precision_plugin).__qualname__)

    def still_describes(self, trainer: pl.Trainer) -> bool:
        """Is every live model tensor the one the template was built from?"""
        for entry in self.model:
            if entry.owner.get(entry.name) is not entry.tensor:
                return False
        return True

    def refresh(self, trainer: pl.Trainer) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """``(skeleton, sources)`` of the live state, the template's static parts reused."""
        sources = [entry.tensor for entry in self.model]
        skeleton = dict(self.template)
        skeleton["epoch"] = trainer.current_epoch
        skeleton["global_step"] = trainer.global_step
        fit_loop = compat.fit_loop_state_dict(trainer, lambda state: split(state, sources)[0])
        skeleton["loops"] = {**self.template["loops"], "fit_loop": fit_loop}
        skeleton["callbacks"] = split(_callbacks_state(trainer), sources)[0]
        skeleton["optimizer_states"] = [split(trainer.strategy.optimizer_state(o), sources)[0] for o in trainer.optimizers]
        skeleton["lr_schedulers"] = split([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs], sources)[0]
        precision = trainer.precision_plugin.state_dict()
        if precision:
            skeleton[self.precision_key] = split(precision, sources)[0]
        return skeleton, sources


class CheckpointCapture:
    """Splits the live checkpoint of one fit attempt for a commit: a full dump the first
    time (and whenever the template no longer describes the live model), else a refresh."""

    def __init__(self) -> None:
        self._recipe: CaptureRecipe | None = None
        self._full_dumps_only = False

    def new_attempt(self) -> None:
        """A fit attempt starts: its optimizers, hooks and callbacks may all be new."""
        self._recipe = None
        self._full_dumps_only = False

    def capture(self, trainer: pl.Trainer) -> tuple[Any, list[torch.Tensor]]:
        """``(skeleton, sources)`` of the live checkpoint; the skeleton is fresh or immutable."""
        recipe = self._recipe
        if recipe is not None and recipe.still_describes(trainer):
            return recipe.refresh(trainer)
        skeleton, sources = split(compat.dump_checkpoint(trainer))
        if not self._full_dumps_only:
            self._recipe = CaptureRecipe.build(trainer, skeleton, sources)
            self._full_dumps_only = self._recipe is None
        return skeleton, sources


def _overrides(obj: object, base: type, method: str) -> bool:
    """Does ``obj``'s class override ``base.method``?"""
    return getattr(type(obj), method, None) is not getattr(base, method)


def _callbacks_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Every callback's non-empty ``state_dict`` by its ``state_key``, as Lightning saves them."""
    states = {}
    for callback in trainer.callbacks:
        state = callback.state_dict()
        if state:
            states[callback.state_key] = state
    return states


def _only_standard_hooks(trainer: pl.Trainer) -> bool:
    """No hook that could put more into a checkpoint, or change what a state dict holds."""
    module = trainer.lightning_module
    if module is None or _overrides(module, pl.LightningModule, "on_save_checkpoint"):
        return False
    datamodule = trainer.datamodule
    if datamodule is not None and _overrides(datamodule, pl.LightningDataModule, "state_dict"):
        return False  # a stateful datamodule (Lightning saves its state_dict, nothing else of it)
    if any(_overrides(cb, pl.Callback, "on_save_checkpoint") for cb in trainer.callbacks):
        return False
    if _overrides(trainer.precision_plugin, Precision, "on_save_checkpoint"):
        return False
    for optimizer in trainer.optimizers:
        if type(optimizer).state_dict is not torch.optim.Optimizer.state_dict:
            return False
    return True


def _model_tensors(module: torch.nn.Module) -> list[tuple[str, _ModelTensor]] | None:
    """``module.state_dict()``'s tensors by name, with where each lives; None if it is not plain.

    A custom ``state_dict`` or a state-dict hook could make the dict differ from the
    module's own tensors: such a model is dumped in full at every commit.
    """
    if type(module).state_dict is not torch.nn.Module.state_dict:
        return None
    found: list[tuple[str, _ModelTensor]] = []
    for prefix, sub in module.named_modules(remove_duplicate=True):
        if (type(sub).state_dict is not torch.nn.Module.state_dict
                or type(sub)._save_to_state_dict is not torch.nn.Module._save_to_state_dict
                or sub._state_dict_hooks or sub._state_dict_pre_hooks):
            return None
        head = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is not None:
                found.append((head + name, _ModelTensor(sub._parameters, name, param)))
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                found.append((head + name, _ModelTensor(sub._buffers, name, buffer)))
    return found


def _no_slots(tree: Any) -> bool:
    if isinstance(tree, TensorSlot):
        return False
    if isinstance(tree, dict):
        return all(_no_slots(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_no_slots(v) for v in tree)
    return True


def _same_storage(saved: torch.Tensor, live: torch.Tensor) -> bool:
    return saved.data_ptr() == live.data_ptr() and saved.shape == live.shape and saved.dtype == live.dtype
