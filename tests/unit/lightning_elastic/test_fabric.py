"""lightning_elastic/fabric.py: Fabric's "elastic_hvd" strategy and FabricState, in a world of one.

Each test that launches a Fabric runs in a process of its own (a world of one): the
worker and Fabric's global rank state must not leak into the test session.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

_WORLD_OF_ONE = r"""
import json, warnings, torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset, Sampler
import lightning_elastic as le
from lightning_elastic.fabric import ElasticFabricStrategy

fabric = L.Fabric(strategy="elastic_hvd", accelerator="cpu", devices=1)
fabric.launch()
out = {"strategy": type(fabric.strategy).__name__, "world": fabric.world_size}
data = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.zeros(20, 1))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = le.FabricState(fabric, model=model, optimizer=optimizer, loader=loader, epoch=0)
out["sampler"] = type(state.sampler).__name__
# Fabric's loader sets a sampler's epoch to its iteration count; the elastic one keeps its own.
state.sampler.set_epoch(5)
list(loader); list(loader)
out["epoch_after_two_passes"] = state.sampler.epoch
ddp_model, ddp_optimizer = state.setup()
out["wrapped"] = type(ddp_model._forward_module).__name__
for batch_idx, (x, y) in enumerate(loader):
    ddp_optimizer.zero_grad()
    fabric.backward(torch.nn.functional.mse_loss(ddp_model(x), y))
    ddp_optimizer.step()
    state.record_batch(batch_idx)
    if batch_idx == 1:
        state.commit()
        break
out["committed_consumed"] = state._snapshot.committed().tree()["stateful"]["sampler"]["consumed"]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    class Custom(Sampler):
        def __iter__(self): return iter(range(20))
        def __len__(self): return 20
    fabric.setup_dataloaders(DataLoader(data, batch_size=4, sampler=Custom()))
out["custom_warning"] = any("custom sampler" in str(w.message) for w in caught)
# use_distributed_sampler=False keeps the loader whole, as with ddp (an evaluation loader).
whole = fabric.setup_dataloaders(DataLoader(data, batch_size=4), use_distributed_sampler=False)
out["whole_sampler"] = type(whole.sampler).__name__
# A loader no state owns is elastic too, and takes Fabric's epoch count (a new order each pass).
extra = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
orders = [[int(i) for x, _ in extra for i in x.flatten()] for _ in range(2)]
out["extra_epoch"] = extra.sampler.elastic.epoch
out["extra_orders_differ"] = orders[0] != orders[1] and sorted(orders[0]) == list(range(20))
try:
    le.FabricState(fabric, loader=DataLoader(data, batch_size=4))
except ValueError as err:
    out["plain_loader"] = str(err)
print(json.dumps(out))
"""


def test_fabric_gets_the_strategy_the_elastic_sampler_and_commits_its_position(tmp_path):
    result = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], cwd=tmp_path, capture_output=True, text=True,
                            timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    import json  # noqa: PLC0415

    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "strategy": "ElasticFabricStrategy", "world": 1, "sampler": "ElasticSampler",
        "epoch_after_two_passes": 5, "wrapped": "DistributedDataParallel",
        "committed_consumed": 8,  # two batches of 4 recorded before the commit
        "custom_warning": True,
        "whole_sampler": "SequentialSampler", "extra_epoch": 1, "extra_orders_differ": True,
        "plain_loader": "FabricState: loader must come from fabric.setup_dataloaders with the 'elastic_hvd' "
                        "strategy and a plain DataLoader (its sampler is not elastic)",
    }


def test_a_fabric_state_needs_the_elastic_strategy():
    import lightning as L  # noqa: PLC0415

    import lightning_elastic as le  # noqa: PLC0415

    fabric = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="FabricState: the Fabric's strategy must be 'elastic_hvd', got SingleDeviceStrategy"):
        le.FabricState(fabric)


class _Reporter:
    def __init__(self, reported=None, in_retry_loop=False) -> None:
        self.reported, self.in_retry_loop, self.sent = reported, in_retry_loop, []

    def report(self, outcome, message: str = "") -> None:
        self.sent.append((outcome, message))


def test_the_end_of_training_outside_the_retry_loop_is_reported(monkeypatch, capsys):
    from lightning_elastic import protocol as p  # noqa: PLC0415
    from lightning_elastic.fabric import report_end_outside_retry_loop  # noqa: PLC0415

    monkeypatch.delattr("sys.last_value", raising=False)
    clean = _Reporter()
    report_end_outside_retry_loop(clean)
    assert clean.sent == [(p.Outcome.DONE, "")]
    monkeypatch.setattr("sys.last_value", ValueError("bad batch"), raising=False)
    raised = _Reporter()
    report_end_outside_retry_loop(raised)
    assert raised.sent == [(p.Outcome.FAILED, "ValueError: bad batch")]
    assert "raised outside @le.run, where nothing recovers" in capsys.readouterr().err
    for looped in (_Reporter(reported=p.Outcome.DONE), _Reporter(in_retry_loop=True)):
        report_end_outside_retry_loop(looped)  # @le.run reports itself
        assert looped.sent == []
_SNAPSHOT = r"""
import json, sys, torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
import lightning_elastic as le

directory, phase = sys.argv[1], sys.argv[2]
worker = le.init(snapshot_dir=directory, snapshot_every=1e-6)
fabric = L.Fabric(strategy="elastic_hvd", accelerator="cpu", devices=1)
fabric.launch()
torch.manual_seed(0)
data = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.zeros(20, 1))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = le.FabricState(fabric, model=model, optimizer=optimizer, loader=loader, epoch=0, step=0)
out = {}

@le.run
def train(state):
    out["resumed_at"] = [state.epoch, state.step, state.sampler.consumed]
    if phase == "resume":
        return
    ddp_model, ddp_optimizer = state.setup()
    state.sampler.set_epoch(state.epoch)
    for batch_idx, (x, y) in enumerate(loader):
        ddp_optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(ddp_model(x), y))
        ddp_optimizer.step()
        state.record_batch(batch_idx)
        state.step += 1
        if state.step == 3:
            state.commit()
            break

train(state)
worker.snapshot_writer.wait(30)
if phase == "write":
    fresh_model, fresh_optimizer = torch.nn.Linear(1, 1), torch.optim.SGD(model.parameters(), lr=0.1)
    rest = fabric.load(directory + "/snapshot-1-step-3.pt", {"model": fresh_model, "optimizer": fresh_optimizer})
    out["loaded_equal"] = bool(torch.equal(fresh_model.weight, model.weight))
    out["rest"] = {k: v for k, v in rest.items() if k in ("epoch", "step", "sampler")}
print(json.dumps(out))
"""


def test_a_fabric_states_snapshot_loads_with_fabric_load_and_a_new_run_resumes_from_it(tmp_path):
    import json  # noqa: PLC0415

    def run(phase: str) -> dict:
        result = subprocess.run([sys.executable, "-c", _SNAPSHOT, str(tmp_path / "snapshots"), phase], cwd=tmp_path,
                                capture_output=True, text=True, timeout=110)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    written = run("write")
    assert written["resumed_at"] == [0, 0, 0] and written["loaded_equal"]
    assert written["rest"] == {"epoch": 0, "step": 3, "sampler": {"epoch": 0, "consumed": 12}}
    assert run("resume")["resumed_at"] == [0, 3, 12]  # the next launch goes on from the snapshot
