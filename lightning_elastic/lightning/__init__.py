"""The PyTorch Lightning integration: ``Trainer(strategy="elastic_hvd")`` (DDP) and
``Trainer(strategy="elastic_fsdp")`` (FSDP2 in ``configure_model``).

The names below load ``lightning.pytorch`` on first use (PEP 562), so that a submodule that
needs only ``lightning.fabric`` (``environment``, used by the Fabric integration) can be
imported without it; ``lightning_elastic`` imports this package only once Lightning itself
is imported (see ``registration``), so plain-PyTorch workers never pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_elastic.lightning.callbacks import ElasticCallback, ScaleLearningRate, scale_learning_rates
    from lightning_elastic.lightning.fsdp import ElasticFSDPStrategy
    from lightning_elastic.lightning.strategy import STRATEGY_NAME, ElasticStrategy

_MODULE_OF = {
    "ElasticCallback": "lightning_elastic.lightning.callbacks",
    "ScaleLearningRate": "lightning_elastic.lightning.callbacks",
    "scale_learning_rates": "lightning_elastic.lightning.callbacks",
    "STRATEGY_NAME": "lightning_elastic.lightning.strategy",
    "ElasticStrategy": "lightning_elastic.lightning.strategy",
    "ElasticFSDPStrategy": "lightning_elastic.lightning.fsdp",
}

__all__ = ["STRATEGY_NAME", "ElasticCallback", "ElasticFSDPStrategy", "ElasticStrategy", "ScaleLearningRate", "scale_learning_rates"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_elastic.lightning' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
