"""Elastic training on Ray from Python, as in a notebook: ``ElasticRayExecutor``.

    python examples/ray_executor.py --address auto            # an existing cluster
    python examples/ray_executor.py --address local --np 2    # a private one-node Ray

``train`` fits a small linear model with a hand-written loop on the workers; each returns
its rank, the world size and the final loss. With ``--fail-with MESSAGE`` every worker
raises ``ValueError(MESSAGE)`` instead, to show how a failed job reaches the caller.
Prints the results (or the error) as one JSON line, for the integration test to read.
"""

from __future__ import annotations

import argparse
import json

import ray

from lightning_elastic.ray import ElasticJobError, ElasticRayExecutor


def train(steps: int, fail_with: str = "") -> dict[str, float]:
    # Runs on every worker, in a process of its own started by a Ray actor.
    import torch

    import lightning_elastic as le

    le.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp_model = le.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = le.TorchState(model, optimizer, step=0)
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 8, generator=generator)
    y = x @ torch.arange(8.0).unsqueeze(1)

    @le.run
    def loop(state: le.TorchState) -> dict[str, float]:
        loss = torch.tensor(0.0)
        while state.step < steps:
            if fail_with:
                raise ValueError(fail_with)
            rows = slice(le.rank() * 16, le.rank() * 16 + 16)  # each rank its own batch
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp_model(x[rows]), y[rows])
            loss.backward()  # gradients averaged across the ranks
            optimizer.step()
            state.step += 1
            state.commit()
        return {"rank": le.rank(), "size": le.size(), "steps": state.step, "loss": float(loss)}

    return loop(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="auto", help="ray.init's address; 'local': a private Ray")
    parser.add_argument("--np", type=int, default=2, help="workers (min and max)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fail-with", default="", help="make every worker raise ValueError(MESSAGE)")
    parser.add_argument("--runs", type=int, default=1, help="call run this many times on the one executor")
    args = parser.parse_args()

    ray.init(address=None if args.address == "local" else args.address, include_dashboard=False,
             logging_level="WARNING", log_to_driver=False)
    executor = ElasticRayExecutor(min_np=args.np, max_np=args.np, cpus_per_worker=1)
    executor.start()
    try:
        runs = [executor.run(train, args=(args.steps,), kwargs={"fail_with": args.fail_with})
                for _ in range(args.runs)]
        print(json.dumps({"results": runs[-1], "runs": len(runs)}))
    except ElasticJobError as err:
        print(json.dumps({"error": str(err)}))
    finally:
        executor.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
