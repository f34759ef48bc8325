"""Benchmark the recipes against each other: same model, global batch, synthetic data and step count.

    python tools/bench.py --devices cpu:2                      # every entry, tiny model, 32x32: 5 x ~3.5 min
    python tools/bench.py --devices 0,1,3 --arch resnet101 --batch-size 384 --image-size 32 \\
        --recipes dp,ddp_torchrun,apex_ddp,apex_amp,torch_amp:fp16   # write-up 000's table on GPUs 0, 1, 3
    python tools/bench.py --recipes torch_amp --steps 100      # every torch_amp mode (fp16, bf16, fp32)
    python tools/bench.py --add-entry "amp_cl=recipes/torch_amp.py --channels-last" --recipes amp_cl,torch_amp:fp16

The GPU line mirrors write-up 000's table (DataParallel vs DDP vs apex vs AMP, CIFAR-100-sized inputs) with
resnet101 and 128 images per GPU: the global batch must divide by the GPU count (128 on 3 GPUs does not).

Each selected entry (a name, a recipe file and extra recipe flags; see ENTRIES) is started through
launch.sh with `--dataset synthetic --epochs 1 --max-steps STEPS` and exactly STEPS batches of data,
and its `RESULT {json}` line is read. DataParallel (dp) runs as one process: on GPUs it gets the same
GPU list, on the CPU `cpu`. Entries whose recipe file does not exist are skipped with a note.

Repeats: every entry runs --repeats times, in rounds: each round launches every entry once, in the --recipes order,
then runs the bare loop (below), so the order is A B C bare A B C bare ... and a drift in the machine's load
hits every entry alike. A run that fails is reported with its stderr tail and the others still run; an entry is
summarized from its runs that succeeded, and one with none is left out of the tables. Any failed run: exit 1.

Written to --out (default bench/, made and checked before the first run): results.md (the tables, printed first),
results.json (settings, hardware, every run with its RESULT line, every bare-loop run, the summaries and the
comparisons, so anyone can recompute) and results.png (images/s and s per 20 it: bars at the median, whiskers to the
lowest and highest run).

Columns of the first table; each timed cell is "median (lowest-highest)" over the entry's successful runs:
  runs              runs that succeeded / runs launched
  images/s          global images per second, from the recipe; its first step (warm-up) is left out
  s / 20 it         20 * global batch / images/s: seconds for 20 optimizer steps; the median is 20 * global batch /
                    the median images/s (with an even count of runs, not the mean of the middle two runs' times)
  peak MB per rank  the recipe's peak_mem_mb_per_rank, the median over the runs of each rank; DataParallel lists
                    one value per GPU, so GPU 0's extra memory (gathered outputs, gradients) shows
  state kB per rank parameters + gradients + optimizer state held by each rank (DDP: a full copy each; fsdp: a
                    shard each); "-" for a RESULT line without it
  all-reduce kB / step  the ddp_comm_hooks entries: what DDP's comm hook all-reduced in the last training step
                    (rank 0), counted by tests/instrument/sitecustomize.py (every dist.all_reduce torch's ddp_comm_hooks
                    make); they all run under it, "none" too (DDP's own all-reduce, done by a Python hook that does the
                    same); "-" for the other entries
  launch -> step 1  first_step_end_unix (when the first optimizer step ended) minus the wall-clock time just
                    before launch.sh was started: interpreter, launcher, process group, data, model, step 1
  step ms           recipe step time = global batch / images/s (the median too, as for s / 20 it). In one step
                    each replica (a DDP process, or one GPU of DataParallel) trains on global batch / replicas images
  bare ms           a bare loop in this process: the same model on one device, global batch / replicas
                    random images, SGD, no data loader, no wrapper; STEPS steps, the first left out. On the
                    CPU it gets the threads a recipe process gets. It runs once per round for every
                    (batch, device, threads) that the entries of this and earlier rounds need
  step / bare       median step ms / median bare ms: 1.0 = no overhead; above 1 is what the recipe adds (data
                    loading, the DDP/DP wrapper, communication, sharing the cores); AMP entries also include
                    AMP's gain or cost

Comparisons (the second table), made only where both sides were selected and have a successful run:
  each DDP entry (ddp_torchrun, ddp_launch, ddp_spawn, ddp_checkpoint, apex_ddp) against dp (images/s: the
  speed-up of DDP over DataParallel), fsdp against ddp_torchrun (images/s: what sharding costs), ddp_compile
  against ddp_torchrun (images/s: what torch.compile gains after its first step; its compile is in launch -> step
  1), ddp_zero against ddp_torchrun (images/s: what sharding the optimizer state costs), each ddp_comm_hooks hook
  against ddp_comm_hooks:none (images/s: what sending fewer bytes gains or costs), each AMP mode against its
  fp32 sibling (images/s: torch_amp:fp16/bf16 against torch_amp:fp32, apex_amp:O1-O3 against apex_amp:O0), and each
  entry's step ms against its bare loop's.
  The ratio is of the medians. The verdict is "within noise" when the two [lowest, highest] ranges overlap
  (touching counts), else "faster" or "slower"; with a single run on either side there is no range to compare,
  and the verdict says so. Two entries that perform alike, each with N runs in random order, get disjoint ranges
  by chance with probability 2 / C(2N, N): 1 in 3 for N = 2, 1 in 10 for N = 3, 1 in 126 for N = 5 (the default
  --repeats).

Warm-up: recipes leave their first step out of images/s; the bare loop does the same. A --warmup that drops
more steps is not offered, since the RESULT line holds only the average; raise --steps to dilute the rest.
"""

