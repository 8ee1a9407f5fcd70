"""The PyTorch Lightning integration: ``Trainer(strategy="elastic_hvd")``.

Importing this package imports Lightning; ``lightning_elastic`` imports it only when
Lightning itself is imported (see ``registration``), so plain-PyTorch workers never pay
for it.
"""

from lightning_elastic.lightning.callbacks import ElasticCallback, ScaleLearningRate, scale_learning_rates
from lightning_elastic.lightning.strategy import STRATEGY_NAME, ElasticStrategy

__all__ = ["STRATEGY_NAME", "ElasticCallback", "ElasticStrategy", "ScaleLearningRate", "scale_learning_rates"]
