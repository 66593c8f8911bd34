#!/usr/bin/env bash
# The GPU check (issue 20): every PyTorch path of polytrain on CUDA (local, ddp, fsdp, deepspeed ZeRO 1-3,
# horovod through the shim), bf16 and fp16 with an injected inf, memory against the ZeRO/FSDP formulas,
# and step time against a hand-written loop, Lightning and Accelerate; one table. See docs/gpu-check.md.
#
#   bash scripts/gpu_check.sh --markdown docs/gpu-results.md     # the whole check (minutes; see the doc)
#   bash scripts/gpu_check.sh --sections speed --peak-tflops 989  # one section
#   bash scripts/gpu_check.sh --device cpu --quick                # the same code paths on the CPU (dry run)
#   bash scripts/gpu_check.sh --help                              # every option
#
# Without a CUDA device, or with torch or a package missing, it prints one line saying why and exits 2
# (before installing anything). Otherwise: 0 when no row failed, 1 when one did.
# On the GPU machine (no network) it first makes polytrain importable from this working tree, installed
# into $POLYTRAIN_GPU_SITE (default /tmp/polytrain-gpu-site), and installs what scripts/gpu_prepare.sh
# carried in .gpu-wheels/ (DeepSpeed and its needs) there too. POLYTRAIN_PYTHON picks the interpreter
# (default: .venv/bin/python if there is one, else python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${POLYTRAIN_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
SITE="${POLYTRAIN_GPU_SITE:-/tmp/polytrain-gpu-site}"
WHEELS="${POLYTRAIN_GPU_WHEELS:-$REPO/.gpu-wheels}"

fail() {
  echo "gpu_check: $*" >&2
  exit 2
}

command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter '$PY' here (set POLYTRAIN_PYTHON)"

for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    exec "$PY" -m bench.gpu --help
  fi
done

# 1. Can the check run here at all? (imports torch only)
status=0
"$PY" -m bench.gpu.preflight "$@" || status=$?
[[ $status -eq 0 ]] || exit "$status"

# 2. polytrain from this working tree: already (an editable install), or installed now, offline
use_site() {
  case ":${PYTHONPATH:-}:" in
    *":$SITE:"*) ;;
    *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
}
from_tree() {
  "$PY" -c 'import os, sys, polytrain.adapters.torch as m
sys.exit(0 if os.path.realpath(m.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)' \
    "$REPO" >/dev/null 2>&1
}
if from_tree; then
  rm -rf "$SITE/polytrain" "$SITE"/polytrain-*.dist-info  # an older copy there must not shadow this tree
else
  # the tree's polytrain/ lacks adapters/ and launchers/ (an install maps them in): it must not shadow the
  # installed copy, so the current directory leaves sys.path (Python >= 3.11) and bench/ comes after it
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail "$PY is older than 3.11: install polytrain in it first (pip install -e .)"
  export PYTHONSAFEPATH=1
  use_site
  export PYTHONPATH="$PYTHONPATH:$REPO"
  log="$(mktemp)"
  if ! "$PY" -m pip install --no-deps --no-build-isolation --no-index --no-cache-dir --no-compile --upgrade \
      --target "$SITE" "$REPO" >"$log" 2>&1; then
    fail "could not install polytrain from $REPO into $SITE: $(grep -v '^\s*$' "$log" | tail -n 1)"
  fi
  rm -f "$log"
  "$PY" -c 'import polytrain.adapters.torch' >/dev/null 2>&1 ||
    fail "polytrain does not import after installing it into $SITE"
fi
if [[ -d "$SITE" ]]; then
  use_site  # what an earlier run installed there (DeepSpeed)
fi

# 3. DeepSpeed, when it was carried and does not import yet (its rows are skipped otherwise); not for
#    the CPU dry run. Built here, so that it records this machine's accelerator (cuda).
device=cuda
previous=""
for arg in "$@"; do
  [[ "$previous" == "--device" ]] && device="$arg"
  [[ "$arg" == --device=* ]] && device="${arg#--device=}"
  previous="$arg"
done
if [[ "$device" == "cuda" && -d "$WHEELS" ]] && compgen -G "$WHEELS/deepspeed-*.tar.gz" >/dev/null && \
   "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' && \
   ! "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
  use_site
  mkdir -p "$SITE"
  log="$SITE/deepspeed-install.log"
  echo "gpu_check: installing the carried DeepSpeed into $SITE (DS_BUILD_OPS=0: ops are JIT-built)" >&2
  # DeepSpeed's setup.py imports op_builder/ beside it: not with PYTHONSAFEPATH, which keeps its folder off sys.path
  if "$PY" -m pip install --no-index --no-deps --no-cache-dir --no-compile --upgrade --target "$SITE" \
        "$WHEELS"/*.whl >"$log" 2>&1 && \
     env -u PYTHONSAFEPATH DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip install --no-index --no-deps \
        --no-build-isolation --no-cache-dir --no-compile --upgrade --target "$SITE" "$WHEELS"/deepspeed-*.tar.gz \
        >>"$log" 2>&1; then
    :
  else
    why="$(grep -E 'Error|error:' "$log" | grep -v 'subprocess-exited-with-error' | tail -n 1 | sed 's/^ *//' || true)"
    echo "gpu_check: DeepSpeed did not install (${why:-see $log}; the whole log: $log); its rows will be skipped" >&2
  fi
fi

# 4. The check itself
exec "$PY" -m bench.gpu "$@"
