"""The renamed copy of the integration for the standalone ``pytorch_lightning`` package."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_elastic.lightning import standalone

pytestmark = pytest.mark.timeout(90)


def test_every_integration_module_is_mirrored():
    here = Path(standalone.__file__).parent
    modules = {p.stem for p in here.glob("*.py")} - {"__init__", "standalone", "registration"}
    assert modules == set(standalone._MODULES)


def test_the_mirror_serves_pytorch_lightning_classes():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    mirror = standalone.load_for_standalone_package()
    assert issubclass(mirror.strategy.ElasticStrategy, pytorch_lightning.strategies.DDPStrategy)
    assert issubclass(mirror.callbacks.ElasticCallback, pytorch_lightning.Callback)
    assert mirror.capture.pl is pytorch_lightning


_FIT_WITH_PYTORCH_LIGHTNING = r"""
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from lightning_elastic.pytorch_lightning import ElasticCallback, ScaleLearningRate

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Probe(pl.Callback):  # after the elastic callback: the newest commit's step at each batch end
    steps = []
    def on_train_batch_end(self, trainer, *args):
        committed = trainer.strategy.snapshot.committed()
        self.steps.append(committed.meta.global_step if committed else None)

data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
trainer = pl.Trainer(strategy="elastic_hvd", accelerator="cpu", max_epochs=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ElasticCallback(commit_every_n_steps=2), ScaleLearningRate(), Probe()])
trainer.fit(Module(), data)
print(type(trainer.strategy).__module__, Probe.steps)
"""


def test_pytorch_lightning_users_get_the_callbacks_and_the_strategy(tmp_path):
    pytest.importorskip("pytorch_lightning")
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    # A process of its own: a world of one, with nothing else of the test session imported.
    result = subprocess.run([sys.executable, "-c", _FIT_WITH_PYTORCH_LIGHTNING], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    module, steps = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert module == "lightning_elastic.lightning._for_pytorch_lightning.strategy"
    assert steps == "[0, 2, 2, 4]"  # the start of the fit, then the callback at steps 2 and 4
