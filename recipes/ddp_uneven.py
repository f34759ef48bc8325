"""Uneven inputs: ranks with different numbers of batches, kept in step by torch's Join context manager.

    ./launch.sh recipes/ddp_uneven.py 0,1,3 --dataset cifar100 --epochs 30
    ./launch.sh recipes/ddp_uneven.py cpu:3 --arch tiny --shard-size 30

What it shows (the rest is recipes/ddp_torchrun.py): data sharded by whole files (--shard-size samples each, dealt
out to the ranks in turn, as a sharded IterableDataset or a per-file sampler splits it) gives the ranks different
numbers of batches. Under plain DDP the rank that runs out first leaves the others waiting in their next gradient
all-reduce until --dist-timeout ends the job. `with Join([model]):` lets a rank that is out of batches shadow the
others' all-reduces (it contributes zeros; each gradient is still divided by the world size: a step is the sum of
each rank's batch-mean gradient over W, so a short last batch weighs as much as a full one, and a step that k of W
ranks still train moves k/W as far: with the default files, one rank more, about a fifth of each epoch at lr / W)
until all are done; then every rank gets the weights of the last rank to finish. What
Join does not sync is yours: SGD's momentum and the LR schedule of the ranks that sat steps out (both are synced
below), and any other collective in the loop (none here: the divergence check waits for the epoch's end).
DDP(forward_sync_buffers=False): with Join, DDP's per-forward buffer broadcast costs a blocking all-reduce and a host
sync every step; BatchNorm's statistics are recomputed and broadcast at each epoch's end instead.
--sync-bn is not offered: SyncBatchNorm's collectives are not ones Join shadows.

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import datetime
import inspect
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join  # New
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.data import add_data_flags, build_datasets, device_normalize, prepare_dataset
from common.models import build_model, recomputed_batchnorm
from common.schedule import warmup_cosine
from common.utils import AverageMeter, accuracy, print0


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_flags(p)  # --dataset, --data-root, --image-size, ...: build_datasets' flags (common/data.py)
    p.add_argument("--arch", default="resnet18", help="torchvision model name, or tiny / tiny_unused")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, help="GLOBAL batch, split across processes (default: 128; 126 on 3)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/ddp_uneven", help="model.pt is written here")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    p.add_argument("--shard-size", type=int,  # New
                   help="samples per shard (file), dealt out to the ranks in turn (default: the training set in "
                        "4 x processes + 1 files, so one rank gets a file more)")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # one line each: nan/inf, a bad count or --arch, an uneven --batch-size
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // world_size) * world_size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem


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


def shard_of(num_samples, shard_size, rank, world_size):  # New
    """This rank's samples: consecutive shards (files) of shard_size, dealt out in turn. Whole files per rank, as a
    sharded dataset splits them, so the ranks' sample counts differ (a short last file, files that do not divide)."""
    starts = range(rank * shard_size, num_samples, world_size * shard_size)
    return [i for start in starts for i in range(start, min(start + shard_size, num_samples))]


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
    if local_rank == 0:  # one per node (in turn on a shared folder: one download); the others wait at the barrier
        prepare_dataset(args.dataset, args.data_root)
    dist.barrier()
    # YOUR DATA goes here: two map-style Datasets whose items are (image tensor C x H x W, integer label), and the
    # number of classes. build_datasets fails with one line naming the folder or file that is wrong.
    train_set, val_set, num_classes = build_datasets(args.dataset, args.data_root, args.image_size,
                                                     args.synthetic_train, args.synthetic_val, flip=not args.no_flip)
    # Their images arrive as uint8 (4x fewer bytes to hand over, pin and copy than float32): normalised on the device.
    normalize = device_normalize(args.dataset, device)
    # New: this rank's files, shuffled within (its own generator: the same order every run); drop_last=False, so each
    # rank has as many batches as its shards fill, and a short last one.
    args.shard_size = args.shard_size or -(-len(train_set) // (4 * world_size + 1))
    if len(train_set) < world_size:  # no --shard-size gives every rank a sample
        harness.die(f"{len(train_set)} training samples cannot give each of {world_size} ranks one")
    if len(train_set) <= (world_size - 1) * args.shard_size:  # the same verdict on every rank
        harness.die(f"--shard-size {args.shard_size} leaves rank {world_size - 1} no sample of {len(train_set)}: "
                    f"every rank needs a shard; try --shard-size {max(1, len(train_set) // world_size)}")
    mine = shard_of(len(train_set), args.shard_size, rank, world_size)
    loader_args = dict(batch_size=batch_per_process, num_workers=workers_per_process,
                       pin_memory=device.type == "cuda", persistent_workers=workers_per_process > 0)
    train_loader = DataLoader(Subset(train_set, mine), shuffle=True,  # New: no sampler, the last batch kept
                              generator=torch.Generator().manual_seed(args.seed + rank), **loader_args)
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), **loader_args)
    # New: every rank's batch count, visibly gathered: the schedule is laid out on the longest (each rank steps it
    # alike), and that rank, which trains every step, holds the optimizer state the others copy after each epoch.
    counts = [None] * world_size
    dist.all_gather_object(counts, len(train_loader))
    steps_per_epoch = max(counts)
    longest = max(r for r, count in enumerate(counts) if count == steps_per_epoch)  # the rank Join takes weights from
    ones = [r for r in range(world_size) if batch_per_process > 1 and len(shard_of(
        len(train_set), args.shard_size, r, world_size)) % batch_per_process == 1]  # New: a last batch of one sample
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={steps_per_epoch} batches_per_rank={counts}")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device)
    if ones and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):  # New
        harness.die(f"rank {ones[0]}'s last batch would hold 1 sample ({batch_per_process} a process): BatchNorm's "
                    "statistics of one (an error where its map is 1 x 1); change --batch-size or --shard-size")
    # New: no buffer broadcast at each forward. Under Join it first agrees on a rank that has not joined: a blocking
    # all-reduce and a host read, every step. Training BatchNorm never reads its buffers: recomputed, rank 0's are
    # broadcast below (else keep the broadcast). The keyword is forward_sync_buffers from torch 2.13, before that
    # broadcast_buffers (deprecated in 2.14, a FutureWarning on every rank).
    no_buffer_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else \
        "broadcast_buffers"
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters, **{no_buffer_sync: False},
                process_group=harness.ddp_process_group(timeout))
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs)  # New: the longest's

    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": harness.state_bytes(model.module)},
                                    tb_dir=args.tb_dir)
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * steps_per_epoch, args.max_steps or float("inf"))  # New: the longest rank's
    step, speed = 0, harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model, forward=model.module)  # own_ms on the epoch line: data + forward
    tb = harness.TensorBoard(args.tb_dir, args.tb_every, is_main, vars(args))  # rank 0 alone writes
    diverged = harness.DivergenceCheck(device)  # a NaN/inf loss stops the run before anything is saved
    for epoch in range(args.epochs):
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        recent = collections.deque(maxlen=4)  # this epoch's last inputs, for BatchNorm below
        speed.start()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", leave=False, disable=not (is_main and sys.stdout.isatty()))
        # New: a rank out of batches shadows the others' all-reduces until every rank is out (no other collective in
        # this loop: Join shadows only those of the objects it is given).
        with Join([model]):
            for images, targets in bar:
                images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
                recent.append(images)
                output = model(images)  # DDP checks here that the last backward reduced every gradient
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
                speed.step(images.size(0))  # New: this rank's own (the others' added below: uneven, some sit out)
                prof.step()  # --profile: OUT_DIR/profile/trace_rankR.json
                if step >= total_steps:
                    break
        # New: the steps this rank sat out: its schedule goes on from the longest rank's count.
        while step < min(total_steps, (epoch + 1) * steps_per_epoch):
            step += 1
            scheduler.step()
        # New: Join gave every rank the weights of the last rank to finish, not its momentum: copy that too, from a
        # rank that trained every step (all such ranks hold the same). In parameter order: the same on every rank.
        for group in optimizer.param_groups:
            for param in group["params"]:
                momentum = optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
                dist.broadcast(momentum, src=longest)
        epoch_time = speed.stop()  # waits for the device: the host clock runs ahead of queued GPU work
        loss_meter.all_reduce(device, ride=speed)  # with every rank's own_ms: one all-reduce
        acc_meter.all_reduce(device)
        diverged.all_reduce_and_check(epoch, step, model=model)  # before eval and any save: no file from NaN weights
        # BatchNorm's running statistics trail the weights (momentum 0.1): after a short or fast epoch, eval's loss
        # explodes. Recompute them with the final weights from the last batches: local, on every rank.
        with recomputed_batchnorm(model.module):
            while recent:  # popped: each batch leaves GPU memory once used
                model.module(recent.popleft())
        # -------------------------------------------------------------------------------- eval
        # New: no buffer broadcast in training (forward_sync_buffers=False), so every rank holds its own BatchNorm
        # statistics: evaluate everywhere with rank 0's, which model.pt gets.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
        # model.module: evaluation needs nothing of DDP (its forward broadcasts buffers in the siblings: a collective).
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
    speed.images = sum(harness.gather_values(speed.images, device))  # New: the images every rank trained, timed
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="ddp_uneven", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples,
                                      timed_images=speed.images))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
