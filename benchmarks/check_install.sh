#!/usr/bin/env bash
# Install check (docs/install.md): mmtok installed next to a torch that is already there, as in a
# training container. For each torch version, in a fresh venv:
#   1. pip install torch==VERSION (pip's own lookup: on the reference machine, a file on local disk)
#   2. core install, no extras: pip keeps that torch; `mmtok --help`; `mmtok bench reconstruct` without the
#      bench extra fails with one line and exit 2; `mmtok demo` runs (merge verifies with mmtok's reader)
#   3. pip install -c constraints.txt (less the torch stack) -e '.[test]': pip keeps that torch again and
#      takes the tested set for the rest; pip check; the codec golden-vector tests (or $TESTS)
# With FLOOR=1, step 3 pins every dependency declared with a floor (`>=X`) in pyproject.toml to exactly
# X instead of constraints.txt (the declared lower bounds, tested), the rest resolving freely.
# Also checks that the declared torch range admits NGC's versions (2.9.0a0+<commit>, ...).
#
#   bash benchmarks/check_install.sh [TORCH_VERSION ...]         default: 2.14.1 2.13.0
#   FLOOR=1 TESTS="tests/test_codecs_emu35.py tests/test_scan.py" bash benchmarks/check_install.sh 2.13.0
#
# Minutes per version (downloads aside): not part of the test suite. The codec tests read the golden
# sets in tests/golden (docs/development.md#tests). Venvs go to $WORK (default /tmp/mmtok-check-install), kept for a
# look afterwards; a summary line per version is printed and appended to $WORK/results.txt.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${WORK:-/tmp/mmtok-check-install}"
TESTS="${TESTS:-tests/test_codecs_emu35.py tests/test_codecs_wavtokenizer.py}"
FLOOR="${FLOOR:-0}"
PYTHON="${PYTHON:-python3}"
VERSIONS=("$@")
[ "${#VERSIONS[@]}" -gt 0 ] || VERSIONS=(2.14.1 2.13.0)
mkdir -p "$WORK"
trap 'echo "check_install: FAIL at line $LINENO; logs in $WORK" >&2' ERR
# The torch stack: what a container brings with its torch and constraints.txt must not replace.
TORCH_STACK='^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)=='

"$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
from packaging.requirements import Requirement
torch = next(Requirement(r) for r in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
             if Requirement(r).name == "torch")
# pip accepts an installed pre-release when the range contains its version (checked with pip 23.2 and 26.3).
ngc = ["2.9.0a0+50eac811a6", "2.10.0a0+b558c986e8", "2.14.0a0+0123456789"]
refused = [v for v in ngc if not torch.specifier.contains(v, prereleases=True)]
print(f"check_install: torch range {torch.specifier}: NGC-style versions {'refused: ' + ', '.join(refused) if refused else 'all admitted'}")
sys.exit(1 if refused else 0)
EOF

floors() {  # name==X for every `name>=X` in pyproject.toml's dependencies and extras (for a name declared
            # twice, the higher X), torch excepted
  "$PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
from packaging.requirements import Requirement
from packaging.version import Version
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
texts = project["dependencies"] + [t for ts in project["optional-dependencies"].values() for t in ts]
floors = {}
for requirement in map(Requirement, texts):
    for spec in requirement.specifier:
        if spec.operator == ">=" and requirement.name != "torch":
            version = Version(spec.version)
            floors[requirement.name] = max(floors.get(requirement.name, version), version)
print("\n".join(f"{name}=={version}" for name, version in floors.items()))
EOF
}

for version in "${VERSIONS[@]}"; do
  venv="$WORK/torch-$version"
  pinned="constraints.txt"
  if [ "$FLOOR" = 1 ]; then venv="$venv-floor"; pinned="declared floors"; fi
  log="$venv.log"
  echo "check_install: torch $version -> $venv (log: $log)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  pip=("$venv/bin/pip" install -q)
  {
    "$venv/bin/pip" install -q --upgrade pip
    start=$(date +%s)
    "${pip[@]}" "torch==$version"
    echo "torch install: $(( $(date +%s) - start )) s"
  } >"$log" 2>&1
  installed() { "$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null; }
  have="$(installed)"

  # 2. the core install, no extras
  "${pip[@]}" -e "$REPO" >>"$log" 2>&1
  [ "$(installed)" = "$have" ] || { echo "FAIL: the core install replaced torch $have with $(installed)"; exit 1; }
  "$venv/bin/mmtok" --help >/dev/null
  status=0
  message="$("$venv/bin/mmtok" bench reconstruct --manifest x --category-column c --tokenizer emu3.5=x --out \
             "$WORK/bench-out" 2>&1)" || status=$?
  echo "$message" >>"$log"
  if [ "$status" -ne 2 ] || [ "$(echo "$message" | wc -l)" -ne 1 ] || ! grep -q "pip install 'mmtok\[bench\]'" <<<"$message"; then
    echo "FAIL: bench without its extra: exit $status, said: $message"; exit 1
  fi
  rm -rf "$WORK/demo"
  (cd "$WORK" && "$venv/bin/mmtok" demo --out "$WORK/demo") >>"$log" 2>&1 || { echo "FAIL: demo (core install), see $log"; exit 1; }
  grep -q "megatron-core is not installed" "$log" || { echo "FAIL: demo: merge did not say how it verified"; exit 1; }

  # 3. the test extra, with the tested set (or the declared floors) for everything but the torch stack
  pins="$venv/pins.txt"
  if [ "$FLOOR" = 1 ]; then floors >"$pins"; else grep -vE "$TORCH_STACK" "$REPO/constraints.txt" >"$pins"; fi
  "${pip[@]}" -c "$pins" -e "$REPO[test]" >>"$log" 2>&1
  [ "$(installed)" = "$have" ] || { echo "FAIL: the test install replaced torch $have with $(installed)"; exit 1; }
  "$venv/bin/pip" check >>"$log" 2>&1 || { echo "FAIL: pip check, see $log"; exit 1; }
  if [ "$FLOOR" = 1 ]; then
    "$venv/bin/pip" freeze >"$venv/freeze.txt"
    "$PYTHON" - "$pins" "$venv/freeze.txt" <<'EOF' || { echo "FAIL: a floor was not installed"; exit 1; }
import sys
from packaging.utils import canonicalize_name as canon
from packaging.version import Version
def read(path):
    pairs = (l.split("==") for l in open(path) if "==" in l and not l.startswith(("#", "-")))
    return {canon(name): Version(version.strip()) for name, version in pairs}
pins, got = read(sys.argv[1]), read(sys.argv[2])
wrong = [f"{n}: {got.get(n)} (floor {v})" for n, v in pins.items() if got.get(n) != v]
print("\n".join(wrong) or "every floor installed")
sys.exit(1 if wrong else 0)
EOF
  fi
  if "$venv/bin/python" -c "import torchaudio" 2>/dev/null; then echo "note: torchaudio is installed in $venv"; fi
  status=0
  (cd "$REPO" && "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS) >"$venv.pytest.log" 2>&1 || status=$?
  tail -3 "$venv.pytest.log"
  numpy="$("$venv/bin/python" -c "import numpy; print(numpy.__version__)")"
  line="$(date -u +%F) torch $have, numpy $numpy, $pinned \
python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'): pytest exit $status \
($(tail -1 "$venv.pytest.log" | tr -d '=' | sed 's/^ *//'); $TESTS)"
  echo "$line" | tee -a "$WORK/results.txt"
  [ "$status" -eq 0 ] || exit "$status"
done
