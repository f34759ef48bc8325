"""How many DataLoader workers, pin_memory or not, DataLoader or DataLoaderX: measured on your data.

    python tools/tune_loader.py --dataset imagefolder --data-root ~/my_data --batch-size 256 --processes 4
    python tools/tune_loader.py --dataset synthetic --processes 1        # no data needed; ~12 s on 2 cores
    python tools/tune_loader.py --dataset cifar100 --data-root ./data --device cuda --json runs/loader.json
    python tools/tune_loader.py --dataset imagefolder --data-root ~/my_data --rounds 3   # a machine shared with others
    python tools/tune_loader.py --dataset imagefolder --data-root ~/my_data --batch-size 256 --processes 1 --target 6184

It reads the training data exactly as one recipe process does: the dataset from common.data.build_datasets
(the same files, training transforms and image size), process 0's shard of a shuffling DistributedSampler over
--processes processes, batches of --batch-size / --processes (the GLOBAL batch, as in the recipes), drop_last,
persistent workers. Nothing trains: it measures how fast the loader alone can feed one process. If that is
well above what your model's step takes, loading is not your bottleneck. (DataLoaderX's other gain, loading
while the step computes, needs a step to show: tools/bench_loader.py measures that.)

For each setting (a row) it reads --batches batches and reports images/s and ms/batch; with --rounds R it
measures every row R times, round after round, and reports each row's median. Before the clock starts
it reads one batch per worker (at least one): that absorbs the workers' start-up, and leaves every worker busy
with its next batch, so the timed batches are not ones that were already waiting. Rows:
  workers      0, 1, 2, 4, 8, ... up to --max-workers (default: the cores of one process, cores / --processes),
               and the recipes' default count where it is not above that (common.data.default_worker_count:
               one per core of the process beyond its own, at most 16)
  loader       torch's DataLoader, and common.loader.DataLoaderX (loads ahead in a thread; on a GPU also
               copies each batch on a side stream)
  pin_memory   off and on, only with --device cuda; there the time includes the copy to the GPU
The process (and so its workers) is pinned to cores / --processes of the cores: the share of the machine
that one of --processes training processes gets. Every row reads the same samples in the same order; on
--dataset imagefolder one pass reads them first, so that every row reads them from the page cache and none
pays alone for the disk (on data larger than memory, real epochs read from the disk and can be slower).

Recommended: the fastest row; among rows within 5% of it, the one with the fewest workers (fewer workers cost
less memory and start-up for the same speed), printed as the recipe flag: --workers N (per process). Only the rows
a recipe can be set to count: on a GPU the pinned ones (every recipe pins there; the unpinned rows show what pinning
gains). Where that row is DataLoaderX's, the same rule over the DataLoader rows follows: most recipes build a plain
DataLoader.

--target IMAGES_PER_SEC asks the seeds' question with the GPU's own step as the answer to reach: the images/s your
training step runs at with the data already on the GPU, all processes together (tools/gpu_bench.py's section 1 on
your GPU: one H200 ran torch_amp.py's resnet50 step at 6,184 images/s in fp16, bench/gpu.md). Each process must then
load --target / --processes a second; the tool prints, for each loader, the fewest workers that do (among the rows a
recipe can be set to, as above), or, where no row does, how much of each step the GPU would wait
(1 - fastest / needed) and what to do instead.

Output: one progress line per measurement as it finishes, then a table (loader, workers, pin_memory, images/s,
ms/batch), the recommendation and what the recipes' default worker count measured (their DataLoader row); a
chart of images/s against workers (--out, PNG) and, with --json, the settings, the hardware and every row with its
rounds.
Bad input (a missing --data-root, --batches 0, a batch that does not divide by --processes, --device cuda
without a GPU, an --out or --json whose folder cannot be written: checked before measuring) gets one line on stderr
and exit code 2; an image that does not load, one line and exit 1.
"""

import gc
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.data import (
    DEFAULT_IMAGE_SIZE,
    MAX_DEFAULT_WORKERS,
    DataError,
    SampleError,
    build_datasets,
    default_worker_count,
    prepare_dataset,
)
from common.loader import DataLoaderX
from tools.bench import hardware
from tools.cli import OneLineParser, unwritable_output

