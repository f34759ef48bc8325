#!/usr/bin/env bash
# A session on a borrowed GPU machine, prepared: the measurements the open issues wait for, each writing files of its
# own under OUT, so that a timeout loses one of them, not all.
#
#   tools/gpu_session.sh bench OUT [SECTION...]   tools/gpu_bench.py, each section a process of its own (all six in
#                                                 its run order if none is named), each under the limit below
#   tools/gpu_session.sh tier OUT                 apex from vendor/ (python-only), then the GPU tier: pytest -m gpu,
#                                                 8 processes if pytest-xdist is there (about 4 minutes on an H100)
#
# A loan is 15 minutes of device time in all (the machine's start, about 30 s, and idle waits count), a call at most
# 10, and a call returns at most 8 files from OUT: each part packs what it writes into one file, OUT/PART.tgz (bench:
# bench-SECTIONS.tgz; tier: tier.tgz), repacked after every step, so that a call killed at its limit still returns
# the steps that ended. GPU_SESSION_END (seconds since the epoch; default: 570 s from the start) is when this call's
# work must be done: each step's limit is its own below or what is left before GPU_SESSION_END (less 25 s: the 20 s
# kill-after and the packing), whichever is less, and a step with under 10 s left is not run (said, exit 1). One
# GPU_SESSION_END exported before two parts in one call is their shared deadline.
#
# The plan for a loan, the open issues in their order, two calls back to back (the machine stays warm between):
#   1. timeout_s 480: export GPU_SESSION_END=$(( $(date +%s) + 450 )); tools/gpu_session.sh bench "$OUT" data
#      issue 65: six recipe jobs on 20,000 JPEGs it makes first, the goals' jobs first (in memory, GPU decode, CPU
#      decode; then the same compiled), about 6-7 minutes estimated: one cut short keeps the jobs that ended.
#   2. at once, LEFT the lease's budget_left_s after call 1, timeout_s LEFT - 20:
#      export GPU_SESSION_END=$(( $(date +%s) + LEFT - 45 )); tools/gpu_session.sh bench "$OUT" lm;
#      tools/gpu_session.sh tier "$OUT"
#      issue 66's language models, eager and compiled (about 160 s), then the GPU tier in what is left, its
#      language models' one-GPU runs first (tests/conftest.py orders them so): issue 67's lm_moe tokens/s.
# The other four sections (throughput, amp, overhead, compile: 20-55 s each on one H200, bench/gpu-2026-11-28-h200)
# do not fit beside them; the first run's figures stand for them until a longer loan.
#
# Each part writes machine.txt (the date, the tree if it is a git checkout, nvidia-smi, the versions) first. A
# section's JSON is written when it ends or is stopped at its limit (tools/gpu_bench.py keeps the rows that ended,
# the section marked cut_short); beside it its log, and data's each job's whole output, data.json.data-JOB.log.
# Back on a machine with the project, unpack each .tgz into one folder of bench/ and render them with the first
# run's other four sections (the same machine kind):
#   for f in OUT/*.tgz; do tar xzf "$f" -C bench/gpu-DATE-h200; done
#   python tools/gpu_bench.py --render bench/gpu-DATE-h200/bench \
#     bench/gpu-2026-11-28-h200/{throughput,amp,overhead,compile}.json --tier bench/gpu-DATE-h200/tier.xml \
#     --tree SHA --md bench/gpu.md
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
# A section's own limit, seconds, process start and CUDA's initialisation included: about 1.5x what it took on one H200
# or, for the sections that grew since (lm's compiled steps, data's compiled jobs), is estimated to take; what is left
# before GPU_SESSION_END caps it (the plan above: data gets about 425 s, lm its 210, the tier the rest).
# lm, estimated from the first H200 run (its two eager rows 22.6 s of the tool's 23.5, CUDA's start in those; a
# compiled GPT-2 small step compiles in about 26 s, probe.log): 10 s to import torch, 23 s eager, about 35 s a
# compiled row (26 s compile, 44 steps, the profile), 5 s AdamW alone: about 110 s; lm_fsdp_tp's two rows
# (--dp 1 --tp 1) add about 50 s (eager as lm_tp's or slower, about 15 s; compiled about 35 s): about 160 s under
# 210 (1.3x). They run last and every row is kept as it ends, so a timeout there costs lm_fsdp_tp's rows alone.
declare -A LIMIT=([throughput]=90 [amp]=100 [overhead]=75 [lm]=210 [compile]=120 [data]=540)
TIER_LIMIT=380  # 3 min 46 s on the first H200 run (-n 8)
RESERVE=25  # seconds kept back from a step's limit before GPU_SESSION_END: the 20 s kill-after, then the packing
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
session_end=${GPU_SESSION_END:-$(($(date +%s) + 570))}
[[ $session_end =~ ^[0-9]+$ ]] || {
  echo "gpu_session.sh: GPU_SESSION_END='$session_end' is not seconds since the epoch; e.g. \$(( \$(date +%s) + 450 ))" >&2
  exit 2; }
