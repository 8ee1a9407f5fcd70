"""The Lightning integration for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` users take ``le.ElasticCallback``, ``le.ScaleLearningRate`` and
``le.ElasticStrategy``. The standalone ``pytorch_lightning`` package has classes of its own
(its strategy does not take a ``lightning.pytorch`` ``ElasticCallback`` for its own: it adds
a default one beside it, and the options given are not used), so its users import the same
names from here, built on ``pytorch_lightning``'s classes::

    import pytorch_lightning as pl
    from lightning_elastic.pytorch_lightning import ElasticCallback, ScaleLearningRate

    trainer = pl.Trainer(strategy="elastic_hvd", callbacks=[ElasticCallback(), ScaleLearningRate()])

Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

from lightning_elastic.lightning.standalone import load_for_standalone_package

_mirror = load_for_standalone_package()

ElasticCallback = _mirror.callbacks.ElasticCallback
ScaleLearningRate = _mirror.callbacks.ScaleLearningRate
ElasticStrategy = _mirror.strategy.ElasticStrategy
STRATEGY_NAME = _mirror.strategy.STRATEGY_NAME

__all__ = ["STRATEGY_NAME", "ElasticCallback", "ElasticStrategy", "ScaleLearningRate"]
