"""The recipes' speed on one GPU against published references: throughput, the recipe's cost over a bare loop,
torch.compile's gain, the language model's MFU at GPT-2 small's shape, and AMP's gain (issue 59).

    python tools/gpu_bench.py --out bench/gpu.json --md bench/gpu_table.md   # one H100 or H200: about 9-10 min
    python tools/gpu_bench.py --render bench/gpu-2026-11-28-h200 --tree b41c64a --md bench/gpu.md   # no GPU

One process, world size 1, synthetic data made on the device (no download, no dataset). Every figure is the median
of --steps timed steps after --warmup untimed ones, each step timed on the device (CUDA events recorded between
steps, read after one synchronize at the end: no sync inside the timed steps; on the CPU the host clock, where
synchronize is a no-op). DDP at world size 1 needs a process group: one process on a free local port (nccl on a
GPU, gloo on the CPU), destroyed at the end. Sections (--only picks some; they run in the order 1, 5, 2, 4, 3, 6
so that the long compile comes late and the recipes' own jobs last):

 1 throughput  torch_amp.py's model and step at its default precision (fp16 autocast with GradScaler on a GPU),
               bf16 beside it: resnet50, channels-last, batch 256 at 224 px, the batch already on the GPU, DDP at
               world 1, fused SGD, its meters and harness calls. images/s against NVIDIA DeepLearningExamples'
               ResNet-50 v1.5 for PyTorch, mixed precision on one A100 80GB: 2,470 images/s (pytorch-21.03
               container, DALI loader); goal: 1.5x that.
 2 overhead    ddp_torchrun.py's step (fp32 with TF32 as that recipe runs, DDP at world 1, DistributedSampler and a
               DataLoader over images already on the GPU, its meters, Throughput, DivergenceCheck, TensorBoard and
               Profiler calls) against a bare loop of the same model, batch and SGD in this process (bare_loop_step
               below), their timed steps interleaved in rounds. Goal: the recipe's median step at most 1.05x the
               bare loop's.
 3 compile     ddp_compile.py's step (model.compile(dynamic=False) before the DDP wrap) against the same step eager,
               resnet50 with bf16 autocast and channels-last on both sides. Goal: 1.2x the eager images/s. The first
               step (trace and compile) is timed apart, with the graphs and graph breaks dynamo counted.
 4 lm_ddp,     lm_ddp.py's model and step at GPT-2 small's shape (12 layers, 12 heads, d_model 768, 1024 bytes a
   lm_tp,      sequence, its global batch of 32, bf16 autocast, AdamW, clipping, the stop vote), then lm_tp.py's
   lm_fsdp_tp  (parallelize_module with its plan on a mesh of 1: --tp 1, DTensor's dispatch cost), each eager and
               with the recipes' --compile. tokens/s and MFU: model FLOPs per token 6N + 12 L d T (nanoGPT's
               estimate_mfu, PaLM's appendix B; N: the parameters that multiply, every one but the two embedding
               tables) against the GPU's dense bf16 peak from its datasheet (PEAKS; --peak-tflops for another GPU).
               Beside them what nanoGPT and llm.c publish. Last, no goal riding on it, lm_fsdp_tp.py's step at
               --dp 1 --tp 1 (its plan, then fully_shard on each block and the root, on a 1 x 1 mesh), eager and
               compiled, against lm_ddp's.
 5 amp         the step of 1 in fp32 with TF32 on (torch_amp.py --amp-dtype tf32) against its default (fp16), bf16
               beside: DLE's A100 80GB table has 938 images/s TF32 against 2,470 mixed precision, 2.63x. (The first
               run measured bf16 alone: its BatchNorm takes torch's own kernels, fp16's cuDNN's: bench/gpu.md.)
 6 data        the recipes themselves, each a ./launch.sh job on GPU 0 (issue 65): torch_amp.py on in-memory images,
               torch_amp.py on --data-files real JPEGs (tools/make_jpegs.py, 500x375 px) decoded by its workers with
               PIL, and gpu_decode.py on the same files decoded on the GPU; the last epoch's img/s of each at the
               recipe's default precision, and the CPU cores each job kept busy. Goal: the best file path at least
               0.95x in memory; then the three again with --compile (goal 0.90x). Estimated at 6-7 minutes on an
               H200 with 16 cores (20,000 files made in about 20 s), not yet run on a GPU: tools/gpu_session.sh
               gives it a call of its own.

After each measurement's timed steps, 3 more run under torch.profiler: its JSON's top_ops, the ops that take the
step's time on the device, from which a missed goal's cause is read (the timed steps are not profiled).
Writes --out (JSON: the environment, the settings, every timed step of every measurement, the summaries) and
prints a Markdown table (also --md FILE) with the reference or goal beside each figure and met / missed. A section
or a row that fails is reported in the table and the JSON, the others still run, and the exit code is 1. Stopped
by SIGTERM (a time limit: tools/gpu_session.sh's) or Ctrl-C, it writes --out all the same: the section it was in
keeps the rows that had ended (lm's rows, data's jobs), marked cut_short, and the sections after it do not run.
On the CPU (--device cpu) every size defaults to a tiny one (tests/test_gpu_bench.py): a check that the script runs,
not a measurement. The GPU machine's torch is 2.11: nothing here needs a newer one.

--render measures nothing and needs no GPU: it merges the JSONs of one machine's runs (a folder: its *.json; e.g. one
`--only SECTION` process each), refusing ones whose machine, torch or sizes differ, and writes --md: a header (the
tree, given by --tree since the JSONs do not record it; the machine; the dates; the commands), table() of the merged
report, a marker line, and below it whatever the page already held there, kept byte for byte (bench/gpu.md's
hand-written reading). Run again, it rewrites the same bytes (tests/test_gpu_bench.py checks bench/gpu.md). With
--tier FILE (the GPU tier's JUnit XML, tools/gpu_session.sh's OUT/tier.xml) the page also gets each language model's
run on one GPU from the tier (tokens/s, val_bpb, peak memory: lm_moe's tokens/s for issue 67) and the tier's totals.
"""

import argparse
import collections
import contextlib
import datetime
import itertools
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # common/ and tools/ when run as a script
from common import harness  # noqa: E402
from common.compiler import missing_compiler  # noqa: E402
from common.lm import Transformer, adamw_implementation, check_model_flags, train_batch  # noqa: E402
from common.models import build_model, check_arch, check_image_size  # noqa: E402
from common.schedule import default_lr, warmup_cosine  # noqa: E402
from common.utils import AverageMeter, accuracy, first_line  # noqa: E402
from tools import junit  # noqa: E402
from tools.cli import OneLineParser, unwritable_output, write_failed  # noqa: E402
from tools.free_port import free_port  # noqa: E402
from tools.recipes import load_recipe  # noqa: E402

SECTIONS = ("throughput", "overhead", "compile", "lm", "amp", "data")  # the issues' order: the table's
RUN_ORDER = ("throughput", "amp", "overhead", "lm", "compile", "data")  # the long compile, then the recipes' runs
ROWS = ("throughput", "overhead", "compile", "lm_ddp", "lm_tp", "lm_fsdp_tp", "amp", "data")  # the table's; lm as 3

# NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA
# DGX A100 (8x A100 80GB)", 1 GPU, batch 256, pytorch-21.03 NGC container, DALI loader.
DLE = {"source": "NVIDIA DeepLearningExamples ResNet-50 v1.5 for PyTorch, README 'Training performance: NVIDIA DGX "
                 "A100 (8x A100 80GB)', 1 GPU, batch 256, pytorch-21.03 container, DALI",
       "tf32_images_per_sec": 938, "mixed_images_per_sec": 2470, "speedup": 2.63}
GOALS = {"throughput": 1.5, "overhead": 1.05, "compile": 1.2, "amp": DLE["speedup"], "data": 0.95,
         # issue 66: lm_ddp compiled at least 45% MFU; lm_tp --tp 1 at most 1.6x lm_ddp's step eager, 1.1x compiled
         "lm_mfu_compiled": 0.45, "lm_tp_eager": 1.6, "lm_tp_compiled": 1.1,
         "data_compiled": 0.90}  # issue 65: the best JPEG path >= 0.95x in memory eager, >= 0.90x compiled
# Dense (no 2:4 sparsity) bf16 tensor-core peaks, matched in order against torch.cuda.get_device_name(). An NVL part
# (a lower clock) matches none: its MFU is left out unless --peak-tflops gives its peak.
PEAKS = [
    ("H100 PCIe", 756.0, "H100 PCIe: 756 TFLOPS dense bf16 (the datasheet's 1,513 is with sparsity; llm.c's "
                         "llmc/mfu.h has the same)"),
    ("H100", 989.0, "H100 SXM: 989 TFLOPS dense bf16 (the datasheet's 1,979 is with sparsity)"),
    ("H200", 989.0, "H200 SXM: 989 TFLOPS dense bf16, the H100 SXM's (the datasheet's 1,979 is with sparsity)"),
    ("A100", 312.0, "A100: 312 TFLOPS dense bf16 (the datasheet's 624 is with sparsity)"),
]
# What nanoGPT and llm.c publish for GPT-2 small (124M); only what was found in their own text.
LM_REFERENCES = [
    {"name": "llm.c", "mfu": "up to ~60%", "hardware": "8X A100 80GB SXM",
     "source": "karpathy/llm.c discussion #481 ('Reproducing GPT-2 (124M) in llm.c in 90 minutes for $20'): "
               "'quite efficient at up to ~60% model flops utilization'; its MFU counts 6N + 6 L d T against "
               "A100's 312 TFLOPS (train_gpt2.cu gpt2_estimate_mfu, llmc/mfu.h)"},
    {"name": "nanoGPT", "mfu": "not verified", "hardware": "-",
     "source": "its README publishes no MFU for GPT-2 (124M) (only '4 days on 8XA100 40GB'); train.py prints one "
               "from 6N + 12 L H Q T against A100's 312 TFLOPS (model.py estimate_mfu)"},
]
GPU_DEFAULTS = dict(arch="resnet50", image_size=224, batch_size=256, num_classes=1000, steps=30, warmup=10,
                    lm_layers=12, lm_heads=12, lm_d_model=768, lm_seq_len=1024, lm_batch_size=32, data_files=20000)
