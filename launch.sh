#!/usr/bin/env bash
# Start a recipe on a list of GPUs or on N CPU processes, with the launcher the recipe declares.
# Run ./launch.sh --help for usage.
set -euo pipefail
# SIGUSR1 (a scheduler's warning) must not kill this script before it becomes the launcher, which passes it on to the
# ranks: ignored until then (an ignored signal stays ignored across exec, until tools/torchrun.py's own handler).
trap '' USR1

usage() {
  cat <<'EOF'
usage: ./launch.sh [--dry-run] RECIPE [DEVICES] [recipe args...]

  DEVICES   0,1,3   GPUs 0, 1 and 3 (nvidia-smi numbering), one process each
            GPU-<uuid>,...  GPUs by UUID, or a MIG-... id (as job schedulers set CUDA_VISIBLE_DEVICES)
            0:2     2 processes sharing GPU 0 over gloo, for debugging DDP on a one-GPU box
            cpu     2 processes on the CPU (gloo backend)
            cpu:N   N processes on the CPU
            omitted CUDA_VISIBLE_DEVICES if set, else all GPUs, or cpu:2 when there is none
            (given, a list replaces a CUDA_VISIBLE_DEVICES that names other GPUs, and says so)

  --dry-run (or LAUNCH_DRY_RUN=1) prints the command and its environment instead of running it.

Environment: MASTER_PORT (default: a free port), MASTER_ADDR (default 127.0.0.1),
NNODES and NODE_RANK for multi-node (then MASTER_ADDR and MASTER_PORT are required),
MAX_RESTARTS (default 0): torchrun restarts every rank this many times when one fails (give the
recipe --resume auto so it goes on from its last checkpoint), PYTHON (default python3),
OMP_NUM_THREADS (default: cores / processes; cores: nproc's, at most a container's CPU limit).

The recipe names its launcher in a line '# launcher: torchrun|torch.distributed.launch|python'.

examples:
  ./launch.sh recipes/ddp_torchrun.py 0,1,3 --dataset cifar100
  ./launch.sh recipes/ddp_torchrun.py cpu:2 --arch tiny --epochs 1
EOF
}

fail() {
  echo "launch.sh: error: $*" >&2
  exit 2
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
dry_run=${LAUNCH_DRY_RUN:-0}

while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    *) fail "unknown option '$1'; launch.sh takes --dry-run or --help before RECIPE, recipe flags after DEVICES" ;;
  esac
  shift
done
# Only 1 prints: any other word (true, yes) would run the job for real (unless --dry-run says to print).
if [[ $dry_run != 1 && ! ${LAUNCH_DRY_RUN:-0} =~ ^[01]$ ]]; then
  fail "LAUNCH_DRY_RUN='$LAUNCH_DRY_RUN' must be 1 (print the command, as --dry-run does) or 0 (run it); unset it to run"
fi
[[ $# -ge 1 ]] || { usage >&2; exit 2; }

# ---- recipe: a path from here, or from the repo root; it names its own launcher
recipe=$1
shift
if [[ ! -f $recipe ]]; then
  if [[ ! -f $here/$recipe ]]; then
    for guess in "$recipe.py" "recipes/$recipe" "recipes/$recipe.py"; do # no .py, or no recipes/
      [[ ! -f $guess && ! -f $here/$guess ]] || fail "recipe '$recipe' not found; did you mean $guess?"
    done
    fail "recipe '$recipe' not found; try one of: $(cd "$here" && echo recipes/*.py)"
  fi
  recipe=$here/$recipe
fi
launcher=$(head -n 60 "$recipe" | sed -n 's/^# launcher: *\([A-Za-z._]*\) *$/\1/p' | head -n 1)
case $launcher in
  torchrun | torch.distributed.launch | python) ;;
  "") fail "$recipe has no '# launcher: torchrun|torch.distributed.launch|python' line in its first 60 lines; add one" ;;
  *) fail "$recipe names launcher '$launcher'; use torchrun, torch.distributed.launch or python" ;;
esac

# ---- devices -> CUDA_VISIBLE_DEVICES and the process count (never torch.cuda.device_count() of the box)
smi_list() {
  # nvidia-smi -L's lines. "No devices were found" is a machine without GPUs; any other failure (a driver/library
  # version mismatch after a driver update, a driver not loaded, a hang) stops here in one line: read as "no GPU",
  # it would train an 8-GPU job on the CPU.
  local out rc=0
  out=$(timeout 10 nvidia-smi -L 2>&1) || rc=$?
  if ((rc == 124)); then
    fail "nvidia-smi -L did not answer in 10 s; check the GPU driver, or pass cpu or cpu:N to run on the CPU"
  elif ((rc != 0)) && [[ $out != *"No devices were found"* ]]; then
    fail "nvidia-smi -L failed (exit $rc): $(head -n 1 <<<"${out:-no output}"); fix the GPU driver, or pass cpu or cpu:N to run on the CPU"
  fi
  ((rc != 0)) || printf '%s\n' "$out"
}

