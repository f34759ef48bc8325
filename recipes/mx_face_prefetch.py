"""Face recognition on MXNet RecordIO data (insightface layout), fed by DataLoaderX, with DDP.

    python tools/pack_rec.py ~/faces_by_identity ~/faces_rec --size 112        # ImageFolder -> train.rec/.idx
    ./launch.sh recipes/mx_face_prefetch.py 0,1,3 --rec ~/faces_rec --image-size 112
    ./launch.sh recipes/mx_face_prefetch.py 0,1,3 --rec /data/faces_emore --num-classes 85742
    ./launch.sh recipes/mx_face_prefetch.py cpu:2 --rec synthetic --arch tiny  # no data at all

What it shows (the rest is recipes/ddp_torchrun.py):
- insightface's data path without MXNet (retired to the Apache Attic; 1.9.1 needs numpy<1.24):
  common.recordio reads train.rec/train.idx in pure Python, safely from forked DataLoader workers
  (pread, no shared file position). --reader mxnet uses mx.recordio instead, for comparison.
  A corrupt or truncated file stops training with one line naming the file and the record key.
- common.DataLoaderX: a background thread loads the next batches while this one computes, and on a GPU
  copies them on a side CUDA stream (the step waits on that copy's event; record_stream keeps the memory
  alive). Call torch.cuda.set_device(local_rank) first: the DataLoader's pin-memory thread pins on the current GPU.
- A margin-based softmax head: CosFace s*(cos(theta_y) - m) or ArcFace s*cos(theta_y + m) for the true
  identity, s*cos(theta) for the others, on L2-normalised embeddings and class weights. Validation
  scores held-out images of the same identities (every 10th image) by plain cosine logits.

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import datetime
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.data import NameFailingSamples, build_datasets, device_normalize
from common.loader import DataLoaderX
from common.models import build_model, recomputed_batchnorm
from common.recordio import MXFaceDataset, RecordIOError
from common.schedule import warmup_cosine
from common.utils import AverageMeter, accuracy, print0


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rec", default="synthetic", help="folder with train.rec + train.idx, or 'synthetic'")
    p.add_argument("--reader", choices=["auto", "python", "mxnet"], default="auto", help="auto = python")
    p.add_argument("--num-classes", type=int, help="identities, when the .rec has no header record 0")
    p.add_argument("--image-size", type=int, default=112, help="images are resized to this square")
    p.add_argument("--no-flip", action="store_true", help="no random horizontal flip (text, digits)")
    p.add_argument("--synthetic-train", type=int, default=2048, help="synthetic: training samples")
    p.add_argument("--synthetic-val", type=int, default=500, help="synthetic: validation samples")
    p.add_argument("--arch", default="resnet18", help="backbone: torchvision model name, or tiny")
    p.add_argument("--embedding-size", type=int, default=128)  # New
    p.add_argument("--head", choices=["cosface", "arcface"], default="cosface")
    # Defaults for small sets; insightface trains millions of images with s=64, m=0.4 (CosFace) / 0.5 (ArcFace).
    p.add_argument("--scale", type=float, default=16.0, help="s: logits are s * cosine")
    p.add_argument("--margin", type=float, default=0.2, help="m: subtracted from (CosFace) or added to (ArcFace)")
    p.add_argument("--prefetch", type=int, default=2, help="batches DataLoaderX loads ahead")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, help="GLOBAL batch, split across processes (default: 128; 126 on 3)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/mx_face_prefetch", help="model.pt is written here")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # one line each: nan/inf, a bad count or --arch, an uneven --batch-size
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // world_size) * world_size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    if args.rec != "synthetic" and not os.path.isdir(args.rec):  # New
        harness.die(f"--rec {args.rec}: no such folder (expected train.rec + train.idx there, or --rec synthetic)",
                    all_ranks=True)


# ------------------------------------------------------------------------------------------ model
class MarginHead(nn.Module):  # New: the face model, a backbone's embedding and this head
    """Cosine logits with a margin on the true class: CosFace cos(t) - m, ArcFace cos(t + m), times s."""

    def __init__(self, embedding_size, num_classes, kind, scale, margin):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_classes, embedding_size) * 0.01)
        self.kind, self.scale, self.margin = kind, scale, margin

    def forward(self, embeddings, labels=None):
        cos = F.linear(F.normalize(embeddings), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        if labels is None:  # evaluation: no margin
            return self.scale * cos
        target = cos.gather(1, labels[:, None])
        m = self.margin  # ArcFace: cos(t + m) rises past t = pi - m (hard samples pushed away): cos(t) - m sin(m) there
        arc = torch.where(target > -np.cos(m), torch.cos(torch.acos(target) + m), target - m * np.sin(m))
        target = target - m if self.kind == "cosface" else arc
        return self.scale * cos.scatter(1, labels[:, None], target)


class FaceModel(nn.Module):
    def __init__(self, arch, embedding_size, num_classes, kind, scale, margin, image_size=None):
        super().__init__()
        # Its classifier layer now outputs the embedding; below 64 px a ResNet gets the small-image stem.
        self.backbone = build_model(arch, embedding_size, image_size)
        self.head = MarginHead(embedding_size, num_classes, kind, scale, margin)

    def forward(self, images, labels=None):
        return self.head(self.backbone(images), labels)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device, normalize):
    """Each rank scores its own shard; the sums are all-reduced, as if one process scored all (every rank calls it)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    for images, targets in loader:
        images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
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
    workers_per_process = harness.default_workers(args.workers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({batch_per_process} per process x {world_size}), workers={workers_per_process} per process")
    # ------------------------------------------------------------------------------------ data
    # YOUR DATA goes here: two map-style Datasets whose items are (image tensor C x H x W, integer label), and the
    # number of classes. build_datasets fails with one line naming the folder or file that is wrong.
    flip = [] if args.no_flip else [T.RandomHorizontalFlip()]  # aligned faces: flipping is insightface's only one
    # uint8 pixels to the training process (a quarter of float32's bytes to pin and copy); the device normalises them
    square = (args.image_size, args.image_size)  # Resize(int) scales the short side alone: other shapes, no batch
    train_tf = T.Compose([T.Resize(square), *flip, T.PILToTensor()])
    val_tf = T.Compose([T.Resize(square), T.PILToTensor()])
    normalize = device_normalize("synthetic" if args.rec == "synthetic" else "faces", device)  # insightface's 0.5s
    if args.rec == "synthetic":
        train_set, val_set, num_classes = build_datasets("synthetic", image_size=args.image_size,
                                                         synthetic_train=args.synthetic_train,
                                                         synthetic_val=args.synthetic_val)
    else:
        reader = "python" if args.reader == "auto" else args.reader
        try:
            faces = MXFaceDataset(args.rec, train_tf, reader=reader, num_classes=args.num_classes)  # checks labels
            faces_val = faces.with_transform(val_tf)  # one reader: its index (numpy arrays) in memory once
        except (RecordIOError, OSError) as exc:
            harness.die(str(exc), all_ranks=True)
        num_classes = faces.num_classes  # --num-classes, else the identity count in the header
        if not num_classes:
            harness.die(f"{args.rec}/train.rec has no header record 0 giving the identity count; pass --num-classes")
        # Every 10th image is held out: the same identities, unseen images. An array: workers copy a list's ints.
        # NameFailingSamples: a record that does not decode stops training with its index and key, on its rank.
        train_set = Subset(NameFailingSamples(faces, "train"), np.flatnonzero(np.arange(len(faces)) % 10))
        val_set = Subset(NameFailingSamples(faces_val, "val"), range(0, len(faces), 10))
    # Same seed on every rank: each process sees a different shard of one shared permutation.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # Batches arrive on `device`, loaded (and on GPU copied) while the previous step computes.
    train_loader = DataLoaderX(device, train_set, batch_size=batch_per_process, sampler=train_sampler,
                               num_workers=workers_per_process, pin_memory=device.type == "cuda",
                               drop_last=True, persistent_workers=workers_per_process > 0, prefetch=args.prefetch)
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoaderX(device, Subset(val_set, range(rank, len(val_set), world_size)),
                             batch_size=batch_per_process, num_workers=workers_per_process,
                             pin_memory=device.type == "cuda", persistent_workers=workers_per_process > 0)
    harness.check_full_batch(len(train_loader), len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.rec} reader={args.reader} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={len(train_loader)}")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = FaceModel(args.arch, args.embedding_size, num_classes, args.head, args.scale, args.margin,
                      args.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters, process_group=harness.ddp_process_group(timeout))
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs)  # per step
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": harness.state_bytes(model.module)},
                                    tb_dir=args.tb_dir)
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * len(train_loader), args.max_steps or float("inf"))
    step, speed = 0, harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model, forward=model.module)  # own_ms on the epoch line: data + forward
    tb = harness.TensorBoard(args.tb_dir, args.tb_every, is_main, vars(args))  # rank 0 alone writes
    diverged = harness.DivergenceCheck(device)  # a NaN/inf loss stops the run before anything is saved
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch replays the same order
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        recent = collections.deque(maxlen=4)  # this epoch's last inputs, for BatchNorm below
        speed.start()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", leave=False, disable=not (is_main and sys.stdout.isatty()))
        for images, targets in bar:
            images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
            recent.append((images, targets))
            output = model(images, targets)  # New: the margin needs the labels; DDP checks the last backward
            loss = criterion(output, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages gradients across ranks during backward
            optimizer.step()
            scheduler.step()  # every optimizer step: warm-up, then cosine
            loss_meter.update(loss, images.size(0))  # a tensor: summed on the device, no sync per step
            acc_meter.update(accuracy(output, targets)[0], images.size(0))
            step += 1
            diverged.update(step, loss)  # on the device: no sync per step
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"])  # rank 0's own samples
            if tb.on and step % args.tb_every == 0:  # values are read here anyway
                diverged.all_reduce_and_check(epoch, step)  # a collective: one verdict everywhere
            speed.step(args.batch_size)
            prof.step()  # --profile: OUT_DIR/profile/trace_rankR.json
            if step >= total_steps:
                break
        epoch_time = speed.stop()  # waits for the device: the host clock runs ahead of queued GPU work
        loss_meter.all_reduce(device, ride=speed)  # with every rank's own_ms: one all-reduce
        acc_meter.all_reduce(device)
        diverged.all_reduce_and_check(epoch, step, model=model)  # before eval and any save: no file from NaN weights
        # BatchNorm's running statistics trail the weights (momentum 0.1): after a short or fast epoch, eval's loss
        # explodes. Recompute them with the final weights from the last batches: local, on every rank.
        with recomputed_batchnorm(model.module):
            while recent:  # popped: each batch leaves GPU memory once used
                model.module(*recent.popleft())  # images and labels: the margin head needs them
        # -------------------------------------------------------------------------------- eval
        # DDP copies rank 0's buffers (BatchNorm statistics) to the others as each forward starts, so after the last
        # step every rank holds its own: evaluate everywhere with rank 0's, which model.pt gets.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
        # model.module: DDP's forward broadcasts buffers, a collective that hangs on an empty shard or a lone rank 0.
        val_loss, val_acc1, val_acc5, val_samples = evaluate(model.module, val_loader, criterion, device, normalize)
        print0(f"epoch={epoch + 1}/{args.epochs} step={step}/{total_steps} train_loss={loss_meter.avg:.4f} "
               f"train_acc1={acc_meter.avg:.2f} val_loss={val_loss:.4f} val_acc1={val_acc1:.2f} "
               f"val_acc5={val_acc5:.2f} img/s={loss_meter.count / epoch_time:.1f} eta={speed.eta(total_steps - step)}"
               f"{speed.spread}")  # each rank's own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=loss_meter.count / epoch_time)
        if step >= total_steps:
            break
    # ------------------------------------------------------------------------------------ save
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "model.pt")
        torch.save(model.module.state_dict(), path)  # .module: keys without the "module." prefix
        print0(f"saved: {path}")
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    prof.stop()  # --profile: writes the steps it recorded
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(harness.gather_profile_table(prof, device))
    tb.close()
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="mx_face_prefetch", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
