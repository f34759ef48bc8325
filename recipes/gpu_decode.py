"""Real JPEGs at GPU speed: workers read the files' bytes, the GPU decodes, crops, flips and normalises each batch.

    ./launch.sh recipes/gpu_decode.py 0 --dataset imagefolder --data-root ~/imagenet --channels-last  # one GPU
    python tools/make_jpegs.py data/jpegs --train 20000 --val 1000   # real JPEGs to try it on: --data-root data/jpegs
    ./launch.sh recipes/gpu_decode.py cpu:2 --arch tiny --epochs 3 --save-every 5 --resume auto  # CPU: the same lines

What it shows (the rest is recipes/torch_amp.py): the data path of write-up 001 at a GPU's pace. A CPU core decodes
and augments about 300 ImageNet JPEGs a second with PIL; one H200 trains resnet50 on over 6,000 a second. Here:
- a DataLoader worker reads a file's bytes, reads its header for the size, and draws the sample's RandomResizedCrop
  box and flip: about 2,400 files a second a core here, where PIL's decode and augment does 320; the batch crosses
  to the main process as the files' bytes (about 110 KB an ImageNet file, against 147 KiB of uint8 pixels at 224 px
  from torch_amp.py's workers, which decode);
- the main process decodes the batch with torchvision.io.decode_jpeg on the GPU (nvjpeg; on a CPU the same call
  decodes with libjpeg-turbo), crops, resizes, flips and normalises each image there, in channels-last if asked;
- all of it one batch ahead, on a side CUDA stream in DataLoaderX's thread, while the step runs on the default stream:
  the step waits for that batch's event, so it never reads a batch before it is decoded; and the side stream is
  drained before each decode, since nvjpeg writes its output from a stream of its own (pytorch/vision PR #9606);
- the files a decoder on the GPU cannot take (a PNG named .JPEG, a CMYK JPEG: ImageNet has them) are decoded by PIL
  in the worker, a JPEG only nvjpeg refuses by the CPU's decoder in the main process; a file nothing decodes (cut
  short, no image data inside) stops the run with one line naming it; a JPEG whose data is damaged but decodes
  trains, libjpeg's "Corrupt JPEG data" on stderr, as PIL's decode does in torch_amp.py;
- each sample's box and flip drawn as torchvision's RandomResizedCrop draws them, from a generator of the sample's
  own seeded (seed, epoch, index), so a run resumed mid-epoch (--save-every N: a checkpoint every N steps) trains on
  what the uninterrupted run did (dropout's draws, from torch's generator, are new: RNG state in ddp_checkpoint.py).
--dataset synthetic encodes its images as JPEGs in the worker, as if read from files. --compile (torch_amp.py's): the
step compiled, so that the data path is measured against the fastest step. Measured: docs/data.md.

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import contextlib
import datetime
import io
import itertools
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.io import ImageReadMode, decode_jpeg
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.checkpoint import find_resume, load_same_flags, load_weights, save_atomic
from common.data import (
    NameFailingSamples,
    SampleError,
    SkipFirst,
    add_data_flags,
    build_datasets,
    crop_box,
    device_normalize,
    rgb,
    sample_seed,
)
from common.loader import DataLoaderX
from common.models import build_model, recomputed_batchnorm
from common.schedule import warmup_cosine
from common.utils import AverageMeter, accuracy, gather_values, print0

# New: torchvision 0.29 marks its decoders deprecated in favour of TorchCodec; they are what this recipe measured.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_flags(p)  # --dataset, --data-root, --image-size, ...: build_datasets' flags (common/data.py)
    p.add_argument("--arch", default="resnet18", help="torchvision model name, or tiny / tiny_unused")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, help="GLOBAL batch per optimizer step, split evenly across "
                   "processes and --accum-steps (default: 128, rounded down to a multiple of processes x accum-steps)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/gpu_decode", help="model.pt and checkpoint.pt go here")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPUs only)")

    p.add_argument("--amp-dtype", choices=["fp16", "bf16", "tf32", "fp32"],
                   help="default: fp16 on GPU; on CPU bf16 if it has native bf16, else fp32. tf32: no autocast, "
                        "TF32 matmuls and convolutions on GPUs (as the other recipes); fp32: no autocast, no TF32")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip-grad", type=float, help="clip the gradient norm to this (after unscaling)")
    p.add_argument("--channels-last", action="store_true", help="NHWC layout for model and inputs")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in place before DDP, as "
                   "ddp_compile.py (the step's speed, which the data must keep up with)")
    p.add_argument("--resume", help="a checkpoint.pt to continue from (model, optimizer, scheduler, scaler), "
                   "or 'auto': OUT_DIR/checkpoint.pt if it exists (for MAX_RESTARTS)")
    p.add_argument("--save-every", type=int, help="also save checkpoint.pt every N steps (a resume goes on mid-epoch)")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # nan/inf, a bad count or --arch, an uneven --batch-size, --sync-bn on CPU
    parts = world_size * args.accum_steps  # the global batch splits over processes and micro-batches
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // parts) * parts
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem
    if args.resume and args.resume != "auto" and not os.path.isfile(args.resume):
        harness.die(f"--resume {args.resume}: no such file", all_ranks=True)  # files can differ per node
    if args.dataset == "cifar100":  # New
        harness.die("--dataset cifar100 holds pixels, not files: this recipe reads image files (--dataset "
                    "imagefolder) or makes JPEGs (--dataset synthetic); CIFAR-100 trains in recipes/torch_amp.py")


# ------------------------------------------------------------------------------------------- data
class EncodedImages(Dataset):  # New: what a DataLoader worker does: read, look at the header, draw the box
    """Sample i as (the file's bytes, its crop box top/left/height/width, flip, label, i). The bytes stay encoded: the
    main process decodes them (decode_batch). A file the GPU's decoder cannot take (not a JPEG, a CMYK JPEG) is
    decoded here by PIL instead, and crosses as pixels (3 x H x W uint8); so is one that does not end in JPEG's end
    marker (bytes after it: PIL decodes it; cut short: PIL's error names it).
    Train: torchvision's RandomResizedCrop box, then a flip, drawn from a generator seeded (seed, epoch, index): not
    torch's global one, which the step draws from (dropout) while DataLoaderX's thread loads with --workers 0.
    Val: Resize(size * 8 / 7) and CenterCrop(size) as one box. source: an ImageFolder (its .samples: the files) or a
    dataset of image tensors (--dataset synthetic), encoded here as JPEGs. set_epoch(e) before each epoch's iter()."""

    def __init__(self, source, size, train, flip, seed=0):
        self.source, self.size, self.train, self.flip, self.seed, self.epoch = source, size, train, flip, seed, 0
        self.samples = getattr(source, "samples", None)  # (path, class) per index: NameFailingSamples names the file
        self.scale = (0.08, 1.0) if size >= 64 else (0.35, 1.0)  # at 32 px an 8% crop is a few pixels

    def __len__(self):
        return len(self.source)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, index):
        if self.samples is not None:
            path, label = self.samples[index]
            with open(path, "rb") as f:
                data = f.read()
        else:  # synthetic: the image as the JPEG a camera would have written
            image, label = self.source[index]
            encoded = io.BytesIO()
            TF.to_pil_image((image * 50 + 128).clamp(0, 255).to(torch.uint8)).save(encoded, "JPEG", quality=95)
            data = encoded.getvalue()
        image = Image.open(io.BytesIO(data))  # reads the header: format, mode and size, no pixels yet
        width, height = image.size
        if self.train:  # the sample's own generator: a run resumed mid-epoch crops it as the uninterrupted run did
            generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))
            top, left, h, w = crop_box(height, width, self.scale, (3 / 4, 4 / 3), generator)  # RandomResizedCrop's
            flip = self.flip and bool(torch.rand(1, generator=generator) < 0.5)  # then RandomHorizontalFlip's draw
        else:  # Resize(short) to rh x rw, then CenterCrop(size): that box in the file's pixels
            short = self.size * 8 // 7
            rh, rw = (short, int(short * width / height)) if height <= width else (int(short * height / width), short)
            top = round(round((rh - self.size) / 2) * height / rh)
            left = round(round((rw - self.size) / 2) * width / rw)
            h, w, flip = round(self.size * height / rh), round(self.size * width / rw), False
        if image.format == "JPEG" and image.mode in ("RGB", "L") and data.endswith(b"\xff\xd9"):
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # the file as it is: 1-D bytes
        else:  # PNG, CMYK, cut short: PIL decodes it, or raises naming what is wrong
            payload = TF.pil_to_tensor(rgb(image))  # 16-bit PNGs scaled to 8 bits, not clipped at 255
        return payload, torch.tensor([top, left, h, w]), flip, label, index


