"""What a commit of an ``elastic_fsdp`` fit holds, and how a rebuilt fit takes it back.

The sharded tensors are the LightningModule's DTensor parameters and every optimizer's
DTensor state (``sharded.parts``: each rank's rows, copied to a peer). The rest is the same
on every rank and travels whole: Lightning's checkpoint dict without the model's and
optimizers' state dicts (loops with mid-epoch progress, callbacks, LR schedulers, the
precision plugin, hyper-parameters), what ``sharded.parts`` leaves out of the rows
(buffers, unsharded parameters, optimizer step counts and hyper-parameters), and the
``CommitInfo`` an ``elastic_hvd`` commit carries (world size, step, sampler position, RNG).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from lightning_elastic.errors import ElasticError
from lightning_elastic.lightning.commit import CommitInfo, resume_checkpoint
from lightning_elastic.sharded import parts
from lightning_elastic.sharded.rows import Entry

# Keys of Lightning's checkpoint dict whose contents are the rows (and their rest) instead.
WEIGHT_KEYS = ("state_dict", "optimizer_states")


class FitRest(TypedDict):
    """A commit's rest: everything but the rows (a dict, which the commit copies to host memory
    tensor by tensor)."""

    checkpoint: dict[str, Any]  # Lightning's, without WEIGHT_KEYS
    parts: list[dict[str, Any]]  # sharded.parts' rest, by optimizer (the model's with the first)
    info: CommitInfo


def _prefix(index: int) -> str:
    # The first optimizer's entries are keyed as a ShardedState's are; later ones apart.
    return "" if index == 0 else f"optimizer{index}."


def split_fit(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], checkpoint: dict[str, Any],
              info: CommitInfo) -> tuple[list[Entry], list[torch.Tensor], FitRest]:
    """``(entries, local rows, rest)`` of a fit: the module with each of its optimizers."""
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    rests: list[dict[str, Any]] = []
    for index, optimizer in enumerate(optimizers or [None]):
        e, t, r = parts.split(module, optimizer, _prefix(index), with_model=index == 0)
        entries += e
        tensors += t
        rests.append(r)
    kept = {key: value for key, value in checkpoint.items() if key not in WEIGHT_KEYS}
    return entries, tensors, FitRest(checkpoint=kept, parts=rests, info=info)


def destinations(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 entries: tuple[Entry, ...]) -> dict[int, torch.Tensor]:
    """The rebuilt module's and optimizers' local rows to receive the commit's, by entry index."""
    local: dict[int, torch.Tensor] = {}
    for index, optimizer in enumerate(optimizers or [None]):
        local.update(parts.allocate(module, optimizer, entries, _prefix(index)))
    if len(local) != len(entries):
        missing = sorted({".".join(entries[i].key[:1]) for i in range(len(entries)) if i not in local})
        raise ElasticError(f"sharded state: the commit has rows of {', '.join(missing)}, which the rebuilt fit does "
                           f"not have; expected configure_optimizers to return {len(optimizers)} optimizer(s) as before")
    return local


def load_fit(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], rest: FitRest,
             world_size: int) -> dict[str, Any]:
    """Load the rest into the rebuilt module and optimizers; return the checkpoint dict for
    Lightning to restore the loops, callbacks and schedulers from, rescaled to ``world_size``."""
    given = list(optimizers or [None])
    if len(rest["parts"]) != len(given):
        raise ElasticError(f"sharded state: the commit has {len(rest['parts'])} optimizer(s), the rebuilt fit "
                           f"{len(given)}; expected configure_optimizers to return the same optimizers every time")
    for optimizer, part in zip(given, rest["parts"], strict=True):
        parts.load_rest(module, optimizer, part)
    return resume_checkpoint(dict(rest["checkpoint"]), rest["info"], world_size)
