#!/usr/bin/env bash
# The README's test command: sets up .venv if needed (the project with its test, docs,
# timeline and ray extras) and runs the suite.
#
#   bash scripts/test.sh [PYTEST ARGS]          the quick run: every test but the few marked slow
#   bash scripts/test.sh --full [PYTEST ARGS]   every test (what CI runs: .ci/run)
#
# The suite runs in two lanes side by side: most of an integration test's time is waiting
# (steps that sleep, timeouts that expire, processes that start), so one lane left the
# machine's two cores idle half of the time. Each test file runs in one lane, in order; the
# files that share the machine's namespaced hosts and Slurm cluster (made once per pytest
# session) run in lane B, together with the files whose tests bound a heartbeat timeout or
# a start-up tightly; the Lightning-heavy files, whose workers spend seconds importing, run
# in lane A with the unit tests. Every 30 s each lane says how far it is (tests/conftest.py);
# each lane's output is printed whole once both have ended; the exit status is the first
# failing lane's.
#
# Other arguments go to pytest. With an argument that names tests (a file or directory that
# exists, or a test id with ::), the selection runs in one pytest, as given, slow ones included.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
full=0
args=()
for arg in "$@"; do
    if [ "$arg" = --full ]; then full=1; else args+=("$arg"); fi
done
bash "$root/scripts/setup-venv.sh" test
cd "$root"
pytest=("$root/.venv/bin/python" -m pytest)

for arg in ${args[@]+"${args[@]}"}; do
    if [[ "$arg" != -* && ( -e "${arg%%::*}" ) ]]; then
        exec "${pytest[@]}" "${args[@]}"
    fi
done
select=()
if [ "$full" = 0 ]; then
    select=(-m "not slow")
    echo "scripts/test.sh: the quick run leaves out the tests marked slow; 'bash scripts/test.sh --full' runs them too (as CI does)"
fi

lane_b=(
    tests/integration/test_agents.py
    tests/integration/test_bad_inputs.py tests/integration/test_broken_stdout.py
    tests/integration/test_chaos_loop.py tests/integration/test_driver_restart.py
    tests/integration/test_elastic_launch.py tests/integration/test_fleet.py
    tests/integration/test_hostile.py tests/integration/test_multi_machine.py
    tests/integration/test_namespaces.py tests/integration/test_slurm.py
)
ignore_b=()
for file in "${lane_b[@]}"; do
    [ -f "$file" ] || { echo "scripts/test.sh: lane B names $file, which does not exist" >&2; exit 2; }
    ignore_b+=("--ignore=$file")
done

out="$(mktemp -d)"
: >"$out/progress"
trap 'rm -rf "$out"' EXIT
# Each lane appends a line to one file every 30 s (tests/conftest.py); shown here as they come.
progress=(--progress-every 30 --progress-file "$out/progress")
shown=0
show_progress() {
    local lines
    lines=$(wc -l <"$out/progress")
    if [ "$lines" -gt "$shown" ]; then
        sed -n "$((shown + 1)),${lines}p" "$out/progress"
        shown=$lines
    fi
}
echo "scripts/test.sh: two lanes side by side; a line from each every 30 s, each lane's output at the end"
"${pytest[@]}" "${progress[@]}" --progress-label "lane A " ${select[@]+"${select[@]}"} ${args[@]+"${args[@]}"} tests "${ignore_b[@]}" >"$out/a" 2>&1 &
lane_a=$!
"${pytest[@]}" "${progress[@]}" --progress-label "lane B " ${select[@]+"${select[@]}"} ${args[@]+"${args[@]}"} "${lane_b[@]}" >"$out/b" 2>&1 &
lane_b_pid=$!
while kill -0 "$lane_a" 2>/dev/null || kill -0 "$lane_b_pid" 2>/dev/null; do
    sleep 5
    show_progress
done
show_progress
status_a=0; wait "$lane_a" || status_a=$?
status_b=0; wait "$lane_b_pid" || status_b=$?
echo "==================== lane A: unit tests and the Lightning-heavy files ===================="
cat "$out/a"
echo "==================== lane B: namespaced hosts, Slurm, and tight time bounds ===================="
cat "$out/b"
echo "lanes: A exited $status_a, B exited $status_b"
if [ "$status_a" -ne 0 ]; then exit "$status_a"; fi
exit "$status_b"
