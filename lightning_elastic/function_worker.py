"""``python -m lightning_elastic.function_worker FUNCTION RESULT``: a worker that runs a function.

``ElasticRayExecutor.run(fn, args, kwargs)`` starts this in place of a training command:
FUNCTION holds the pickled ``(fn, args, kwargs)``; when ``fn`` returns, RESULT gets the
pickled ``(rank, return value)``, the rank being the worker's in the round it finished in.
A worker removed from the job leaves through ``SystemExit`` and writes nothing; an
exception ends the process with a traceback, as any training script's would.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m lightning_elastic.function_worker FUNCTION RESULT", file=sys.stderr)
        return 2
    from ray import cloudpickle  # noqa: PLC0415 - the function was pickled by Ray's cloudpickle

    function_path, result_path = argv
    with open(function_path, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    value = fn(*args, **kwargs)
    # The launcher's RANK, which the worker runtime updates at every new round.
    rank = int(os.environ.get("RANK", "0"))
    partial = f"{result_path}.partial"
    with open(partial, "wb") as f:
        cloudpickle.dump((rank, value), f)
    os.replace(partial, result_path)  # all or nothing, even if the process is killed now
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
