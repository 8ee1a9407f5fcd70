#!/usr/bin/env bash
# The README's demo command: sets up .venv if needed (torch's CPU build and the project with
# its timeline extra only), then runs an elastic job on this machine that loses a worker
# (SIGKILL) and gains a host, ending in the driver's summary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh" demo
exec "$root/.venv/bin/python" "$root/examples/demo.py"
