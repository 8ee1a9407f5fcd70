"""Loads a sharded snapshot as a torch.distributed.checkpoint user would, at the world size
torchrun gives, into ``examples/sharded_loop.py``'s model, and prints the state's digest.

    torchrun --standalone --nproc-per-node 2 tests/integration/dcp_load_check.py DIR WIDTH BLOCKS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from sharded_loop import Blocks, full, shard  # noqa: E402


def main() -> None:
    path, width, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Blocks(width, blocks)
    shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    import hashlib

    h = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            h.update(name.encode())
            h.update(full(param).contiguous().view(torch.uint8).numpy().tobytes())
            for _, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    h.update(full(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if dist.get_rank() == 0:
        print(f"digest {h.hexdigest()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