def collate(samples):  # New: files differ in length: a list of them, not one stacked tensor
    payloads, boxes, flips, labels, indices = zip(*samples, strict=True)
    return list(payloads), torch.stack(boxes), torch.tensor(flips), torch.tensor(labels), torch.tensor(indices)


def decode_batch(batch, device, size, memory_format, normalize, counts, split, source):  # New: the main process's
    """Decode, crop, resize, flip and normalise a batch on `device` (DataLoaderX runs it one batch ahead, on CUDA on
    its side stream): (images N x 3 x size x size float32, labels). normalize: device_normalize's, made once (its
    mean and std copied to the GPU here would wait for the side stream's queued work at every batch). counts: bytes
    and images handed over, added up. split, source: what names a file that does not decode (an ImageFolder's)."""
    payloads, boxes, flips, labels, indices = batch
    files = [p for p in payloads if p.dim() == 1]
    if device.type == "cuda":  # nvjpeg writes its output from a stream of its own: nothing may be queued on ours
        torch.cuda.current_stream(device).synchronize()
    try:
        decoded = iter(decode_jpeg(files, mode=ImageReadMode.RGB, device=device) if files else [])
    except RuntimeError as exc:  # a file the decoder refuses: each file alone, to decode it apart or to name it
        alone, refused = [], False
        for p, i in [(p, i) for p, i in zip(payloads, indices.tolist(), strict=True) if p.dim() == 1]:
            try:
                alone.append(decode_jpeg(p, mode=ImageReadMode.RGB, device=device))
                continue
            except RuntimeError:  # nvjpeg refuses some JPEGs the CPU's libjpeg-turbo decodes (chroma subsampling)
                refused = True
            try:
                alone.append(decode_jpeg(p, mode=ImageReadMode.RGB))  # on the CPU; to the device below
            except RuntimeError as bad:
                where = f" ({source.samples[i][0]})" if hasattr(source, "samples") else ""
                raise SampleError(f"{split} sample {i}{where} does not decode: {' '.join(str(bad).split())}") from exc
        if not refused:  # every file decodes alone (the GPU out of memory): no file to blame, the error goes on
            raise
        if device.type == "cuda":  # a failed decode's writes, queued on nvjpeg's stream, end before any copy lands
            torch.cuda.synchronize(device)
        decoded = iter([image.to(device) for image in alone])
    images = []
    for p, (top, left, h, w), flip in zip(payloads, boxes.tolist(), flips.tolist(), strict=True):
        image = next(decoded) if p.dim() == 1 else p.to(device, non_blocking=True)
        image = TF.resized_crop(image, top, left, h, w, [size, size], antialias=True)
        images.append(TF.horizontal_flip(image) if flip else image)
    counts.update(encoded_bytes=sum(p.numel() for p in files), images=len(payloads),
                  decoded_by_workers=len(payloads) - len(files))
    images = normalize(torch.stack(images))  # ImageNet's mean and std, as float32
    return images.contiguous(memory_format=memory_format), labels.to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device):
    """Each rank scores its own shard; the sums are all-reduced, as if one process scored all (every rank calls it)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    for images, targets in loader:  # New: on the device already, in training's memory format
        output = model(images)
        acc1, acc5 = accuracy(output, targets, topk=(1, 5))
        loss.update(criterion(output, targets), images.size(0))
        top1.update(acc1, images.size(0))
        top5.update(acc5, images.size(0))
    for meter in (loss, top1, top5):
        meter.all_reduce(device)
    return loss.avg, top1.avg, top5.avg, top1.count


def main():
    args = parse_args()
    # ------------------------------------------------------------------------ distributed setup
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; plain python: a world of 1.
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    is_main = rank == 0
    check_args(args, world_size)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"  # one GPU per process; NCCL between GPUs
        device, backend = harness.check_gpu(device, backend)  # visible? (launch.sh G:N: N ranks on GPU G, gloo)
        torch.cuda.set_device(device)  # first CUDA call, or each process also opens a context on GPU 0 (write-up 000)
        torch.backends.cudnn.benchmark = True  # fixed-size inputs: cuDNN times its kernels once, keeps the fastest
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # TF32: fast, fp32's curves
    else:
        device, backend = torch.device("cpu"), "gloo"
    if args.debug_collectives:  # each collective first checks that every rank called the same one (slow: debugging)
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # before init: TORCH_DISTRIBUTED_DEBUG is read only at import
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # torch's 30 min would leave the others hanging that long
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    batch_per_process = args.batch_size // world_size
    micro_batch = batch_per_process // args.accum_steps  # --accum-steps micro-batches per process and step
    workers_per_process = harness.default_workers(args.workers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({batch_per_process} per process x {world_size}, micro_batch={micro_batch} x {args.accum_steps} "
           f"accum_steps), workers={workers_per_process} per process")
    # the default: fp16 on a GPU; on a CPU bf16 where oneDNN runs it natively (AVX-512, AMX, Arm), else fp32
    amp_name = args.amp_dtype or ("fp16" if device.type == "cuda" else harness.cpu_amp_default())
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "fp32": torch.float32}[amp_name]
    if amp_name == "fp32":  # strict fp32: TF32 off too (set on above); a no-op on the CPU, which has no TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    # ------------------------------------------------------------------------------------ data
    # YOUR DATA goes here: an ImageFolder's files (train/<class>/*.jpg, val/...), or any dataset whose .samples lists
    # (path, label), and the number of classes. build_datasets fails with one line naming the folder that is wrong.
    train_files, val_files, num_classes = build_datasets(args.dataset, args.data_root, args.image_size,
                                                         args.synthetic_train, args.synthetic_val)
    # New: workers read bytes and draw boxes (EncodedImages); each sample's box and flip seeded by (seed, epoch,
    # index): a run resumed mid-epoch augments the rest as the uninterrupted run did. A file PIL cannot read stops the
    # run with one line naming it (NameFailingSamples).
    train_source, val_source = (getattr(d, "dataset", d) for d in (train_files, val_files))  # ImageFolder, or images
    train_images = EncodedImages(train_source, args.image_size, True, not args.no_flip, args.seed)
    train_set = NameFailingSamples(train_images, "train")
    val_set = NameFailingSamples(EncodedImages(val_source, args.image_size, False, False), "val")
    # Same seed on every rank: each process sees a different shard of one shared permutation.
    # New: SkipFirst, a run resumed mid-epoch leaves out what the ranks trained on before the save.
    train_sampler = SkipFirst(DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                                 seed=args.seed))
    counts, val_counts = collections.Counter(), collections.Counter()  # New: what crossed from the workers
    normalize = device_normalize("imagefolder", device)  # New: ImageNet's mean and std, on the device once
    # New: DataLoaderX decodes one batch ahead: on_device runs in its thread (on CUDA, on its side stream). Workers
    # not persistent: each epoch's copy of train_set has its epoch (the seeds). pin_memory: for the labels' copy.
    loader_args = dict(batch_size=batch_per_process, num_workers=workers_per_process, collate_fn=collate,
                       pin_memory=device.type == "cuda", persistent_workers=workers_per_process > 0, prefetch=1)
    train_loader = DataLoaderX(device, train_set, sampler=train_sampler, drop_last=True, on_device=lambda b:
                               decode_batch(b, device, args.image_size, memory_format, normalize, counts, "train",
                                            train_source),
                               **{**loader_args, "batch_size": micro_batch, "persistent_workers": False})
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoaderX(device, Subset(val_set, range(rank, len(val_set), world_size)), on_device=lambda b:
                             decode_batch(b, device, args.image_size, memory_format, normalize, val_counts, "val",
                                          val_source),
                             **loader_args)
    steps_per_epoch = len(train_loader) // args.accum_steps  # a partial accumulation at the end is dropped
    harness.check_full_batch(steps_per_epoch, len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={steps_per_epoch}")
    if workers_per_process > 0:  # New: start the validation workers now. The training workers are forked again every
        # epoch, and on Python <= 3.11 a fork just after another loader shut down (here in DataLoaderX's thread) can
        # deadlock the child (CPython gh-112275). DataLoader's own iter(): DataLoaderX's would start decoding.
        torch.utils.data.DataLoader.__iter__(val_loader)
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device, memory_format=memory_format)
    if args.sync_bn:  # before the DDP wrap; each BatchNorm all-gathers its statistics in every training forward
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.compile:  # in place, before the DDP wrap: ddp_compile.py's lesson, the step compiled, the data as it was
        model.compile(dynamic=False)  # evaluation's last, smaller batch: a graph of its own
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters, process_group=harness.ddp_process_group(timeout))
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    # fused: GradScaler hands it the inf flag on the device (with a plain SGD, scaler.step() reads it on the host).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, fused=True)
    # fused SGD's first step() makes its momentum with empty_like, even when GradScaler skips it: start at 0.
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs)  # per step
    # enabled for fp16 only, with bf16 or fp32 its calls pass straight through.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    # ----------------------------------------- resume: AMP's checkpoint also holds the scaler's state
    # fp16's scaler keeps the scale it settled on (restarted at 65536, it skips steps to find it again). A disabled
    # (bf16/fp32) scaler saves {}: --amp-dtype must match, and --epochs (the cosine schedule is laid out for them).
    # Checkpoints in full, RNG included: ddp_checkpoint.py.
    # New: and --batch-size: a resume mid-epoch skips the samples that many steps of it covered.
    run_flags, start_epoch, step = {"amp_dtype": amp_name, "epochs": args.epochs, "batch_size": args.batch_size}, 0, 0
    in_epoch_at_start, sums = 0, [0.0] * 4  # New: steps of start_epoch done before the save, its meters' sums
    resume = find_resume(args.resume, os.path.join(args.out_dir, "checkpoint.pt"))  # 'auto': the last one, if any
    if resume:
        ckpt = load_same_flags(resume, map_location=device, flags=run_flags,
                               require=("model", "optimizer", "scheduler", "scaler"))
        load_weights(model.module, ckpt["model"], resume)  # a wrong --arch: one line naming the keys
        optimizer.load_state_dict(ckpt["optimizer"])
        for group in optimizer.param_groups:  # a plain SGD's checkpoint would switch fused off (GradScaler then fails)
            group.update(fused=True, foreach=None)
        scaler.load_state_dict(ckpt["scaler"])  # without it fp16 restarts at scale 65536 and skips steps
        # New: the step goes by this run's steps per epoch (another world size can count others, DistributedSampler
        # pads each shard): the epochs done and the steps into the next, as saved (before in_epoch: from the step)
        start_epoch, sums = ckpt["epoch"], ckpt["sums"]
        in_epoch_at_start = ckpt.get("in_epoch", ckpt["step"] - start_epoch * steps_per_epoch)
        if not 0 <= in_epoch_at_start < steps_per_epoch:
            harness.die(f"{resume} holds no step count in its epoch that this run's {steps_per_epoch} steps an "
                        "epoch can place: resume it on the process count that saved it", all_ranks=False)
        step = start_epoch * steps_per_epoch + in_epoch_at_start
        scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs, step)  # New: step
        torch.manual_seed(args.seed + rank + 10_000 * step)  # New: no RNG state saved: not the draws before (dropout)
        print0(f"resumed: {resume} epoch={start_epoch} step={step} scaler={scaler.state_dict()}")
    print0(f"amp: {amp_name} autocast={amp_dtype != torch.float32} grad_scaler={scaler.is_enabled()}"
           + (f" ({harness.cpu_amp_default(why=True)})" if args.amp_dtype is None and device.type == "cpu" else ""))
    harness.broadcast_out_dir_check(args.out_dir, is_main, {
        "checkpoint.pt": harness.state_bytes(model.module, optimizer), "model.pt": harness.state_bytes(model.module)},
        shared=True, tb_dir=args.tb_dir)  # New: shared: every rank loads checkpoint.pt on a resume
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * steps_per_epoch, args.max_steps or float("inf"))
    speed = harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    # own_ms: data + forward; the data alone with --sync-bn (its waits) or --compile (the hooks would break its graph)
    speed.watch(model, forward=None if args.sync_bn or args.compile else model.module)
    # resumed, the curves go on from `step`; what an interrupted run logged after its checkpoint is dropped.
    tb = harness.TensorBoard(args.tb_dir, args.tb_every, is_main, vars(args), start_step=step)  # rank 0 alone writes
    diverged = harness.DivergenceCheck(device)  # a NaN/inf loss stops the run before anything is saved
    diverged.last_good = resume  # what the stop message names; each save below updates it
    harness.check_epochs_left(resume, start_epoch, args.epochs)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch replays the same order
        train_images.set_epoch(epoch)  # New: the epoch in each sample's augmentation seed
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        in_epoch, before = 0, 0  # New: steps of this epoch done; its images trained before the save (not timed here)
        if epoch == start_epoch and in_epoch_at_start:  # New: mid-epoch: skip what was trained, go on with its sums
            in_epoch, train_sampler.skip = in_epoch_at_start, in_epoch_at_start * batch_per_process
            if is_main:  # the sums of every rank: all-reduced at the epoch's end, as the ranks' own would be
                (loss_meter.sum, loss_meter.count, acc_meter.sum, acc_meter.count) = sums
            before = sums[1]  # New: img/s below is this run's images alone
        recent = collections.deque(maxlen=4)  # this epoch's last inputs, for BatchNorm below
        speed.start()
        left = (steps_per_epoch - in_epoch) * args.accum_steps  # New: micro-batches
        micro_batches = itertools.islice(train_loader, left)
        bar = tqdm(micro_batches, total=left, desc=f"epoch {epoch + 1}", leave=False,
                   disable=not (is_main and sys.stdout.isatty()))
        for i, (images, targets) in enumerate(bar):  # New: on the device already: decoded, cropped, normalised there
            recent.append(images)
            boundary = (i + 1) % args.accum_steps == 0  # the step's last micro-batch
            # no_sync, gradients accumulate locally; the boundary micro-step's backward all-reduces the sum.
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                    output = model(images)  # DDP checks here that the last backward reduced every gradient
                    loss = criterion(output, targets)
                # backward outside autocast. /K: the K micro-losses add up to the mean over the full batch.
                scaler.scale(loss / args.accum_steps).backward()
            loss_meter.update(loss, images.size(0))  # a tensor: summed on the device, no sync per step
            acc_meter.update(accuracy(output, targets)[0], images.size(0))
            if not scaler.is_enabled():  # fp16: an overflowing step is skipped, which is normal; the scale tells
                diverged.update(step + 1, loss)  # the step this micro-batch belongs to; on the device, no sync
            if not boundary:
                continue
            if args.clip_grad:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # skipped if fp16 gradients overflowed (inf/nan)
            scaler.update()
            scheduler.step()  # every optimizer step: warm-up, then cosine
            optimizer.zero_grad(set_to_none=True)
            step += 1
            compiled.step()  # --compile: after the first step, which compiled the model, the 'compile:' line
            in_epoch += 1  # New
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"],
                    loss_scale=scaler.get_scale if scaler.is_enabled() else None)
            if tb.on and step % args.tb_every == 0:  # values are read here anyway
                diverged.all_reduce_and_check(epoch, step, scaler.get_scale() if scaler.is_enabled() else None)
            # New: --save-every within the epoch, leaving 4 steps or more of it (the BatchNorm recompute below takes
            # its last 4 micro-batches). Every rank's meters go in, summed: a collective, then rank 0 writes.
            if (args.save_every and step % args.save_every == 0 and steps_per_epoch - in_epoch >= 4
                    and step < total_steps):
                ranks = gather_values([loss_meter.sum, loss_meter.count, acc_meter.sum, acc_meter.count], device)
                diverged.all_reduce_and_check(epoch, step, scaler.get_scale() if scaler.is_enabled() else None, model)
                if is_main:
                    save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
                                 "in_epoch": in_epoch, "sums": [sum(r[k] for r in ranks) for k in range(4)],
                                 "step": step, "flags": run_flags}, os.path.join(args.out_dir, "checkpoint.pt"))
                    print0(f"saved: checkpoint.pt at step {step} ({in_epoch} of epoch {epoch + 1})")
                diverged.last_good = os.path.join(args.out_dir, "checkpoint.pt")
            speed.step(args.batch_size)
            prof.step()  # --profile: OUT_DIR/profile/trace_rankR.json
            if step >= total_steps:
                break
        epoch_time = speed.stop()  # waits for the device: the host clock runs ahead of queued GPU work
        loss_meter.all_reduce(device, ride=speed)  # with every rank's own_ms: one all-reduce
        acc_meter.all_reduce(device)
        # Before eval and any save: no file from NaN weights. fp16: a scale below 1 is divergence (a collective).
        diverged.all_reduce_and_check(epoch, step, scaler.get_scale() if scaler.is_enabled() else None, model)
        # BatchNorm's running statistics trail the weights (momentum 0.1): after a short or fast epoch, eval's loss
        # explodes. Recompute them with the final weights from the last batches: every rank (--sync-bn: a collective).
        with recomputed_batchnorm(model.module), torch.autocast(device.type, dtype=amp_dtype,
                                                               enabled=amp_dtype != torch.float32):
            with torch.compiler.set_stance("force_eager"):  # --compile: these few batches want no graphs of their own
                while recent:  # popped: each batch leaves GPU memory once used
                    model.module(recent.popleft())
        # -------------------------------------------------------------------------------- eval
        # DDP copies rank 0's buffers (BatchNorm statistics) to the others as each forward starts, so after the last
        # step every rank holds its own: evaluate everywhere with rank 0's, which model.pt gets.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
        # model.module: DDP's forward broadcasts buffers, a collective that hangs on an empty shard or a lone rank 0.
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            val_loss, val_acc1, val_acc5, val_samples = evaluate(model.module, val_loader, criterion, device)
        print0(f"epoch={epoch + 1}/{args.epochs} step={step}/{total_steps} train_loss={loss_meter.avg:.4f} "
               f"train_acc1={acc_meter.avg:.2f} val_loss={val_loss:.4f} val_acc1={val_acc1:.2f} "
               f"val_acc5={val_acc5:.2f} img/s={(loss_meter.count - before) / epoch_time:.1f} "
               f"eta={speed.eta(total_steps - step)}{speed.spread}")  # own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=(loss_meter.count - before) / epoch_time)
        # after each whole epoch (not one cut short by --max-steps), so an interrupted run can --resume.
        if is_main and step % steps_per_epoch == 0:  # atomic: a crash mid-write keeps the previous checkpoint
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "epoch": epoch + 1, "step": step, "in_epoch": 0, "sums": [0.0] * 4, "flags": run_flags},
                        os.path.join(args.out_dir, "checkpoint.pt"))
        if step % steps_per_epoch == 0:
            diverged.last_good = os.path.join(args.out_dir, "checkpoint.pt")
        if step >= total_steps:
            break
    # ------------------------------------------------------------------------------------ save
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "model.pt")
        save_atomic(model.module.state_dict(), path)  # .module: no "module." prefix; atomic: --resume auto ends here
        print0(f"saved: {path} and checkpoint.pt, scaler={scaler.state_dict()}")
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    prof.stop()  # --profile: writes the steps it recorded
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(harness.gather_profile_table(prof, device))
    tb.close()
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    # New: what each rank's workers handed over in training: the files' bytes, and the images PIL decoded there.
    handed = gather_values([counts["images"], counts["encoded_bytes"], counts["decoded_by_workers"]], device)
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="gpu_decode", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples,
                                      handed_per_rank=[[int(v) for v in r] for r in handed], **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