if [[ $part == bench ]]; then name=bench-$(IFS=-; echo "${sections[*]}"); else name=tier; fi
mkdir -p "$out" || exit 2
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX") || exit 2
# What this part writes, packed into OUT/NAME.tgz after every step (a call killed at its limit returns what ended).
pack() {
  tar czf "$out/.$name.tgz.part" -C "$work" . && mv -f "$out/.$name.tgz.part" "$out/$name.tgz"
}
trap 'pack; rm -rf "$work"' EXIT
{
  date -u +%FT%TZ
  git rev-parse HEAD 2>/dev/null || echo "tree: not a git checkout"
  nvidia-smi || echo "nvidia-smi: not found"
  "$python" -c 'import platform, importlib.metadata as m; print("python", platform.python_version(), "torch",
m.version("torch"), "torchvision", m.version("torchvision"))'  # the versions, without importing torch (seconds)
} > "$work/machine.txt" 2>&1
pack

# After a timeout the jobs a killed section or tier started may still hold the GPU: torchrun stops its ranks in up to
# 30 s, and the tier's jobs run in sessions of their own (orphans once their parent is killed). Each step runs with
# GPU_SESSION_TAG in its environment, which every process it starts inherits; settle stops those and no other (a
# shared machine's other jobs, another gpu_session.sh), and waits, at most 40 s, for an idle GPU.
tag=gpu_session_$$_$RANDOM
tagged() {
  grep -l -a "GPU_SESSION_TAG=$tag" /proc/[0-9]*/environ 2> /dev/null | cut -d/ -f3 || true
}
settle() {
  local pids
  mapfile -t pids < <(tagged)
  ((${#pids[@]} == 0)) || kill -TERM "${pids[@]}" 2> /dev/null
  if command -v nvidia-smi > /dev/null; then
    for _ in $(seq 20); do
      [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null) ]] && break
      sleep 2
    done
  fi
  mapfile -t pids < <(tagged)
  ((${#pids[@]} == 0)) || kill -KILL "${pids[@]}" 2> /dev/null
  return 0
}

# A step's limit: its own (CAP), or what is left before GPU_SESSION_END less RESERVE, whichever is less.
limit_of() {
  local left=$((session_end - $(date +%s) - RESERVE))
  echo $((left < $1 ? left : $1))
}

# Runs LOG LIMIT SIGNAL COMMAND...: COMMAND under a time limit (then SIGNAL, and SIGKILL 20 s later), its output into
# LOG; says when it ran out and settles; under 10 s left, says so and does not run it (exit 124). Packs after.
limited() {
  local log=$1 limit=$2 signal=$3 start=$SECONDS code
  shift 3
  if [[ $limit -lt 10 ]]; then
    echo "gpu_session.sh: not run: $((limit + RESERVE)) s left before GPU_SESSION_END" > "$log"
    pack
    return 124
  fi
  GPU_SESSION_TAG=$tag timeout -s "$signal" --kill-after 20 "$limit" "$@" > "$log" 2>&1
  code=$?
  if [[ ($code -eq 124 || $code -eq 137) && $((SECONDS - start)) -ge $limit ]]; then
    echo "gpu_session.sh: ran out of its $limit s" >> "$log"
    pack # before settle's wait (up to 40 s): a call killed at the loan's end still returns this step's files
    settle
  fi
  pack
  return $code
}

failed=0
if [[ $part == bench ]]; then
  mkdir -p "$work/bench"
  for section in "${sections[@]}"; do
    start=$SECONDS
    limited "$work/bench/$section.log" "$(limit_of "${LIMIT[$section]}")" TERM "$python" tools/gpu_bench.py \
      --only "$section" --out "$work/bench/$section.json"
    code=$?
    echo "$section: exit $code after $((SECONDS - start)) s; $(tail -n 1 "$work/bench/$section.log")"
    [[ $code -eq 0 ]] || failed=1
  done
else
  apex_limit=$(limit_of 60)
  if [[ $apex_limit -lt 10 ]] || ! timeout "$apex_limit" "$python" -m pip install --no-index \
    --disable-pip-version-check --no-build-isolation --no-deps ./vendor/apex-25.04.tar.gz > "$work/apex.log" 2>&1
  then
    echo "apex: not installed (apex.log); its tests say so"
  fi
  spread=()
  "$python" -c 'import xdist' 2> /dev/null && spread=(-n 8)
  start=$SECONDS
  limited "$work/tier.log" "$(limit_of "$TIER_LIMIT")" "$TIER_SIGNAL" "$python" -m pytest "${TIER_ARGS[@]}" \
    "${spread[@]}" --junitxml "$work/tier.xml"
  code=$?
  echo "tier: exit $code after $((SECONDS - start)) s; $(tail -n 1 "$work/tier.log")"
  [[ $code -eq 0 ]] || failed=1
fi
echo "gpu_session.sh: wrote $out/$name.tgz"
exit $failed
