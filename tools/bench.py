"""Benchmark the recipes against each other: same model, global batch, synthetic data and step count.

    python tools/bench.py --devices cpu:2                      # every entry, tiny model, 32x32: ~3.5 min on 2 cores
    python tools/bench.py --devices 0,1,3 --arch resnet101 --batch-size 384 --image-size 32 \\
        --recipes dp,ddp_torchrun,apex_ddp,apex_amp,torch_amp:fp16   # write-up 000's table on GPUs 0, 1, 3
    python tools/bench.py --recipes torch_amp --steps 100      # every torch_amp mode (fp16, bf16, fp32)
    python tools/bench.py --add-entry "amp_cl=recipes/torch_amp.py --channels-last" --recipes amp_cl,torch_amp:fp16

The GPU line mirrors write-up 000's table (DataParallel vs DDP vs apex vs AMP, CIFAR-100-sized inputs) with
resnet101 and 128 images per GPU: the global batch must divide by the GPU count (128 on 3 GPUs does not).

Each selected entry (a name, a recipe file and extra recipe flags; see ENTRIES) is started through
launch.sh with `--dataset synthetic --epochs 1 --max-steps STEPS` and exactly STEPS batches of data,
and its `RESULT {json}` line is read. DataParallel (dp) runs as one process: on GPUs it gets the same
GPU list, on the CPU `cpu`. Entries whose recipe file does not exist are skipped with a note. A run
that fails is reported with its stderr tail; the others still run and the tool exits 1 at the end.

Written to --out (default bench/): results.md (the table, also printed), results.json (settings,
hardware, every run's RESULT line and the derived numbers) and results.png (images/s, s per 20 it).

Columns:
  images/s          global images per second, from the recipe; its first step (warm-up) is left out
  s / 20 it         20 * global batch / images/s: seconds for 20 optimizer steps
  peak MB per rank  the recipe's peak_mem_mb_per_rank; DataParallel lists one value per GPU, so GPU 0's
                    extra memory (gathered outputs, gradients) shows
  launch -> step 1  first_step_end_unix (when the first optimizer step ended) minus the wall-clock time just
                    before launch.sh was started: interpreter, launcher, process group, data, model, step 1
  step ms           recipe step time = global batch / images/s. In one step each replica (a DDP process, or
                    one GPU of DataParallel) trains on global batch / replicas images
  bare ms           a bare loop in this process: the same model on one device, global batch / replicas
                    random images, SGD, no data loader, no wrapper; STEPS steps, the first left out. On the
                    CPU it gets the threads a recipe process gets
  step / bare       step ms / bare ms: 1.0 = no overhead; above 1 is what the recipe adds (data loading, the
                    DDP/DP wrapper, communication, sharing the cores); AMP entries also include AMP's gain or cost

Warm-up: recipes leave their first step out of images/s; the bare loop does the same. A --warmup that drops
more steps is not offered, since the RESULT line holds only the average; raise --steps to dilute the rest.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.data import build_datasets
from common.models import build_model
from tools.procs import run_group

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Entry:
    """One benchmark row: NAME[:MODE], the recipe file (from the repo root) and extra recipe flags.
    one_process: DataParallel-style, one process drives every device (`cpu` on the CPU)."""

    name: str
    recipe: str
    args: tuple = ()
    one_process: bool = False

    @property
    def base(self):
        return self.name.split(":")[0]

    @property
    def mode(self):
        return self.name.split(":", 1)[1] if ":" in self.name else "-"


ENTRIES = [
    Entry("dp", "recipes/dp.py", one_process=True),
    Entry("ddp_torchrun", "recipes/ddp_torchrun.py"),
    Entry("ddp_launch", "recipes/ddp_launch.py"),
    Entry("ddp_spawn", "recipes/ddp_spawn.py"),
    Entry("ddp_checkpoint", "recipes/ddp_checkpoint.py"),
    *(Entry(f"torch_amp:{dtype}", "recipes/torch_amp.py", ("--amp-dtype", dtype))
      for dtype in ("fp16", "bf16", "fp32")),
    Entry("apex_ddp", "recipes/apex_ddp.py"),
    *(Entry(f"apex_amp:{level}", "recipes/apex_amp.py", ("--opt-level", level)) for level in ("O0", "O1", "O2", "O3")),
]
ERROR_LINE = re.compile(r"(^|: )error: |^\w*(Error|Exception): ")
COLUMNS = ["recipe", "mode", "world size", "device", "devices", "images/s", "s / 20 it", "peak MB per rank",
           "launch -> step 1 (s)", "step ms", "bare ms", "step / bare"]


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
    p.add_argument("--workers", type=int, default=0, help="TOTAL DataLoader workers per recipe (default 0)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one recipe run may take (default 900)")
    p.add_argument("--out", type=Path, default=REPO / "bench",
                   help="where results.md, .json and .png go (default bench/)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu(:[1-9][0-9]*)?|[0-9]+(,[0-9]+)*", args.devices):
        p.error(f"--devices {args.devices!r}: expected a GPU list like 0,1,3, or cpu:N")
    if args.batch_size % process_count(args.devices):
        p.error(f"--batch-size {args.batch_size} is the GLOBAL batch; it must divide by the "
                f"{process_count(args.devices)} processes of --devices {args.devices}")
    if args.steps < 2:
        p.error("--steps must be >= 2: the first step is not timed")
    for flag, value in (("--batch-size", args.batch_size), ("--image-size", args.image_size)):
        if value < 1:
            p.error(f"{flag} must be >= 1")
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


# -------------------------------------------------------------------------------------- devices
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
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // processes)


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


def run_entry(entry, args):
    """Launch one entry; returns a run dict (with 'result') or a failure dict (with 'error')."""
    devices = "cpu" if entry.one_process and is_cpu(args.devices) else args.devices
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    # The bare loop copies launch.sh's OMP_NUM_THREADS (so dp on `cpu` gets cores / 2 threads, like a DDP process).
    threads = cpu_threads(process_count(devices)) if is_cpu(devices) else None
    run = {"name": entry.name, "recipe": entry.base, "mode": entry.mode, "recipe_path": entry.recipe,
           "devices": devices, "threads_per_process": threads}
    with tempfile.TemporaryDirectory(prefix=f"bench_{entry.base}_") as out_dir:
        argv = recipe_command(entry, devices, args, out_dir)
        run["command"] = shlex.join(argv)
        print(f"bench: {entry.name}: {run['command']}", flush=True)
        t_launch = time.time()
        try:
            proc = run_group(argv, env, REPO, args.timeout)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            return {**run, "error": f"timed out after {args.timeout:g} s", "stderr_tail": ""}
    run["t_launch"] = t_launch
    run["wall_s"] = round(time.time() - t_launch, 3)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if code != 0 or len(lines) != 1:
        why = f"exit code {code}" if code != 0 else f"{len(lines)} RESULT lines, expected 1"
        return {**run, "error": why, "stderr_tail": stderr_tail(stderr)}
    run["result_line"] = lines[0]
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
    Same optimizer settings as the recipes; step 1 is left out, like theirs; loss.item() syncs each step."""
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _, _, num_classes = build_datasets("synthetic", image_size=image_size, synthetic_train=1, synthetic_val=1)
        torch.manual_seed(0)
        model = build_model(arch, num_classes).to(device).train()
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


