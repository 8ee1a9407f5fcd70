#!/usr/bin/env bash
# Creates .venv (once) and installs torch's CPU build, then the project with its test, docs,
# timeline (the demo draws its timeline) and ray extras.
# Sourced by scripts/demo.sh and scripts/test.sh so both README commands work on a fresh clone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
stamp="$venv/.installed-$(sha1sum "$root/pyproject.toml" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q -e "$root[test,docs,timeline,ray]"
    touch "$stamp"
fi
