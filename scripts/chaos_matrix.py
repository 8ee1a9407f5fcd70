"""Render docs/reliability.md's chaos matrix from one run of the suite.

    CI=true LIGHTNING_ELASTIC_CHAOS_REPORT=report.jsonl bash scripts/test.sh -q -ra --durations=0 > pytest.log
    python scripts/chaos_matrix.py report.jsonl pytest.log

``report.jsonl`` holds one line per launch (tests/integration/conftest.py); ``pytest.log``
gives the wall time of the cases that start the driver themselves. Each case below names
its test, the fault, what must happen and what the test checks beyond that.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

EO = "exactly once, identical replicas"
SAME = "same processes"

# (test node id without "tests/integration/", API, fault, expected result, extra checks).
# Signal parameters show as their numbers in node ids: 2 SIGINT, 9 SIGKILL, 15 SIGTERM.
CASES: list[tuple[str, str, str, str, str]] = [
    ("test_elastic_launch.py::test_sigkilled_worker_survivors_restore_commit_and_finish", "loop",
     "a worker SIGKILLed mid-epoch", "success at 2 of 3; host blacklisted; last commit restored", EO),
    ("test_chaos_loop.py::test_second_worker_killed_while_the_first_recovery_re_forms", "loop",
     "a second worker SIGKILLed while the survivors re-form (rendezvous)", "success at 2 of 4", f"{EO}, {SAME}"),
    ("test_chaos_loop.py::test_second_worker_killed_inside_its_reset_callback", "loop",
     "a second worker SIGKILLed inside its reset callback", "success; sizes 4 -> 3 -> 2", f"{EO}, {SAME}"),
    ("test_chaos_loop.py::test_second_worker_killed_during_the_state_broadcast", "loop",
     "a second worker SIGKILLed during the state broadcast (96 MB of state)", "success; sizes 4 -> 3 -> 2",
     f"{EO}, {SAME}; the victim never finished the broadcast"),
    ("test_chaos_loop.py::test_sigterm_is_a_graceful_leave_without_rollback_or_blacklist", "loop",
     "SIGTERM to one worker (preemption)", "success; leaver exits 0; no blacklist; nothing re-executed",
     f"{EO}; round 2 starts at round 1's last step"),
    ("test_chaos_loop.py::test_a_preempted_worker_that_cannot_leave_in_its_grace_falls_back_to_a_failure", "loop",
     "SIGTERM with steps longer than --preemption-grace", "success without it; it counts as lost and is blacklisted", EO),
    ("test_chaos_loop.py::test_a_worker_exiting_3_after_training_returned_fails_the_job", "loop",
     "a worker exits 3 after training returned", "failure naming it", "both reported done"),
    ("test_chaos_loop.py::test_a_done_worker_that_never_exits_is_stopped_within_the_exit_timeout", "loop",
     "a worker never exits after training returned", "failure after --exit-timeout (3 s); it is stopped", "no process left"),
    ("test_chaos_loop.py::test_a_deterministic_collective_error_ends_the_job_within_the_limit", "loop",
     "DistError at the same step on every rank, every round", "failure after 3 rounds naming the error", "at most 4 rounds"),
    ("test_chaos_loop.py::test_one_rank_raising_a_dist_error_alone_makes_everyone_recover", "loop",
     "one rank raises DistError once", "success at the same size; no blacklist", f"{EO}, {SAME}"),
    ("test_chaos_loop.py::test_discovery_misbehaving_mid_run_leaves_training_at_the_same_size[hangs]", "loop",
     "discovery script hangs mid-run", "success at the same size; the script is killed at the end", EO),
    ("test_chaos_loop.py::test_discovery_misbehaving_mid_run_leaves_training_at_the_same_size[fails]", "loop",
     "discovery script fails mid-run", "success at the same size; failure logged", EO),
    ("test_chaos_loop.py::test_discovery_misbehaving_mid_run_leaves_training_at_the_same_size[garbage]", "loop",
     "discovery script prints garbage mid-run", "success at the same size; error logged", EO),
    ("test_elastic_launch.py::test_worker_exception_is_reported_and_job_goes_on", "loop",
     "a user exception on one worker", "success without it; traceback shown; host blacklisted", EO),
    ("test_elastic_launch.py::test_hosts_added_and_removed_repeatedly", "loop",
     "a flapping host (added, removed, added, removed)", "success; sizes 2 -> 3 -> 2 -> 3 -> 2", EO),
    ("test_elastic_launch.py::test_blacklisted_host_returns_after_cooldown", "loop",
     "a host that fails and comes back after its cooldown", "success; the host rejoins", EO),
    ("test_elastic_launch.py::test_stopped_worker_is_killed_after_missed_heartbeats", "loop",
     "SIGSTOP to a worker", "success at 2 of 3 after --heartbeat-timeout", EO),
    ("test_elastic_launch.py::test_all_workers_failing_fails_the_job", "loop",
     "every rank raises", "failure naming the first error", ""),
    ("test_elastic_launch.py::test_every_host_blacklisted_fails_the_job", "loop",
     "every host blacklisted", "failure naming the hosts", ""),
    ("test_elastic_launch.py::test_reset_limit_exceeded_fails_the_job", "loop",
     "--reset-limit 0 and a lost worker", "failure: reset limit exceeded", ""),
    ("test_elastic_launch.py::test_below_min_np_past_elastic_timeout_fails_the_job", "loop",
     "below --min-np past --elastic-timeout", "failure naming the slots", ""),
    ("test_elastic_launch.py::test_driver_signal_stops_every_worker[15]", "loop",
     "SIGTERM to the driver", "failure: interrupted; every worker stopped", "no process left"),
    ("test_elastic_launch.py::test_driver_signal_stops_every_worker[2]", "loop",
     "SIGINT to the driver", "failure: interrupted; every worker stopped", "no process left"),
    ("test_elastic_launch.py::test_driver_sigkill_takes_workers_down", "loop",
     "SIGKILL to the driver (no `--state-dir`)", "every worker dies with it", "no process left"),
    ("test_broken_stdout.py::test_job_succeeds_after_the_stdout_reader_goes_away", "loop",
     "`\\| head -n 5` on the driver's output", "success; workers drained; logs complete", "no process left"),
    ("test_broken_stdout.py::test_job_status_survives_stdout_and_stderr_going_away", "loop",
     "`2>&1 \\| head -n 5`", "exit status is the job's", "no process left"),
    ("test_lightning.py::test_sigkill_of_rank0_fit_completes_in_surviving_processes", "Lightning",
     "rank 0 SIGKILLed mid-epoch", "success at 2 of 3; one logger run", f"{EO}, {SAME}, LR schedule"),
    ("test_lightning.py::test_host_added_then_removed_mid_epoch", "Lightning",
     "a host added, then removed, mid-epoch", "success; no rollback", EO),
    ("test_chaos_lightning.py::test_sigterm_to_one_of_three_leaves_without_rollback_restart_or_blacklist", "Lightning",
     "SIGTERM to one of three (preemption)", "success; leaver exits 0; no blacklist; nothing re-executed",
     f"{EO}, {SAME}, LR rescaled 3 -> 2"),
    ("test_chaos_lightning.py::test_preemption_wave_two_of_three_leave_at_once", "Lightning",
     "SIGTERM to two of three at once", "success; 2 preempted; no blacklist", f"{EO}, {SAME}"),
    ("test_chaos_lightning.py::test_second_worker_killed_inside_on_elastic_reset", "Lightning",
     "a second worker SIGKILLed inside on_elastic_reset", "success; sizes 4 -> 3 -> 2", f"{EO}, {SAME}"),
    ("test_chaos_lightning.py::test_a_worker_exiting_3_after_fit_returned_fails_the_job", "Lightning",
     "a worker exits 3 after fit returned", "failure naming it", ""),
    ("test_chaos_lightning.py::test_one_rank_raising_dist_error_alone_makes_everyone_recover", "Lightning",
     "one rank raises DistError once", "success at the same size; no blacklist", f"{EO}, {SAME}"),
    ("test_lightning.py::test_user_exception_on_every_rank_fails_promptly", "Lightning",
     "every rank raises in training_step", "failure naming the error", ""),
    ("test_lightning.py::test_user_exception_on_one_rank_that_worker_fails_others_go_on", "Lightning",
     "one rank raises in training_step", "success without it", EO),
    ("test_multi_machine.py::test_remote_worker_sigkilled_survivors_go_on_in_the_same_processes", "machines",
     "a remote worker SIGKILLed", "success; same processes", EO),
    ("test_multi_machine.py::test_remote_worker_sigterm_is_a_graceful_leave", "machines",
     "SIGTERM to a remote worker (preemption)", "success; leaver exits 0; no blacklist; nothing re-executed", EO),
    ("test_multi_machine.py::test_partitioned_host_is_lost_and_its_worker_exits_on_its_own", "machines",
     "a host's link goes down (partition)", "success without it; its worker exits on its own", ""),
    ("test_multi_machine.py::test_host_whose_every_process_dies_is_lost", "machines",
     "every process of a host dies (machine loss)", "success without it", ""),
    ("test_multi_machine.py::test_ssh_connection_dropped_takes_the_remote_worker_down", "machines",
     "the ssh connection is killed", "the remote worker dies with it; success without it", ""),
    ("test_multi_machine.py::test_unreachable_host_is_blacklisted_with_the_ssh_error", "machines",
     "a host without sshd", "blacklisted with ssh's error", ""),
    ("test_multi_machine.py::test_driver_killed_or_stopped_leaves_no_worker_on_any_host[9]", "machines",
     "SIGKILL to the driver", "no worker left on any host", "no process left"),
    ("test_multi_machine.py::test_driver_killed_or_stopped_leaves_no_worker_on_any_host[15]", "machines",
     "SIGTERM to the driver", "failure: interrupted; no worker left on any host", "no process left"),
    ("test_driver_restart.py::test_restarted_driver_adopts_the_running_workers", "loop",
     "`--state-dir`: SIGKILL to the driver, the same command again 3 s later; a second driver meanwhile",
     "success in the same round (world sizes 2); the second driver refused (2)",
     f"{SAME}, no step run twice, steps during the outage, {EO}, outage in summary and events"),
    ("test_driver_restart.py::test_worker_lost_during_the_outage_is_recovered_from_once_the_driver_is_back",
     "loop", "`--state-dir`: SIGKILL to the driver, then to a worker, the driver started again",
     "success at 2 -> 1: one recovery, from a commit", EO),
    ("test_driver_restart.py::test_workers_exit_when_no_driver_comes_back_within_the_patience", "loop",
     "`--state-dir --driver-patience 6`: SIGKILL to the driver, never restarted",
     "every worker exits after the patience", "no process left"),
    ("test_driver_restart.py::test_restarted_driver_reattaches_to_workers_on_other_machines", "machines",
     "`--state-dir`: SIGTERM to the driver (a hand-over: it closes its ssh connections and exits 0 within 5 s), "
     "the same command again",
     "success in the same round on both hosts",
     f"{SAME}, no step run twice, exactly once, output of the outage forwarded"),
    ("test_driver_restart.py::test_lightning_fit_survives_a_driver_restart", "Lightning",
     "`--state-dir`: SIGKILL to the driver mid-fit, the same command again", "success in the same round",
     f"{SAME}, exactly once, final state (global step, optimizer and scheduler steps)"),
    ("test_slurm.py::test_a_worker_sigkilled_in_its_step_leaves_the_others_training", "Slurm",
     "a worker SIGKILLed inside its srun step", "success at 2 of 3; node blacklisted",
     f"{EO}, {SAME}; each worker on its own node's host name"),
    ("test_slurm.py::test_a_crashed_node_is_lost_within_the_heartbeat_timeout", "Slurm",
     "every process of a node dies (slurmd, step, worker)", "success at 2 of 3 within --heartbeat-timeout + 3 s",
     f"{EO}, {SAME}"),
    ("test_slurm.py::test_scancel_signal_term_on_a_step_is_a_graceful_leave", "Slurm",
     "`scancel --signal=TERM JOB.STEP` (a preemption notice)",
     "success; graceful leave, no blacklist, nothing re-executed", EO),
    ("test_slurm.py::test_lightning_under_slurm_keeps_the_elastic_ranks_through_a_killed_worker", "Slurm, Lightning",
     "a worker SIGKILLed; every step says SLURM_PROCID=0, SLURM_NTASKS=1",
     "success at 2 of 3; ranks 0-2 of 3 from the elastic job", f"{EO}, {SAME}, LR schedule"),
    ("test_slurm.py::test_a_second_allocations_node_joins_the_running_job", "Slurm",
     "a second allocation (`--slurm-jobs`, by its job name) starts mid-training", "success; sizes 2 -> 3, nothing rolled back", EO),
    ("test_slurm.py::test_slurm_outside_an_allocation_is_one_line", "Slurm",
     "`--slurm` outside an allocation", "one line, nothing started", "—"),
    ("test_driver_restart.py::test_sigterm_hands_the_job_over_to_the_next_driver", "loop",
     "`--state-dir`: SIGTERM to the driver mid-epoch (a Kubernetes pod restart), the next driver started with "
     "another `--port`", "the driver alone exits, `job handed over: ...` in under 5 s; then success in the same round",
     "workers alive through the hand-over, state saved, `driver_handed_over` event, line documented; same processes, "
     "each worker follows the URL in `DIR/driver-url`"),
    ("test_driver_restart.py::test_a_driver_restarted_on_another_machine_is_found_through_the_shared_state_dir",
     "machines", "`--state-dir`: SIGKILL to the driver, the same command again in another namespaced host (another "
     "address, the filesystem shared)", "success in the same round on both hosts",
     "the new driver serves on its own address, re-attaches over ssh; same processes; each worker follows the URL in "
     "`DIR/driver-url`"),
    ("test_chaos_loop.py::test_workers_slow_to_exit_after_they_reported_are_not_taken_for_wedged", "loop",
     "every worker takes 4 s to exit after it reported, with no heartbeat, past a `--heartbeat-timeout` of 2 s",
     "success; nobody killed", "both reported done, no \"no heartbeat\" verdict"),
    ("test_chaos_loop.py::test_a_driver_stopped_longer_than_the_heartbeat_timeout_kills_nobody_when_it_continues", "loop",
     "the driver SIGSTOPped for 4.5 s mid-training (Ctrl-Z and `fg`), `--heartbeat-timeout 3`, then SIGCONT",
     "success at the same size; nobody killed", f"the driver's warning says how long it was away; {EO}"),
    ("test_chaos_loop.py::test_what_a_worker_started_ends_with_it_whether_it_exits_or_is_killed", "loop",
     "each worker starts a child (an hour's sleep); one worker alone is SIGKILLed (as by the OOM killer), the other "
     "finishes", "success at 1 of 2",
     "the killed worker's child ends with it, the finished worker's child at its exit; nothing left after the driver"),
    ("test_elastic_launch.py::test_a_rolling_move_across_hosts_keeps_the_state", "loop",
     "a rolling move: discovery lists H1 -> H1,H2 -> H2,H3 -> H3, H2 removed before H3's worker joined",
     "success at 1 on H3; H2 stays until the round with H3 formed", "exactly once; no failure, no blacklist"),
    ("test_multi_machine.py::test_a_rolling_move_across_remote_hosts_keeps_the_state", "machines",
     "a rolling move over ssh: discovery lists H1 -> H1,H2 -> H2,H3 -> H3, H2 removed before H3's worker joined",
     "success at 1 on H3; H2 stays until the round with H3 formed", "exactly once; no failure, no blacklist"),
    ("test_snapshots.py::test_a_newer_snapshot_is_never_replaced_by_an_older_write_that_ends_after_it", "loop",
     "`--snapshot-dir`: rank 0's snapshot write held, its host removed; the next round's rank 0 writes a newer "
     "snapshot under the same number, then the held write ends", "success at 2 -> 1",
     "both snapshots kept under their own names, the newer unchanged and the one a resume takes; no failed write"),
    ("test_driver_restart.py::test_workers_that_gave_up_on_the_driver_are_not_failures", "loop",
     "`--state-dir --driver-patience 4 --snapshot-dir`: SIGKILL to the driver, every worker gives up waiting "
     "(exit 75), the same command again",
     "success: a fresh round on the same slots from the newest snapshot; no failure, no blacklist",
     "state kept until the end; exactly once after the snapshot"),
    ("test_driver_restart.py::test_a_full_state_dir_fails_one_start_and_the_keepers_report_real_exits",
     "loop", "`--state-dir` on a tmpfs with no inode left: a host added (its worker's log cannot be created), "
     "then a worker with a child SIGKILLed (its keeper cannot write the status)",
     "success on the first host: the new host's start and the killed worker fail alone",
     "the killed worker reported killed by SIGKILL, its child ended"),
    ("test_driver_restart.py::test_a_driver_failing_while_it_takes_over_leaves_the_job_for_the_next",
     "loop", "`--state-dir`: SIGKILL to the driver, a worker's log removed, the same command again (fails "
     "adopting it), the log back, the same command again",
     "the failed driver exits 1 touching nothing; the next one adopts: success in the same round",
     "state.json and secret kept, same processes"),
    ("test_slurm.py::test_a_crashed_node_with_the_default_timeouts_is_a_lost_peer_not_the_survivors_error", "Slurm",
     "every process of a node dies right after the first epoch, default timeouts (`--heartbeat-timeout` 10 s longer "
     "than `--error-wait` 5 s), a loop that also checks its replicas with a collective",
     "success at 2 of 3 within --heartbeat-timeout + 3 s: the survivors' errors wait for the dead node's verdict",
     f"{EO}, {SAME}; the loss is the heartbeat verdict (its srun lingers)"),
]

# Cases numbered apart from CASES while other branches append to it (issue 34's, from 70);
# moved to the end of CASES, and renumbered, when the branches are merged.


def all_cases() -> list[tuple[int, tuple[str, str, str, str, str]]]:
    """Every case with its number (its place in CASES, from 1)."""
    return list(enumerate(CASES, start=1))


def main(report_path: str, pytest_log: str | None = None) -> None:
    launches = {}
    for line in Path(report_path).read_text().splitlines():
        entry = json.loads(line)
        launches[entry["test"].removeprefix("tests/integration/")] = entry
    walls = {}
    if pytest_log:
        for m in re.finditer(r"([0-9.]+)s call\s+tests/integration/(\S+)", Path(pytest_log).read_text()):
            walls[m.group(2)] = float(m.group(1))
    print("| # | API | fault | expected (exit status) | also checked | driver | test | test function |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for number, (test, api, fault, expected, checks) in all_cases():
        entry = launches.get(test, {})
        driver = f"{entry['driver_seconds']:.1f} s" if entry.get("driver_seconds") is not None else "—"
        wall = walls.get(test, entry.get("test_seconds"))
        wall_text = f"{wall:.0f} s" if wall is not None else "not run"
        exit_text = f" ({entry['exit']})" if entry.get("exit") is not None else ""
        module, name = test.split("::")
        print(f"| {number} | {api} | {fault} | {expected}{exit_text} | {checks or '—'} | {driver} | {wall_text} "
              f"| `{module}::{name}` |")

if __name__ == "__main__":
    main(*sys.argv[1:3])
