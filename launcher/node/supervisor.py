"""The remote end of an ssh-started worker: ``python -m lightning_elastic.launcher.node.supervisor``.

The driver runs this through ssh and talks to it over the connection:

- stdin, first line: a JSON ``{"command", "env", "cwd", "secret", "secret_fd_variable"}``
  (the secret travels inside the encrypted ssh channel, never on a command line);
- stdin, later lines: ``signal N``, forwarded to the worker's process group;
- stdin at EOF: the driver or the connection is gone, so the worker is SIGKILLed — a
  remote worker never outlives its driver or its ssh connection;
- stdout: the worker's own output (stdout and stderr), untouched;
- stderr: ``lightning-elastic-supervisor: started PID`` and ``... exit STATUS`` lines
  (STATUS as ``Popen.returncode``: negative for a signal), so the driver can tell the
  worker's exit from an ssh failure (ssh's own errors also arrive on stderr); in an srun
  step also ``... step JOB.STEP``, the step's id.

The same runs as an srun step under ``--slurm`` (``processes/slurm.py``): srun forwards the
step's stdin and output the same way.

The worker runs in its own session with PR_SET_PDEATHSIG, so killing this supervisor
(SIGKILL included) kills it too. Standard library only: it starts on every remote start.

With ``--state-dir`` the start message has a ``"detach"`` object (``dir``, ``name``) and the
worker outlives the connection instead: it runs under a keeper (``keeper.py``) in a session
of its own, writing to ``DIR/NAME.log``; this supervisor relays that file to stdout and the
signals to the worker, and at EOF on stdin it leaves, the worker still running (it waits for
a driver within its own ``--driver-patience``). ``started PID TICKS OFFSET`` says which
process to find again and from which byte of the file the output is relayed. A restarted
driver re-attaches with ``{"attach": {"dir", "name", "pid", "ticks", "offset"}}``: the same
relay, from the offset its predecessor had forwarded to, for a worker it did not start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

from lightning_elastic.launcher.hosts.network import collective_interface_env
from lightning_elastic.launcher.node.spawn import end_leftovers_at_exit, signal_group, spawn_worker

MARK = "lightning-elastic-supervisor:"
# How long the worker gets to exit after SIGKILL before the supervisor leaves anyway.
REAP_BOUND = 5.0


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"{MARK} {text}\n")
        sys.stderr.flush()
    except OSError:
        pass  # the connection is gone: nobody is listening any more


def _parse_start(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"start message: expected a JSON object, got {type(message).__name__}")
    if "attach" in message:
        attach = message["attach"]
        kinds = {"dir": str, "name": str, "pid": int, "ticks": int, "offset": int, "mark": str}
        if not isinstance(attach, dict) or any(not isinstance(attach.get(k), t) for k, t in kinds.items()):
            raise ValueError("start message: 'attach' must give dir, name, pid, ticks, offset and mark")
        return message
    expected = {"command": list, "env": dict, "cwd": str, "secret": str, "secret_fd_variable": str}
    for key, kind in expected.items():
        if not isinstance(message.get(key), kind):
            raise ValueError(f"start message: field {key!r} missing or not a {kind.__name__}")
    if not message["command"] or not all(isinstance(a, str) for a in message["command"]):
        raise ValueError("start message: 'command' must be a non-empty list of strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in message["env"].items()):
        raise ValueError("start message: 'env' must map strings to strings")
    return message


def main() -> int:
    stdin = sys.stdin.buffer
    try:
        start = _parse_start(stdin.readline())
    except ValueError as err:
        _say(f"error {err}")
        return 2
    if "attach" in start or "detach" in start:
        return _relay(start, stdin)
    # Under Slurm (an srun step) a signal sent through Slurm (scancel --signal, a preemption
    # notice, the job's end) reaches every process of the step, the worker included: the
    # supervisor then leaves the worker to act on it. A Python handler, not SIG_IGN, which the
    # worker would inherit across exec.
    in_step = "SLURM_STEP_ID" in os.environ
    if in_step:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda _s, _f: None)
    env = {**os.environ, **start["env"]}
    if "MASTER_ADDR" in env:  # collectives go out through the interface that reaches the driver
        env.update(collective_interface_env(env, env["MASTER_ADDR"]))
    try:
        proc = spawn_worker(
            start["command"], env, start["secret"], start["cwd"], sys.stdout.fileno(), start["secret_fd_variable"]
        )
    except OSError as err:
        _say(f"error cannot start {start['command'][0]!r}: {err}")
        return 127
    _say(f"started {proc.pid}")
    if in_step:  # the step to signal through Slurm: scancel --signal=SIG JOB.STEP
        _say(f"step {os.environ.get('SLURM_JOB_ID', '')}.{os.environ['SLURM_STEP_ID']}")

    def end(status: int) -> None:
        _say(f"exit {status}")
        os._exit(0)

    def on_signal(signum: int, _frame: Any) -> None:
        # Whoever stops the supervisor stops the worker: it must not be left running alone.
        signal_group(proc.pid, signal.SIGKILL)

    if not in_step:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, on_signal)

    def reap() -> None:
        end_leftovers_at_exit(proc.pid)
        end(proc.wait())

    threading.Thread(target=reap, name="reaper", daemon=True).start()

    for line in iter(stdin.readline, b""):
        verb, _, arg = line.decode(errors="replace").strip().partition(" ")
        if verb == "signal" and arg.isdigit():
            signal_group(proc.pid, int(arg))
    # EOF: the driver died, stopped us, or the connection dropped.
    signal_group(proc.pid, signal.SIGKILL)
    try:
        status = proc.wait(REAP_BOUND)
    except Exception:
        status = -signal.SIGKILL
    end(status)
    return 0  # not reached: end() leaves the process


def _relay(start: dict[str, Any], stdin: Any) -> int:
    """--state-dir: start the worker under a keeper (or find it again), then relay its
    output file and the driver's signals until it ends or the connection does."""
    from pathlib import Path  # noqa: PLC0415

    from lightning_elastic.launcher.processes.detached import (  # noqa: PLC0415
        KEEPER,
        FollowFile,
        is_keeper,
        is_running,
        process_start,
    )

    where = start.get("attach") or start["detach"]
    directory = Path(where["dir"])
    output, status_path = directory / f"{where['name']}.log", directory / f"{where['name']}.status"
    child = None
    if "attach" in start:
        pid, ticks, offset = where["pid"], where["ticks"], where["offset"]
        if not (is_running(pid, ticks) or status_path.exists()):
            _say("exit -9")  # gone without a status: killed, as its keeper was
            return 0
        if is_running(pid, ticks) and not is_keeper(pid, ticks, where["mark"]):
            _say("exit -9")  # not this job's keeper (a pid and start time prove nothing): never signalled
            return 0
    else:
        env = {**os.environ, **start["env"]}
        if "MASTER_ADDR" in env:
            env.update(collective_interface_env(env, env["MASTER_ADDR"]))
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            status_path.unlink(missing_ok=True)
            out_fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as err:
            _say(f"error cannot use {directory}: {err}")
            return 2
        try:
            offset = os.fstat(out_fd).st_size
            fd_variable = start["secret_fd_variable"]
            keeper = [sys.executable, "-I", str(KEEPER), str(status_path), fd_variable, str(where.get("mark", "-")),
                      "--", *start["command"]]
            child = spawn_worker(keeper, env, start["secret"], start["cwd"], out_fd, fd_variable, die_with_parent=False)
        except OSError as err:
            _say(f"error cannot start {start['command'][0]!r}: {err}")
            return 127
        finally:
            os.close(out_fd)
        pid = child.pid
        found = process_start(pid)
        ticks = found[1] if found else 0
        # Reaped as it ends, so that it is not a zombie for as long as this supervisor lives.
        threading.Thread(target=child.wait, name="keeper-reaper", daemon=True).start()

    def ended() -> bool:
        return (child.poll() is not None) if child is not None else not is_running(pid, ticks)

    def leave(_signum: int = 0, _frame: Any = None) -> None:
        os._exit(0)  # the worker stays: it waits for a driver within its patience

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, leave)
    _say(f"started {pid} {ticks} {offset}")

    def relay_output() -> None:
        stream = FollowFile(output, None, ended, offset)
        out = sys.stdout.buffer
        try:
            while chunk := stream.read1(65536):
                out.write(chunk)
                out.flush()
        except OSError:
            leave()  # the connection is gone
        try:
            status = int(status_path.read_text().strip())
        except (OSError, ValueError):
            status = -signal.SIGKILL
        _say(f"exit {status}")
        os._exit(0)

    threading.Thread(target=relay_output, name="relay", daemon=True).start()
    for line in iter(stdin.readline, b""):
        verb, _, arg = line.decode(errors="replace").strip().partition(" ")
        if verb == "signal" and arg.isdigit() and not ended():
            signal_group(pid, int(arg))
    leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
