#!/usr/bin/env bash
# A session on a borrowed GPU machine, prepared: the measurements the open issues wait for, each writing files of its
# own under OUT, so that a timeout loses one of them, not all.
#
#   tools/gpu_session.sh bench OUT [SECTION...]   tools/gpu_bench.py, each section a process of its own (all six in
#                                                 its run order if none is named), each under the limit below
#   tools/gpu_session.sh tier OUT                 apex from vendor/ (python-only), then the GPU tier: pytest -m gpu,
#                                                 8 processes if pytest-xdist is there (about 4 minutes on an H100)
#
# A call there may run 10 minutes and the whole loan is 15, start-up included, so a session spends it on the open
# issues in their order, two calls: `tools/gpu_session.sh bench OUT data` (issue 65: six recipe jobs on 20,000 JPEGs
# it makes first; 6-7 minutes estimated), then `tools/gpu_session.sh bench OUT lm; tools/gpu_session.sh tier OUT`
# (issue 66's language models, eager and compiled; issue 67's lm_moe and the GPU decode's own tests are in the tier).
# The other four sections (throughput, amp, overhead, compile: 20-55 s each on one H200, bench/gpu-2026-11-28-h200)
# do not fit beside them; the first run's figures stand for them until a longer loan.
#
# Each part writes OUT/machine.txt (the date, the tree if it is a git checkout, nvidia-smi, the versions) first. A
# section's JSON is written when it ends, so one that runs out of time leaves its log, which says so (and data, each
# job's figures as it ended: OUT/bench/data.json.data.partial, and its whole output, data.json.data-JOB.log; lm, each
# row: OUT/bench/lm.json.lm.partial). Each call's OUT comes back on its own: copy both into one folder of bench/, then,
# back on a machine with the project, render them with the first run's other four sections (the same machine kind):
#   python tools/gpu_bench.py --render OUT1/bench OUT2/bench \
#     bench/gpu-2026-11-28-h200/{throughput,amp,overhead,compile}.json --tier OUT2/tier.xml --tree SHA --md bench/gpu.md
# (and point tests/test_gpu_bench.py's RUN_DIR, which re-renders the page, at the new folder).
# (--tier: the language models' one-GPU runs from the tier, lm_moe's tokens/s among them. pytest keeps no output of a
# test that passed unless told to: TIER_ARGS' junit_logging puts each test's printed lines into tier.xml.)
set -uo pipefail
called_from=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage="usage: tools/gpu_session.sh bench OUT [SECTION...] | tools/gpu_session.sh tier OUT"
[[ $# -ge 2 ]] || { echo "gpu_session.sh: $usage" >&2; exit 2; }
part=$1 out=$2
[[ $out == /* ]] || out=$called_from/$out  # OUT as the caller named it, though this runs in the project's root
shift 2
# A section's limit, seconds, process start and CUDA's initialisation included: about 1.5x what it took on one H200
# or, for the sections that grew since (lm's compiled steps, data's compiled jobs), is estimated to take. The
# limits of each call above add up to at most 600 (tests/test_gpu_bench.py); so does lm's with the tier's.
# lm, estimated from the first H200 run (its two eager rows 22.6 s of the tool's 23.5, CUDA's start in those; a
# compiled GPT-2 small step compiles in about 26 s, probe.log): 10 s to import torch, 23 s eager, about 35 s a
# compiled row (26 s compile, 44 steps, the profile), 5 s AdamW alone: about 110 s; lm_fsdp_tp's two rows
# (--dp 1 --tp 1) add about 50 s (eager as lm_tp's or slower, about 15 s; compiled about 35 s): about 160 s under
# 210 (1.3x; 1.5x would not leave the tier its 380). They run last and every row is kept as it ends, so a timeout
# there costs lm_fsdp_tp's rows alone.
declare -A LIMIT=([throughput]=90 [amp]=100 [overhead]=75 [lm]=210 [compile]=120 [data]=540)
TIER_LIMIT=380
TIER_LIMIT=${GPU_TIER_LIMIT:-$TIER_LIMIT}  # a loan with less time left: the tier's limit to fit it (it keeps what ran)
# The tier is stopped at its limit with SIGINT: pytest writes its JUnit XML on KeyboardInterrupt, with the tests that
# ended (tests/test_gpu_bench.py runs it so), and none on SIGTERM: tier.xml, lm_moe's tokens/s in it, would be lost.
TIER_SIGNAL=INT
TIER_ARGS=(-m gpu -v -rfEs -o junit_logging=system-out)  # tests/test_gpu_bench.py runs pytest with these
RUN_ORDER=(throughput amp overhead lm compile data)  # tools/gpu_bench.py's RUN_ORDER (tests/test_gpu_bench.py)
case $part in
  bench)
    if [[ $# -gt 0 ]]; then sections=("$@"); else sections=("${RUN_ORDER[@]}"); fi
    for section in "${sections[@]}"; do
      [[ -n $section && -n ${LIMIT[$section]+set} ]] || {
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

# After a timeout the jobs a killed section or tier started may still hold the GPU: torchrun stops its ranks in up to
# 30 s, and the tier's jobs run in sessions of their own. Stop what is left and wait, at most 40 s, for an idle GPU.
# It stops every recipe, launcher and warm server on the machine: a borrowed one runs nothing else (not for yours).
settle() {
  local jobs='(^|[ /])recipes/[a-z_]+\.py|tools/torchrun\.py|tests/warm_server\.py'
  pkill -TERM -f "$jobs" 2> /dev/null
  if command -v nvidia-smi > /dev/null; then
    for _ in $(seq 20); do
      [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null) ]] && return 0
      sleep 2
    done
  fi
  pkill -KILL -f "$jobs" 2> /dev/null
  return 0
}

# Runs LOG LIMIT SIGNAL COMMAND...: COMMAND under a time limit (then SIGNAL, and SIGKILL 20 s later), its output into
# LOG; says when it ran out and settles.
limited() {
  local log=$1 limit=$2 signal=$3 start=$SECONDS code
  shift 3
  timeout -s "$signal" --kill-after 20 "$limit" "$@" > "$log" 2>&1
  code=$?
  if [[ ($code -eq 124 || $code -eq 137) && $((SECONDS - start)) -ge $limit ]]; then
    echo "gpu_session.sh: ran out of its $limit s" >> "$log"
    settle
  fi
  return $code
}

failed=0
if [[ $part == bench ]]; then
  mkdir -p "$out/bench"
  for section in "${sections[@]}"; do
    start=$SECONDS
    limited "$out/bench/$section.log" "${LIMIT[$section]}" TERM "$python" tools/gpu_bench.py --only "$section" \
      --out "$out/bench/$section.json"
    code=$?
    echo "$section: exit $code after $((SECONDS - start)) s"
    [[ $code -eq 0 ]] || failed=1
  done
else
  timeout 60 "$python" -m pip install --no-index --disable-pip-version-check --no-build-isolation --no-deps \
    ./vendor/apex-25.04.tar.gz > "$out/apex.log" 2>&1 || echo "apex: not installed ($out/apex.log); its tests say so"
  spread=()
  "$python" -c 'import xdist' 2> /dev/null && spread=(-n 8)
  start=$SECONDS
  limited "$out/tier.log" "$TIER_LIMIT" "$TIER_SIGNAL" "$python" -m pytest "${TIER_ARGS[@]}" "${spread[@]}" \
    --junitxml "$out/tier.xml"
  code=$?
  echo "tier: exit $code after $((SECONDS - start)) s; $(tail -n 1 "$out/tier.log")"
  [[ $code -eq 0 ]] || failed=1
fi
exit $failed
