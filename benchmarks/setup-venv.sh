#!/usr/bin/env bash
# Creates the benchmarks' own venv, benchmarks/.venv (once): torch 2.13.0's CPU build, the
# project (editable), matplotlib, and torchft (optional: a peer to compare against).
# Idempotent: a second run only checks a stamp. When torchft cannot be installed or imported
# with this torch, it says so in one line and still succeeds; the suite then skips torchft.
#
#     bash benchmarks/setup-venv.sh
#     benchmarks/.venv/bin/python benchmarks/peers/torchft_recovery.py --repeats 5
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
venv="$here/.venv"
torchft_spec="torchft==0.2.0"   # the newest release on PyPI (2026-11); needs torch>=2.7
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
key="$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" "$root/scripts/install-torch-cpu.sh" | sha1sum | cut -c1-12)"
stamp="$venv/.installed-$key"
if [ ! -f "$stamp" ]; then
    rm -f "$venv"/.installed-*
    bash "$root/scripts/install-torch-cpu.sh" "$venv"   # torch==2.13.0+cpu, as for scripts/setup-venv.sh
    "${pip[@]}" -e "$root" matplotlib
    # torchft: a Rust extension plus opentelemetry; it must not replace torch 2.13.0.
    if "${pip[@]}" "$torchft_spec" "torch==2.13.0" >"$venv/torchft-install.log" 2>&1 \
        && "$venv/bin/python" -c "import torchft, torchft.coordination" >>"$venv/torchft-install.log" 2>&1; then
        echo "available: $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torchft"))')" >"$stamp"
    else
        echo "unavailable: see $venv/torchft-install.log" >"$stamp"
    fi
fi
status="$(cat "$stamp")"
case "$status" in
    available:*) echo "benchmarks venv ready: $venv (torchft ${status#available: })" ;;
    *) echo "benchmarks venv ready: $venv; torchft could not be installed or imported with torch 2.13.0 (${status#unavailable: }): the suite will skip it" ;;
esac
