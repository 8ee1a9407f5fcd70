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