gpu_count() {
  # nvidia-smi lists every GPU of the machine in PCI order; CUDA_DEVICE_ORDER=PCI_BUS_ID below makes
  # CUDA number them the same way, so "0,1,3" means what nvidia-smi shows.
  if command -v nvidia-smi >/dev/null 2>&1; then
    local smi
    smi=$(smi_list) || exit $?
    grep -c '^GPU ' <<<"$smi" || true
  else
    # No nvidia-smi: a container started without the driver's "utility" capability still runs CUDA. Ask
    # CUDA through torch (a few seconds), with every GPU visible and numbered as nvidia-smi would.
    env -u CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=PCI_BUS_ID \
      "$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
  fi
}

devices=""
given=0
cvd="" # CUDA_VISIBLE_DEVICES= where the list came from it: the errors below name it
if [[ $# -gt 0 && $1 =~ ^-[0-9] ]]; then # CUDA_VISIBLE_DEVICES' -1, typed as DEVICES: read as a recipe flag
  fail "bad DEVICES '$1': to run without GPUs pass cpu or cpu:N, e.g. cpu:2"
fi
# launch.sh's own words after the recipe's flags would reach the recipe, which refuses them: --dry-run (unless
# the recipe takes one of its own) and DEVICES ("cpu", "cpu:2" where no flag takes it as its value).
if [[ " $* " == *" --dry-run "* ]] && ! grep -q -e --dry-run "$recipe"; then
  fail "--dry-run goes before RECIPE: ./launch.sh --dry-run RECIPE [DEVICES] [recipe args...]"
fi
if [[ $# -gt 0 && $1 == -* ]]; then
  previous=""
  for word in "$@"; do
    [[ ! $word =~ ^cpu(:[0-9]+)?$ || $previous == -* ]] ||
      fail "DEVICES '$word' comes after a recipe flag; put it right after RECIPE: ./launch.sh RECIPE $word [recipe args...]"
    previous=$word
  done
fi
if [[ $# -gt 0 && $1 != -* ]]; then
  devices=$1
  given=1
  shift
  if [[ $devices == *, && $# -gt 0 && $1 =~ ^[0-9] ]]; then # `0, 1`: the shell split the list at the space
    fail "the GPU list '$devices $1' has a space in it; write it without one, e.g. ${devices}$1"
  fi
fi
if [[ -z $devices ]]; then
  if [[ ${CUDA_VISIBLE_DEVICES:-} == -1 || ${CUDA_VISIBLE_DEVICES:-} == NoDevFiles ]]; then # no GPU for this job
    devices=cpu:2
    echo "launch.sh: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES hides every GPU, running cpu:2 (2 processes, gloo); pass DEVICES to choose" >&2
  elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    devices=$CUDA_VISIBLE_DEVICES
    cvd=CUDA_VISIBLE_DEVICES=
  elif [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then # set but empty: the usual way to hide every GPU
    devices=cpu:2
    echo "launch.sh: CUDA_VISIBLE_DEVICES is empty, running cpu:2 (2 processes, gloo); pass DEVICES to choose" >&2
  else
    count=$(gpu_count) || exit $?
    if ((count > 0)); then
      devices=$(seq -s, 0 $((count - 1)))
    else
      devices=cpu:2
      echo "launch.sh: no GPU found, running cpu:2 (2 processes, gloo); pass DEVICES to choose" >&2
    fi
  fi
fi

if [[ $devices == cpu ]]; then
  devices=cpu:2
fi
asked=$devices
named="${cvd:-DEVICES }'$asked'" # DEVICES '0,1' or CUDA_VISIBLE_DEVICES='0,1'
hint="" # where the list came from CUDA_VISIBLE_DEVICES, a fix of launch.sh's syntax there is no fix for CUDA
[[ -z $cvd ]] || hint=" (with no DEVICES given, launch.sh reads CUDA_VISIBLE_DEVICES: fix or unset it, or pass DEVICES)"
ranks_per_gpu=1
if [[ $devices =~ ^([0-9]+):([0-9]+)$ ]]; then # G:N, N ranks on GPU G
  ranks_per_gpu=$((10#${BASH_REMATCH[2]}))
  ((ranks_per_gpu >= 1)) || fail "bad $named: G:N needs N >= 1 processes, e.g. 0:2$hint"
  devices=${BASH_REMATCH[1]}
fi
if [[ $devices == cpu:* ]]; then
  n=${devices#cpu:}
  if ! [[ $n =~ ^[0-9]+$ ]] || ((10#$n < 1)); then
    fail "bad $named: cpu:N needs a whole number N >= 1, e.g. cpu:2$hint"
  fi
  nprocs=$((10#$n))
  visible=""
  where="cpu"
elif [[ $devices =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  IFS=, read -ra ids <<<"$devices"
  declare -A seen=()
  visible=""
  for id in "${ids[@]}"; do
    id=$((10#$id))
    [[ -z ${seen[$id]:-} ]] || fail "GPU $id is listed twice in $cvd'$asked'; list each GPU once, e.g. $(tr ',' '\n' <<<"$devices" | awk '!seen[$0 + 0]++' | paste -sd,)$hint"
    seen[$id]=1
    visible+=${visible:+,}$id
  done
  count=$(gpu_count) || exit $?
  use=use
  [[ -z $cvd ]] || use="unset it, or pass DEVICES"
  ((count > 0)) || fail "$named asks for GPUs, but this machine has none (nvidia-smi, or torch without it); $use cpu or cpu:N, e.g. cpu:2"
  for id in "${!seen[@]}"; do
    ((id < count)) || fail "GPU $id${cvd:+ in $named} does not exist: this machine has $count GPU(s), ids 0-$((count - 1)); e.g. $(seq -s, 0 $((count - 1)))"
  done
  nprocs=$((${#ids[@]} * ranks_per_gpu))
  if ((given)) && [[ -n ${CUDA_VISIBLE_DEVICES:-} && $CUDA_VISIBLE_DEVICES != "$visible" ]]; then
    # A scheduler's allocation, or the user's: DEVICES replaces it (nvidia-smi's numbering, not places in it).
    echo "launch.sh: DEVICES $asked replaces CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: GPU(s) $visible by nvidia-smi's numbering will run; omit DEVICES to run on the ones it names" >&2
  fi
  where="GPU $visible"
  ((ranks_per_gpu == 1)) || where+=" shared by $nprocs processes (gloo: NCCL takes one process per GPU)"
elif [[ $devices =~ ^(GPU|MIG)-[A-Za-z0-9/-]+(,(GPU|MIG)-[A-Za-z0-9/-]+)*$ ]]; then
  # UUIDs (nvidia-smi -L) or MIG instances, as schedulers set them: passed to CUDA as they are.
  IFS=, read -ra ids <<<"$devices"
  [[ $(printf '%s\n' "${ids[@]}" | sort | uniq -d) == "" ]] || fail "a GPU is listed twice in $cvd'$asked'; list each once$hint"
  if command -v nvidia-smi >/dev/null 2>&1; then # CUDA drops an id it does not know, and every id after it
    smi=$(smi_list) || exit $?
    listed=$(grep -o 'UUID: [^)]*' <<<"$smi" | cut -c7- | paste -sd, - || true)
    for id in "${ids[@]}"; do # a UUID's first characters do (NVIDIA's docs); the legacy MIG-GPU-.../GI/CI form is
      [[ $id == */* || ,$listed == *,"$id"* ]] || # not in the list: passed as it is
        fail "GPU $id${cvd:+ in $named} is not on this machine: nvidia-smi -L lists ${listed:-no UUID}; pass ids from it, or numbers like 0,1"
    done
  fi
  if ((given)) && [[ -n ${CUDA_VISIBLE_DEVICES:-} && $CUDA_VISIBLE_DEVICES != "$devices" ]]; then
    echo "launch.sh: DEVICES $asked replaces CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; omit DEVICES to run on the ones it names" >&2
  fi
  visible=$devices
  nprocs=${#ids[@]}
  where="GPU $visible"
elif [[ $devices =~ ^[0-9,]+$ ]]; then
  fail "bad GPU list $cvd'$asked': an empty entry between commas; write ids separated by single commas, e.g. 0,1,3$hint"
else
  fail "bad $named: expected a GPU list like 0,1,3, or G:N (N processes on GPU G), or cpu, or cpu:N$hint"
fi

# ---- rendezvous: nodes, address, port
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
# 10#: a leading zero ("08") would otherwise be read as octal. At most 6 digits: bash arithmetic wraps past 2^63.
if ! [[ $nnodes =~ ^0*[1-9][0-9]{0,5}$ ]]; then
  fail "NNODES='$nnodes' must be a whole number from 1 to 999999 (the number of nodes)"
fi
nnodes=$((10#$nnodes))
if [[ -z ${NNODES:-} && $node_rank =~ ^0*[1-9][0-9]*$ ]]; then # a node of a multi-node job, told too little
  fail "NODE_RANK=$node_rank needs NNODES, the number of nodes: set NNODES (and MASTER_ADDR, MASTER_PORT) the same on every node, or unset NODE_RANK for a one-node job"
fi
if ! [[ $node_rank =~ ^0*[0-9]{1,6}$ ]] || ((10#$node_rank >= nnodes)); then
  fail "NODE_RANK='$node_rank' must be 0..$((nnodes - 1)) (NNODES=$nnodes)"
fi
node_rank=$((10#$node_rank))
max_restarts=${MAX_RESTARTS:-0}
if ! [[ $max_restarts =~ ^0*[0-9]{1,6}$ ]]; then # bounded: bash arithmetic wraps past 2^63
  fail "MAX_RESTARTS='$max_restarts' must be a whole number >= 0 and at most 999999 (restarts when a rank fails); unset it for none"
fi
max_restarts=$((10#$max_restarts))
if ((max_restarts > 0)) && [[ $launcher == python ]]; then
  fail "MAX_RESTARTS needs a recipe started by torchrun; $(basename "$recipe") starts its own processes ('# launcher: python'), which nothing restarts"
fi
if ((nnodes > 1)) && [[ -z ${MASTER_ADDR:-} || -z ${MASTER_PORT:-} ]]; then
  fail "NNODES=$nnodes needs MASTER_ADDR (node 0's address) and MASTER_PORT, set the same on every node"
fi
master_addr=${MASTER_ADDR:-127.0.0.1}

check_master() {
  # On node 0, which hosts the rendezvous: MASTER_ADDR must be an address of this machine (any other one, say a
  # cluster job's left exported, makes every rank retry its connection for 15 minutes), and MASTER_PORT, when
  # given, free to listen on (SO_REUSEADDR as torch's TCPStore sets it: a port in TIME_WAIT is not busy).
  # Exit 0: fine; 6: the port is in use; 3: the address is not this machine's; 4: it does not resolve; 5: the
  # port needs root; anything else (1: a traceback): the check could not run.
  "$python" -c 'import errno, socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
try:
    found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
except (socket.gaierror, UnicodeError):
    sys.exit(4)
local = False
for family, kind, _, _, where in found:
    try:  # an IPv6 address on a kernel without IPv6 is not an address here
        with socket.socket(family, kind) as s:
            s.bind((where[0], 0, *where[2:]))  # an IPv6 link-local address keeps its scope
            local = True
    except OSError:
        pass
if not local:
    sys.exit(3)
if port:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError as e:
        sys.exit(5 if e.errno == errno.EACCES else 6)' "$1" "$2"
}

if [[ -n ${MASTER_PORT:-} ]]; then
  if ! [[ $MASTER_PORT =~ ^[0-9]+$ ]] || ((10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535)); then
    fail "MASTER_PORT='$MASTER_PORT' is not a port number (1-65535)"
  fi
  master_port=$((10#$MASTER_PORT))
fi
# Only node 0 listens; on the other nodes MASTER_ADDR and MASTER_PORT are node 0's. Nothing to check when neither
# is given: 127.0.0.1 and a port picked free below.
if ((node_rank == 0)) && [[ -n ${MASTER_ADDR:-} || -n ${MASTER_PORT:-} ]]; then
  ok=0
  check_master "$master_addr" "${master_port:-0}" 2>/dev/null || ok=$?
  case $ok in
    0) ;;
    6) fail "MASTER_PORT=$master_port is already in use (another job on this machine?); unset MASTER_PORT to get a free port, or pick another" ;;
    3) fail "MASTER_ADDR=$master_addr is not an address of this machine, and node 0 (NODE_RANK=$node_rank) hosts the rendezvous there; set it to this node's address, or unset it for a one-node job" ;;
    4) fail "MASTER_ADDR=$master_addr does not resolve to an address; set it to node 0's address or host name, or unset it for a one-node job" ;;
    5) fail "MASTER_PORT=$master_port is a privileged port (below 1024) that this user cannot listen on; pick one above 1024" ;;
    *) fail "could not run '$python' to check MASTER_ADDR and MASTER_PORT; set PYTHON to your environment's python" ;;
  esac
fi
if [[ -z ${MASTER_PORT:-} ]]; then
  # A random free port below the kernel's ephemeral range, where no other job's connection can take it before
  # torchrun listens on it (tools/free_port.py says why).
  master_port=$("$python" "$here/tools/free_port.py") ||
    fail "could not run '$python' to pick a free port; set PYTHON to your environment's python"
fi

# ---- command
# The cores this node's job may use: nproc's (its CPU affinity: a Slurm job's CPUs, a taskset, a cpuset), and no
# more than a container's CPU limit (Docker's --cpus, a Kubernetes CPU limit), which nproc does not count: the
# cgroup's CFS quota over its period, rounded up, as common/data.py's cpu_quota() reads it (CGROUP_FS: tests' files).
cores=$(nproc)
cgroup=${CGROUP_FS:-/sys/fs/cgroup}
quota=0
if { read -r q p _ < "$cgroup/cpu.max"; } 2>/dev/null ||  # braced: a missing file's error is the redirection's
   { read -r q _ < "$cgroup/cpu/cpu.cfs_quota_us" && read -r p _ < "$cgroup/cpu/cpu.cfs_period_us"; } 2>/dev/null; then
  if [[ $q =~ ^[0-9]+$ && $p =~ ^[0-9]+$ ]] && ((10#$q > 0 && 10#$p > 0)); then
    quota=$(((10#$q + 10#$p - 1) / 10#$p))
  fi
fi
if ((quota > 0 && quota < cores)); then
  cores=$quota
fi
if [[ -n ${OMP_NUM_THREADS:-} && ! $OMP_NUM_THREADS =~ ^0*[1-9][0-9]{0,5}(,0*[1-9][0-9]{0,5})*$ ]]; then
  # libgomp ignores a bad value with a warning and runs a thread per core in every process (6x slower measured)
  fail "OMP_NUM_THREADS='$OMP_NUM_THREADS' must be a whole number >= 1 (threads per process; a list such as 4,2 for nested levels); unset it for cores / processes ($((cores / nprocs > 0 ? cores / nprocs : 1)) here)"
fi
threads=${OMP_NUM_THREADS:-$((cores / nprocs > 0 ? cores / nprocs : 1))}
# tools/torchrun.py is torchrun (from this environment) with the same flags; when a rank fails it prints one
# line naming the failed ranks and exits with the failed rank's code (torchrun itself always exits 1).
case $launcher in
  torchrun) cmd=("$python" "$here/tools/torchrun.py") ;;
  torch.distributed.launch) cmd=("$python" "$here/tools/torchrun.py" --legacy-launch) ;;
  python) cmd=("$python") ;;
esac
if [[ $launcher != python ]]; then
  cmd+=(--nnodes="$nnodes" --nproc-per-node="$nprocs" --max-restarts="$max_restarts")
  if ((max_restarts == 0)); then
    cmd+=(--node-rank="$node_rank" --master-addr="$master_addr" --master-port="$master_port")
  else
    # Restarts: the ranks must not share one store across attempts (torchrun's default), or a restarted rank can
    # read a dead rank's address left there and connect to it (its orphaned DataLoader workers still hold its
    # sockets). With the c10d rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every attempt gets a new store.
    cmd+=(--rdzv-backend=c10d --rdzv-endpoint="$master_addr:$master_port" --rdzv-id="cookbook-$master_port")
  fi
fi
cmd+=("$recipe" "$@")
env_vars=(CUDA_VISIBLE_DEVICES="$visible" CUDA_DEVICE_ORDER=PCI_BUS_ID OMP_NUM_THREADS="$threads"
  MASTER_ADDR="$master_addr" MASTER_PORT="$master_port" NNODES="$nnodes" NODE_RANK="$node_rank"
  NPROC_PER_NODE="$nprocs" RANKS_PER_GPU="$ranks_per_gpu")
((max_restarts == 0)) || env_vars+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)

restarts=""
((max_restarts == 0)) || restarts=", up to $max_restarts restart(s)"
started="$nprocs process(es) per node on $where"
# A '# launcher: python' recipe starts as one process and decides how many more: dp.py none, ddp_spawn.py one per
# GPU (half with --model-parallel), on the CPU --nproc (default NPROC_PER_NODE). Say what launch.sh set, no count.
if [[ $launcher == python ]]; then
  started="one $(basename "$recipe") per node on ${where%% shared by*}, which starts its own processes (NPROC_PER_NODE=$nprocs)"
fi
echo "launch.sh: $started, $nnodes node(s), $launcher$restarts, master $master_addr:$master_port" >&2
if [[ $dry_run == 1 ]]; then
  line=""
  for word in "${env_vars[@]}" "${cmd[@]}"; do
    [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]*$ ]] || word=$(printf '%q' "$word")
    line+=${line:+ }$word
  done
  echo "$line"
  exit 0
fi
exec env "${env_vars[@]}" "${cmd[@]}"
