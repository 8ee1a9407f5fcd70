"""Put ``"elastic_hvd"`` and ``"elastic_fsdp"`` in Lightning's strategy registries."""

from __future__ import annotations

import importlib


def register_strategy(package: str = "lightning.pytorch") -> None:
    """Register ``ElasticStrategy`` as ``"elastic_hvd"`` and ``ElasticFSDPStrategy`` as
    ``"elastic_fsdp"`` in ``package``'s registry (idempotent).

    ``lightning.pytorch`` and the standalone ``pytorch_lightning`` keep separate registries
    and separate class hierarchies; the strategy is built on ``lightning.pytorch``, so the
    standalone package gets a copy of the integration built on its own classes.
    """
    if package != "lightning.pytorch":
        from lightning_elastic.lightning.standalone import load_for_standalone_package

        mirror = load_for_standalone_package()
        mirror.strategy.register()
        mirror.fsdp.register()
        return
    for name in ("strategy", "fsdp"):
        strategy_module = importlib.import_module(f"lightning_elastic.lightning.{name}")
        # The import hook may run while a strategy module is itself importing Lightning
        # (``from lightning_elastic.lightning import ElasticStrategy`` before Lightning): it is
        # then half initialised, and registers at its end.
        if hasattr(strategy_module, "register"):
            strategy_module.register()