CPU_DEFAULTS = dict(arch="tiny_bn", image_size=16, batch_size=8, num_classes=10, steps=3, warmup=1,
                    lm_layers=2, lm_heads=2, lm_d_model=32, lm_seq_len=32, lm_batch_size=4, data_files=48)


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = OneLineParser("gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default): GPU 0 at the sizes above; cpu: tiny sizes, a check that it runs")
    p.add_argument("--only", help=f"comma-separated sections, of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--arch", help="image model (default: resnet50; cpu: tiny_bn)")
    p.add_argument("--image-size", type=int, help="synthetic images are SIZE x SIZE (default 224; cpu: 16)")
    p.add_argument("--batch-size", type=int, help="images a step (default 256; cpu: 8)")
    p.add_argument("--num-classes", type=int, help="classes (default 1000, ImageNet's; cpu: 10)")
    p.add_argument("--steps", type=int, help="timed steps per measurement (default 30; cpu: 3)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 10; cpu: 1)")
    p.add_argument("--lm-layers", type=int, help="the language model's layers (default 12; cpu: 2)")
    p.add_argument("--lm-heads", type=int, help="its heads (default 12; cpu: 2)")
    p.add_argument("--lm-d-model", type=int, help="its width (default 768; cpu: 32)")
    p.add_argument("--lm-seq-len", type=int, help="bytes a sequence, also its positions (default 1024; cpu: 32)")
    p.add_argument("--lm-batch-size", type=int, help="sequences a step (default 32, lm_ddp.py's; cpu: 4)")
    p.add_argument("--data-files", type=int, help="section data: training JPEGs tools/make_jpegs.py makes, 500x375 "
                   "(default 20000; cpu: 48 of 40x30), and a twentieth of that for validation")
    p.add_argument("--data-root", type=Path, help="section data: an ImageFolder of JPEGs already made (default: a new "
                   "one in a temporary folder)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: PEAKS by its name)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "gpu.json", help="the JSON (default bench/gpu.json)")
    p.add_argument("--md", type=Path, help="also write the table here (--render: the Markdown page to write)")
    p.add_argument("--render", nargs="+", type=Path, metavar="DIR_OR_JSON",
                   help="measure nothing: merge these JSONs (a folder: its *.json), one machine's per-section runs, "
                        "into --md FILE: a header, the table, and FILE's own text below its marker line, kept")
    p.add_argument("--tree", help="--render: the project commit the JSONs were measured at (they do not record it)")
    p.add_argument("--tier", type=Path, metavar="XML", help="--render: also the language models' runs of the GPU tier "
                   "from its JUnit XML (tools/gpu_session.sh tier writes OUT/tier.xml)")
    args = p.parse_args(argv)
    if args.tier is not None and args.render is None:
        p.error("--tier goes with --render")
    if args.render is not None:  # no device, no sizes: everything comes from the JSONs
        if args.md is None:
            p.error("--render needs --md FILE, the page to write")
        return args
    if args.tree is not None:
        p.error("--tree goes with --render")
    for key, value in (CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag in ("image_size", "batch_size", "num_classes", "steps", "lm_batch_size", "data_files"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup} must be >= 0")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        p.error(f"--peak-tflops {args.peak_tflops} must be a finite number > 0")
    args.sections = SECTIONS if args.only is None else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sections:
        p.error(f"--only {args.only!r}: expected some of {','.join(SECTIONS)}")
    try:
        check_arch(args.arch)
        check_image_size(args.arch, args.image_size)
        check_model_flags(args.lm_layers, args.lm_heads, args.lm_d_model, args.lm_seq_len, args.lm_seq_len)
    except ValueError as exc:
        p.error(str(exc))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here; --device cpu runs the tiny check (tests/test_gpu_bench.py)")
    return args


# ------------------------------------------------------------------------------------------ timing
def timed(step, warmup, steps, device):
    """Milliseconds of each of `steps` calls of step(), after `warmup` untimed calls and a synchronize. On a GPU one
    CUDA event is recorded between consecutive steps and all are read after one synchronize at the end: each
    interval is the device's time from one step boundary to the next, host-bound gaps included, with no sync
    inside the timed steps. On the CPU: the host clock (the work is done when the call returns)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for mark in marks[1:]:
            step()
            mark.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    times, last = [], time.perf_counter()
    for _ in range(steps):
        step()
        now = time.perf_counter()
        times.append(1000 * (now - last))
        last = now
    return times


def summary(times, warmup, per_step=None, unit=None):
    """The median of the timed steps (and their range, every step's ms); per_step items (images, tokens): a rate."""
    median = statistics.median(times)
    out = {"median_ms": median, "min_ms": min(times), "max_ms": max(times), "timed_steps": len(times),
           "warmup_steps": warmup, "steps_ms": times}
    if per_step is not None:
        out[f"{unit}_per_sec"] = per_step * 1000 / median
    return out


def interleaved(steps_by_name, warmup, steps, device, rounds=3):
    """{name: per-step ms}: each step() warmed up, then the timed steps taken in `rounds` rounds, every name once a
    round (A B A B A B): a drift in the machine's pace reaches both alike. The rounds' sizes add up to `steps`."""
    for step in steps_by_name.values():
        timed(step, warmup, 0, device)
    rounds = max(1, min(rounds, steps))
    sizes = [steps // rounds + (i < steps % rounds) for i in range(rounds)]
    times = {name: [] for name in steps_by_name}
    for size in sizes:
        for name, step in steps_by_name.items():
            times[name] += timed(step, 0, size, device)
    return times


def profiled(step, device, steps=3, top=12):
    """Where one step's time goes, after the timed steps (it changes none of them): torch.profiler over `steps`
    more steps, the `top` ops by their own time on the device (on the CPU, the host's), per step, in ms. What a
    missed goal's 'why' is read from."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch's CUDA build on a machine without one: quiet
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            torch.get_device_module(device.type).synchronize()
    except Exception as exc:  # a profiler that cannot start here (CUPTI) costs the profile, not the measurement
        return [{"op": f"profile failed: {type(exc).__name__}: {exc}"[:300], "calls_per_step": 0, "self_cpu_ms": 0,
                 "self_device_ms": 0}]
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"op": e.key, "calls_per_step": e.count / steps,
                     "self_cpu_ms": e.self_cpu_time_total / 1000 / steps, "self_device_ms": device_us / 1000 / steps})
    key = "self_device_ms" if device.type == "cuda" else "self_cpu_ms"
    return sorted(rows, key=lambda r: -r[key])[:top]


# -------------------------------------------------------------------------------------------- data
def image_batch(args, device, memory_format=torch.contiguous_format):
    """A fixed synthetic batch already on the device: (images, labels)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), generator=g)
    return images.to(device, memory_format=memory_format), labels.to(device)


class DeviceImages(Dataset):
    """`length` items cycling over a pool of images already on the device, with int labels as the recipes'
    datasets give them: the sampler, the DataLoader's per-item indexing and collation and the recipe's .to(device)
    run as in ddp_torchrun.py; decoding and the host-to-device copy of the images do not."""

    def __init__(self, images, labels, length):
        self.images, self.labels, self.length = images, labels.tolist(), length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        j = i % len(self.labels)
        return self.images[j], self.labels[j]


# --------------------------------------------------------------------------------------- the steps
class Harness:
    """The harness calls each recipe's loop makes (common/harness.py): Throughput watching the model, the divergence
    check, TensorBoard and Profiler (both off, as in a run without --tb-dir and --profile), the meters."""

    def __init__(self, device, model, forward=None):
        self.speed = harness.Throughput(device)
        self.speed.watch(model, forward=forward)
        self.diverged = harness.DivergenceCheck(device)
        self.tb = harness.TensorBoard(None, 20, True, {})
        self.prof = harness.Profiler(False, "runs/gpu_bench", 0, device)
        self.loss_meter, self.acc_meter = AverageMeter(), AverageMeter()
        self.recent = collections.deque(maxlen=4)
        self.step = 0
        self.speed.start()


def ddp(model, device, **kwargs):
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def torch_amp_step(args, device, amp_name):
    """recipes/torch_amp.py's model and training step at --accum-steps 1, no --clip-grad, --channels-last: its
    DDP wrap, fused SGD with zeroed momentum, GradScaler (enabled for fp16 only), schedule and the loop body from
    `images = images.to(...)` to `prof.step()`, the batch already on the device (its .to() a no-op then)."""
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "fp32": torch.float32}[amp_name]
    memory_format = torch.channels_last
    torch.manual_seed(0)
    model = build_model(args.arch, args.num_classes, args.image_size).to(device, memory_format=memory_format)
    model = ddp(model, device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=default_lr(args.batch_size), momentum=0.9, weight_decay=5e-4,
                                fused=True)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scheduler = warmup_cosine(optimizer, 1, 10_000, 0.1)  # long: the rate stays in range for any --steps
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    h = Harness(device, model, forward=model.module)
    x, y = image_batch(args, device, memory_format)

    def step():
        images = x.to(device, non_blocking=True, memory_format=memory_format)
        targets = y.to(device, non_blocking=True)
        h.recent.append(images)
        with contextlib.nullcontext():  # the boundary micro-batch: no no_sync() at --accum-steps 1
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                output = model(images)
                loss = criterion(output, targets)
            scaler.scale(loss / 1).backward()
        h.loss_meter.update(loss, images.size(0))
        h.acc_meter.update(accuracy(output, targets)[0], images.size(0))
        if not scaler.is_enabled():
            h.diverged.update(h.step + 1, loss)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        h.step += 1
        h.tb.step(h.step, h.loss_meter, h.acc_meter, lr=optimizer.param_groups[0]["lr"])
        h.speed.step(args.batch_size)
        h.prof.step()

    return step


def ddp_torchrun_step(args, device, total_steps):
    """recipes/ddp_torchrun.py's model and training step at world size 1: build_model(...).to(device) (fp32, TF32 on
    a GPU as the recipe sets it), its DDP wrap, SGD, schedule, DistributedSampler and DataLoader (0 workers: the
    images are on the device already) iterated through tqdm, and the loop body from `images, targets = ...to()` to
    `prof.step()`."""
    torch.manual_seed(0)
    model = ddp(build_model(args.arch, args.num_classes, args.image_size).to(device), device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=default_lr(args.batch_size), momentum=0.9, weight_decay=5e-4)
    images, labels = image_batch(args, device)
    train_set = DeviceImages(images, labels, args.batch_size * total_steps)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(train_set, sampler=sampler, drop_last=True, batch_size=args.batch_size, num_workers=0,
                        pin_memory=False)
    scheduler = warmup_cosine(optimizer, 1, len(loader), 0.1)
    h = Harness(device, model, forward=model.module)
    sampler.set_epoch(0)
    model.train()
    batches = iter(tqdm(loader, desc="epoch 1", leave=False, disable=True))

    def step():
        images, targets = next(batches)
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        h.recent.append(images)
        output = model(images)
        loss = criterion(output, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        h.loss_meter.update(loss, images.size(0))
        h.acc_meter.update(accuracy(output, targets)[0], images.size(0))
        h.step += 1
        h.diverged.update(h.step, loss)
        h.tb.step(h.step, h.loss_meter, h.acc_meter, lr=optimizer.param_groups[0]["lr"])
        h.speed.step(args.batch_size)
        h.prof.step()

    return step


def bare_loop_step(args, device):
    """The bare loop: the same model, batch and SGD as ddp_torchrun_step, nothing else."""
    torch.manual_seed(0)
    model = build_model(args.arch, args.num_classes, args.image_size).to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=default_lr(args.batch_size), momentum=0.9, weight_decay=5e-4)
    x, y = image_batch(args, device)

    def step():
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def ddp_compile_step(args, device, compiled):
    """recipes/ddp_compile.py's model and training step (model.compile(dynamic=False) in place before the DDP wrap
    with bucket_cap_mb=25, plain SGD, the loop body of ddp_torchrun.py), with bf16 autocast around forward and loss
    and channels-last (issue 59: resnet50 bf16; the recipe itself runs fp32), on a batch already on the device.
    compiled=False: the same without model.compile()."""
    memory_format = torch.channels_last
    torch.manual_seed(0)
    model = build_model(args.arch, args.num_classes, args.image_size).to(device, memory_format=memory_format)
    if compiled:
        model.compile(dynamic=False)
    model = ddp(model, device, bucket_cap_mb=25)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=default_lr(args.batch_size), momentum=0.9, weight_decay=5e-4)
    scheduler = warmup_cosine(optimizer, 1, 10_000, 0.1)
    h = Harness(device, model)  # as ddp_compile.py: its forward is compiled, the data wait alone is watched
    x, y = image_batch(args, device, memory_format)

    def step():
        images, targets = x, y
        h.recent.append(images)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            output = model(images)
            loss = criterion(output, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        h.loss_meter.update(loss, images.size(0))
        h.acc_meter.update(accuracy(output, targets)[0], images.size(0))
        h.step += 1
        h.diverged.update(h.step, loss)
        h.speed.step(args.batch_size)
        h.prof.step()

    return step


def matmul_params(model):
    """N of the FLOPs count: the parameters that multiply, every one but the two embedding tables (a lookup is no
    product; the untied head is one)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok_emb", "pos_emb")))


def lm_model(args, device):
    torch.manual_seed(0)
    return Transformer(args.lm_layers, args.lm_heads, args.lm_d_model, args.lm_seq_len).to(device)


def lm_step(args, device, recipe, stop_group, compiled=False):
    """A language-model recipe's training step, bf16 autocast, from `x, y = ...train_batch(...)` to the stop vote, on
    random bytes in place of the corpus. recipe: "lm_ddp" (DDP at world 1), "lm_tp" (parallelize_module with its
    tp_plan on a mesh of 1, loss_parallel, grads_as_params, clipping under implicit_replication) or "lm_fsdp_tp" (its
    tp_plan on the tp row of a 1 x 1 (dp x tp) mesh, then FSDP2's fully_shard on each block and the root across dp,
    loss_parallel, its clip_grad_norm_across_meshes; one micro-batch, as its default --accum-steps 1). The weights
    are lm_model's, built on the device (lm_fsdp_tp.py builds on meta and loads rank 0's: the same step after).
    compiled: the recipes' --compile, each block compiled in place (before the DDP wrap; after the plan; before
    fully_shard). Returns (step, the model's multiplying parameters N)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tp, fsdp = recipe in ("lm_tp", "lm_fsdp_tp"), recipe == "lm_fsdp_tp"
    model = lm_model(args, device)
    n_matmul = matmul_params(model)
    module = load_recipe(recipe) if tp else None  # its own plan, grads_as_params, clip_grad_norm_across_meshes
    if fsdp:
        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], module.tp_plan(False), src_data_rank=0)
    elif tp:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
        model = parallelize_module(model, mesh, module.tp_plan(False), src_data_rank=0)
    for block in model.blocks.values() if compiled else ():
        block.compile(dynamic=False)  # as the recipes' --compile
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif not tp:
        model = ddp(model, device)
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), **adamw_implementation(dtensor=tp))  # the recipes'
    scheduler = warmup_cosine(optimizer, 1, 10_000, 0.05)
    # The recipes' own plumbing objects: the loss, the clock, the NaN watch, --profile (off); SIGUSR1's vote.
    meter = harness.StepMeter(model, device, False, "runs/gpu_bench", 0, forward=None if tp else model.module)
    vote = harness.StopVote(False, stop_group)  # no SIGUSR1 here: every vote says go on, as in a normal run
    g = torch.Generator().manual_seed(0)
    train_text = torch.randint(0, 256, (max(1 << 20, 8 * args.lm_seq_len),), generator=g, dtype=torch.uint8)
    steps = [0]

    def step():
        x, y = (t.to(device, non_blocking=True)
                for t in train_batch(train_text, steps[0], 0, args.lm_batch_size, args.lm_seq_len, 0, 1))
        if fsdp:  # as lm_fsdp_tp.py: before the micro-batches; the last (here the only) one reduce-scatters
            optimizer.zero_grad(set_to_none=True)
            model.set_requires_gradient_sync(True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x)
        if fsdp:
            with loss_parallel():
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss.backward()
            loss = loss.detach().to_local()
            module.clip_grad_norm_across_meshes(model, 1.0)
            optimizer.step()
        elif tp:
            optimizer.zero_grad(set_to_none=True)
            with loss_parallel():
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss.backward()
            loss = loss.to_local()
            module.grads_as_params(model)
            with implicit_replication():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        scheduler.step()
        steps[0] += 1
        meter.step(steps[0], loss, args.lm_batch_size * args.lm_seq_len)  # tokens (bytes); no host sync
        vote.all_reduce_max()  # the last step's vote read, this step's started (gloo, beside the step)

    return step, n_matmul


