#!/usr/bin/env bash
# A session on a borrowed GPU machine, prepared: the measurements the open issues wait for, each writing files of its
# own under OUT, so that a timeout loses one of them, not all. Two parts, one call each (a call there may run 10
# minutes; the whole loan is 15, start-up included):
#
#   tools/gpu_session.sh bench OUT [SECTION...]   tools/gpu_bench.py, each section a process of its own (all six in
#                                                 its run order if none is named), each under the limit below
#   tools/gpu_session.sh tier OUT                 apex from vendor/ (python-only), then the GPU tier: pytest -m gpu,
#                                                 8 processes if pytest-xdist is there (about 4 minutes)
#
# All six sections' limits add up to more than one call's 10 minutes, so a session names them over two calls, the
# open issues' first: `bench OUT data lm` (issues 65 and 66), `tier OUT` (67's lm_moe, the GPU decode's own
# tests), then `bench OUT throughput amp overhead compile` if time is left. On one H200 the first five sections
# took 20-55 s each (bench/gpu-2026-11-28-h200), before the language models' compiled steps came.
#
# Each part writes OUT/machine.txt (nvidia-smi, torch, the tree) first. Back on a machine with the project:
#   python tools/gpu_bench.py --render OUT/bench --tree SHA --md bench/gpu.md
# A section that failed or ran out of time is named in OUT/bench/SECTION.log; --render takes the JSONs there are.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage="usage: tools/gpu_session.sh bench OUT [SECTION...] | tools/gpu_session.sh tier OUT"
[[ $# -ge 2 ]] || { echo "gpu_session.sh: $usage" >&2; exit 2; }
part=$1 out=$2
shift 2
# A section's limit, seconds, process start included: about twice what it took on one H200 (data and lm: estimated).
declare -A LIMIT=([throughput]=60 [amp]=75 [overhead]=75 [lm]=150 [compile]=120 [data]=300)
RUN_ORDER=(throughput amp overhead lm compile data)  # tools/gpu_bench.py's RUN_ORDER (tests/test_gpu_session.py)
case $part in
  bench)
    if [[ $# -gt 0 ]]; then sections=("$@"); else sections=("${RUN_ORDER[@]}"); fi
    for section in "${sections[@]}"; do
      [[ -n ${LIMIT[$section]+set} ]] || {
        echo "gpu_session.sh: no section '$section'; name some of: ${RUN_ORDER[*]}" >&2; exit 2; }
    done ;;
  tier) [[ $# -eq 0 ]] || { echo "gpu_session.sh: tier takes no sections; $usage" >&2; exit 2; } ;;
  *) echo "gpu_session.sh: no part '$part'; $usage" >&2; exit 2 ;;
esac
python=${PYTHON:-$(command -v python || command -v python3)}
mkdir -p "$out" || exit 2
{
  date -u +%FT%TZ
  git rev-parse HEAD 2>/dev/null || echo "tree: not a git checkout"
  nvidia-smi || echo "nvidia-smi: not found"
  "$python" -c 'import platform, importlib.metadata as m; print("python", platform.python_version(), "torch",
m.version("torch"), "torchvision", m.version("torchvision"))'  # the versions, without importing torch (seconds)
} > "$out/machine.txt" 2>&1

failed=0
if [[ $part == bench ]]; then
  mkdir -p "$out/bench"
  for section in "${sections[@]}"; do
    start=$SECONDS
    timeout --kill-after 10 "${LIMIT[$section]}" "$python" tools/gpu_bench.py --only "$section" \
      --out "$out/bench/$section.json" > "$out/bench/$section.log" 2>&1
    code=$?
    [[ $code -eq 124 || $code -eq 137 ]] && echo "gpu_session.sh: $section ran out of its ${LIMIT[$section]} s" \
      >> "$out/bench/$section.log"
    echo "$section: exit $code after $((SECONDS - start)) s"
    [[ $code -eq 0 ]] || failed=1
  done
else
  "$python" -m pip install --no-build-isolation --no-deps ./vendor/apex-25.04.tar.gz > "$out/apex.log" 2>&1 ||
    echo "apex: not installed (see $out/apex.log); the apex tests say so"
  spread=()
  "$python" -c 'import xdist' 2> /dev/null && spread=(-n 8)
  start=$SECONDS
  timeout --kill-after 10 450 "$python" -m pytest -m gpu "${spread[@]}" -rfEs --junitxml "$out/tier.xml" \
    > "$out/tier.log" 2>&1
  code=$?
  echo "tier: exit $code after $((SECONDS - start)) s; $(tail -n 1 "$out/tier.log")"
  [[ $code -eq 0 ]] || failed=1
fi
exit $failed