LOADERS = ("DataLoader", "DataLoaderX")
TOLERANCE = 0.05  # rows within 5% of the fastest count as equally fast
RULE = "the fastest row; among rows within 5% of it, the one with the fewest workers"
COLUMNS = ("loader", "workers", "pin_memory", "images/s", "ms/batch")
CHART_SUFFIXES = (".png", ".svg", ".pdf")


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = OneLineParser("tune_loader", description=__doc__.split("\n")[0],  # a bad flag: one line, not a usage block
                      epilog=f"Recommended: {RULE}. See the top of tools/tune_loader.py.")
    p.add_argument("--dataset", choices=["synthetic", "cifar100", "imagefolder"], default="synthetic")
    p.add_argument("--data-root", default="./data", help="cifar100: download dir; imagefolder: has train/ val/")
    p.add_argument("--image-size", type=int, help="default: 32 (synthetic, cifar100), 224 (imagefolder)")
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch, split evenly across --processes")
    p.add_argument("--processes", type=int,
                   help="training processes that will share this machine (one per GPU); batch per process = "
                   "--batch-size / N, cores per process = cores / N. Default: what launch.sh starts without a "
                   "DEVICES list: one per visible GPU with --device cuda, 2 on the CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: also measure pin_memory on/off and the copy to the GPU (default: cuda if there is one)")
    p.add_argument("--max-workers", type=int,
                   help="the largest worker count tried (default: cores per process); more than the cores can "
                   "pay off where reading waits on a network file system")
    p.add_argument("--batches", type=int, default=50, help="batches each row times, after its warm-up (default 50)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every row this many times, the rounds one after the other, and report each row's "
                   "median: on a machine that other jobs share, 3 or more (default 1)")
    p.add_argument("--out", type=Path, default=Path("runs/tune_loader.png"),
                   help="the chart: .png, .svg or .pdf (default runs/tune_loader.png)")
    p.add_argument("--json", type=Path, help="also write the settings and every row here")
    p.add_argument("--target", type=float, help="the training step's images/s, all processes together, data on "
                   "the GPU (tools/gpu_bench.py section 1): the fewest workers that feed it, or how far short it is")
    return p.parse_args(argv)


def check_args(args):
    """The one-line message for bad input, or None."""
    for flag, value in (("--batches", args.batches), ("--rounds", args.rounds), ("--processes", args.processes),
                        ("--batch-size", args.batch_size), ("--image-size", args.image_size)):
        if value is not None and value < 1:
            return f"{flag} {value} must be >= 1"
    if args.target is not None and not args.target > 0:  # nan too
        return f"--target {args.target} must be > 0 (images/s)"
    if args.out.suffix.lower() not in CHART_SUFFIXES:  # matplotlib decides by the suffix: before any measurement
        return f"--out {args.out} must end in {', '.join(CHART_SUFFIXES)} (the chart's format)"
    if args.max_workers is not None and args.max_workers < 0:
        return f"--max-workers {args.max_workers} must be >= 0"
    if args.batch_size % args.processes:
        return (f"--batch-size {args.batch_size} is the GLOBAL batch and must be a multiple of --processes "
                f"{args.processes}; try --batch-size {max(1, args.batch_size // args.processes) * args.processes}")
    return None