# ----------------------------------------------------------------------------------------- sections
def free(device):
    """Between sections: the last one's tensors gone, its peak forgotten."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device):
    return round(harness.peak_memory_mb(device), 1)


def recipe_default(device):
    """torch_amp.py's own precision with no --amp-dtype: fp16 on a GPU; on a CPU bf16 where it is native, else fp32."""
    return "fp16" if device.type == "cuda" else harness.cpu_amp_default()


def amp_measure(args, device, cache, amp_name):
    """torch_amp_step in `amp_name`: timed, then profiled (cached: sections 1 and 5 share each)."""
    if amp_name not in cache:
        free(device)
        step = torch_amp_step(args, device, amp_name)
        times = timed(step, args.warmup, args.steps, device)
        precision = f"{amp_name} autocast" if amp_name in ("fp16", "bf16") else f"{amp_name}, no autocast"
        cache[amp_name] = {"config": f"{args.arch}, {precision}, channels-last, batch {args.batch_size}, "
                                     f"{args.image_size} px, DDP world 1, data on the device",
                           **summary(times, args.warmup, args.batch_size, "images"), "peak_mem_mb": peak_mb(device),
                           "top_ops": profiled(step, device)}
    return cache[amp_name]


def run_throughput(args, device, cache):
    """The recipe's default precision (fp16 with GradScaler on a GPU), bf16 beside it: BatchNorm takes cuDNN's
    kernels in fp16 with fp32 weights and torch's own in bf16 (bench/gpu.md, the first run's AMP reading)."""
    default = recipe_default(device)
    out = {**amp_measure(args, device, cache, default), "amp": default}
    if default != "bf16":
        bf16 = amp_measure(args, device, cache, "bf16")
        out["bf16"] = {k: bf16[k] for k in ("images_per_sec", "median_ms", "peak_mem_mb")}
    out["anchor_images_per_sec"] = DLE["mixed_images_per_sec"]
    out["ratio_to_anchor"] = out["images_per_sec"] / DLE["mixed_images_per_sec"]
    return out