import argparse
import collections
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.data import build_datasets, usable_cores
from common.models import build_model
from tools.cli import unwritable_folder
from tools.procs import run_group

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Entry:
    """One benchmark row: NAME[:MODE], the recipe file (from the repo root) and extra recipe flags.
    one_process: DataParallel-style, one process drives every device (`cpu` on the CPU).
    against: the entry this one is compared with on images/s, when both ran (see Comparisons above).
    counts_bytes: run under tests/instrument, which counts the bytes DDP's comm hook all-reduces each step."""

    name: str
    recipe: str
    args: tuple = ()
    one_process: bool = False
    against: str | None = None
    counts_bytes: bool = False

    @property
    def base(self):
        return self.name.split(":")[0]

    @property
    def mode(self):
        return self.name.split(":", 1)[1] if ":" in self.name else "-"


ENTRIES = [
    Entry("dp", "recipes/dp.py", one_process=True),
    Entry("ddp_torchrun", "recipes/ddp_torchrun.py", against="dp"),
    Entry("ddp_launch", "recipes/ddp_launch.py", against="dp"),
    Entry("ddp_spawn", "recipes/ddp_spawn.py", against="dp"),
    Entry("ddp_checkpoint", "recipes/ddp_checkpoint.py", against="dp"),
    *(Entry(f"torch_amp:{dtype}", "recipes/torch_amp.py", ("--amp-dtype", dtype),
            against=None if dtype == "fp32" else "torch_amp:fp32") for dtype in ("fp16", "bf16", "fp32")),
    Entry("apex_ddp", "recipes/apex_ddp.py", against="dp"),
    Entry("fsdp", "recipes/fsdp.py", against="ddp_torchrun"),
    Entry("ddp_compile", "recipes/ddp_compile.py", against="ddp_torchrun"),
    Entry("ddp_zero", "recipes/ddp_zero.py", against="ddp_torchrun"),
    # PowerSGD compresses from step 3 (its first 2 steps all-reduce whole gradients): the steady state is what counts.
    *(Entry(f"ddp_comm_hooks:{hook}", "recipes/ddp_comm_hooks.py", ("--comm-hook", hook, "--powersgd-start", "2"),
            against=None if hook == "none" else "ddp_comm_hooks:none", counts_bytes=True)
      for hook in ("none", "bf16", "fp16", "powersgd")),
    *(Entry(f"apex_amp:{level}", "recipes/apex_amp.py", ("--opt-level", level),
            against=None if level == "O0" else "apex_amp:O0") for level in ("O0", "O1", "O2", "O3")),
]
BARE = "bare loop"  # the bare loop's place in each round of the schedule, after the entries
ERROR_LINE = re.compile(r"(^|: )error: |^\w*(Error|Exception): ")
# The timed columns: run key, header, format. Each cell is "median (lowest–highest)" over the entry's runs.
TIMED = [("images_per_sec", "images/s", "{:.1f}"), ("s_per_20_it", "s / 20 it", "{:.3f}"),
         ("launch_to_first_step_s", "launch -> step 1 (s)", "{:.2f}"), ("step_ms", "step ms", "{:.2f}"),
         ("bare_step_ms", "bare ms", "{:.2f}")]
FORMAT = {key: fmt for key, _, fmt in TIMED}
COLUMNS = ["recipe", "mode", "world size", "device", "devices", "runs", "images/s", "s / 20 it", "peak MB per rank",
           "state kB per rank", "all-reduce kB / step",
           "launch -> step 1 (s)", "step ms", "bare ms", "step / bare"]
