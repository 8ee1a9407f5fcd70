"""A sharded state as the tree its durable snapshot holds, and the tree a resume reads into.

The tree has the keys a torch.distributed.checkpoint user expects, so that
``dcp.load({"model": get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, o)})``
reads it at any world size: ``model`` (parameters and buffers by fully qualified name),
``optimizer`` (``state`` by parameter name, ``param_groups`` naming their parameters) and
``extra`` (the state's plain values, samplers and scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_elastic.sharded.dcp_format import ShardPiece
from lightning_elastic.sharded.rows import Entry, RankRows

OPTIMIZER_STATE = "optimizer.state."
# Under ``extra``, a strategy="elastic_fsdp" fit keeps its Lightning checkpoint (one packed
# value) where a ``le.ShardedState`` keeps its values, samplers and scheduler: the one key
# that tells the two kinds of sharded snapshot apart before a read fails deep in DCP.
FIT_EXTRA = "lightning"


def written_by_a_fit(saved_keys: Sequence[str]) -> bool:
    """Whether a sharded snapshot with these keys was written by an elastic_fsdp fit."""
    return f"extra.{FIT_EXTRA}" in saved_keys


def written(own: RankRows, rest: dict[str, Any]) -> dict[str, Any]:
    """The tree of a commit: this rank's rows (views of ``own``, not copies) and the rest."""
    model: dict[str, Any] = dict(rest["model"])
    state: dict[str, dict[str, Any]] = {fqn: dict(values) for fqn, values in rest["optimizer"]["state"].items()}
    for index, entry in enumerate(own.entries):
        piece = ShardPiece(own.view(index), entry.shape, own.first_row(index))
        if entry.key[0] == "model":
            model[entry.key[1]] = piece
        else:
            state.setdefault(entry.key[1], {})[entry.key[2]] = piece
    return {"model": model, "optimizer": {"state": state, "param_groups": rest["optimizer"]["param_groups"]},
            "extra": {k: rest[k] for k in ("values", "stateful", "scheduler")}}


def read_target(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved_keys: Sequence[str],
                tensor_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], extra: dict[str, Any]) -> dict[str, Any]:
    """What a resume reads a snapshot into: the rebuilt model's own parameters and buffers
    (filled in place), its optimizer's state created for every ``optimizer.state.*`` key the
    snapshot has (sharded like the parameter when it has the parameter's shape), the
    optimizer's groups and ``extra`` as they are now (replaced by the saved values)."""
    params = dict(model.named_parameters())
    tree_model: dict[str, Any] = {**dict(model.named_buffers()), **params}
    fqn_of = {id(p): fqn for fqn, p in params.items()}
    for key in saved_keys:
        if not key.startswith(OPTIMIZER_STATE):
            continue
        rest = key[len(OPTIMIZER_STATE):]
        fqn = max((f for f in params if rest.startswith(f + ".")), key=len, default=None)
        if fqn is None:
            continue
        name, param = rest[len(fqn) + 1:], params[fqn]
        state = optimizer.state[param]
        if key in tensor_shapes:
            shape, dtype = tensor_shapes[key]
            if isinstance(param, DTensor) and shape == tuple(param.shape):
                state[name] = torch.zeros_like(param, dtype=dtype)
            else:
                state[name] = torch.zeros(shape, dtype=dtype)
        else:
            state.setdefault(name, None)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    state_tree = {fqn_of[id(p)]: values for p, values in optimizer.state.items()}
    return {"model": tree_model, "optimizer": {"state": state_tree, "param_groups": groups}, "extra": extra}


def entries_of(tree: dict[str, Any]) -> list[Entry]:
    """The sharded entries a written tree holds (for tests and sizes)."""
    out = [Entry(("model", k), v.global_shape, v.tensor.dtype) for k, v in tree["model"].items()
           if isinstance(v, ShardPiece)]
    for fqn, values in tree["optimizer"]["state"].items():
        out += [Entry(("optimizer", fqn, k), v.global_shape, v.tensor.dtype) for k, v in values.items()
                if isinstance(v, ShardPiece)]
    return out
