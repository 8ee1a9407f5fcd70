"""Put ``"elastic_hvd"`` in Lightning's strategy registries."""

from __future__ import annotations

import importlib


def register_strategy(package: str = "lightning.pytorch") -> None:
    """Register ``ElasticStrategy`` as ``"elastic_hvd"`` in ``package``'s registry (idempotent).

    ``lightning.pytorch`` and the standalone ``pytorch_lightning`` keep separate registries
    and separate class hierarchies; the strategy is built on ``lightning.pytorch``, so the
    standalone package gets a copy of the integration built on its own classes.
    """
    if package == "lightning.pytorch":
        from lightning_elastic.lightning.strategy import STRATEGY_NAME, ElasticStrategy
    else:
        from lightning_elastic.lightning.standalone import load_for_standalone_package

        strategy_module = load_for_standalone_package().strategy
        STRATEGY_NAME, ElasticStrategy = strategy_module.STRATEGY_NAME, strategy_module.ElasticStrategy
    registry = importlib.import_module(f"{package}.strategies").StrategyRegistry
    if STRATEGY_NAME not in registry:
        registry.register(
            STRATEGY_NAME,
            ElasticStrategy,
            description="Elastic DDP: survives lost workers and host changes in-process (lightning-elastic)",
        )
