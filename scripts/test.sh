#!/usr/bin/env bash
# The README's test command: sets up .venv if needed (the project with its test, docs,
# timeline and ray extras) and runs the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh" test
cd "$root"
# Two lanes side by side (tests/conftest.py says which file runs in which); `-n 0` after
# this, or any arguments that select tests, still work as pytest reads them.
exec "$root/.venv/bin/python" -m pytest -n 2 --dist loadgroup "$@"
