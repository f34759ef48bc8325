"""ZeRO-1 with DDP: ZeroRedundancyOptimizer shards the optimizer state over the ranks; checkpoints consolidate it.

    ./launch.sh recipes/ddp_zero.py 0,1,3 --dataset cifar100 --epochs 30 --resume auto
    ./launch.sh recipes/ddp_zero.py cpu:2 --arch tiny --epochs 3
    ./launch.sh recipes/ddp_zero.py cpu:3 --arch tiny --epochs 3 --resume auto    # stopped early? go on, on 3

What it shows (the rest is recipes/ddp_checkpoint.py's epoch-end checkpoints; no SIGUSR1 save or --save-every):
- ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, ...) keeps the optimizer state
  (SGD's momentum here; Adam's two moments are where it pays most) of about 1/N of the parameters on each rank:
  whole parameters, assigned greedily by size. DDP still all-reduces every gradient; each rank steps its own
  parameters, then broadcasts them (inside optimizer.step(), a collective), so every replica is the same again:
  with parameters_as_bucket_view=True one broadcast per rank, not torch's default of one per parameter tensor.
  The weights and gradients stay whole on every rank: FSDP (recipes/fsdp.py) shards those too.
- The pitfall is the checkpoint. optimizer.state_dict() needs the shards of every rank: each rank first calls
  optimizer.consolidate_state_dict(to=0), a collective (rank 0 alone would wait for the others forever), then
  rank 0 saves the whole state. Without it, state_dict() raises, or after an earlier consolidation returns that
  one: the state of an epoch ago, without an error.
- That consolidated state is a plain SGD state_dict: --resume loads it on every rank, each keeping its new
  shard, so a checkpoint from 2 GPUs resumes on 3 (and recipes/ddp_checkpoint.py can resume it too).
- state_bytes_per_rank in the RESULT line is each rank's parameters, gradients and optimizer shard.

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

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer  # New
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.checkpoint import find_resume, load_checkpoint, load_weights, save_atomic
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
    p.add_argument("--out-dir", default="runs/ddp_zero", help="latest.pt, best.pt, model.pt")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPUs only)")
    # New
    p.add_argument("--resume", help="a latest.pt to continue from, or 'auto': OUT_DIR/latest.pt if it exists")
    p.add_argument("--init-from", help="weights to start from (a state_dict, with or without 'module.')")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # nan/inf, a bad count or --arch, an uneven --batch-size, --sync-bn on CPU
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // world_size) * world_size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem
    for flag, path in (("--resume", args.resume), ("--init-from", args.init_from)):  # New
        if path and path != "auto" and not os.path.isfile(path):
            harness.die(f"{flag} {path}: no such file", all_ranks=True)  # files can differ per node


# ------------------------------------------------------------------------------------ checkpoints
def rng_state(device):  # New
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


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
    if local_rank == 0:  # one per node (in turn on a shared folder: one download); the others wait at the barrier
        prepare_dataset(args.dataset, args.data_root)
    dist.barrier()
    # YOUR DATA goes here: two map-style Datasets whose items are (image tensor C x H x W, integer label), and the
    # number of classes. build_datasets fails with one line naming the folder or file that is wrong.
    train_set, val_set, num_classes = build_datasets(args.dataset, args.data_root, args.image_size,
                                                     args.synthetic_train, args.synthetic_val, flip=not args.no_flip)
    # Their images arrive as uint8 (4x fewer bytes to hand over, pin and copy than float32): normalised on the device.
    normalize = device_normalize(args.dataset, device)
    # Same seed on every rank: each process sees a different shard of one shared permutation.
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader_args = dict(batch_size=batch_per_process, num_workers=workers_per_process,
                       pin_memory=device.type == "cuda", persistent_workers=workers_per_process > 0)
    # New: not persistent, workers are re-seeded from the (checkpointed) RNG each epoch, so resume is exact.
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True,
                              **{**loader_args, "persistent_workers": False})
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), **loader_args)
    harness.check_full_batch(len(train_loader), len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={len(train_loader)}")

    # New: start the validation workers now. The training workers are forked again every epoch, and on
    # Python <= 3.11 a fork just after another loader shut down can deadlock the child (CPython gh-112275).
    iter(val_loader)
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device)
    if args.sync_bn:  # before the DDP wrap; each BatchNorm all-gathers its statistics in every training forward
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters, process_group=harness.ddp_process_group(timeout))
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    # New: each rank keeps the momentum of its shard of the parameters only. parameters_as_bucket_view=True: each
    # rank's shard lives in one flat bucket (param.data points into it), so the step ends in one broadcast per rank,
    # not one per parameter tensor (resnet18: 62, each a latency-bound NCCL call that backward does not hide).
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr,
                                        momentum=0.9, weight_decay=5e-4, parameters_as_bucket_view=True)
    scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs)  # per step
    # Before the resume and the first step: an --out-dir that cannot hold the checkpoints, or that another node
    # cannot see (every rank loads latest.pt; a node that resumed from a file the others lack would hang in a
    # collective), fails now, not after hours of training.
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"latest.pt": harness.state_bytes(model.module, optimizer),
                                                            "best.pt": harness.state_bytes(model.module),
                                                            "model.pt": harness.state_bytes(model.module)},
                                    shared=True, tb_dir=args.tb_dir)  # New: shared=True, latest.pt and best.pt
    # New: ---------------------------------------------------------------------- resume or start
    latest, best = os.path.join(args.out_dir, "latest.pt"), os.path.join(args.out_dir, "best.pt")
    start_epoch, step, best_acc1 = 0, 0, float("-inf")
    if args.init_from:
        state = load_checkpoint(args.init_from, map_location=device)  # onto THIS rank's device
        load_weights(model.module, state.get("model", state), args.init_from)  # a checkpoint or bare weights
        print0(f"init: weights from {args.init_from}")
    resume = find_resume(args.resume, latest)  # 'auto': latest.pt if there is one (what MAX_RESTARTS reruns)
    if resume:
        ckpt = load_checkpoint(resume, map_location=device, require=(  # same_run_as: the --epochs, --lr, --seed, data
            "model", "optimizer", "scheduler", "epoch", "step", "best_acc1", "rng", "args"), same_run_as=args)
        load_weights(model.module, ckpt["model"], resume)
        optimizer.load_state_dict(ckpt["optimizer"])  # New: the whole state on every rank; each keeps its shard
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]
        # The step and the schedule go by this run's steps per epoch (another world size or batch counts others: the
        # saved step, in the old count, ended this run's epochs off their boundaries and it stopped early, unsaved).
        step = start_epoch * len(train_loader)
        scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs, step)
        if ckpt.get("step_in_epoch"):  # ddp_checkpoint.py's mid-epoch save: from here the epoch would train twice
            harness.die(f"{resume} was saved {ckpt['step_in_epoch']} steps into epoch {start_epoch + 1}; this recipe "
                        "resumes from an epoch's end: resume it with recipes/ddp_checkpoint.py")
        # What the saved streams do not cover (another world size; the CUDA stream of a checkpoint saved on CPU) gets
        # a seed per epoch: seed + rank again would replay epoch 0's random draws (distinct below 10,000 ranks).
        torch.manual_seed(args.seed + rank + 10_000 * start_epoch)
        if len(ckpt["rng"]) == world_size:  # each rank continues its own random stream
            torch.set_rng_state(ckpt["rng"][rank]["cpu"].cpu())
            if device.type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:  # None: saved on CPU
                torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"].cpu(), device)
        else:
            print0(f"resume: saved with {len(ckpt['rng'])} ranks, now {world_size}: random streams reseeded "
                   f"after epoch {start_epoch}")
        print0(f"resume: {resume} at epoch {start_epoch} step {step} best_acc1={best_acc1:.2f}")
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * len(train_loader), args.max_steps or float("inf"))
    speed = harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model, forward=None if args.sync_bn else model.module)  # own_ms: data + forward (--sync-bn's waits)
    # New: resumed, the curves go on from `step`; what an interrupted run logged after its checkpoint is dropped.
    tb = harness.TensorBoard(args.tb_dir, args.tb_every, is_main, vars(args), start_step=step)  # rank 0 alone writes
    diverged = harness.DivergenceCheck(device)  # a NaN/inf loss stops the run before anything is saved
    diverged.last_good = resume  # New: what the stop message names; each save below updates it
    harness.check_epochs_left(resume, start_epoch, args.epochs)  # New
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch replays the same order
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        recent = collections.deque(maxlen=4)  # this epoch's last inputs, for BatchNorm below
        speed.start()
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", leave=False, disable=not (is_main and sys.stdout.isatty()))
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
        # explodes. Recompute them with the final weights from the last batches: every rank (--sync-bn: a collective).
        with recomputed_batchnorm(model.module):
            while recent:  # popped: each batch leaves GPU memory once used
                model.module(recent.popleft())
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

        # New: ---------------------------------------------- checkpoint: rank 0 saves, barrier, all load
        if step % len(train_loader):  # an epoch cut short by --max-steps is not a resume point
            break
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state(device))  # a collective: every rank calls it
        optimizer.consolidate_state_dict(to=0)  # New: a collective too: the shards onto rank 0, for its state_dict()
        improved = val_acc1 > best_acc1  # val_acc1 is all-reduced, so every rank agrees
        best_acc1 = max(best_acc1, val_acc1)
        if is_main:
            os.makedirs(args.out_dir, exist_ok=True)
            if improved:  # first: a latest.pt whose best_acc1 no best.pt holds would never write it again
                save_atomic({"model": model.module.state_dict(), "epoch": epoch + 1, "val_acc1": val_acc1}, best)
                print0(f"best: epoch={epoch + 1} val_acc1={val_acc1:.2f} saved {best}")
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "step": step,
                         "best_acc1": best_acc1, "rng": rngs, "args": vars(args)}, latest)
        dist.barrier()  # nobody reads latest.pt before rank 0 has finished writing it
        diverged.last_good = latest
        # The weights alone, mapped: read only as they are copied in (not the optimizer and RNG states onto the GPU)
        load_weights(model.module, load_checkpoint(latest, map_location="cpu", mmap=True)["model"], latest)
        if step >= total_steps:
            break
    # ------------------------------------------------------------------------------------ save
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "model.pt")
        save_atomic(model.module.state_dict(), path)  # .module: no "module." prefix; atomic: --resume auto ends here
        print0(f"saved: {path}")
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    prof.stop()  # --profile: writes the steps it recorded
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(harness.gather_profile_table(prof, device))
    tb.close()
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="ddp_zero", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