def add_derived(run, args, bare_cache):
    """images/s, s per 20 it, launch -> step 1 and the step time vs the bare loop, into `run`."""
    result = run["result"]
    ips = result["images_per_sec"]
    per_rank = result.get("peak_mem_mb_per_rank") or [result["peak_mem_mb"]]
    replicas = max(result["world_size"], len(per_rank))  # DataParallel: 1 process, one replica per GPU
    batch = args.batch_size // replicas
    if is_cpu(run["devices"]):
        device = "cpu"
    else:  # the first listed GPU; CUDA_DEVICE_ORDER=PCI_BUS_ID (set in main) numbers GPUs as launch.sh does
        device = f"cuda:{run['devices'].split(',')[0]}"
    key = (batch, device, run["threads_per_process"])
    if key not in bare_cache:
        print(f"bench: bare loop, batch {batch} on {device}" + (f", {key[2]} thread(s)" if key[2] else ""), flush=True)
        bare_cache[key] = bare_step_seconds(args.arch, batch, args.image_size, args.steps, device, key[2])
    step_s = args.batch_size / ips if ips > 0 else float("inf")
    run.update(world_size=result["world_size"], device=result["device"], images_per_sec=ips,
               s_per_20_it=20 * step_s, peak_mem_mb_per_rank=per_rank, replicas=replicas,
               batch_per_replica=batch, launch_to_first_step_s=result["first_step_end_unix"] - run["t_launch"],
               step_ms=1000 * step_s, bare_step_ms=1000 * bare_cache[key], step_vs_bare=step_s / bare_cache[key])


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
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def table_rows(runs):
    return [[r["recipe"], r["mode"], str(r["world_size"]), r["device"], r["devices"], f"{r['images_per_sec']:.1f}",
             f"{r['s_per_20_it']:.3f}", " / ".join(f"{m:.1f}" for m in r["peak_mem_mb_per_rank"]),
             f"{r['launch_to_first_step_s']:.2f}", f"{r['step_ms']:.2f}", f"{r['bare_step_ms']:.2f}",
             f"{r['step_vs_bare']:.3f}"] for r in runs]


