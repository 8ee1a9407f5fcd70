"""What one ``--state-dir`` save costs at fleet size: the capture under the driver's lock,
and the encoding (JSON) in the writer thread; and the decoding a restarted driver does.

    flock /tmp/le-cpu.lock .venv/bin/python benchmarks/state_save_cost.py [--workers 4096]

A ``JobState`` as a formed round of N members leaves it (every member with its assignment,
a heartbeat and its keeper's pid; the target, the round's slots, the announced slots), best
of ``--repeat`` for each step. Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_elastic.launcher.job.slots import assign_slots, HostSlots  # noqa: E402
from lightning_elastic.launcher.job.state import JobState, RoundInfo, WorkerRecord, WorkerState  # noqa: E402
from lightning_elastic.launcher.restart import state_codec  # noqa: E402
from lightning_elastic.protocol import Assignment  # noqa: E402


def fleet(workers: int, slots_per_host: int = 8) -> JobState:
    hosts = [HostSlots(f"node-{i:04d}", slots_per_host) for i in range(-(-workers // slots_per_host))]
    target = assign_slots(hosts, workers)
    state = JobState(address="10.0.0.1", port=29400, target=target, generation=3)
    ids = []
    for number, slot in enumerate(target):
        worker_id = f"{slot.slot}#{number}"
        ids.append(worker_id)
        state.workers[worker_id] = WorkerRecord(
            worker_id, slot.slot, started_at=100.0, state=WorkerState.MEMBER, joined=True, last_heartbeat=150.0,
            keeper_pid=10_000 + number, start_ticks=123_456, log_file=f"/logs/worker-{number}.log",
            assignment=Assignment(7, slot.rank, slot.size, slot.slot.local_rank, slot.local_size, slot.cross_rank,
                                  slot.cross_size, slot.slot.host, "10.0.0.1", 29400, 3))
    slots = tuple(s.slot for s in target)
    state.round = RoundInfo(7, tuple(ids), 3, slots)
    state.announced_for = slots
    state.tally.next_worker = workers
    return state


def best(repeat: int, step):  # noqa: ANN001, ANN201
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    state = fleet(args.workers)
    capture_s, copy = best(args.repeat, lambda: state_codec.capture(state))
    encode_s, text = best(args.repeat, lambda: state_codec.encode(copy, 200.0))
    decode_s, _ = best(args.repeat, lambda: state_codec.decode(text, 500.0))
    print(f"{args.workers} workers: capture {capture_s * 1e3:.1f} ms (driver lock held), "
          f"encode {encode_s * 1e3:.1f} ms (writer thread; {len(text) / 1e6:.1f} MB), "
          f"decode {decode_s * 1e3:.1f} ms (restart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
