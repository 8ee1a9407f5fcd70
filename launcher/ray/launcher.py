"""Starting workers as Ray actors pinned to their nodes (the driver's ``WorkerLauncher``).

``start`` returns at once: creating the actor and starting its child happen in a thread of
the worker's own, which then relays the child's output into a pipe read by the usual
``LineForwarder`` (rank-prefixed lines on the driver's stdout, ``--log-dir`` files) until
the exit status arrives. The driver loop never waits on Ray.

An actor that dies (its node removed or lost, ``ray.kill``) ends the worker as a SIGKILL
would: status -9, with Ray's reason as the detail. The driver's own SIGKILL kills the actor
too, so a worker on an unreachable node is never waited for. Every actor is released when
its worker has ended, so that its resources are free for the next worker of that slot.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lightning_elastic.launcher.config import RaySettings
from lightning_elastic.launcher.processes.base import WorkerSpec
from lightning_elastic.launcher.processes.output import LineForwarder, OutputSink, as_sink
from lightning_elastic.launcher.ray.agent import OutputChunk, WorkerAgent
from lightning_elastic.launcher.ray.nodes import RayNodeDiscovery
from lightning_elastic.launcher.ray.sealed import seal
from lightning_elastic.protocol import ENV_CUDA_DEVICE

log = logging.getLogger(__name__)

READ_WAIT = 0.5  # longest one read call waits in the actor for output
CLOSE_WAIT = 5.0
# The driver's variables a worker gets besides the job's own ones and -x (as for ssh).
FORWARDED_BY_DEFAULT = ("PATH", "PYTHONPATH", "VIRTUAL_ENV")
ACTOR_NAME_PREFIX = "lightning-elastic"


def actor_name(job: str, worker_id: str) -> str:
    """The named actor of a worker (``ray list actors`` shows it)."""
    return f"{ACTOR_NAME_PREFIX}:{job}:{worker_id}"


class RayLauncher:
    """Starts each worker in a ``WorkerAgent`` actor on the worker's node.

    ``function``: a pickled ``(fn, args, kwargs)`` to run instead of the command (the
    Python API); each worker's pickled ``(rank, return value)`` is then kept (``results``).
    """

    def __init__(
        self,
        settings: RaySettings,
        nodes: RayNodeDiscovery,
        job: str,
        out: OutputSink | None = None,
        function: bytes | None = None,
    ) -> None:
        self._settings = settings
        self._nodes = nodes
        self._job = job
        self._sink = as_sink(out)
        self._function = function
        self._agent_class = ray.remote(WorkerAgent)
        self._lock = threading.Lock()
        self._processes: list[RayProcess] = []

    def start(self, spec: WorkerSpec, prefix: Callable[[], str]) -> RayProcess:
        node = self._nodes.node(spec.host)
        env = {k: os.environ[k] for k in FORWARDED_BY_DEFAULT if k in os.environ}
        env.update(spec.env)
        if self._settings.gpus_per_worker > 0:
            # Ray shows an actor only its own GPUs (CUDA_VISIBLE_DEVICES): device 0 is the
            # worker's first, whatever its local rank.
            env[ENV_CUDA_DEVICE] = "0"
        actor = self._agent_class.options(
            name=actor_name(self._job, spec.worker_id),
            num_cpus=self._settings.cpus_per_worker,
            num_gpus=self._settings.gpus_per_worker,
            max_concurrency=2,  # a signal next to the pending read
            max_restarts=0,  # a restarted agent would not have the worker: a lost node is a lost worker
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        ).remote()
        process = RayProcess(actor, spec, prefix, self._sink, self._function)
        with self._lock:
            self._processes.append(process)
        return process

    def results(self) -> list[tuple[int, object]]:
        """(rank, value) of every worker whose function returned, as ``function_worker`` wrote them."""
        from ray import cloudpickle  # noqa: PLC0415

        with self._lock:
            kept = [p.result for p in self._processes if p.result is not None]
        return [cloudpickle.loads(data) for data in kept]

    def close(self) -> None:
        """Release every actor still held (the job ended); their children die with them."""
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            process.release()


class RayProcess:
    """A worker in a Ray actor, as the driver sees it (``WorkerProcess``)."""

    def __init__(
        self, actor: ray.actor.ActorHandle, spec: WorkerSpec, prefix: Callable[[], str], sink: OutputSink,
        function: bytes | None,
    ) -> None:
        self._actor = actor
        self._spec = spec
        self._function = function
        self._pid = 0
        self._status: int | None = None
        self._detail = ""
        self._killed = False
        self._ended = threading.Event()
        self._released = False
        self._release_lock = threading.Lock()
        self.result: bytes | None = None
        read_end, write_end = os.pipe()
        self._pipe = os.fdopen(write_end, "wb", buffering=0)
        self._forwarder = LineForwarder(
            os.fdopen(read_end, "rb"), prefix, spec.log_file, sink, f"ray-output-{spec.worker_id}"
        )
        self._forwarder.start()
        threading.Thread(target=self._relay, name=f"ray-worker-{spec.worker_id}", daemon=True).start()

    @property
    def pid(self) -> int:
        """The worker's pid on its node, once it has started (0 before)."""
        return self._pid

    @property
    def child_pid(self) -> int | None:
        return None  # an actor, in a process of Ray's, maybe on another node

    def poll(self) -> int | None:
        return self._status if self._ended.is_set() else None

    def wait(self, timeout: float) -> int | None:
        self._ended.wait(timeout)
        return self.poll()

    def signal(self, sig: int) -> None:
        if self._ended.is_set():
            return
        if sig == signal.SIGKILL:
            # Do not wait on a node that may be unreachable: killing the actor kills its child.
            self._killed = True
            self.release()
            return
        try:
            self._actor.signal.remote(int(sig))
        except Exception as err:  # noqa: BLE001 - the actor is gone: the relay reports it
            log.debug("Signal %d to worker %s not sent: %s", sig, self._spec.worker_id, err)

    def finish_output(self, timeout: float = 5.0) -> None:
        self._forwarder.join(timeout)

    def last_line(self) -> str:
        return self._forwarder.last_line

    def exit_detail(self) -> str:
        return "" if self._killed else self._detail

    def release(self) -> None:
        with self._release_lock:
            if self._released:
                return
            self._released = True
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception as err:  # noqa: BLE001 - already dead, or Ray is shutting down
            log.debug("Actor of worker %s not killed: %s", self._spec.worker_id, err)

    def _write(self, data: bytes) -> None:
        try:
            self._pipe.write(data)
        except OSError:
            pass  # never happens while the forwarder reads; the relay must go on regardless

    def _relay(self) -> None:
        spec = self._spec
        status = -signal.SIGKILL  # unless the agent reports the worker's own exit
        try:
            status = self._run_and_relay()
        except ray.exceptions.RayActorError as err:
            self._detail = f"its Ray actor on {spec.host} died: {first_line(err)}"
        except OSError as err:  # raised by start() in the actor: the command cannot run
            status = 127
            cause = getattr(err, "cause", None) or err  # the actor's own exception, without Ray's traceback
            self._detail = f"cannot start {spec.command[0]!r} on {spec.host}: {first_line(cause)}"
        except Exception as err:  # noqa: BLE001 - a Ray error: the worker is lost either way
            self._detail = f"Ray failed on {spec.host}: {type(err).__name__}: {first_line(err)}"
        finally:
            try:
                self._pipe.close()  # the forwarder sees the end of the output
            except OSError:
                pass
            self._status = status
            self._ended.set()
            self.release()

    def _run_and_relay(self) -> int:
        """Start the worker in the actor, relay its output; its exit status."""
        spec = self._spec
        # The secret sealed for this actor's key: Ray's RPC is unencrypted (sealed.py).
        sealed = seal(spec.secret, ray.get(self._actor.public_key.remote()))
        self._pid = ray.get(self._actor.start.remote(spec.command, spec.env, sealed, spec.cwd, self._function))
        log.info("Worker %s runs as pid %d on Ray node %s.", spec.worker_id, self._pid, spec.host)
        while True:
            chunk: OutputChunk = ray.get(self._actor.read.remote(READ_WAIT))
            if chunk.data:
                self._write(chunk.data)
            if chunk.status is not None:
                break
        try:  # the worker has ended: its status stands whatever happens to the actor now
            if self._function is not None:
                self.result = ray.get(self._actor.result.remote(), timeout=CLOSE_WAIT)
            ray.get(self._actor.close.remote(), timeout=CLOSE_WAIT)  # its scratch files
        except Exception as err:  # noqa: BLE001
            log.warning("Worker %s: its return value or scratch files were lost with its actor: %s",
                        spec.worker_id, first_line(err))
        return chunk.status


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__