def markdown(report):
    s, hw = report["settings"], report["hardware"]
    gpus = "; ".join(hw["gpus"]) or "none"
    lines = [
        "# Recipe benchmark", "",
        f"- Hardware: {hw['cpu']}, {hw['cores']} cores; GPUs: {gpus}",
        f"- Software: torch {hw['torch']}, Python {hw['python']}, {hw['platform']}; {hw['date']}",
        f"- Settings: --arch {s['arch']}, global batch {s['batch_size']}, {s['image_size']}x{s['image_size']} "
        f"synthetic images, {s['steps']} steps (the first not timed), {s['workers']} loader workers, "
        f"devices {s['devices']}",
        f"- Command: `{s['command']}`", "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 5 else "---:" for i in range(len(COLUMNS))) + "|",
        *("| " + " | ".join(row) + " |" for row in table_rows(report["runs"])),
        "",
        "s / 20 it = 20 x global batch / images/s. step ms = global batch / images/s; bare ms = a plain loop "
        "(same model, global batch / replicas images, one device, no loader, no wrapper); step / bare = their ratio.",
    ]
    if report["skipped"]:
        lines += ["", "Skipped (recipe file missing): " + ", ".join(report["skipped"])]
    if report["failed"]:
        lines += ["", "Failed: " + ", ".join(f"{f['name']} ({f['error']})" for f in report["failed"])]
    return "\n".join(lines) + "\n"


def plot(report, path):
    """Two horizontal bar charts: images/s and s per 20 it, one bar per run."""
    import matplotlib  # here: the Agg backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, settings = report["runs"], report["settings"]
    labels = [f"{r['name']} [{r['devices']}]" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.45 * max(len(runs), 1)), sharey=True)
    for ax, key, title in ((axes[0], "images_per_sec", "images/s (higher is better)"),
                           (axes[1], "s_per_20_it", "s per 20 it (lower is better)")):
        values = [r[key] for r in runs]
        bars = ax.barh(labels, values, color="tab:blue" if key == "images_per_sec" else "tab:orange")
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], padding=2, fontsize=8)
        ax.set_title(title)
        ax.margins(x=0.2)
    axes[0].invert_yaxis()
    hw = report["hardware"]
    names = sorted({gpu.split(", ")[1] for gpu in hw["gpus"] if gpu.count(", ") >= 1})  # "index, name, memory"
    gpus = f"{len(hw['gpus'])} GPU(s): {', '.join(names)}" if hw["gpus"] else "no GPU"
    fig.suptitle(f"--arch {settings['arch']}, global batch {settings['batch_size']}, {settings['image_size']}px, "
                 f"{settings['steps']} steps on {settings['devices']}; {hw['cpu']} ({hw['cores']} cores), {gpus}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    try:
        entries = ENTRIES + [parse_entry(text) for text in args.add_entry]
        chosen = select(args.recipes, entries)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    # Before the bare loop's first CUDA call: number GPUs as nvidia-smi and launch.sh do, all of them visible.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # launch.sh sets it for each recipe from --devices

    runs, failed, skipped = [], [], []
    for entry in chosen:
        if not (REPO / entry.recipe).is_file():
            print(f"bench: note: skipping {entry.name}: {entry.recipe} does not exist", flush=True)
            skipped.append(entry.name)
            continue
        run = run_entry(entry, args)
        if "error" in run:
            print(f"bench: FAILED {entry.name}: {run['error']}\n--- stderr tail ---\n{run['stderr_tail']}\n---",
                  file=sys.stderr, flush=True)
            failed.append(run)
        else:
            runs.append(run)
    if not runs and not failed:
        print("bench: error: nothing ran (every selected recipe file is missing)", file=sys.stderr)
        return 2

    bare_cache = {}  # after all launches, so that the bare loop never competes with a recipe for the cores
    for run in runs:
        add_derived(run, args, bare_cache)

    settings = {key: getattr(args, key) for key in ("arch", "batch_size", "image_size", "steps", "workers", "devices")}
    settings["command"] = shlex.join(["python", "tools/bench.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"settings": settings, "hardware": hardware(), "runs": runs, "failed": failed, "skipped": skipped}
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "results.png")
    print("\n" + text, flush=True)
    print(f"bench: wrote {args.out / 'results.md'}, results.json, results.png", flush=True)
    if failed:
        print(f"bench: {len(failed)} run(s) failed: {', '.join(f['name'] for f in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
