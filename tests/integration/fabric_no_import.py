"""A Fabric training script as a Fabric user writes it, run by ``lightning-elastic launch``
without importing lightning_elastic and without ``@le.run``: ``strategy="elastic_hvd"`` is
registered by the launcher. Its options are ``--n`` (samples), ``--e`` (epochs) and ``--d``
(where each rank writes what it trained on): each a prefix of several launch options.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--e", type=int, required=True)
    parser.add_argument("--d", type=Path, required=True)
    args = parser.parse_args()
    fabric = L.Fabric(strategy="elastic_hvd", accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    dataset = TensorDataset(torch.arange(args.n), torch.randn(args.n, 4), torch.randn(args.n, 1))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    orders = []
    for _ in range(args.e):
        order = []
        for index, x, y in loader:
            optimizer.zero_grad()
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            order.extend(index.tolist())
        orders.append(order)
    args.d.mkdir(parents=True, exist_ok=True)
    record = {"rank": fabric.global_rank, "size": fabric.world_size, "orders": orders,
              "argv": {**vars(args), "d": str(args.d)}}
    (args.d / f"rank{fabric.global_rank}.{os.getpid()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