def run_amp(args, device, cache):
    """TF32 against the recipe's default (fp16 on a GPU), and against bf16."""
    default = recipe_default(device)
    chosen = amp_measure(args, device, cache, default)
    bf16 = amp_measure(args, device, cache, "bf16")
    free(device)
    step = torch_amp_step(args, device, "tf32")
    tf32 = {**summary(timed(step, args.warmup, args.steps, device), args.warmup, args.batch_size, "images"),
            "peak_mem_mb": peak_mb(device)}
    return {"config": f"torch_amp.py's step: fp32 with TF32 on (--amp-dtype tf32) against its default ({default}) "
                      f"and bf16, {args.arch}, channels-last, batch {args.batch_size}", "tf32": tf32,
            "default": default, default: chosen, "bf16": bf16, "speedup": chosen["images_per_sec"] /
            tf32["images_per_sec"], "bf16_speedup": bf16["images_per_sec"] / tf32["images_per_sec"], "anchor": DLE}


def run_overhead(args, device, cache):
    total = args.warmup + args.steps + 8  # the loader's epoch covers every step taken, the profiled ones too
    steps = {"recipe": ddp_torchrun_step(args, device, total), "bare": bare_loop_step(args, device)}
    times = interleaved(steps, args.warmup, args.steps, device)
    recipe = summary(times["recipe"], args.warmup, args.batch_size, "images")
    bare = summary(times["bare"], args.warmup, args.batch_size, "images")
    return {"config": f"ddp_torchrun.py's step (fp32, TF32 on a GPU; DDP world 1, DistributedSampler, DataLoader of "
                      f"images on the device, meters, harness) against a bare loop; {args.arch}, batch "
                      f"{args.batch_size}, {args.image_size} px; timed steps interleaved in rounds",
            "recipe": recipe, "bare": bare, "ratio": recipe["median_ms"] / bare["median_ms"],
            "peak_mem_mb": peak_mb(device), "top_ops": {name: profiled(step, device) for name, step in steps.items()}}


def first_step_s(step, device):
    """Seconds of one call of step(), the device synchronized before and after: a compiled step's first, its compile."""
    sync = torch.get_device_module(device.type).synchronize
    sync()
    started = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - started


def run_compile(args, device, cache):
    missing = missing_compiler(device)
    if missing:
        raise RuntimeError(missing)
    import torch._dynamo
    from torch._dynamo.utils import counters

    compiled_graphs = load_recipe("ddp_compile").compiled_graphs  # the recipe's own count of graphs and breaks
    result = {"config": f"ddp_compile.py's step (model.compile(dynamic=False) before DDP) against eager; "
                        f"{args.arch}, bf16 autocast, channels-last, batch {args.batch_size}, {args.image_size} px"}
    for name, compiled in (("eager", False), ("compiled", True)):
        free(device)
        torch._dynamo.reset()
        counters.clear()
        step = ddp_compile_step(args, device, compiled)
        first = first_step_s(step, device)  # compiled, it traces and compiles forward and backward
        times = timed(step, args.warmup, args.steps, device)
        result[name] = {**summary(times, args.warmup, args.batch_size, "images"), "first_step_s": first,
                        "peak_mem_mb": peak_mb(device), "top_ops": profiled(step, device)}
        if compiled:
            graphs, breaks = compiled_graphs()
            result[name].update(graphs=graphs, graph_breaks=sum(breaks.values()), break_reasons=dict(breaks))
    result["speedup"] = result["compiled"]["images_per_sec"] / result["eager"]["images_per_sec"]
    result["compile_s"] = result["compiled"]["first_step_s"]
    torch._dynamo.reset()
    return result


def optimizer_steps(args, device, steps=20):
    """Issue 66: AdamW's step alone on the language model's parameters, plain (lm_ddp) and DTensor (lm_tp --tp 1), in
    each implementation: ms a step (median of `steps`, gradients of ones, under implicit_replication as lm_tp.py steps)
    and the DTensorSpec objects left alive per step (torch 2.10-2.11's fused leak: about one per parameter a step).
    The recipes take common.lm.adamw_implementation's choice; this is what it rests on, on this GPU and torch."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    def specs():
        gc.collect()
        return sum(type(o).__name__ == "DTensorSpec" for o in gc.get_objects())

    out = {"chosen": {"plain": adamw_implementation(False), "dtensor": adamw_implementation(True)}}
    for kind in ("plain", "dtensor"):
        for impl in ("foreach", "fused"):
            free(device)
            model = lm_model(args, device)
            if kind == "dtensor":
                mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
                model = parallelize_module(model, mesh, load_recipe("lm_tp").tp_plan(False), src_data_rank=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **{impl: True})
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            with implicit_replication():
                optimizer.step()  # the state made
                before = specs()
                times = timed(optimizer.step, 2, steps, device)
                left = (specs() - before) / (steps + 2)
            out[f"{kind}_{impl}"] = {**summary(times, 2), "dtensor_specs_left_per_step": left,
                                     "params": len(list(model.parameters()))}
            del model, optimizer
    return out


def lm_flops_per_token(args, n_matmul):
    """nanoGPT's estimate_mfu (PaLM, appendix B): 6N for the weights' matrix products, forward and backward, plus
    12 L d T for attention's two (B, T, T) products per layer, forward and backward, T the sequence length."""
    return 6 * n_matmul + 12 * args.lm_layers * args.lm_d_model * args.lm_seq_len


def failure(what, exc):
    """A measurement's one-line error in place of its figures, {"error": ...}, said on stderr: the others go on."""
    error = {"error": f"{type(exc).__name__}: {first_line(exc) or type(exc).__name__}"[:300]}
    print(f"gpu_bench: {what} failed: {error['error']}", file=sys.stderr, flush=True)
    return error


class TimeUp(BaseException):
    """SIGTERM (tools/gpu_session.sh's time limit, `timeout`): main() keeps the section's rows that ended, in --out
    with the section marked cut_short, and stops. A BaseException, so that no row's `except Exception` takes it."""


def time_up(signum, frame):
    if os.getpid() != TIME_UP_PID[0]:  # a forked child (make_jpegs' pool, which Pool's exit stops with SIGTERM)
        signal.signal(signum, signal.SIG_DFL)  # inherits the handler: it ends as SIGTERM ends it, without a traceback
        os.kill(os.getpid(), signum)
        return
    raise TimeUp(signal.Signals(signum).name)


TIME_UP_PID = [None]  # the process whose SIGTERM raises TimeUp: main()'s


PARTIAL = {}  # section: its dict of figures as it fills (keep_partial), what main() keeps of a section cut short


def keep_partial(args, section, out):
    """A section's figures so far, to --out's name + '.<section>.partial' (its log beside, a record as it goes) and
    PARTIAL, from which main() writes a section cut short into --out, the rows that ended kept."""
    PARTIAL[section] = out
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_name(f"{args.out.name}.{section}.partial").write_text(json.dumps(out, indent=1) + "\n")


