#!/usr/bin/env bash
# Creates .venv (once) and installs torch's CPU build (scripts/install-torch-cpu.sh), then
# the project with the extras of one purpose:
#   bash scripts/setup-venv.sh        the tests' (test, docs, timeline, ray, cli): scripts/test.sh
#   bash scripts/setup-venv.sh demo   the demo's (timeline, to draw its timeline; cli, for the README's
#                                     LightningCLI command): scripts/demo.sh
# Each purpose has its own stamp, so the demo never pulls the tests' extras (Ray, MkDocs);
# the tests' set includes the demo's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"

purpose="${1:-test}"
case "$purpose" in
    test) extras="test,docs,timeline,ray,cli" ;;
    demo) extras="timeline,cli" ;;
    *) echo "usage: $0 [test|demo]" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
key="$(cat "$root/pyproject.toml" "$root/scripts/setup-venv.sh" "$root/scripts/install-torch-cpu.sh" | sha1sum | cut -c1-12)"
stamp() { echo "$venv/.installed-$1-$key"; }
if [ -f "$(stamp "$purpose")" ] || { [ "$purpose" = demo ] && [ -f "$(stamp test)" ]; }; then
    exit 0
fi
bash "$root/scripts/install-torch-cpu.sh" "$venv"
"$venv/bin/pip" install -q -e "$root[$extras]"
touch "$(stamp "$purpose")"