COMPARISON_COLUMNS = ["entry", "against", "measure", "ratio of medians", "entry: median (range)",
                      "against: median (range)", "verdict"]


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Columns: see the top of tools/bench.py.")
    p.add_argument("--recipes", default=",".join(e.name for e in ENTRIES),
                   help="comma-separated entry names; a name without ':MODE' selects all its modes. Default: all of "
                   f"{', '.join(e.name for e in ENTRIES)}. On the CPU the fp16 modes (torch_amp:fp16, apex_amp:O1-O3) "
                   "are slow: CPU fp16 kernels take 10-50x fp32's time")
    p.add_argument("--add-entry", action="append", default=[], metavar="'NAME=RECIPE [ARGS]'",
                   help="define another entry (select it with --recipes), e.g. 'amp_cl=recipes/torch_amp.py "
                   "--channels-last'; repeatable. A recipe file that is missing is skipped with a note")
    p.add_argument("--devices", default="cpu:2",
                   help="launch.sh DEVICES: a GPU list like 0,1,3, or cpu:N (dp gets the same GPUs, or cpu)")
    p.add_argument("--arch", default="tiny", help="model for every recipe: tiny (default), or e.g. resnet101 on GPUs")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch, the same for every recipe (default 64)")
    p.add_argument("--image-size", type=int, default=32, help="synthetic images are SIZE x SIZE (default 32)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per run, the first not timed (default 50)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs per entry, launched in interleaved rounds (A B C A B C); the tables show the median "
                   "and the lowest-highest range (default 5)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process (default 0)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one recipe run may take (default 900)")
    p.add_argument("--out", type=Path, default=REPO / "bench",
                   help="where results.md, .json and .png go (default bench/)")
    args = p.parse_args(argv)
    if not valid_devices(args.devices):
        p.error(f"--devices {args.devices!r}: expected a GPU list like 0,1,3, or cpu:N")
    if args.batch_size % process_count(args.devices):
        p.error(f"--batch-size {args.batch_size} is the GLOBAL batch; it must divide by the "
                f"{process_count(args.devices)} processes of --devices {args.devices}")
    if args.steps < 2:
        p.error("--steps must be >= 2: the first step is not timed")
    for flag, value in (("--batch-size", args.batch_size), ("--image-size", args.image_size),
                        ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{flag} must be >= 1")
    if args.workers < 0:
        p.error("--workers must be >= 0 (DataLoader workers per process)")
    if not args.timeout > 0:  # nan too
        p.error("--timeout must be > 0 (seconds one recipe run may take)")
    return args


def parse_entry(text):
    """'NAME=RECIPE [ARGS...]' -> Entry."""
    name, sep, command = text.partition("=")
    words = shlex.split(command)
    if not sep or not name.strip() or not words:
        raise ValueError(f"--add-entry {text!r}: expected 'NAME=RECIPE [ARGS...]', e.g. 'amp_cl=recipes/torch_amp.py "
                         "--channels-last'")
    return Entry(name.strip(), words[0], tuple(words[1:]))


def select(names, entries):
    """The entries named in the comma-separated `names`, in that order; 'torch_amp' selects every torch_amp:*."""
    chosen = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        found = [e for e in entries if e.name == name] or [e for e in entries if e.base == name]
        if not found:
            raise ValueError(f"unknown recipe entry {name!r}; known: {', '.join(e.name for e in entries)}")
        chosen += [e for e in found if e not in chosen]
    return chosen


def schedule(items, repeats):
    """The launch order as (round, item), rounds numbered from 1: every item once per round, in the given order,
    so A B C A B C, never A A B B C C. A drift in the machine's load then reaches every item alike."""
    return [(round_, item) for round_ in range(1, repeats + 1) for item in items]


# -------------------------------------------------------------------------------------- devices
def valid_devices(devices):
    """Whether DEVICES is one launch.sh takes here: a GPU list like 0,1,3, cpu, or cpu:N with N >= 1."""
    return re.fullmatch(r"cpu(:[1-9][0-9]*)?|[0-9]+(,[0-9]+)*", devices) is not None


def is_cpu(devices):
    return devices == "cpu" or devices.startswith("cpu:")


def process_count(devices):
    """Processes launch.sh starts for DEVICES: cpu -> 2, cpu:N -> N, a GPU list -> its length."""
    if devices == "cpu":
        return 2
    if devices.startswith("cpu:"):
        return int(devices[4:])
    return len(devices.split(","))


def cpu_threads(processes):
    """Threads per recipe process, as launch.sh sets them: OMP_NUM_THREADS if set, else cores / processes."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"].split(",")[0])  # a list (nested levels): the outer one
    return max(1, usable_cores() // processes)


# ------------------------------------------------------------------------------------------- runs
def recipe_command(entry, devices, args, out_dir):
    """The launch.sh command line: shared flags first, the entry's own flags last (they win)."""
    return [str(REPO / "launch.sh"), entry.recipe, devices,
            "--dataset", "synthetic", "--arch", args.arch, "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--workers", str(args.workers),
            "--epochs", "1", "--max-steps", str(args.steps),
            # exactly STEPS full batches per epoch; a small validation set keeps the run short
            "--synthetic-train", str(args.steps * args.batch_size), "--synthetic-val", str(args.batch_size),
            "--out-dir", str(out_dir), *entry.args]


def run_entry(entry, args, round_):
    """Launch one entry once; returns a run dict (with 'result') or a failure dict (with 'error')."""
    devices = "cpu" if entry.one_process and is_cpu(args.devices) else args.devices
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    # The bare loop copies launch.sh's OMP_NUM_THREADS (so dp on `cpu` gets cores / 2 threads, like a DDP process).
    threads = cpu_threads(process_count(devices)) if is_cpu(devices) else None
    run = {"name": entry.name, "recipe": entry.base, "mode": entry.mode, "recipe_path": entry.recipe,
           "devices": devices, "threads_per_process": threads, "round": round_}
    with tempfile.TemporaryDirectory(prefix=f"bench_{entry.base}_") as out_dir:
        argv = recipe_command(entry, devices, args, out_dir)
        run["command"] = shlex.join(argv)
        counts = Path(out_dir) / "counts"
        if entry.counts_bytes:  # every entry compared with this one runs under the instrument too (counts_bytes)
            counts.mkdir()
            path = os.pathsep.join(filter(None, [str(REPO / "tests" / "instrument"), env.get("PYTHONPATH")]))
            env = {**env, "PYTHONPATH": path, "COUNT_DDP_DIR": str(counts)}
        print(f"bench: round {round_}/{args.repeats}: {entry.name}: {run['command']}", flush=True)
        t_launch = time.time()
        try:
            proc = run_group(argv, env, REPO, args.timeout)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            return {**run, "t_launch": t_launch, "error": f"timed out after {args.timeout:g} s", "stderr_tail": ""}
        if entry.counts_bytes and code == 0:  # each rank's bytes per training step
            run["allreduce_bytes_per_step"] = [json.loads(f.read_text())["allreduce_bytes_per_step"]
                                               for f in sorted(counts.glob("rank*.json"))]
    run["t_launch"] = t_launch
    run["wall_s"] = round(time.time() - t_launch, 3)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code != 0 or len(lines) != 1:
        why = f"exit code {code}" if code != 0 else f"{len(lines)} RESULT lines, expected 1"
        return {**run, "error": why, "stderr_tail": stderr_tail(stderr)}
    run["result_line"] = lines[0]
    # The apex recipes' first line says which impl ran and, for apex, which build (python-only is slow on a GPU).
    run["impl_line"] = next((line for line in stdout.splitlines() if line.startswith("impl: ")), None)
    run["result"] = json.loads(lines[0][len("RESULT "):])
    return run


def stderr_tail(stderr, lines=20):
    """The last `lines` lines, after the error lines from further up: a rank's traceback or torchrun's log
    lines can bury its one-line error (`error: ...`, `prog: error: ...`, `ValueError: ...`)."""
    all_lines = stderr.splitlines()
    errors = [line for line in dict.fromkeys(all_lines[:-lines]) if ERROR_LINE.search(line)]
    return "\n".join([*errors[:5], *(["..."] if errors else []), *all_lines[-lines:]])


# ------------------------------------------------------------------------------------- bare loop
def bare_step_seconds(arch, batch, image_size, steps, device, threads):
    """Seconds per step of a minimal training loop: random tensors, forward, loss, backward, SGD.
    Same optimizer settings as the recipes, and on a GPU their cuDNN autotuning and TF32; step 1 is left out, like
    theirs; loss.item() syncs each step."""
    saved_threads = torch.get_num_threads()
    saved_cuda = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
                  torch.backends.cudnn.allow_tf32)
    if threads:
        torch.set_num_threads(threads)
    if torch.device(device).type == "cuda":  # as the recipes set them on a GPU
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        _, _, num_classes = build_datasets("synthetic", image_size=image_size, synthetic_train=1, synthetic_val=1)
        torch.manual_seed(0)
        model = build_model(arch, num_classes, image_size).to(device).train()  # the recipes' model at this size
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        criterion = torch.nn.CrossEntropyLoss()
        images = torch.randn(batch, 3, image_size, image_size, device=device)
        targets = torch.randint(num_classes, (batch,), device=device)
        for step in range(steps):
            loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss.item()
            if step == 0:
                start = time.perf_counter()
        return (time.perf_counter() - start) / (steps - 1)
    finally:
        torch.set_num_threads(saved_threads)
        (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved_cuda


def add_derived(run, args):
    """images/s, s per 20 it, launch -> step 1, step ms and the bare loop's key (batch, device, threads), into `run`."""
    result = run["result"]
    ips = result["images_per_sec"]
    per_rank = result.get("peak_mem_mb_per_rank") or [result["peak_mem_mb"]]
    replicas = max(result["world_size"], len(per_rank))  # DataParallel: 1 process, one replica per GPU
    if is_cpu(run["devices"]):
        device = "cpu"
    else:  # the first listed GPU; CUDA_DEVICE_ORDER=PCI_BUS_ID (set in main) numbers GPUs as launch.sh does
        device = f"cuda:{run['devices'].split(',')[0]}"
    step_s = args.batch_size / ips if ips > 0 else float("inf")
    run.update(world_size=result["world_size"], device=result["device"], images_per_sec=ips,
               s_per_20_it=20 * step_s, peak_mem_mb_per_rank=per_rank, replicas=replicas,
               state_bytes_per_rank=result.get("state_bytes_per_rank"),
               batch_per_replica=args.batch_size // replicas, bare_device=device,
               launch_to_first_step_s=result["first_step_end_unix"] - run["t_launch"], step_ms=1000 * step_s)


def bare_key(run):
    """What the bare loop for this run needs: (batch per replica, device, threads)."""
    return run["batch_per_replica"], run["bare_device"], run["threads_per_process"]


def run_bare(key, args, round_):
    """One bare-loop run for `key`; returns its record for results.json."""
    batch, device, threads = key
    print(f"bench: round {round_}/{args.repeats}: bare loop, batch {batch} on {device}"
          + (f", {threads} thread(s)" if threads else ""), flush=True)
    t_start = time.time()
    seconds = bare_step_seconds(args.arch, batch, args.image_size, args.steps, device, threads)
    return {"batch": batch, "device": device, "threads": threads, "round": round_, "t_start": t_start,
            "step_ms": 1000 * seconds}


# ------------------------------------------------------------------------------------ arithmetic
def summarize(values):
    """(median, lowest, highest) of one measure's runs. The median of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("summarize() needs at least one value")
    return statistics.median(values), min(values), max(values)


def summarize_time(values):
    """summarize() for a time a step derived from images/s (global batch / images/s, each run's): its median is the
    reciprocal of the rates' median, so global batch / the median images/s, as the table's footnote says. The two
    differ for an even count: the mean of the middle two times is not the time of the mean of the middle two rates."""
    if not values:
        raise ValueError("summarize_time() needs at least one value")
    rate = statistics.median([1 / v for v in values])  # a time of inf (images/s 0): rate 0
    low, high = min(values), max(values)
    # 1 / (1 / v) can round past v (25.899085861793406 does): kept inside the runs' range, where it is exactly
    return min(max(1 / rate if rate else float("inf"), low), high), low, high


TIME_KEYS = ("s_per_20_it", "step_ms")  # the timed columns derived from images/s: summarize_time's


def compare(values, against, higher_is_better=True, summary=summarize):
    """`values` against `against` (each one measure's runs): the ratio of their medians, and whether their
    [lowest, highest] ranges overlap (touching counts as overlapping): then the runs cannot tell the two apart and
    the verdict is "within noise", else "faster" or "slower". With one run on either side there is no range:
    within_noise is None. summary: how `values` are summarized (summarize_time for a recipe's step ms)."""
    mine, theirs = summary(values), summarize(against)
    ratio = mine[0] / theirs[0] if theirs[0] else float("inf")
    if min(len(values), len(against)) < 2:
        within_noise, verdict = None, "one run: no range"
    elif mine[1] <= theirs[2] and theirs[1] <= mine[2]:
        within_noise, verdict = True, "within noise"
    else:  # disjoint ranges: the medians differ in the same direction as every run
        within_noise, verdict = False, "faster" if (mine[0] > theirs[0]) == higher_is_better else "slower"
    return {"ratio": ratio, "within_noise": within_noise, "verdict": verdict,
            "entry_summary": mine, "against_summary": theirs, "entry_runs": len(values), "against_runs": len(against)}


def summarize_entry(runs, bare_ms, attempts):
    """One row of the first table from an entry's successful runs (with add_derived's numbers), its bare loop's
    runs (ms) and how many runs were launched. Timed measures: {median, low, high}; peak memory: each rank's median."""
    first = runs[0]
    row = {key: first[key] for key in ("name", "recipe", "mode", "devices", "world_size", "device")}
    row.update(runs=len(runs), attempts=attempts)
    for key, _, _ in TIMED:
        values = bare_ms if key == "bare_step_ms" else [run[key] for run in runs]
        row[key] = dict(zip(("median", "low", "high"), (summarize_time if key in TIME_KEYS else summarize)(values),
                            strict=True))
    per_rank = zip(*(r["peak_mem_mb_per_rank"] for r in runs), strict=True)
    row["peak_mem_mb_per_rank"] = [statistics.median(rank) for rank in per_rank]
    row["state_bytes_per_rank"] = first.get("state_bytes_per_rank")  # exact: the same in every run
    # exact too: rank 0's last step (PowerSGD's first steps send whole gradients)
    row["allreduce_bytes_per_step"] = first["allreduce_bytes_per_step"][0][-1] if first.get(
        "allreduce_bytes_per_step") else None
    row["step_vs_bare"] = row["step_ms"]["median"] / row["bare_step_ms"]["median"]
    row["impl_line"] = first.get("impl_line")
    return row


def comparisons(chosen, runs_by_name, bare_ms_by_name):
    """The second table: each entry that has an `against` (DDP vs dp, an AMP mode vs its fp32 sibling) on images/s,
    then each entry's step ms against its bare loop's; only where both sides have a successful run."""
    made = []
    for entry in chosen:
        if entry.against and runs_by_name.get(entry.name) and runs_by_name.get(entry.against):
            made.append({"entry": entry.name, "against": entry.against, "measure": "images/s",
                         **compare([r["images_per_sec"] for r in runs_by_name[entry.name]],
                                   [r["images_per_sec"] for r in runs_by_name[entry.against]])})
    for entry in chosen:
        if runs_by_name.get(entry.name) and bare_ms_by_name.get(entry.name):
            made.append({"entry": entry.name, "against": BARE, "measure": "step ms",
                         **compare([r["step_ms"] for r in runs_by_name[entry.name]], bare_ms_by_name[entry.name],
                                   higher_is_better=False, summary=summarize_time)})
    return made


# ----------------------------------------------------------------------------------------- report
def hardware():
    """CPU model, cores, GPUs (nvidia-smi), torch, python, date."""
    cpu = platform.processor() or platform.machine()
    try:
        models = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")]
        cpu = models[0] if models else cpu
    except OSError:
        pass
    gpus = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cpu": cpu, "cores": usable_cores(), "gpus": gpus, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def cell(summary, fmt):
    """'median (lowest–highest)' from (median, low, high) or {median, low, high}."""
    median, low, high = (summary["median"], summary["low"], summary["high"]) if isinstance(summary, dict) else summary
    return f"{fmt.format(median)} ({fmt.format(low)}–{fmt.format(high)})"


def table_rows(entries):
    return [[e["recipe"], e["mode"], str(e["world_size"]), e["device"], e["devices"], f"{e['runs']}/{e['attempts']}",
             *(cell(e[key], fmt) for key, _, fmt in TIMED[:2]),
             " / ".join(f"{m:.1f}" for m in e["peak_mem_mb_per_rank"]),
             " / ".join(f"{b / 1024:.1f}" for b in e["state_bytes_per_rank"]) if e.get("state_bytes_per_rank") else "-",
             f"{e['allreduce_bytes_per_step'] / 1024:.1f}" if e.get("allreduce_bytes_per_step") is not None else "-",
             *(cell(e[key], fmt) for key, _, fmt in TIMED[2:]), f"{e['step_vs_bare']:.3f}"] for e in entries]


def mermaid_chart(entries):
    """images/s medians as a Mermaid bar chart, which the code host draws from the text (no image file)."""
    medians = [cell(e["images_per_sec"], "{:.0f}").split()[0] for e in entries]
    names = ", ".join(f'"{e["recipe"]}' + (f':{e["mode"]}"' if e["mode"] != "-" else '"') for e in entries)
    return ["```mermaid", "xychart-beta", '    title "images/s: the median of each entry\'s runs"',
            f"    x-axis [{names}]", f'    y-axis "images/s" 0 --> {int(max(map(float, medians)) * 1.1) + 1}',
            f"    bar [{', '.join(medians)}]", "```"]


def comparison_rows(made):
    rows = []
    for c in made:
        fmt = FORMAT["images_per_sec" if c["measure"] == "images/s" else "step_ms"]
        rows.append([c["entry"], c["against"], c["measure"], f"{c['ratio']:.3f}", cell(c["entry_summary"], fmt),
                     cell(c["against_summary"], fmt), c["verdict"]])
    return rows


def markdown_table(columns, rows, align):
    """A markdown table; `align` has one letter per column, l (left) or r (right)."""
    assert len(align) == len(columns), (align, columns)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return ["| " + " | ".join(columns) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)]


def markdown(report):
    s, hw = report["settings"], report["hardware"]
    gpus = "; ".join(hw["gpus"]) or "none"
    lines = [
        "# Recipe benchmark", "",
        f"- Hardware: {hw['cpu']}, {hw['cores']} cores; GPUs: {gpus}",
        f"- Software: torch {hw['torch']}, Python {hw['python']}, {hw['platform']}; {hw['date']}",
        f"- Settings: --arch {s['arch']}, global batch {s['batch_size']}, {s['image_size']}x{s['image_size']} "
        f"synthetic images, {s['steps']} steps (the first not timed), {s['workers']} loader workers per process, "
        f"devices {s['devices']}; {s['repeats']} run(s) per entry, in interleaved rounds (each round: every entry "
        "once, then the bare loop)",
        f"- Command: `{s['command']}`", "",
        *(markdown_table(COLUMNS, table_rows(report["entries"]), "lllll" + "r" * (len(COLUMNS) - 5))
          if report["entries"] else ["No entry has a successful run."]),
        "",
        "Each timed cell is the median of the entry's runs and, in brackets, the lowest and the highest run; "
        "runs = succeeded / launched. s / 20 it = 20 x global batch / images/s. step ms = global batch / images/s; "
        "bare ms = a plain loop (same model, global batch / replicas images, one device, no loader, no wrapper), "
        "run once per round; step / bare = the ratio of their medians. peak MB per rank: each rank's median.",
        *(["", *mermaid_chart(report["entries"])] if report["entries"] else []),
    ]
    if report["comparisons"]:
        lines += ["", "## Comparisons", "",
                  *markdown_table(COMPARISON_COLUMNS, comparison_rows(report["comparisons"]), "lllrrrl"), "",
                  "ratio of medians = entry's median / against's median. images/s: DDP entries against dp, fsdp "
                  "against ddp_torchrun, comm hooks against none, AMP modes against their fp32 sibling; step ms: each "
                  "entry against its bare "
                  "loop. \"within noise\": the two "
                  "ranges (lowest–highest run) overlap, so these runs cannot tell the two apart; \"faster\" or "
                  "\"slower\": every run of one is beyond every run of the other; \"one run: no range\": a side "
                  "has a single successful run, so there is no spread to compare."]
    impls = [f"{e['name']}: `{e['impl_line']}`" for e in report["entries"] if e.get("impl_line")]
    if impls:  # what the apex rows measured: apex (which build) or torch's stand-in
        lines += ["", "What the apex entries ran (their first line): " + "; ".join(impls)]
    if report["skipped"]:
        lines += ["", "Skipped (recipe file missing): " + ", ".join(report["skipped"])]
    if report["failed"]:
        lines += ["", "Failed runs: " + ", ".join(f"{f['name']} round {f['round']} ({f['error']})"
                                                  for f in report["failed"])]
    if report["failed_entries"]:
        lines += ["", "No successful run, left out of the tables: " + ", ".join(report["failed_entries"])]
    return "\n".join(lines) + "\n"


def plot(report, path):
    """Two horizontal bar charts, images/s and s per 20 it: one bar per entry at its median, whiskers to its lowest
    and highest run. An entry compared with another on images/s is labelled with the ratio of medians; hatched when
    the comparison is within noise."""
    import matplotlib  # here: the Agg backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries, settings = report["entries"], report["settings"]
    versus = {c["entry"]: c for c in report["comparisons"] if c["measure"] == "images/s"}
    labels = [f"{e['name']} [{e['devices']}]" for e in entries]
    fig, axes = plt.subplots(1, 2, figsize=(13, 2 + 0.45 * max(len(entries), 1)), sharey=True)
    for ax, key, title in ((axes[0], "images_per_sec", "images/s (higher is better)"),
                           (axes[1], "s_per_20_it", "s per 20 it (lower is better)")):
        medians = [e[key]["median"] for e in entries]
        whiskers = [[max(e[key]["median"] - e[key]["low"], 0) for e in entries],  # matplotlib refuses any below 0
                    [max(e[key]["high"] - e[key]["median"], 0) for e in entries]]
        hatches = ["//" if versus.get(e["name"], {}).get("within_noise") else "" for e in entries]
        bars = ax.barh(labels, medians, xerr=whiskers, capsize=3, hatch=hatches, edgecolor="white",
                       color="tab:blue" if key == "images_per_sec" else "tab:orange")
        texts = [f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in medians]
        if key == "images_per_sec":
            for i, e in enumerate(entries):
                c = versus.get(e["name"])
                if c:
                    texts[i] += f"   x{c['ratio']:.2f} vs {c['against']}: {c['verdict']}"
        # after the whisker, so that the label never sits on it
        for bar, text, high in zip(bars, texts, [e[key]["high"] for e in entries], strict=True):
            ax.text(high, bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
        ax.set_title(title)
        ax.margins(x=0.45 if key == "images_per_sec" else 0.2)
    axes[0].invert_yaxis()
    hw = report["hardware"]
    names = sorted({gpu.split(", ")[1] for gpu in hw["gpus"] if gpu.count(", ") >= 1})  # "index, name, memory"
    gpus = f"{len(hw['gpus'])} GPU(s): {', '.join(names)}" if hw["gpus"] else "no GPU"
    fig.suptitle(f"--arch {settings['arch']}, global batch {settings['batch_size']}, {settings['image_size']}px, "
                 f"{settings['steps']} steps on {settings['devices']}; {hw['cpu']} ({hw['cores']} cores), {gpus}\n"
                 f"bar: median of {settings['repeats']} run(s); whisker: lowest to highest run; hatched: within "
                 "noise of the entry it is compared with (the ranges overlap)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    try:
        entries = ENTRIES + [parse_entry(text) for text in args.add_entry]
        taken = [name for name, n in collections.Counter(e.name for e in entries).items() if n > 1]
        if taken:  # two configurations under one name would be launched both and summarised as one row
            raise ValueError(f"--add-entry {taken[0]!r}: an entry of that name exists already; give it another name")
        chosen = select(args.recipes, entries)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    problem = unwritable_folder(f"--out {args.out}", args.out)  # now, not after every run: a benchmark whose results
    if problem:  # cannot be written is lost
        print(f"bench: error: {problem}", file=sys.stderr)
        return 2
    # Before the bare loop's first CUDA call: number GPUs as nvidia-smi and launch.sh do, all of them visible.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    visible = os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # launch.sh sets it for each recipe from --devices
    if visible is not None and not is_cpu(args.devices):  # a scheduler's allocation: --devices may leave it
        print(f"bench: note: CUDA_VISIBLE_DEVICES={visible} is not used: --devices {args.devices} names GPUs by "
              "nvidia-smi's index, as launch.sh's DEVICES does", flush=True)

    skipped = [e.name for e in chosen if not (REPO / e.recipe).is_file()]
    for name in skipped:
        print(f"bench: note: skipping {name}: {next(e.recipe for e in chosen if e.name == name)} does not exist",
              flush=True)
    present = [e for e in chosen if e.name not in skipped]
    if not present:
        print("bench: error: nothing ran (every selected recipe file is missing)", file=sys.stderr)
        return 2

    runs, failed, bare_runs = [], [], []
    bare_keys = {}  # (batch, device, threads) -> None, in the order first needed
    for round_, item in schedule([*present, BARE], args.repeats):
        if item == BARE:  # after the round's launches: the bare loop never competes with a recipe for the cores
            bare_runs += [run_bare(key, args, round_) for key in bare_keys]
            continue
        run = run_entry(item, args, round_)
        if "error" in run:
            print(f"bench: FAILED {item.name} (round {round_}/{args.repeats}): {run['error']}\n"
                  f"--- stderr tail ---\n{run['stderr_tail']}\n---", file=sys.stderr, flush=True)
            failed.append(run)
            continue
        add_derived(run, args)
        bare_keys.setdefault(bare_key(run))
        runs.append(run)

    runs_by_name = {e.name: [r for r in runs if r["name"] == e.name] for e in present}
    bare_ms_by_name = {name: [b["step_ms"] for b in bare_runs if (b["batch"], b["device"], b["threads"])
                              == bare_key(mine[0])] for name, mine in runs_by_name.items() if mine}
    summaries = [summarize_entry(runs_by_name[e.name], bare_ms_by_name[e.name],
                                 sum(1 for r in [*runs, *failed] if r["name"] == e.name))
                 for e in present if runs_by_name[e.name]]
    settings = {key: getattr(args, key)
                for key in ("arch", "batch_size", "image_size", "steps", "workers", "devices", "repeats")}
    settings["command"] = shlex.join(["python", "tools/bench.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"settings": settings, "hardware": hardware(), "entries": summaries,
              "comparisons": comparisons(present, runs_by_name, bare_ms_by_name), "runs": runs,
              "bare_runs": bare_runs, "failed": failed,
              "failed_entries": [e.name for e in present if not runs_by_name[e.name]], "skipped": skipped}
    text = markdown(report)
    print("\n" + text, flush=True)  # the tables first: files that cannot be written lose no measurement
    try:
        args.out.mkdir(parents=True, exist_ok=True)  # checked before the first run; it can have gone since
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        try:
            plot(report, args.out / "results.png")
            chart = ", results.png"
        except ImportError as exc:  # matplotlib is in requirements-dev.txt, not requirements.txt
            chart = f" (no chart: {exc}; pip install matplotlib)"
    except OSError as exc:
        print(f"bench: error: cannot write to --out {args.out}: {exc.strerror or exc} ({exc.filename or args.out}); "
              "the tables are printed above", file=sys.stderr)
        return 1
    print(f"bench: wrote {args.out / 'results.md'}, results.json{chart}", flush=True)
    if failed:
        counts = collections.Counter(f["name"] for f in failed)  # in the order of the first failure
        print(f"bench: {len(failed)} run(s) failed: "
              + ", ".join(f"{name} ({n} of {args.repeats})" for name, n in counts.items()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
