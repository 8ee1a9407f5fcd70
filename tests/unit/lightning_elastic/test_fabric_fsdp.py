"""lightning_elastic/fabric_fsdp.py: Fabric's "elastic_fsdp" strategy and FabricShardedState.

The options are checked in this process; a Fabric that trains runs in a process of its own
(a world of one), as in test_fabric.py. Resets run in real launches:
tests/integration/test_lightning_sharded.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.troubleshooting_rows import assert_documented

pytest.importorskip("lightning")
from lightning_elastic.fabric_fsdp import ElasticFabricFSDPStrategy  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(tensor_parallel_size=2), ValueError, "ElasticFabricFSDPStrategy: tensor_parallel_size=2: tensor "
                                                   "parallelism is not supported; expected 1 (FSDP2 over every rank "
                                                   "of the job)"),
        (dict(data_parallel_size=4), ValueError, "ElasticFabricFSDPStrategy: data_parallel_size=4: the data-parallel "
                                                 "size is the job's world size, set by lightning-elastic launch; "
                                                 "expected it left out"),
        (dict(parallelize_fn="fsdp"), TypeError, "ElasticFabricFSDPStrategy: parallelize_fn must be a function "
                                                 "(model, device_mesh) -> model, got str"),
        (dict(timeout="10 minutes"), ValueError, "ElasticFabricFSDPStrategy: timeout must be a datetime.timedelta, "
                                                 "got '10 minutes'"),
    ],
)
def test_invalid_options_are_one_line_errors_when_the_strategy_is_built(kwargs, error, message):
    with pytest.raises(error) as info:
        ElasticFabricFSDPStrategy(**kwargs)
    assert str(info.value) == message
    if "tensor_parallel_size" in message:
        assert_documented(message)


def test_the_name_is_registered_with_fabric():
    import importlib

    from lightning.fabric.strategies import STRATEGY_REGISTRY

    importlib.import_module("lightning_elastic")  # registers the Fabric names once lightning.fabric is imported

    assert STRATEGY_REGISTRY["elastic_fsdp"]["strategy"] is ElasticFabricFSDPStrategy


def test_a_fabric_sharded_state_needs_the_elastic_fsdp_strategy():
    import lightning as L

    import lightning_elastic as le

    fabric = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=r"FabricShardedState: the Fabric's strategy must be 'elastic_fsdp' "
                                         r"\(le.ElasticFabricFSDPStrategy\), got SingleDeviceStrategy"):
        le.FabricShardedState(fabric, model=lambda: None, optimizer=lambda p: None)


_WORLD_OF_ONE = r"""
import json, torch
import lightning as L
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset
import lightning_elastic as le

fabric = L.Fabric(strategy="elastic_fsdp", accelerator="cpu", devices=1)
fabric.launch()
out = {"strategy": type(fabric.strategy).__name__, "world": fabric.world_size}
data = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.zeros(20, 1))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
state = le.FabricShardedState(fabric, model=lambda: torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Linear(8, 1)),
                              optimizer=lambda p: torch.optim.AdamW(p, lr=0.1), loader=loader, epoch=0)
out["sampler"] = type(state.sampler).__name__

@le.run
def train(state):
    model, optimizer = state.setup()
    out["sharded"] = isinstance(model._forward_module, FSDPModule)
    out["mesh"] = list(fabric.strategy.device_mesh.mesh_dim_names)
    for batch_idx, (x, y) in enumerate(state.loader):
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        state.record_batch(batch_idx)
        if batch_idx == 1:
            state.commit()
            break

train(state)
out["committed_consumed"] = state._commit.own_rest["stateful"]["sampler"]["consumed"]
out["committed_bytes"] = state.committed_bytes
try:
    fabric.setup(torch.nn.Linear(1, 1))
except Exception as err:
    out["unsharded"] = str(err)
print(json.dumps(out))
"""


def test_a_fabric_loop_trains_commits_and_refuses_a_model_the_state_did_not_build(tmp_path):
    result = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], cwd=tmp_path, capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out.pop("committed_bytes") > 0
    assert out == {
        "strategy": "ElasticFabricFSDPStrategy", "world": 1, "sampler": "ElasticSampler", "sharded": True,
        "mesh": ["data_parallel", "tensor_parallel"],
        "committed_consumed": 8,  # two batches of 4 recorded before the commit
        "unsharded": 'strategy="elastic_fsdp": the model is built and sharded by le.FabricShardedState on every '
                     "round; expected model, optimizer = state.setup() instead of fabric.setup(model)",
    }
    assert_documented(out["unsharded"])
