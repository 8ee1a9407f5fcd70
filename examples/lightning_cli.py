"""The spirals classifier behind LightningCLI, unchanged for lightning-elastic.

    lightning-elastic launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 \\
        python examples/lightning_cli.py fit --trainer.strategy elastic_hvd --trainer.max_epochs 2

Nothing here mentions lightning_elastic: the launcher makes the strategy name known.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_classifier import Events, SpiralClassifier, SpiralData  # noqa: E402


class CLIClassifier(SpiralClassifier):
    def __init__(self, lr: float = 0.02, events_dir: str | None = None) -> None:
        super().__init__(lr, Events(Path(events_dir) if events_dir else None))


def main() -> None:
    LightningCLI(CLIClassifier, SpiralData, seed_everything_default=0, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
