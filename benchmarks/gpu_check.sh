#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): one command, one JSON + one Markdown report.
#
#   bash benchmarks/gpu_check.sh [--out DIR]              # GPU machine: under 8 minutes on an H200
#   bash benchmarks/gpu_check.sh --smoke --out DIR        # CPU, tiny sizes, under 2 minutes (the CI test)
#
# Python: $PYTHON if set, else the repo's .venv when it has torch, else the first python3/python on PATH
# that has torch (a training container's or the device image's), else python3 (the report then says that
# torch is missing). mmtok: if that Python cannot import it, `pip install --no-deps --no-build-isolation -e .`
# (nothing is downloaded: the Python's own torch, numpy, ... are used); PYTHONPATH points at this checkout
# either way, so the check always runs this tree's code. Wheels in ./.whl (carried to a machine without a
# package index) are installed first with --no-index into a scratch target. What was used is printed and
# recorded in the report. The Python runs under `timeout` ($GPU_CHECK_TIMEOUT seconds, default: what is left of
# 465 s, --smoke 110 s); gpu_check.py rewrites its report after every step, so a kill leaves the finished steps.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"

torch_version() { "$1" -c "import torch; print(torch.__version__)" 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"; how="\$PYTHON"; torch="$(torch_version "$PY")"
elif [ -x .venv/bin/python ] && torch="$(torch_version .venv/bin/python)"; then
  PY="$REPO/.venv/bin/python"; how="the repo's .venv"
else
  PY="$(command -v python3 || command -v python)"; how="python3 on PATH"; torch=""
  for candidate in python3 python; do
    path="$(command -v "$candidate")" || continue
    if torch="$(torch_version "$path")"; then PY="$path"; how="$candidate on PATH"; break; fi
  done
fi
if [ -n "$torch" ]; then notes="python $PY ($how, torch $torch)"; else notes="python $PY ($how, WITHOUT torch)"; fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  site="${TMPDIR:-/tmp}/gpu-check-site"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    notes="$notes; wheels from .whl in $site"
  else
    notes="$notes; installing the wheels in .whl FAILED"
  fi
fi

log=/tmp/gpu-check-pip.log
installed="$(cd / && "$PY" -c 'import mmtok, os; print(os.path.dirname(os.path.dirname(mmtok.__file__)))' 2>/dev/null)"
if [ -z "$installed" ]; then
  if timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" >"$log" 2>&1; then
    notes="$notes; mmtok installed now (pip install --no-deps --no-build-isolation -e .)"
  else
    why="$(grep -m1 -E '^ *error:' "$log" | sed 's/^ *//')"
    notes="$notes; pip install -e . failed (${why:-see $log}), so mmtok runs from PYTHONPATH only"
  fi
elif [ "$installed" != "$REPO" ]; then
  notes="$notes; the mmtok installed from $installed is shadowed by this checkout"
else
  notes="$notes; mmtok installed from this checkout"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_SETUP="$notes"
echo "gpu_check.sh: $notes"

# The promise, setup included: 8 minutes on the GPU machine (gpu_check.py's own budget, 405 s of steps, fits
# inside; this is the backstop). --smoke takes ~50 s on an idle 2-core VM; its caps leave room for a loaded one.
limit=465
for arg in "$@"; do [ "$arg" = "--smoke" ] && limit=330; done
timeout -k 5 "${GPU_CHECK_TIMEOUT:-$((limit - SECONDS))}" "$PY" "$REPO/benchmarks/gpu_check.py" "$@"
status=$?
if [ "$status" -eq 124 ]; then
  echo "gpu_check.sh: stopped by the global timeout; the report holds the steps that finished" >&2
fi
exit "$status"
