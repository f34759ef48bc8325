"""nn.DataParallel: one process drives every visible GPU; each batch is split across them.

    ./launch.sh recipes/dp.py 0,1,3 --dataset cifar100 --epochs 30    # GPUs 0, 1 and 3, one process
    ./launch.sh recipes/dp.py cpu --dataset synthetic --arch tiny     # CPU: DataParallel passes through

Without launch.sh: `CUDA_VISIBLE_DEVICES=0,1,3 python recipes/dp.py ...`.

What it shows: the smallest change from one GPU (wrap the model, nothing else), and why DDP
(recipes/ddp_torchrun.py) is preferred anyway: every step DataParallel copies the model from GPU 0
to the others, gathers all outputs on GPU 0 (so GPU 0 needs more memory than the rest and can run
out first), and runs the replicas from threads of one Python process, where the GIL serialises them.
DDP runs one process per GPU and only all-reduces gradients. --batch-size is the whole batch,
split across the GPUs; --workers all belong to the one process.

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: python

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.nn import DataParallel
from torch.utils.data import DataLoader, RandomSampler
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
    p.add_argument("--batch-size", type=int, default=128, help="whole batch, split across the GPUs")
    p.add_argument("--workers", type=int, help="DataLoader workers (one process; default: cores - 1, at most 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/dp", help="model.pt is written here")
    harness.add_flags(p, collectives=False)  # --max-steps, --tb-dir, --tb-every (no process group here)
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # one line each: nan/inf, a bad count or --arch, an uneven --batch-size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device, normalize):
    """Top-1/top-5 over the whole validation set (all_reduce is a no-op without a process group)."""
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
    # New: one process, whatever the GPU count: DataParallel fans each batch out to threads.
    rank, local_rank, world_size, is_main = 0, 0, 1, True
    check_args(args, world_size)
    num_gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank) if num_gpus else torch.device("cpu")  # outputs gather here
    if num_gpus:
        torch.backends.cudnn.benchmark = True  # fixed-size inputs: cuDNN times its kernels once, keeps the fastest
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # TF32: fast, fp32's curves
    batch_per_process = args.batch_size
    workers_per_process = harness.default_workers(args.workers, processes_per_node=1)
    where = f"DataParallel over {num_gpus} GPU(s)" if num_gpus else "no GPU, DataParallel passes through"
    print0(f"setup: 1 process, {where}, batch={args.batch_size} (split across the GPUs), workers={workers_per_process}")
    # ------------------------------------------------------------------------------------ data
    prepare_dataset(args.dataset, args.data_root)
    # YOUR DATA goes here: two map-style Datasets whose items are (image tensor C x H x W, integer label), and the
    # number of classes. build_datasets fails with one line naming the folder or file that is wrong.
    train_set, val_set, num_classes = build_datasets(args.dataset, args.data_root, args.image_size,
                                                     args.synthetic_train, args.synthetic_val, flip=not args.no_flip)
    # Their images arrive as uint8 (4x fewer bytes to hand over, pin and copy than float32): normalised on the device.
    normalize = device_normalize(args.dataset, device)
    train_sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(args.seed))  # New: one process
    train_loader = DataLoader(train_set, batch_size=batch_per_process, sampler=train_sampler,
                              num_workers=workers_per_process, pin_memory=device.type == "cuda",
                              drop_last=True, persistent_workers=workers_per_process > 0)
    val_loader = DataLoader(val_set, batch_size=batch_per_process,
                            num_workers=workers_per_process, pin_memory=device.type == "cuda",
                            persistent_workers=workers_per_process > 0)
    harness.check_full_batch(len(train_loader), len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={len(train_loader)}")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device)
    model = DataParallel(model)  # New: all visible GPUs, replicas copied from GPU 0 each step; on CPU a pass-through
    torch.manual_seed(args.seed + rank)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs)  # per step
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": harness.state_bytes(model.module)},
                                    tb_dir=args.tb_dir)
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * len(train_loader), args.max_steps or float("inf"))
    step, speed = 0, harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model)  # own_ms on the epoch line: waiting for data (one process)
    tb = harness.TensorBoard(args.tb_dir, args.tb_every, is_main, vars(args))  # rank 0 alone writes
    diverged = harness.DivergenceCheck(device)  # a NaN/inf loss stops the run before anything is saved
    for epoch in range(args.epochs):
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        recent = collections.deque(maxlen=4)  # this epoch's last inputs, for BatchNorm below
        speed.start()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", leave=False, disable=not (is_main and sys.stdout.isatty()))
        for images, targets in bar:
            images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
            recent.append(images)
            output = model(images)  # scatter the batch, run replicas in threads, gather on GPU 0
            loss = criterion(output, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradients of all replicas are summed into the GPU 0 model
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
        # explodes. Recompute them with the final weights from the last batches (on GPU 0, a GPU's slice at a time).
        with recomputed_batchnorm(model.module):
            while recent:  # popped: each batch leaves GPU memory once used
                for part in recent.popleft().chunk(max(1, torch.cuda.device_count())):
                    model.module(part)
        # -------------------------------------------------------------------------------- eval
        val_loss, val_acc1, val_acc5, val_samples = evaluate(model, val_loader, criterion, device, normalize)
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
    if args.profile:  # one process, no collective: its compute, data, optimizer, idle
        print0(harness.gather_profile_table(prof, device))
    tb.close()
    # Per GPU: DataParallel gathers outputs and gradients on GPU 0, so it is the fullest.
    peaks = [round(harness.peak_memory_mb(torch.device("cuda", i)), 1) for i in range(num_gpus)]
    print0(harness.gather_result_line(device, speed, model, optimizer, peaks=peaks, recipe="dp", world_size=world_size,
                                      steps=step, train_loss=loss_meter.avg, val_acc1=val_acc1,
                                      val_samples=val_samples))


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
