"""Elastic training on Ray from Python (a notebook): ``ElasticRayExecutor``.

    import ray
    from lightning_elastic.ray import ElasticRayExecutor

    ray.init(address="auto")
    executor = ElasticRayExecutor(min_np=1, max_np=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train_fn, args=(config,))  # one value per rank of the final round

``train_fn`` is what a training script's body would be: it calls ``le.init()`` (or builds
a Trainer with ``strategy="elastic_hvd"``) and trains under ``@le.run``. It runs in a worker
process started by a Ray actor on each slot, exactly as ``lightning-elastic launch --ray``
runs a script: the same driver decides membership, faults and the job's end, in this
process. Needs the ``ray`` extra.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from lightning_elastic.launcher.config import LaunchConfig, RaySettings
from lightning_elastic.launcher.driver.driver import Driver
from lightning_elastic.launcher.driver.launch import run_driver
from lightning_elastic.launcher.driver.result import JobResult
from lightning_elastic.launcher.errors import ConfigError
from lightning_elastic.launcher.observe.events import prepare_log_dir
from lightning_elastic.launcher.processes.output import OutputSink
from lightning_elastic.launcher.ray import require_ray


class ElasticJobError(RuntimeError):
    """The elastic job failed; the message is the driver's one-line reason, ``result`` the rest."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"elastic job failed: {result.reason}")
        self.result = result


class ElasticRayExecutor:
    """Runs a training function elastically on the Ray cluster this process is connected to.

    ``min_np``: fewest workers to train with; ``max_np``: most (default: ``min_np``); the
    job starts once ``np`` slots are there (default: ``min_np``) and grows to ``max_np`` as
    nodes join. A node's slots are how many workers its total resources fit.
    ``env``: variables every worker gets. ``elastic_timeout``, ``reset_limit`` and
    ``log_dir`` are the ``launch`` options of the same names.
    """

    def __init__(
        self,
        min_np: int = 1,
        max_np: int | None = None,
        np: int | None = None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        env: Mapping[str, str] | None = None,
        elastic_timeout: float = 600.0,
        reset_limit: int | None = None,
        log_dir: str | Path | None = None,
        out: IO[str] | None = None,
    ) -> None:
        try:
            require_ray("ElasticRayExecutor")
        except ConfigError as err:
            raise ImportError(str(err)) from None
        np_ = np if np is not None else min_np
        self._config = LaunchConfig(
            command=("<function>",),  # replaced by the function in every worker
            np=np_,
            min_np=min_np,
            max_np=max_np if max_np is not None else max(np_, min_np),
            ray=RaySettings(address=None, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker),
            env=tuple((env or {}).items()),
            elastic_timeout=elastic_timeout,
            reset_limit=reset_limit,
            log_dir=Path(log_dir) if log_dir is not None else None,
        )
        self._out = out  # workers' rank-prefixed output (default: sys.stdout)
        self._started = False
        self.last_result: JobResult | None = None

    def start(self) -> None:
        """Check the connection to Ray (``ray.init`` is the caller's, as for any Ray program)."""
        import ray  # noqa: PLC0415

        if not ray.is_initialized():
            raise RuntimeError("ElasticRayExecutor.start: Ray is not connected: call ray.init(...) first")
        self._started = True

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` elastically; the final round's return values, in rank order.

        Raises ``ElasticJobError`` (the driver's one-line reason: for an error in ``fn``, its
        type and message) when the job fails. Every actor is released before it returns.
        """
        if not self._started:
            raise RuntimeError("ElasticRayExecutor.run: call start() first")
        from ray import cloudpickle  # noqa: PLC0415

        from lightning_elastic.launcher.ray.backend import ray_backend  # noqa: PLC0415

        _show_driver_log()
        if self._config.log_dir is not None:  # each run is a job: keep the previous one's files
            moved = prepare_log_dir(self._config.log_dir)
            if moved:
                logging.getLogger("lightning_elastic.driver").info("%s.", moved)
        function = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        with ray_backend(self._config, OutputSink(self._out), function) as backend:
            result = run_driver(Driver(backend.config, backend.nodes, backend.launcher, backend.nodes.is_local))
            returned = backend.launcher.results()
        self.last_result = result
        if not result.success:
            raise ElasticJobError(result)
        return [value for _, value in sorted(returned, key=lambda ranked: ranked[0])]

    def shutdown(self) -> None:
        """Stop using the cluster. Actors live only while ``run`` runs, so none is left."""
        self._started = False


def _show_driver_log() -> None:
    """The driver's decisions on stderr (rounds, faults), unless the caller configured logging."""
    logger = logging.getLogger("lightning_elastic")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("lightning-elastic %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
