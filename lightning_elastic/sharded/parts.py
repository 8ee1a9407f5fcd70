"""An FSDP2 model and its optimizer as parts of a commit: the sharded tensors (``Entry`` and
this rank's local rows) and the rest, and back into a model rebuilt on another mesh.

The sharded tensors are the model's DTensor parameters and the optimizer's DTensor state
(AdamW's moments), in parameter order; the rest is what every rank holds whole: buffers,
unsharded parameters, the optimizer's per-parameter scalars (``step``) and its
hyperparameters (``param_groups``, parameters named by their fully qualified names).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from lightning_elastic.errors import ElasticError
from lightning_elastic.sharded.rows import Entry


def check_sharding(name: str, tensor: DTensor) -> None:
    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise ElasticError(f"sharded state: {name} is placed as {tuple(tensor.placements)} on a "
                           f"{tensor.device_mesh.ndim}-D mesh; expected FSDP2's Shard(0) on the 1-D mesh it is "
                           "given (tensor parallelism is not supported)")


def split(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, prefix: str = "",
          with_model: bool = True) -> tuple[list[Entry], list[torch.Tensor], dict[str, Any]]:
    """``(entries, local rows, rest)`` of ``model`` and ``optimizer`` (entry keys start with
    ``prefix`` + "model" / "optimizer": several models can share one commit).
    ``with_model=False``: the optimizer's part alone (a model's second optimizer)."""
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    whole: dict[str, torch.Tensor] = {}
    optimizer_rest: dict[str, dict[str, Any]] = {}
    fqn_of: dict[int, str] = {}
    state = optimizer.state if optimizer is not None else {}
    for fqn, param in model.named_parameters():
        fqn_of[id(param)] = fqn
        if with_model and isinstance(param, DTensor):
            check_sharding(fqn, param)
            entries.append(Entry((prefix + "model", fqn), tuple(param.shape), param.dtype))
            tensors.append(param.to_local())
        elif with_model:
            whole[fqn] = param.detach()
        for name, value in state.get(param, {}).items():
            if isinstance(value, DTensor):
                check_sharding(f"{fqn} ({name})", value)
                entries.append(Entry((prefix + "optimizer", fqn, name), tuple(value.shape), value.dtype))
                tensors.append(value.to_local())
            else:
                optimizer_rest.setdefault(fqn, {})[name] = value
    for fqn, buffer in model.named_buffers() if with_model else ():
        whole[fqn] = buffer
    groups = ([{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
               for g in optimizer.param_groups] if optimizer is not None else [])
    return entries, tensors, {"model": whole, "optimizer": {"state": optimizer_rest, "param_groups": groups}}


def allocate(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, entries: tuple[Entry, ...],
             prefix: str = "") -> dict[int, torch.Tensor]:
    """The rebuilt model's local rows for the entries with ``prefix`` (by entry index), the
    optimizer's sharded state created (zeros, sharded like its parameter) to receive its rows."""
    params = dict(model.named_parameters())
    local: dict[int, torch.Tensor] = {}
    for index, entry in enumerate(entries):
        kind, fqn = entry.key[0], entry.key[1]
        if kind not in (prefix + "model", prefix + "optimizer"):
            continue
        param = params.get(fqn)
        if param is None or tuple(param.shape) != entry.shape or not isinstance(param, DTensor):
            got = f"shape {list(param.shape)}" if param is not None else "no such parameter"
            raise ElasticError(f"sharded state: the commit has {'.'.join(entry.key)} of shape {list(entry.shape)}, "
                               f"the rebuilt model {got} (does it build and shard the same model every time?)")
        if kind == prefix + "model":
            local[index] = param.to_local()
        else:
            assert optimizer is not None
            state = optimizer.state[param]
            state[entry.key[2]] = torch.zeros_like(param, dtype=entry.dtype)
            local[index] = state[entry.key[2]].to_local()
    return local


def load_rest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rest: dict[str, Any]) -> None:
    """Buffers, unsharded parameters, the optimizer's scalars and hyperparameters from ``rest``."""
    params = dict(model.named_parameters())
    whole: dict[str, torch.Tensor] = dict(model.named_buffers())
    whole.update((fqn, p) for fqn, p in params.items() if not isinstance(p, DTensor))
    with torch.no_grad():
        for fqn, tensor in rest["model"].items():
            whole[fqn].copy_(tensor)
    if optimizer is None:
        return
    for fqn, values in rest["optimizer"]["state"].items():
        optimizer.state[params[fqn]].update(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()})
    saved_groups = rest["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ElasticError(f"sharded state: the commit's optimizer has {len(saved_groups)} parameter group(s), the "
                           f"rebuilt one {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