# ------------------------------------------------------------------------------------ pure parts
def cores_per_process(cores, processes):
    """Each of `processes` processes gets cores / processes of the cores, at least one."""
    return max(1, cores // processes)


def worker_sweep(max_workers, also=None):
    """0, 1, 2, 4, 8, ... below max_workers, then max_workers itself: [0], [0, 1], [0, 1, 2, 3], [0, 1, 2, 4, 6];
    and `also` (the recipes' default) in its place where it is not above max_workers: 8 and 7: [0, 1, 2, 4, 7, 8]."""
    counts = [0] + [2**k for k in range(max_workers.bit_length()) if 2**k < max_workers]
    counts = counts + [max_workers] if max_workers > 0 else counts
    return sorted(set(counts) | ({also} if also is not None and 0 <= also <= max_workers else set()))


def settings(max_workers, device_type, also=None):
    """(loader, workers, pin_memory) per row, by worker count; pin_memory only matters on a GPU."""
    pins = (False, True) if device_type == "cuda" else (False,)
    return [(loader, workers, pin) for workers in worker_sweep(max_workers, also) for loader in LOADERS
            for pin in pins]


def recommend(rows, tolerance=TOLERANCE):
    """The row to use: among rows within `tolerance` of the fastest, the fewest workers; then the faster."""
    fastest = max(row["images_per_sec"] for row in rows)
    close = [row for row in rows if row["images_per_sec"] >= (1 - tolerance) * fastest]
    return min(close, key=lambda row: (row["workers"], -row["images_per_sec"]))


def usable(rows, device_type):
    """The rows a recipe can be set to: every recipe pins its batches on a GPU (pin_memory=device.type == "cuda"),
    so there the unpinned rows are measurements only."""
    return [row for row in rows if row["pin_memory"] == (device_type == "cuda")]


def feeding(rows, needed):
    """The row that feeds a step of `needed` images/s a process: among rows at or above it, the fewest workers, then
    the faster; None where no row reaches it."""
    fast = [row for row in rows if row["images_per_sec"] >= needed]
    return min(fast, key=lambda row: (row["workers"], -row["images_per_sec"])) if fast else None


def feeding_by_loader(rows, needed):
    """{loader: the row of that loader that feeds `needed` images/s (feeding), or None}: the DataLoader first, the
    loader of most recipes, so that a DataLoaderX row never stands in for the loader a recipe builds."""
    return {loader: feeding([row for row in rows if row["loader"] == loader], needed) for loader in LOADERS}


def target_line(rows, target, processes):
    """What --target answers over `rows` (the usable ones): for each loader, the workers that feed the step; or,
    where no row does, how much of it the GPU would wait."""
    needed = target / processes
    head = f"target: {target:,.0f} images/s over {processes} process(es), {needed:,.1f} each: "
    fed = feeding_by_loader(rows, needed)
    said = [f"--workers {row['workers']} ({loader}, pin_memory={row['pin_memory']}) feeds it at "
            f"{row['images_per_sec']:.1f} images/s" if row is not None else f"no {loader} row feeds it"
            for loader, row in fed.items()]
    if any(row is not None for row in fed.values()):
        return head + "; ".join(said)
    best = max(rows, key=lambda r: r["images_per_sec"])
    share = best["images_per_sec"] / needed
    return (f"{head}no row feeds it: the fastest, --workers {best['workers']} ({best['loader']}), loads "
            f"{best['images_per_sec']:.1f}, {share:.0%} of it: the GPU would wait for data {1 - share:.0%} of each "
            f"step. Decode on the GPU (recipes/gpu_decode.py: workers hand over the files' bytes) or give each "
            f"process more cores")


def summarize(measurements, batch):
    """One row per setting, in the order first measured: the median images/s of its rounds, and the ms/batch
    that goes with it."""
    by_setting = {}
    for m in measurements:
        by_setting.setdefault((m["loader"], m["workers"], m["pin_memory"]), []).append(m["images_per_sec"])
    rows = []
    for (loader, workers, pin_memory), speeds in by_setting.items():
        ips = statistics.median(speeds)
        rows.append({"loader": loader, "workers": workers, "pin_memory": pin_memory, "images_per_sec": ips,
                     "ms_per_batch": 1000 * batch / ips, "rounds_images_per_sec": speeds})
    return rows


def table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---:|---|---:|---:|"]
    lines += [f"| {r['loader']} | {r['workers']} | {r['pin_memory']} | {r['images_per_sec']:.1f} | "
              f"{r['ms_per_batch']:.2f} |" for r in rows]
    return "\n".join(lines)


def recommendation_line(row):
    return (f"recommended: --workers {row['workers']} ({row['loader']}, pin_memory={row['pin_memory']}) "
            f"at {row['images_per_sec']:.1f} images/s")


def default_line(rows, recipes_default, device_type, max_workers):
    """What the recipes take without --workers, and its row: their DataLoader, pinned on a GPU as they pin."""
    row = next((r for r in rows if (r["loader"], r["workers"], r["pin_memory"])
                == ("DataLoader", recipes_default, device_type == "cuda")), None)
    said = (f"DataLoader at {row['images_per_sec']:.1f} images/s" if row is not None
            else f"above --max-workers {max_workers}, not measured")
    return (f"  the recipes' default here: --workers {recipes_default} (one per core of the process beyond its own, "
            f"at most {MAX_DEFAULT_WORKERS}): {said}")


# ---------------------------------------------------------------------------------------- measure
def batches_forever(loader, sampler):
    """The loader's batches epoch after epoch, as training reads them: a small shard takes several epochs."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def make_loader(dataset, loader, workers, pin_memory, batch, processes, device):
    """Process 0's training loader, built as the recipes build it."""
    sampler = DistributedSampler(dataset, num_replicas=processes, rank=0, shuffle=True, seed=0)
    kwargs = dict(batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=pin_memory, drop_last=True,
                  persistent_workers=workers > 0)
    if loader == "DataLoaderX":
        return DataLoaderX(device, dataset, **kwargs), sampler
    return DataLoader(dataset, **kwargs), sampler


def read_seconds(loader, sampler, warmup, batches, device):
    """Seconds to read `batches` batches (onto `device`) after `warmup` untimed ones."""
    stream = batches_forever(loader, sampler)
    try:
        for step in range(warmup + batches):
            if step == warmup:
                start = time.perf_counter()
            images, targets = next(stream)
            # DataLoaderX has copied it already; a DataLoader's batch is copied here, as the recipes do.
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the last copies are done, not just queued
        return time.perf_counter() - start
    finally:
        stream.close()  # stops DataLoaderX's thread now; the workers go with the loader


def settle(threads_before):
    """Wait until the last loader's workers and threads are gone. On Python <= 3.11 a fork while another thread
    is ending can deadlock the child (CPython gh-112275), and the next row forks its workers."""
    gc.collect()
    deadline = time.monotonic() + 10
    while (multiprocessing.active_children() or set(threading.enumerate()) - threads_before) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a joined thread can still be deleting its thread state, under the lock the fork copies


def measure(dataset, setting, batch, processes, device, batches, threads_before):
    loader_kind, workers, pin_memory = setting
    loader, sampler = make_loader(dataset, loader_kind, workers, pin_memory, batch, processes, device)
    seconds = read_seconds(loader, sampler, max(1, workers), batches, device)
    del loader, sampler
    settle(threads_before)
    return {"loader": loader_kind, "workers": workers, "pin_memory": pin_memory,
            "images_per_sec": batches * batch / seconds, "ms_per_batch": 1000 * seconds / batches}


# ------------------------------------------------------------------------------------------ chart
def plot(report, path):
    """images/s against workers, one line per (loader, pin_memory) through the medians, a dot per round; the
    recommended row starred."""
    import matplotlib  # here: the Agg backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, best, s = report["rows"], report["recommended"], report["settings"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (loader, pin), group in itertools.groupby(sorted(rows, key=lambda r: (r["loader"], r["pin_memory"])),
                                                  key=lambda r: (r["loader"], r["pin_memory"])):
        group = list(group)
        label = loader + (f", pin_memory={pin}" if s["device"] == "cuda" else "")
        (line,) = ax.plot([r["workers"] for r in group], [r["images_per_sec"] for r in group], marker="o",
                          label=label)
        if s["rounds"] > 1:  # the spread says how far to trust a difference
            ax.scatter([r["workers"] for r in group for _ in r["rounds_images_per_sec"]],
                       [v for r in group for v in r["rounds_images_per_sec"]], s=12, alpha=0.4, color=line.get_color())
    ax.plot([best["workers"]], [best["images_per_sec"]], marker="*", markersize=18, color="gold",
            markeredgecolor="black", linestyle="none", label=f"recommended: --workers {best['workers']}")
    ax.set_xticks(sorted({r["workers"] for r in rows}))
    ax.set_xlabel("num_workers per process")
    ax.set_ylabel("images/s (one process)" + (f"; median of {s['rounds']} rounds" if s["rounds"] > 1 else ""))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, markerscale=0.6)
    ax.set_title(f"{s['dataset']} {s['image_size']}px, batch {s['batch_per_process']} per process, "
                 f"{s['cores_per_process']} of {s['cores']} cores (--processes {s['processes']}), {s['device']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main
def error(message, code=2):
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():  # before --processes counts the GPUs
        return error("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    if args.processes is None:
        args.processes = torch.cuda.device_count() if args.device == "cuda" else 2
    problem = check_args(args)
    if problem:
        return error(problem)
    problem = unwritable_output(("--json", args.json), ("--out", args.out))  # now, not after the measuring
    if problem:
        return error(problem)
    # One process's share of the machine, taken before torch starts any thread: the workers inherit the pinning,
    # and torch's threads match launch.sh's OMP_NUM_THREADS. Restored after, for callers of main() in a
    # longer-lived process. The cores are what launch.sh's `nproc` counts: a cpuset can hold fewer than the box.
    saved_affinity, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    per_process = cores_per_process(len(saved_affinity), args.processes)
    os.sched_setaffinity(0, sorted(saved_affinity)[:per_process])
    torch.set_num_threads(per_process)
    try:
        return tune(args, len(saved_affinity), per_process)
    except SampleError as exc:
        return error(str(exc), code=1)
    finally:
        os.sched_setaffinity(0, saved_affinity)
        torch.set_num_threads(saved_threads)


def tune(args, cores, per_process):
    batch = args.batch_size // args.processes
    max_workers = per_process if args.max_workers is None else args.max_workers
    recipes_default = default_worker_count(cores, args.processes)  # what a recipe takes without --workers
    try:
        prepare_dataset(args.dataset, args.data_root)
        train_set, _, _ = build_datasets(args.dataset, args.data_root, args.image_size)
    except DataError as exc:
        return error(str(exc))
    if len(DistributedSampler(train_set, num_replicas=args.processes, rank=0)) < batch:
        return error(f"{len(train_set)} training samples make no full batch of {batch} per process (--batch-size "
                     f"{args.batch_size} / --processes {args.processes}); lower --batch-size")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    image_size = args.image_size or DEFAULT_IMAGE_SIZE[args.dataset]
    # Round after round: drift hits every row alike.
    to_measure = settings(max_workers, device.type, also=recipes_default) * args.rounds
    load = os.getloadavg()[0]  # other jobs on these cores make every row slower and noisier: say so up front
    print(f"tune_loader: {args.dataset} train={len(train_set)} images of {image_size}x{image_size}, batch {batch} "
          f"per process (--batch-size {args.batch_size} / --processes {args.processes}), {per_process} of {cores} "
          f"cores per process, device={device.type}, load average {load:.1f}; {len(to_measure)} measurements of "
          f"{args.batches} batches", flush=True)

    threads_before = set(threading.enumerate())
    if device.type == "cuda":
        torch.zeros(1, device=device)  # CUDA's start-up before the first row, not in it
    if args.dataset == "imagefolder":  # from the disk into the page cache, for every row alike
        start = time.perf_counter()
        measure(train_set, ("DataLoader", max_workers, False), batch, args.processes, torch.device("cpu"),
                args.batches, threads_before)
        print(f"tune_loader: read the samples once (into the page cache): {time.perf_counter() - start:.1f} s",
              flush=True)
    measurements = []
    for i, setting in enumerate(to_measure, 1):
        m = measure(train_set, setting, batch, args.processes, device, args.batches, threads_before)
        measurements.append(m)
        print(f"tune_loader: [{i}/{len(to_measure)}] {m['loader']} workers={m['workers']} "
              f"pin_memory={m['pin_memory']}: {m['images_per_sec']:.1f} images/s, {m['ms_per_batch']:.2f} ms/batch",
              flush=True)
    rows = summarize(measurements, batch)

    best = recommend(usable(rows, device.type))
    settings_used = {"dataset": args.dataset, "data_root": args.data_root, "image_size": image_size,
                     "train_samples": len(train_set), "batch_size": args.batch_size, "processes": args.processes,
                     "batch_per_process": batch, "cores": cores, "cores_per_process": per_process,
                     "device": device.type, "batches": args.batches, "rounds": args.rounds, "max_workers": max_workers,
                     "recipes_default_workers": recipes_default, "load_average": load}
    report = {"settings": settings_used, "hardware": hardware(), "rows": rows, "recommended": best, "rule": RULE}
    note = f"\n(images/s: each row's median of its {args.rounds} rounds)" if args.rounds > 1 else ""
    print(f"\n{table(rows)}{note}\n", flush=True)
    print(recommendation_line(best), flush=True)
    if best["loader"] != "DataLoader":  # most recipes build a plain DataLoader: give them their own setting
        plain = recommend([row for row in usable(rows, device.type) if row["loader"] == "DataLoader"])
        print(f"  with DataLoader (the loader of most recipes): --workers {plain['workers']} "
              f"(pin_memory={plain['pin_memory']}) at {plain['images_per_sec']:.1f} images/s", flush=True)
    print(f"  rule: {RULE}; --workers counts per process, images/s is one process's", flush=True)
    print(default_line(rows, recipes_default, device.type, max_workers), flush=True)
    if args.target is not None:
        report["target"] = {"images_per_sec": args.target, "per_process": args.target / args.processes,
                            "rows": feeding_by_loader(usable(rows, device.type), args.target / args.processes)}
        print(target_line(usable(rows, device.type), args.target, args.processes), flush=True)
    written = []
    if args.json:  # the numbers first: a chart that fails to write loses no measurement
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        written.append(str(args.json))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, args.out)
    print(f"tune_loader: wrote {', '.join([str(args.out), *written])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