def run_lm(args, device, cache, peak):
    """lm_ddp's and lm_tp's steps (--tp 1), eager then compiled: issue 66's goals; AdamW's step alone on their
    parameters; then lm_fsdp_tp's (--dp 1 --tp 1, FSDP2 and the plan on a 1 x 1 mesh) eager and compiled, no goal of
    its own, each its step's ratio to lm_ddp's. A row that cannot run here holds its one-line error instead, the
    others kept (and a ratio only where both of its rows ran). Without inductor's toolchain the compiled rows are
    left out and compile_error says why. What is measured is also written after each row, to --out's name +
    '.lm.partial' (a time limit that cuts the section short keeps the rows that ended, the goals' first)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    stop_group = dist.new_group(backend="gloo")  # the recipes' stop vote runs on gloo beside the step
    out = {"config": f"{args.lm_layers} layers, {args.lm_heads} heads, d_model {args.lm_d_model}, sequence "
                     f"{args.lm_seq_len} bytes, batch {args.lm_batch_size}, bf16 autocast, vocabulary 256 (bytes)",
           "references": LM_REFERENCES, "peak": peak}
    missing = missing_compiler(device)  # the compiled rows need inductor's toolchain; the eager ones do not
    out["compile_error"] = missing
    keep_partial(args, "lm", out)

    def measure(recipe, compiled):
        free(device)
        torch._dynamo.reset()
        counters.clear()
        step, n_matmul = lm_step(args, device, recipe, stop_group, compiled)
        first = first_step_s(step, device)  # compiled, it traces and compiles the blocks' forward and backward
        times = timed(step, args.warmup, args.steps, device)
        row = summary(times, args.warmup, args.lm_batch_size * args.lm_seq_len, "tokens")
        row["first_step_s"] = first
        if compiled:
            graphs, breaks = harness.CompileCounts.graphs_and_breaks()  # the recipes' own count
            row.update(graphs=graphs, graph_breaks=sum(breaks.values()))
        row["top_ops"] = profiled(step, device)
        flops = lm_flops_per_token(args, n_matmul)
        row.update(n_matmul_params=n_matmul, flops_per_token=flops, peak_mem_mb=peak_mb(device),
                   achieved_tflops=row["tokens_per_sec"] * flops / 1e12,
                   mfu=row["tokens_per_sec"] * flops / (peak["tflops"] * 1e12) if peak["tflops"] else None)
        return row

    def row(name, recipe, compiled):
        """out[name]: the row, or its one-line error (a compile or the plan that fails on this torch, or memory):
        the other rows are measured all the same."""
        try:
            out[name] = measure(recipe, compiled)
        except Exception as exc:
            out[name] = failure(f"lm {name}", exc)

    def ratio(key, over, under):
        if "median_ms" in out.get(over, {}) and "median_ms" in out.get(under, {}):
            out[key] = out[over]["median_ms"] / out[under]["median_ms"]

    for recipe, compiled in (("lm_ddp", False), ("lm_tp", False), ("lm_ddp", True), ("lm_tp", True)):
        if not (compiled and missing):
            row(recipe + "_compiled" * compiled, recipe, compiled)
            keep_partial(args, "lm", out)
    ratio("tp_over_ddp_step", "lm_tp", "lm_ddp")
    ratio("tp_over_ddp_step_compiled", "lm_tp_compiled", "lm_ddp_compiled")
    ratio("compiled_speedup", "lm_ddp", "lm_ddp_compiled")
    try:  # its failure (memory; fused AdamW on DTensors on this torch) leaves the rows above and below measured
        out["optimizer"] = optimizer_steps(args, device)
    except Exception as exc:
        out["optimizer"] = failure("lm optimizer", exc)
    keep_partial(args, "lm", out)
    for compiled in (False, True) if not missing else (False,):  # last: no goal rides on them
        name = "lm_fsdp_tp" + "_compiled" * compiled
        row(name, "lm_fsdp_tp", compiled)  # FSDP2 or the plan at world size 1 on this torch: the reason, if not
        ratio("fsdp_tp_over_ddp_step" + "_compiled" * compiled, name, "lm_ddp" + "_compiled" * compiled)
        keep_partial(args, "lm", out)
    torch._dynamo.reset()
    return out


# What section data runs: the same recipe on in-memory images, then gpu_decode.py on JPEG files (decoded in the main
# process, on the GPU by nvjpeg), then torch_amp.py on the same files decoded by its workers with PIL. Each its own job,
# in this order, eager then compiled: a section cut short at its time limit keeps the jobs that ended, the goals' first.
DATA_PATHS = (("in_memory", "recipes/torch_amp.py", "synthetic"),
              ("gpu_decode", "recipes/gpu_decode.py", "imagefolder"),
              ("cpu_decode", "recipes/torch_amp.py", "imagefolder"))


def cpu_seconds_of_children():
    """User + system CPU seconds of this process's finished children and theirs (every process a job started: the
    ranks, their DataLoader workers), as the kernel counts them when each is waited for."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_data(args, device, cache):
    """Section 6 (issue 65): images/s of the image recipe on real JPEG files against the same recipe on in-memory
    images, each path a real `./launch.sh` job on GPU 0 (cpu:1 on the CPU) at its default precision, 2 epochs,
    channels-last, one worker per core but one; the figure is the last epoch's img/s (the first pays for cuDNN's
    benchmark and the workers' start), with the CPU cores the job kept busy (its processes' CPU seconds over its
    wall time). Goal: the best file path at least 0.95x in memory. Then each path again with the recipes' --compile
    (the model compiled in place before DDP, the data path unchanged): goal at least 0.90x the compiled in-memory job.
    Without inductor's toolchain the compiled jobs are left out, and compile_error says why. Each job's figures are
    also written as it ends, to --out's name + '.data.partial' (a time limit that cuts the section short keeps them)."""
    import tempfile

    from tools.make_jpegs import make_set

    gpu = device.type == "cuda"
    workers = max(1, (os.cpu_count() or 2) - 1)
    with tempfile.TemporaryDirectory(prefix="gpu_bench_data_") as scratch:
        root, made = args.data_root, None
        if root is None:
            root = Path(scratch) / "jpegs"
            made = make_set(root, train=args.data_files, val=max(10, args.data_files // 20), classes=10,
                            size=(500, 375) if gpu else (40, 30), jobs=os.cpu_count() or 1)
        files = sum(1 for _ in Path(root, "train").rglob("*.*"))
        out = {"config": f"{args.arch}, {args.image_size} px, global batch {args.batch_size}, channels-last, 2 epochs"
                         f", {workers} workers, each recipe's default precision; {files} training files in {root}"
                         + (f" (made in {made['seconds']:.0f} s, mean {made['mean_width']:.0f}x"
                            f"{made['mean_height']:.0f} px, {made['mean_bytes'] / 1024:.0f} KiB)" if made else ""),
               "files": files}
        out["compile_error"] = missing_compiler(device)
        keep_partial(args, "data", out)
        jobs = [(name, recipe, dataset, []) for name, recipe, dataset in DATA_PATHS]
        if not out["compile_error"]:
            jobs += [(f"{name}_compiled", recipe, dataset, ["--compile"]) for name, recipe, dataset in DATA_PATHS]
        for name, recipe, dataset, extra in jobs:
            flags = ["--dataset", dataset, "--arch", args.arch, "--image-size", str(args.image_size), "--batch-size",
                     str(args.batch_size), "--epochs", "2", "--workers", str(workers), "--channels-last", *extra,
                     "--out-dir", str(Path(scratch) / name)]
            flags += (["--data-root", str(root)] if dataset == "imagefolder" else
                      ["--synthetic-train", str(files), "--synthetic-val", str(max(10, files // 20))])
            out[name] = data_job(args, name, [recipe, "0" if gpu else "cpu:1", *flags])
            keep_partial(args, "data", out)  # the JSON is written when the section ends
    data_ratios(out)
    return out


def data_job(args, name, argv, timeout=600):
    """One job of section data: `./launch.sh ARGV`, its figures; or, where it failed, {"error": its last line} and
    the others go on (a path that fails on this GPU or torch leaves the rest measured). Its whole output goes to
    --out's name + '.data-NAME.log' either way."""
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("WORLD_SIZE", None)
    command = shlex.join(["./launch.sh", *argv])
    before, started = cpu_seconds_of_children(), time.perf_counter()
    try:
        proc = subprocess.run([str(REPO / "launch.sh"), *argv], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # its output so far: bytes, text=True notwithstanding
        text = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr)]
        proc = subprocess.CompletedProcess(exc.cmd, f"timed out after {timeout} s", *text)
    wall, cpu = time.perf_counter() - started, cpu_seconds_of_children() - before
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_name(f"{args.out.name}.data-{name}.log").write_text(
        f"$ {command}\nexit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    rates = re.findall(r"^epoch=2/2 .* img/s=([\d.]+)", proc.stdout, re.M)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not rates or not results:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"gpu_bench: data {name} failed: exit {proc.returncode}: {tail}", file=sys.stderr, flush=True)
        return {"command": command, "error": f"exit {proc.returncode}: {tail}"[:300]}
    result = json.loads(results[0][7:])
    return {"command": command, "images_per_sec": float(rates[-1]), "result_images_per_sec": result["images_per_sec"],
            "wall_s": wall, "cpu_s": cpu, "cores_busy": cpu / wall,
            "amp": re.search(r"^amp: (\S+)", proc.stdout, re.M).group(1),
            **{k: result[k] for k in ("train_loss", "val_acc1", "compiled_graphs", "eval_graphs", "recompiles",
                                      "graph_breaks") if k in result}}


def data_ratios(out):
    """Each file path's img/s over the in-memory job's, eager and compiled, and the best of them (best, ratio;
    best_compiled, ratio_compiled), from the jobs that ran; none where the in-memory job or both file paths failed."""
    for suffix in ("", "_compiled") if not out["compile_error"] else ("",):
        memory = out.get(f"in_memory{suffix}", {}).get("images_per_sec")
        ran = [n for n in ("cpu_decode", "gpu_decode") if "images_per_sec" in out.get(n + suffix, {})]
        if memory is None or not ran:
            continue
        for name in ran:
            out[name + suffix]["of_in_memory"] = out[name + suffix]["images_per_sec"] / memory
        best = max(ran, key=lambda n: out[n + suffix]["images_per_sec"])
        out[f"best{suffix}"], out[f"ratio{suffix}"] = best, out[best + suffix]["of_in_memory"]


# ----------------------------------------------------------------------------------------- report
def environment(device):
    env = {"device": device.type, "device_name": None, "driver": None, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
           "python": platform.python_version(), "platform": platform.platform(), "cpu": platform.processor() or
           platform.machine(), "cores": os.cpu_count(),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        env["capability"] = f"{props.major}.{props.minor}"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                                  str(device.index or 0)], capture_output=True, text=True, timeout=20)
            if smi.returncode == 0 and smi.stdout.strip():
                env["driver"] = smi.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return env


def peak_for(env, override):
    if override is not None:
        return {"tflops": override, "source": "--peak-tflops"}
    name = env["device_name"] or ""
    if "NVL" not in name:
        for key, tflops, source in PEAKS:
            if key in name:
                return {"tflops": tflops, "source": source}
    why = "the CPU: no peak" if env["device"] == "cpu" else f"{name!r} is not in PEAKS (--peak-tflops gives it)"
    return {"tflops": None, "source": why}


def verdict(ratio, goal, higher_is_better, applies):
    if ratio is None:
        return "-"
    if not applies:
        return f"n/a ({applies.reason})"
    met = ratio >= goal if higher_is_better else ratio <= goal
    return "met" if met else "missed"


class NotApplicable:
    """A falsy verdict condition that says why."""

    def __init__(self, reason):
        self.reason = reason

    def __bool__(self):
        return False


def anchor_applies(args, env):
    """The DLE anchors are for resnet50 at 224 px, batch 256, on a GPU."""
    if env["device"] != "cuda":
        return NotApplicable("not a GPU")
    if (args.arch, args.image_size, args.batch_size) != ("resnet50", 224, 256):
        return NotApplicable("not the anchor's resnet50, 224 px, batch 256")
    return True


def mfu_text(row):
    return f"MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else "MFU - (no peak)"


def fsdp_tp_row(lm):
    """The table's lm_fsdp_tp row: its steps, eager and compiled, each against lm_ddp's; no goal (issue 66 sets
    none), a row that could not run says why."""
    def rate(name):
        r = lm.get(name)
        if r is None:
            return None
        if "error" in r:
            return f"failed: {r['error']}"
        mfu = mfu_text(r)
        compiled = (f", first step {r['first_step_s']:.1f} s, {r['graphs']} graph(s), {r['graph_breaks']} break(s)"
                    if "graphs" in r else "")
        return f"{r['tokens_per_sec']:,.0f} tokens/s, {mfu}{compiled}"

    eager, compiled = rate("lm_fsdp_tp"), rate("lm_fsdp_tp_compiled")
    measured = f"eager {eager}" + (f"; compiled {compiled}" if compiled else
                                   f"; compiled: not measured ({lm.get('compile_error')})")
    ratios = [f"{lm[key]:.2f}x" for key in ("fsdp_tp_over_ddp_step", "fsdp_tp_over_ddp_step_compiled") if key in lm]
    return ["4 lm_fsdp_tp", measured, "lm_ddp's step, eager; compiled (--dp 1 --tp 1: FSDP2 and DTensor on one "
            "GPU; no goal)", "; ".join(ratios) or "-", "reference only"]


def table(report, args):
    """The Markdown table: one row per figure, the reference or goal beside it, met / missed."""
    s, env = report["sections"], report["environment"]
    on_gpu = True if env["device"] == "cuda" else NotApplicable("not a GPU")
    anchor = anchor_applies(args, env)
    rows = []

    def failed(key):  # lm and data keep the rows that ended when cut short; the other sections have one figure
        section = s.get(key, {})
        return section.get("error") or (section.get("cut_short") if key not in ("lm", "data") else None)

    if "throughput" in s:
        t = s["throughput"]
        beside = f"; bf16 {t['bf16']['images_per_sec']:,.0f} img/s" if "bf16" in t else ""
        rows.append(["1 throughput", failed("throughput") and f"failed: {failed('throughput')}" or
                     f"{t['images_per_sec']:,.0f} img/s ({t['config']}; step {t['median_ms']:.1f} ms){beside}",
                     f"DLE ResNet-50 mixed precision, 1x A100 80GB: {DLE['mixed_images_per_sec']:,} img/s; "
                     f"goal >= {GOALS['throughput']}x that",
                     "-" if failed("throughput") else f"{t['ratio_to_anchor']:.2f}x",
                     "-" if failed("throughput") else verdict(t["ratio_to_anchor"], GOALS["throughput"], True,
                                                               anchor)])
    if "overhead" in s:
        o = s["overhead"]
        rows.append(["2 overhead", failed("overhead") and f"failed: {failed('overhead')}" or
                     f"ddp_torchrun step {o['recipe']['median_ms']:.2f} ms against the bare loop's "
                     f"{o['bare']['median_ms']:.2f} ms", f"goal <= {GOALS['overhead']}x the bare loop",
                     "-" if failed("overhead") else f"{o['ratio']:.3f}x",
                     "-" if failed("overhead") else verdict(o["ratio"], GOALS["overhead"], False, on_gpu)])
    if "compile" in s:
        c = s["compile"]
        rows.append(["3 compile", failed("compile") and f"failed: {failed('compile')}" or
                     f"compiled {c['compiled']['images_per_sec']:,.0f} img/s against eager "
                     f"{c['eager']['images_per_sec']:,.0f}; first step {c['compile_s']:.1f} s (compile), "
                     f"{c['compiled']['graphs']} graph(s), {c['compiled']['graph_breaks']} break(s)",
                     f"goal >= {GOALS['compile']}x eager (CPU, resnet18: 1.05x)",
                     "-" if failed("compile") else f"{c['speedup']:.2f}x",
                     "-" if failed("compile") else verdict(c["speedup"], GOALS["compile"], True, on_gpu)])
    if "lm" in s:
        lm = s["lm"]
        refs = "; ".join(f"{r['name']}: {r['mfu']}" + (f" ({r['hardware']})" if r["hardware"] != "-" else "")
                         for r in LM_REFERENCES)
        for name in ("lm_ddp", "lm_tp"):
            if failed("lm"):
                rows.append([f"4 {name}", f"failed: {failed('lm')}", refs, "-", "-"])
                continue
            r = lm.get(name, {"why": "not measured (the section was cut short)"})
            first_run = "lm_ddp_compiled" not in lm and "compile_error" not in lm and "cut_short" not in lm
            if first_run:  # the first GPU run's JSON: eager alone
                mfu = mfu_text(r)
                extra = f"; {lm['tp_over_ddp_step']:.2f}x lm_ddp's step" if name == "lm_tp" else ""
                rows.append([f"4 {name}", f"{r['tokens_per_sec']:,.0f} tokens/s, {mfu} ({r['achieved_tflops']:.1f} "
                             f"TFLOPS){extra}", refs if name == "lm_ddp" else "lm_ddp (DTensor's dispatch cost)",
                             "-", "reference only"])
                continue
            c = lm.get(f"{name}_compiled", {"why": f"not measured ({lm.get('compile_error')})" if lm.get(
                "compile_error") else "not measured (the section was cut short)"})
            if {"error", "why"} & {*r, *c}:  # a row that failed on this GPU or torch: what ran, and why not the rest
                said = [f"{kind} " + (x["why"] if "why" in x else f"failed: {x['error']}" if "error" in x else
                                      f"{x['tokens_per_sec']:,.0f} tokens/s, {mfu_text(x)}")
                        for kind, x in (("eager", r), ("compiled", c))]
                rows.append([f"4 {name}", "; ".join(said), f"goal: compiled MFU >= {GOALS['lm_mfu_compiled']:.0%}"
                             if name == "lm_ddp" else f"goal: lm_ddp's step x <= {GOALS['lm_tp_eager']} eager, <= "
                             f"{GOALS['lm_tp_compiled']} compiled", "-", "not measured"])
                continue
            mfu, cmfu = mfu_text(r), mfu_text(c)
            measured = (f"eager {r['tokens_per_sec']:,.0f} tokens/s, {mfu}; compiled {c['tokens_per_sec']:,.0f}, "
                        f"{cmfu}, first step {c['first_step_s']:.1f} s, {c['graphs']} graph(s), {c['graph_breaks']} "
                        "break(s)")
            if name == "lm_ddp":
                ratio = c["mfu"]
                rows.append(["4 lm_ddp", measured, f"goal: compiled MFU >= {GOALS['lm_mfu_compiled']:.0%}; {refs}",
                             "-" if ratio is None else f"{100 * ratio:.1f}%",
                             "-" if ratio is None else verdict(ratio, GOALS["lm_mfu_compiled"], True, on_gpu)])
            else:
                o = lm.get("optimizer")
                if o and "error" in o:
                    measured += f"; AdamW alone: failed: {o['error']}"
                elif o:  # issue 66: AdamW's step alone on DTensor parameters, and what fused leaves behind
                    measured += (f"; AdamW on DTensors: fused {o['dtensor_fused']['median_ms']:.2f} ms, foreach "
                                 f"{o['dtensor_foreach']['median_ms']:.2f} ms, fused leaves "
                                 f"{o['dtensor_fused']['dtensor_specs_left_per_step']:.0f} DTensorSpec(s) a step")
                eager, comp = lm.get("tp_over_ddp_step"), lm.get("tp_over_ddp_step_compiled")  # lm_ddp's failed: -
                ok = (verdict(eager, GOALS["lm_tp_eager"], False, on_gpu),
                      verdict(comp, GOALS["lm_tp_compiled"], False, on_gpu))
                rows.append(["4 lm_tp", measured, f"goal: lm_ddp's step x <= {GOALS['lm_tp_eager']} eager, <= "
                             f"{GOALS['lm_tp_compiled']} compiled",
                             "; ".join("-" if x is None else f"{x:.2f}x" for x in (eager, comp)),
                             ok[0] if ok[0] == ok[1] else f"eager {ok[0]}; compiled {ok[1]}"])
        if "lm_fsdp_tp" in lm:  # the first GPU run's JSON has none
            rows.append(fsdp_tp_row(lm))
    if "amp" in s:
        a = s["amp"]
        default = a.get("default", "bf16")  # the first run's JSONs measured bf16 alone
        beside = (f"; bf16 {a['bf16']['images_per_sec']:,.0f} ({a['bf16_speedup']:.2f}x)" if default != "bf16"
                  else "")
        rows.append(["5 amp", failed("amp") and f"failed: {failed('amp')}" or
                     f"{default} {a[default]['images_per_sec']:,.0f} img/s against TF32 "
                     f"{a['tf32']['images_per_sec']:,.0f}{beside}",
                     f"DLE, 1x A100 80GB: {DLE['mixed_images_per_sec']:,} against {DLE['tf32_images_per_sec']} "
                     f"img/s, {DLE['speedup']}x", "-" if failed("amp") else f"{a['speedup']:.2f}x",
                     "-" if failed("amp") else verdict(a["speedup"], GOALS["amp"], True, anchor)])
    if "data" in s:
        d = s["data"]

        def path(name):
            r = d.get(name, {})
            return (f"failed ({r['error']}; its log: the run's .data-{name}.log)" if "error" in r else
                    "not measured (the section was cut short)" if "images_per_sec" not in r else
                    f"{r['images_per_sec']:,.0f} img/s ({r['amp']}, {r['cores_busy']:.1f} cores busy)")
        compiled = d.get("compile_error") is None and "cut_short" in d or "in_memory_compiled" in d
        # A job that failed leaves its path's figure out (data_ratios); the verdict then rests on what ran, and says so.
        kept = [(d[key], GOALS[goal], said) for key, goal, said in (("ratio", "data", "eager "),
                                                                    ("ratio_compiled", "data_compiled", "compiled "))
                if key in d]
        whole = "ratio" in d and ("ratio_compiled" in d or not compiled) and all(
            "images_per_sec" in d.get(name + suffix, {}) for name, _, _ in DATA_PATHS
            for suffix in ("", "_compiled") if compiled or not suffix)
        rows.append(["6 data", failed("data") and f"failed: {failed('data')}" or
                     f"JPEG files, GPU decode {path('gpu_decode')}; CPU decode {path('cpu_decode')}; in memory "
                     f"{path('in_memory')}; last epoch, eager"
                     + (f". Compiled: GPU decode {path('gpu_decode_compiled')}; CPU decode "
                        f"{path('cpu_decode_compiled')}; in memory {path('in_memory_compiled')}" if compiled else ""),
                     f"goal: the best file path >= {GOALS['data']}x in memory eager, >= {GOALS['data_compiled']}x "
                     "compiled" + ("" if compiled else f" (compiled: not measured, {d.get('compile_error')})"),
                     "-" if failed("data") or not kept else
                     "; ".join(f"{'' if whole else said}{ratio:.2f}x" for ratio, _, said in kept),
                     "-" if failed("data") or not kept else
                     verdict(min(ratio / goal for ratio, goal, _ in kept), 1.0, True, on_gpu)
                     + ("" if whole else " (of the jobs that ran)")])
    header = ["section", "measured (median of the timed steps)", "reference / goal", "ratio", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---:|---|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    name = env["device_name"] or env["cpu"]
    peak = report.get("peak") or {}
    commands = report.get("commands") or [report["command"]]  # a merged report (--render): one per process
    head = [f"GPU benchmark: {name}; driver {env['driver']}; torch {env['torch']}, CUDA {env['cuda']}; "
            f"{args.steps} timed steps after {args.warmup} warm-up, medians; {report['wall_s']:.0f} s in all",
            ("Command: " if len(commands) == 1 else "Commands, one process each: ")
            + "; ".join(f"`{c}`" for c in commands)]
    if "lm" in s:
        head.append(f"MFU peak: {peak['tflops']} TFLOPS ({peak['source']})" if peak.get("tflops") else
                    f"MFU peak: none ({peak.get('source')})")
    head += [f"Cut short: {key}, {s[key]['cut_short']}" for key in SECTIONS if "cut_short" in s.get(key, {})]
    return "\n".join(head + [""] + lines) + "\n"


# ----------------------------------------------------------------------------------------- render
# bench/gpu.md: above this line what --render writes from the JSONs; below it, text written by hand, which the next
# --render keeps as it is.
MARKER = "<!-- Above this line: written by tools/gpu_bench.py --render from the JSONs. Below it: by hand, kept. -->"
# What every merged JSON must share: one kind of machine, one torch, the same sizes (--only, --out, --md differ).
SAME_ENVIRONMENT = ("device", "device_name", "torch", "cuda", "cudnn", "python", "capability")
# What may differ between two machines of one kind (a lent H200 is one of several hosts: another driver build, another
# memory figure): the page names each value.
NOTED_ENVIRONMENT = ("driver", "memory_gib", "cores")
SAME_SETTINGS = ("device", "arch", "image_size", "batch_size", "num_classes", "steps", "warmup", "lm_layers",
                 "lm_heads", "lm_d_model", "lm_seq_len", "lm_batch_size", "peak_tflops")


class RenderError(Exception):
    """A --render input that cannot make one report: the one line the command prints, exit 2."""


def load_reports(paths):
    """[(path, report)] from each JSON file given and every *.json in each folder given, in the order they ran
    (their environment's date)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise RenderError(f"--render {path}: no *.json in that folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise RenderError(f"--render {path}: no such file or folder")
    reports = []
    for path in files:
        try:
            report = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RenderError(f"{path}: not JSON ({type(exc).__name__}: {exc})") from None
        if not (isinstance(report, dict) and report.get("tool") == "tools/gpu_bench.py"
                and all(isinstance(report.get(k), dict) for k in ("sections", "environment", "settings"))
                and isinstance(report.get("command"), str) and isinstance(report.get("wall_s"), int | float)):
            raise RenderError(f"{path}: not a tools/gpu_bench.py report (its --out)")
        try:
            datetime.datetime.fromisoformat(report["environment"].get("date"))
        except (TypeError, ValueError):
            raise RenderError(f"{path}: its environment has no ISO date") from None
        reports.append((path, report))
    return sorted(reports, key=lambda pr: (datetime.datetime.fromisoformat(pr[1]["environment"]["date"]), str(pr[0])))


def merge_reports(reports):
    """One report from the per-section JSONs of one machine (`--only SECTION --out ...`, one process each): their
    sections, every command in the order they ran, their wall time added up. Environments or sizes that differ, or
    a section twice, are an error: a table that mixes runs would be no measurement."""
    (first_path, first), sections, came_from = reports[0], {}, {}
    for path, report in reports:
        for part, keys in (("environment", SAME_ENVIRONMENT), ("settings", SAME_SETTINGS)):
            for key in keys:
                mine, theirs = report.get(part, {}).get(key), first.get(part, {}).get(key)
                if mine != theirs:
                    raise RenderError(f"{path}: {part} {key} {mine!r} differs from {first_path}'s {theirs!r}")
        if report.get("peak") != first.get("peak"):
            raise RenderError(f"{path}: its MFU peak differs from {first_path}'s")
        for name, section in report["sections"].items():
            if name not in SECTIONS:
                raise RenderError(f"{path}: unknown section {name!r}")
            if name in sections:
                raise RenderError(f"{path}: section {name} is also in {came_from[name]}")
            sections[name], came_from[name] = section, path
    env = dict(first["environment"])
    for key in NOTED_ENVIRONMENT:
        values = list(dict.fromkeys(str(r["environment"].get(key)) for _, r in reports))
        if len(values) > 1:
            env[key] = " and ".join(values)
    return {**first, "environment": env, "command": None, "commands": [r["command"] for _, r in reports],
            "sections": {k: sections[k] for k in SECTIONS if k in sections},
            "wall_s": sum(r["wall_s"] for _, r in reports)}


# tests/test_gpu.py's test whose runs --tier reads: each language model at its defaults on one GPU, 200 steps; it
# prints "RECIPE: {its RESULT line's JSON}" before its checks, so a failed run's figures are there too.
TIER_TEST = "test_every_language_model_learns_on_one_gpu"


def tier_runs(path):
    """({recipe: (its RESULT or None, the test's outcome)}, the tier's outcome counts and seconds) from the GPU tier's
    JUnit XML (`pytest -m gpu --junitxml FILE -o junit_logging=system-out`: without that option pytest keeps no
    output of a test that passed)."""
    import xml.etree.ElementTree as ET

    try:
        cases, seconds = junit.read(path)
    except (OSError, ET.ParseError) as exc:
        raise RenderError(f"--tier {path}: not a JUnit XML file ({type(exc).__name__}: {exc})") from None
    runs = {}
    for node, outcome, out in cases:
        name = re.search(rf"::{TIER_TEST}\[(\w+)\]$", node)
        if name:
            line = re.search(rf"^{name[1]}: (\{{.*\}})$", out, re.M)
            runs[name[1]] = (json.loads(line[1]) if line else None, outcome)
    if not any(result for result, _ in runs.values()):
        raise RenderError(f"--tier {path}: no {TIER_TEST} run printed its RESULT there; run the tier with "
                          f"-o junit_logging=system-out, as tools/gpu_session.sh tier does")
    return runs, collections.Counter(outcome for _, outcome, _ in cases), seconds


def tier_lines(path, md):
    """The page's part from the tier's JUnit XML: its totals and a row per language model."""
    runs, counts, seconds = tier_runs(path)
    lines = ["", "The language models on one GPU, from the GPU tier "
             f"([{path.name}]({Path(os.path.relpath(path, md.parent)).as_posix()}): `tests/test_gpu.py::{TIER_TEST}`, "
             "each recipe's default model and batch, 200 steps; tokens/s from its RESULT line, which leaves the first "
             "step out). tools/gpu_session.sh runs the tier 8 tests at a time (-n 8) on the one GPU: these ran beside "
             f"other tests, figures for reference, not a benchmark's medians. The tier: {counts.total()} tests, "
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, {counts['skipped']} "
             f"skipped, {seconds:.0f} s.", "", "| recipe | tokens/s | val_bpb | peak memory | test |",
             "|---|---:|---:|---:|---|"]
    for recipe, (result, outcome) in sorted(runs.items()):
        figures = ["-"] * 3 if result is None else [
            f"{result['tokens_per_sec']:,.0f}", f"{result['val_bpb']:.3f}", f"{result['peak_mem_mb']:,.0f} MB"]
        lines.append(f"| {recipe} | {' | '.join(figures)} | {outcome} |")
    return lines


def render(paths, md, tree, command, tier=None):
    """bench/gpu.md's text: a header (the tree, the machine, the software, when, from which files, the command
    that wrote it), table() of the merged report, the tier's language-model runs (tier: its JUnit XML), MARKER, then
    what `md` holds below its marker (kept as it is)."""
    reports = load_reports(paths)
    report = merge_reports(reports)
    env = report["environment"]
    kept = "\n"  # a new file: the marker line, nothing below it
    if md.exists():
        old = md.read_text()
        if MARKER not in old:
            raise RenderError(f"--md {md}: the file has no marker line ({MARKER}); nothing below it to keep, so "
                              f"it is left as it is")
        kept = old.split(MARKER, 1)[1]  # to the byte
    dates = [datetime.datetime.fromisoformat(r["environment"]["date"]) for _, r in reports]
    days = sorted({d.date().isoformat() for d in dates})
    when = (f"{days[0]}, sections started {dates[0]:%H:%M:%S} to {dates[-1]:%H:%M:%S} {dates[0].tzname()}"
            if len(days) == 1 else f"{dates[0].isoformat()} to {dates[-1].isoformat()}")
    files = ", ".join(f"[{path.name}]({Path(os.path.relpath(path, md.parent)).as_posix()}) "
                      f"({datetime.datetime.fromisoformat(r['environment']['date']):%H:%M:%S}, {r['wall_s']:.0f} s)"
                      for path, r in reports)
    more = [f"{env['memory_gib']} GiB" if env.get("memory_gib") else None,
            f"compute capability {env['capability']}" if env.get("capability") else None,
            f"cuDNN {env['cudnn']}" if env.get("cudnn") else None, f"Python {env['python']}",
            f"{env['cores']} CPU cores", env["platform"]]
    table_head, _, table_rows = table(report, argparse.Namespace(**report["settings"])).partition("\n\n")
    head = table_head.splitlines()
    lines = [f"# GPU benchmark: {env['device_name'] or env['cpu']}, {' to '.join(dict.fromkeys([days[0], days[-1]]))}",
             "",
             f"Written by `{command}` from the JSONs of `tools/gpu_bench.py --only SECTION --out FILE` listed "
             f"below; edit only below the marker line, the rest is rewritten.",
             "",
             f"- tree: {tree or 'not recorded in the JSONs (--tree names it)'}",
             f"- {head[0]}",
             f"- also: {', '.join(m for m in more if m)}",
             f"- measured: {when}: {files}",
             *(f"- {line}" for line in head[1:]),
             "",
             table_rows.rstrip("\n"),
             *(tier_lines(tier, md) if tier is not None else []),
             "",
             MARKER]
    return "\n".join(lines) + kept


def render_main(args, command):
    try:
        text = render(args.render, args.md, args.tree, command, args.tier)
    except RenderError as exc:
        print(f"gpu_bench: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text)
    except OSError as exc:
        print(f"gpu_bench: error: {write_failed('--md', args.md, exc)}", file=sys.stderr)
        return 2
    print(f"gpu_bench: wrote {args.md}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------- main
def setup(args):
    """The device and the one-process group DDP needs (a free local port, nccl on a GPU, gloo on the CPU)."""
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # as the image recipes set them
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if backend == "nccl" else {}))
    return device


def main(argv=None):
    args = parse_args(argv)
    command = shlex.join(["python", "tools/gpu_bench.py", *map(str, sys.argv[1:] if argv is None else argv)])
    if args.render is not None:
        return render_main(args, command)
    problem = unwritable_output(("--out", args.out), ("--md", args.md))  # before the first section, not after it
    if problem:
        print(f"gpu_bench: error: {problem}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = setup(args)
    env = environment(device)
    peak = peak_for(env, args.peak_tflops)
    print(f"gpu_bench: {env['device_name'] or 'cpu'}, torch {env['torch']}, CUDA {env['cuda']}, driver "
          f"{env['driver']}; sections {','.join(s for s in RUN_ORDER if s in args.sections)}", flush=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    sections, cache = {}, {}

    def write():  # after every section: a run cut short (a time limit) keeps what it measured
        report = {"tool": "tools/gpu_bench.py", "command": command, "settings": settings, "environment": env,
                  "peak": peak, "goals": GOALS, "anchors": {"dle": DLE, "lm": LM_REFERENCES},
                  "sections": {k: sections[k] for k in SECTIONS if k in sections},
                  "wall_s": time.perf_counter() - started}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # first: a table that fails keeps the figures
        text = table(report, args)
        if args.md:
            args.md.parent.mkdir(parents=True, exist_ok=True)
            args.md.write_text(text)
        return text

    runners = {"throughput": run_throughput, "amp": run_amp, "overhead": run_overhead, "compile": run_compile,
               "lm": lambda a, d, c: run_lm(a, d, c, peak), "data": run_data}
    PARTIAL.clear()  # a main() before this one in the same process (the tests) leaves its rows there
    TIME_UP_PID[0] = os.getpid()
    previous = signal.signal(signal.SIGTERM, time_up)  # a time limit: the rows that ended are written, not lost
    try:
        for name in RUN_ORDER:
            if name not in args.sections:
                continue
            t0 = time.perf_counter()
            try:
                free(device)
                sections[name] = runners[name](args, device, cache)
            except Exception as exc:  # one section's failure (an OOM, no compiler) leaves the others to run
                sections[name] = failure(name, exc)
            except (TimeUp, KeyboardInterrupt) as exc:  # the rows that ended, this section marked, the rest not run
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                sections[name] = cut_short(name, PARTIAL.get(name, {}), exc, time.perf_counter() - t0)
            sections[name]["section_s"] = time.perf_counter() - t0
            write()
            print(f"gpu_bench: {name} " + ("cut short" if "cut_short" in sections[name] else "done")
                  + f" in {sections[name]['section_s']:.1f} s", flush=True)
            if "cut_short" in sections[name]:
                break
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGTERM, previous)
    print("\n" + write(), flush=True)
    print(f"gpu_bench: wrote {args.out}" + (f" and {args.md}" if args.md else ""), flush=True)
    return 1 if any(went_wrong(s) for s in sections.values()) else 0


def cut_short(name, partial, exc, seconds):
    """A section stopped from outside (SIGTERM: a time limit; Ctrl-C) after `seconds`: its rows that ended (what
    keep_partial last held) and why the rest are missing; section data's ratios from the jobs that ended."""
    why = f"stopped by {exc or 'SIGINT'} after {seconds:.0f} s: the rows that had not ended are not measured"
    print(f"gpu_bench: {name} cut short: {why}", file=sys.stderr, flush=True)
    out = {**partial, "cut_short": why}
    if name == "data" and "compile_error" in out:
        data_ratios(out)
    return out


def went_wrong(section):
    """A section that failed or was cut short, or one of its rows (lm's, data's jobs) that failed: exit code 1."""
    return bool({"error", "cut_short"} & set(section)) or any(
        isinstance(row, dict) and "error" in row for row in section.values())


if __name__ == "__main__":
    sys.exit(main())
