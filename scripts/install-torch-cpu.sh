#!/usr/bin/env bash
# Installs torch's CPU build into a venv, unless it is there already:
#     bash scripts/install-torch-cpu.sh VENV
# Used by scripts/setup-venv.sh and benchmarks/setup-venv.sh.
#
# The CPU build is asked for by its version, torch==2.13.0+cpu: PyPI's torch==2.13.0 is
# the CUDA build (several GB), which that pin never matches. The wheel comes from PyTorch's
# CPU index (TORCH_CPU_INDEX_URL, for a mirror) when the index answers within a few
# seconds, else from the indexes and wheel folders pip is configured with (PIP_FIND_LINKS,
# a local mirror), and the install fails, saying so, when none has it.
set -euo pipefail
venv="${1:?usage: install-torch-cpu.sh VENV}"
version="2.13.0+cpu"
index="${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"

if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$version')" 2>/dev/null; then
    exit 0
fi
# A bounded look at the index (any HTTP answer will do; `timeout` bounds a name lookup that
# hangs): pip itself would retry an unreachable index for minutes (PIP_DEFAULT_TIMEOUT, 5 retries).
index_args=()
if timeout 10 "$venv/bin/python" - "$index/torch/" <<'PY'; then
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=5).close()
except urllib.error.HTTPError:
    pass
except Exception:
    sys.exit(1)
PY
    index_args=(--extra-index-url "$index")
else
    echo "install-torch-cpu: $index does not answer; looking for torch==$version in pip's own indexes and wheel folders" >&2
fi
if ! "$venv/bin/pip" install -q ${index_args[@]+"${index_args[@]}"} "torch==$version"; then
    echo "install-torch-cpu: torch==$version (the CPU build) was not found: let this machine reach $index," \
         "or give pip the wheel (PIP_FIND_LINKS, or TORCH_CPU_INDEX_URL for a mirror of that index)" >&2
    exit 1
fi
