"""An ``elastic_fsdp`` commit as a durable sharded snapshot (``--snapshot-dir``), and a rebuilt
fit read back from one, at any world size.

The tree is ``sharded.snapshot_tree``'s, so ``torch.distributed.checkpoint`` users load it as
they load a ``ShardedState``'s: ``model`` (the LightningModule's parameters and buffers by
fully qualified name) and ``optimizer`` (its state by parameter name, ``param_groups``).
What Lightning needs besides (its checkpoint dict without the weights: loops, callbacks,
schedulers; the commit's ``CommitInfo``: world size, sampler position, RNG states) is one
``torch.save`` blob under ``extra.lightning``, written once by rank 0.

One optimizer: the tree has one ``optimizer`` key, as a DCP user expects it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from lightning_elastic.durable import files
from lightning_elastic.durable.files import Found
from lightning_elastic.errors import ElasticError
from lightning_elastic.lightning.commit import CommitInfo
from lightning_elastic.lightning.sharded_commit import FitRest
from lightning_elastic.sharded import snapshot_tree
from lightning_elastic.sharded.rows import RankRows
from lightning_elastic.sharded.snapshots import read_sharded, saved_tensors

EXTRA_KEY = snapshot_tree.FIT_EXTRA


def check_one_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    if len(optimizers) != 1:
        raise ElasticError(f'strategy="elastic_fsdp" with --snapshot-dir: configure_optimizers returned '
                           f"{len(optimizers)} optimizers; durable sharded snapshots hold one (expected one "
                           "optimizer, or a launch without --snapshot-dir)")


def fit_tree(own: RankRows, rest: FitRest) -> dict[str, Any]:
    """The snapshot tree of a fit's commit: this rank's rows (views of ``own``) and the rest."""
    (part,) = rest["parts"]
    tree = snapshot_tree.written(own, {**part, "values": None, "stateful": None, "scheduler": None})
    tree["extra"] = {EXTRA_KEY: _pack({"checkpoint": rest["checkpoint"], "info": rest["info"]})}
    return tree


def read_fit(found: Found, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any],
                                                                                              CommitInfo]:
    """Collective: every rank reads its rows of ``found`` into the rebuilt ``module`` and
    ``optimizer`` (their tensors filled in place); returns the commit's Lightning checkpoint
    dict (without the weights) and its ``CommitInfo``."""
    where = files.base_name(found.path)
    if found.manifest.kind != files.SHARDED:
        raise ElasticError(f'{where}: a {found.manifest.kind!r} snapshot; strategy="elastic_fsdp" resumes from a '
                           "sharded one (to start over: --no-resume, or another --snapshot-dir)")
    shapes = saved_tensors(found.path)
    if not snapshot_tree.written_by_a_fit(list(shapes)):
        raise ElasticError(f'{where}: a sharded snapshot of a hand-written loop (le.ShardedState), not of a '
                           'strategy="elastic_fsdp" fit (to start over: --no-resume, or another --snapshot-dir)')
    target = snapshot_tree.read_target(module, optimizer, list(shapes),
                                       {k: v for k, v in shapes.items() if v is not None}, {EXTRA_KEY: b""})
    read_sharded(found.path, target)
    for group, saved in zip(optimizer.param_groups, target["optimizer"]["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    saved = _unpack(target["extra"][EXTRA_KEY])
    return saved["checkpoint"], saved["info"]


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(blob: bytes) -> Any:
    # Written by this job's own rank 0 (loops, callbacks' states, a CommitInfo): not only weights.
    return torch.load(io.BytesIO(blob), weights_only=False)
