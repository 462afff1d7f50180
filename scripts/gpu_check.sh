#!/usr/bin/env bash
# The GPU check: run first, in one command, whenever a GPU machine is lent (issue "GPU truth").
#
#   scripts/gpu_check.sh                      # on the GPU machine: every phase, results in $OUT
#   scripts/gpu_check.sh --phases pytest,optimizer   # rerun some phases
#   scripts/gpu_check.sh --dry-run --out DIR  # every phase at a tiny size on the CPU, in one
#                                             # process (in make test)
#
# On the GPU machine it installs the wheels of `make gpu-wheels` (carried in .whl/) and
# tensortier itself with --no-index --no-deps into a temporary site dir, then runs each phase of
# scripts/gpu_check.py under its own time cap (seconds: CAP_<PHASE>=... overrides), writing a log
# and one JSON per phase named after the device (pytest-h100.json, ...). The caps add up to 480 s,
# 8 minutes, so a failed phase can be rerun within the same lease.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
phases="transfer,pytest,activations,llama,optimizer,checkpoint"
out="${OUT:-}"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --phases) phases="$2"; shift ;;
    --phases=*) phases="${1#*=}" ;;
    --out) out="$2"; shift ;;
    --out=*) out="${1#*=}" ;;
    --) shift; extra=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument '$1' (--dry-run, --phases a,b, --out DIR, -- ARGS)" >&2
       exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || out=$(mktemp -d /tmp/tt-gpu-check.XXXXXX)
mkdir -p "$out"
PY="${PYTHON:-python3}"

declare -A cap=([transfer]=20 [pytest]=150 [activations]=130 [llama]=50 [optimizer]=85 [checkpoint]=45)
# Installs .whl/ and tensortier with --no-index --no-deps into temporary site dirs (removed on
# exit), as the GPU machine (no registry) needs: two dirs, as a second --target install into one
# skips its existing bin/ (tensortier's CLI went missing), and a wheel for another Python fails
# alone. tensortier is built from a copy of the tree: nothing (build/, *.egg-info) is left in
# the checkout, and no file from an earlier build (kept in build/lib) gets into the wheel.
# Without a build backend (setuptools >= 61; none can be installed there): src/ on PYTHONPATH.
install_site() {
  site_tmp=$(mktemp -d /tmp/tt-site.XXXXXX)
  trap 'rm -rf "$site_tmp"' EXIT
  local peers="$site_tmp/peers" own="$site_tmp/tensortier" tree="$site_tmp/tree"
  local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
    --disable-pip-version-check)
  if compgen -G ".whl/*.whl" >/dev/null; then
    "${pip[@]}" --target "$peers" .whl/*.whl ||
      echo "gpu_check.sh: installing .whl/ failed (wheels for Python 3.12); peers may be missing"
  else
    echo "gpu_check.sh: no .whl/ (run 'make gpu-wheels' here and carry .whl): peers missing"
  fi
  mkdir -p "$tree/src" && cp -r pyproject.toml README.md "$tree/" &&
    cp -r src/tensortier "$tree/src/"
  if "$PY" -c "import setuptools.build_meta" 2>/dev/null &&
      "${pip[@]}" --no-build-isolation --target "$own" "$tree" &&
      PYTHONPATH="$own" "$PY" -c "import importlib.util as u, sys
s = u.find_spec('tensortier'); sys.exit(not (s and s.origin.startswith(sys.argv[1])))" "$own"
  then
    export PATH="$own/bin:$peers/bin:$PATH"
  else
    echo "gpu_check.sh: installing tensortier failed (no setuptools?); using src/ on PYTHONPATH"
    own="$PWD/src"
  fi
  export PYTHONPATH="$own:$peers${PYTHONPATH:+:$PYTHONPATH}"
}

args=()
if [ "$dry" = 1 ]; then
  args+=(--dry-run)
  cap=([transfer]=120 [pytest]=300 [activations]=300 [llama]=300 [optimizer]=200 [checkpoint]=200)
fi
install_site  # the dry run too: the first GPU call cannot fail on the install either
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS
tag=$("$PY" scripts/gpu_check.py tag "${args[@]}") || { echo "cannot import torch" >&2; exit 1; }
log="$out/gpu_check-$tag.log"
{
  echo "== gpu_check $(date -Is) tag=$tag phases=$phases dry=$dry"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  echo "loadavg $(cat /proc/loadavg) cpus $(nproc)"
} | tee "$log"

status=0
if [ "$dry" = 1 ]; then
  list=("$phases")  # one process runs them all: torch and transformers are imported once
else
  IFS=, read -ra list <<<"$phases"  # a process per phase: a CUDA fault stops only its own
fi
for phase in "${list[@]}"; do
  limit=0
  for p in ${phase//,/ }; do
    var="CAP_${p^^}"
    limit=$((limit + ${!var:-${cap[$p]:-120}}))
  done
  start=$SECONDS
  timeout -k 15 "$limit" "$PY" scripts/gpu_check.py "$phase" --out "$out" --tag "$tag" \
    "${args[@]}" "${extra[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "== $phase exit $rc after $((SECONDS - start)) s (cap $limit s)" | tee -a "$log"
  [ "$rc" = 0 ] || status=1
done
"$PY" scripts/gpu_check.py summary --out "$out" --tag "$tag" --phases "$phases" | tee -a "$log"
echo "results in $out"
exit $status
