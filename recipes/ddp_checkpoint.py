"""DDP checkpoints: rank 0 saves, barrier, every rank loads; atomic writes; exact resume.

    ./launch.sh recipes/ddp_checkpoint.py 0,1,3 --dataset cifar100 --epochs 30
    ./launch.sh recipes/ddp_checkpoint.py 0,1,3 --dataset cifar100 --epochs 30 --resume auto   # after a crash
    ./launch.sh recipes/ddp_checkpoint.py 0,1,3 --dataset cifar100 --epochs 30 --save-every 200  # + every 200 steps
    MAX_RESTARTS=3 ./launch.sh recipes/ddp_checkpoint.py 0,1,3 --epochs 30 --resume auto  # restarts by itself
    sbatch --nodes 2 slurm/train.sbatch recipes/ddp_checkpoint.py --epochs 30 --resume auto   # SLURM, 2 nodes
    ./launch.sh recipes/ddp_checkpoint.py cpu:2 --arch tiny --epochs 3 --resume auto
    ./launch.sh recipes/ddp_checkpoint.py cpu:2 --arch tiny --init-from runs/dp/model.pt      # start from weights

What it shows (the rest is recipes/ddp_torchrun.py):
- Each epoch rank 0 writes OUT_DIR/latest.pt: model (no "module." prefix), optimizer, LR scheduler, epoch, step,
  best accuracy, every rank's RNG state and the args; best.pt when validation accuracy improves. Then dist.barrier(),
  then every rank loads the weights back (write-up 000's save -> barrier -> load): without the barrier a fast rank
  reads a half-written file. That reload maps the file (map_location="cpu", mmap=True) and reads only the weights;
  --resume loads all of it with map_location=its own device (without it, onto the GPU it was saved from). The folder
  must be one every node sees, with room for the checkpoints: checked before the first step.
- Writes are atomic (common.checkpoint.save_atomic: a temp file, then os.replace): a crash or a full disk mid-write
  leaves the previous checkpoint whole.
- --resume PATH|auto continues with the same losses and, on CPU, bitwise the same weights as a run that never
  stopped, also from the middle of an epoch: each sample's augmentation is seeded by (seed, epoch, index)
  (SeededSamples), the sampler skips what was trained (SkipFirst), each rank's running sums and random state are in
  the file, and one backward before training lays DDP's gradient buckets out as the first run's were. Files hold
  only tensors and plain types (torch.load(weights_only=True) reads them). AMP adds the scaler's state
  (recipes/torch_amp.py). A resume with other flags that shape the run (--arch, the data, --epochs, --seed, --lr) is
  refused in one line: it would not continue that run (the optimizer's saved state would overrule a new --lr).
- Preemption (SLURM's --signal=USR1@120; docs/clusters.md): SIGUSR1 reaches the ranks at different times, so
  each step all-reduces a stop flag on a gloo group of its own without waiting, read one step later: every rank
  stops after the same step, saves latest.pt, and exits 75 (EX_TEMPFAIL), which launch.sh passes on and
  slurm/train.sbatch requeues. --save-every N also saves every N steps. Within an epoch's last 4 steps the save
  waits for the epoch's own (BatchNorm's statistics are recomputed from its last 4 batches). SIGTERM still stops
  every rank at once (exit 143): a scheduler sends it with about 30 s left, too little to be sure of a save.
- --init-from loads weights with or without the "module." prefix (recipes/dp.py's model.pt too) into the plain model.
- Validation runs on every rank. On rank 0 alone it hangs: the DDP wrapper's forward can start a collective that the
  others, waiting at the barrier, never join (write-up 000). For rank-0-only inference, call model.module(x).

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import datetime
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.checkpoint import EX_TEMPFAIL, SignalFlag, find_resume, load_checkpoint, load_weights, save_atomic
from common.data import SeededSamples, SkipFirst, add_data_flags, build_datasets, device_normalize, prepare_dataset
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
    p.add_argument("--out-dir", default="runs/ddp_checkpoint", help="latest.pt, best.pt, model.pt")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPUs only)")
    # New
    p.add_argument("--resume", help="a latest.pt to continue from, or 'auto': OUT_DIR/latest.pt if it exists")
    p.add_argument("--init-from", help="weights to start from (a state_dict, with or without 'module.')")
    p.add_argument("--save-every", type=int, help="also save latest.pt every N steps within an epoch (default: "
                   "at each epoch's end only); SIGUSR1 saves at the next step and exits 75")
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


def save_latest(path, model, optimizer, scheduler, meters, args, device, **progress):  # New
    """Every rank calls it: an all-gather of each rank's random state and running sums, rank 0 writes `path`
    atomically, then a barrier, so no rank reads the file, or exits, before it is whole. progress: epoch (whole
    epochs done), step, step_in_epoch (0 at an epoch's end), best_acc1."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rng": rng_state(device), "meters": [(float(m.sum), m.count) for m in meters]})
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "rng": [r["rng"] for r in ranks],
                     "meters": [r["meters"] for r in ranks], "args": vars(args), **progress}, path)
    dist.barrier()


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
    # New: SIGUSR1 (SLURM's --signal=USR1@120) asks for a save and exit 75; the loop acts on it at a step boundary.
    preempt = SignalFlag(signal.SIGUSR1)
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
    stop_group = dist.new_group(backend="gloo", timeout=timeout)  # New: the stop vote's, beside the step's
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
    # New: each sample's augmentation is seeded by (seed, epoch, index): a run resumed mid-epoch augments the rest as
    # the uninterrupted run did, whatever its workers loaded before.
    train_set = SeededSamples(train_set, args.seed)
    # Same seed on every rank: each process sees a different shard of one shared permutation.
    # New: SkipFirst, a resumed epoch leaves out what the ranks trained on before the save.
    train_sampler = SkipFirst(DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                                 seed=args.seed))
    loader_args = dict(batch_size=batch_per_process, num_workers=workers_per_process,
                       pin_memory=device.type == "cuda", persistent_workers=workers_per_process > 0)
    # New: workers not persistent, so each epoch's copy of train_set has its epoch; their seeds come from a
    # generator of the loader's own, so starting them does not move the (checkpointed) random stream of the model.
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True,
                              generator=torch.Generator().manual_seed(args.seed + rank),
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
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
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
    start_epoch, step, best_acc1, start_step, resumed_in_epoch = 0, 0, float("-inf"), 0, 0
    if args.init_from:
        state = load_checkpoint(args.init_from, map_location=device)  # onto THIS rank's device
        load_weights(model.module, state.get("model", state), args.init_from)  # a checkpoint or bare weights
        print0(f"init: weights from {args.init_from}")
    resume = find_resume(args.resume, latest)  # 'auto': latest.pt if there is one (what MAX_RESTARTS reruns)
    if resume:
        ckpt = load_checkpoint(resume, map_location=device, require=(  # same_run_as: the --epochs, --lr, --seed, data
            "model", "optimizer", "scheduler", "epoch", "step", "best_acc1", "rng", "args"), same_run_as=args)
        load_weights(model.module, ckpt["model"], resume)
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]
        resumed_in_epoch = ckpt.get("step_in_epoch", 0)  # New: 0 from an epoch's end
        if resumed_in_epoch and ckpt["args"]["batch_size"] != args.batch_size:  # New: steps would cover other samples
            harness.die(f"{resume} was saved at step {resumed_in_epoch} of epoch {start_epoch + 1} with --batch-size "
                        f"{ckpt['args']['batch_size']} (global); resume it with the same --batch-size")
        # The step and the schedule go by this run's steps per epoch (another world size or batch counts others: the
        # saved step, in the old count, ended this run's epochs off their boundaries and it stopped early, unsaved).
        step = start_step = start_epoch * len(train_loader) + resumed_in_epoch  # New: + resumed_in_epoch
        scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs, step)
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
        print0(f"resume: {resume} at epoch {start_epoch} step {step} best_acc1={best_acc1:.2f}"
               + (f", {resumed_in_epoch} steps into epoch {start_epoch + 1}" if resumed_in_epoch else ""))
        # New: DDP lays its gradient buckets out again after the first backward, in the order the gradients came, and
        # on 3+ ranks where an element sits in a bucket changes how the all-reduce rounds its sum. One backward now
        # (eval mode: no statistics move; no step) gives the resumed run the layout the uninterrupted one trained
        # with, so its weights stay bitwise the same.
        model.eval()
        model(torch.zeros(1, 3, args.image_size, args.image_size, device=device)).sum().backward()  # the order alone
        optimizer.zero_grad(set_to_none=True)
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
    vote, ballot, stopped = None, None, False  # New: the stop vote in flight, its tensor; True once SIGUSR1 agreed
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)  # without it every epoch replays the same order
        train_set.set_epoch(epoch)  # New: the epoch in each sample's augmentation seed
        model.train()
        loss_meter, acc_meter = AverageMeter(), AverageMeter()
        in_epoch, before = 0, 0  # New: steps of this epoch done; its images trained before the save (not timed here)
        if epoch == start_epoch and resumed_in_epoch:  # New: mid-epoch: skip what was trained, go on with its sums
            in_epoch, train_sampler.skip = resumed_in_epoch, resumed_in_epoch * batch_per_process
            sums = ckpt["meters"]  # per rank; saved by another world size: all of it on rank 0 (all-reduced: same)
            mine = sums[rank] if len(sums) == world_size else [
                (sum(r[i][0] for r in sums), sum(r[i][1] for r in sums)) if is_main else (0.0, 0) for i in range(2)]
            (loss_meter.sum, loss_meter.count), (acc_meter.sum, acc_meter.count) = mine
            before = sum(r[0][1] for r in sums)  # New: every rank's count: img/s below is this run's images alone
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
            in_epoch += 1  # New
            diverged.update(step, loss)  # on the device: no sync per step
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"])  # rank 0's own samples
            if tb.on and step % args.tb_every == 0:  # values are read here anyway
                diverged.all_reduce_and_check(epoch, step)  # a collective: one verdict everywhere
            # New: SIGUSR1 reaches the ranks at different times; they must stop after the same step. Each step starts
            # an all-reduce (MAX) of its flag on the vote's own gloo group, and reads the last step's, which ran
            # under this step: no step waits for it, and every rank reads the same vote at the same step.
            stop = vote is not None and vote.wait() and ballot.item() > 0
            ballot = torch.tensor([float(bool(preempt))])
            vote = dist.all_reduce(ballot, dist.ReduceOp.MAX, group=stop_group, async_op=True)
            stopped = stopped or stop
            # New: a save within the epoch (--save-every, or the stop) leaves 4 steps or more of it: the BatchNorm
            # recompute below takes the epoch's last 4 batches. Nearer its end, the epoch's own save comes first.
            if ((stop or args.save_every and step % args.save_every == 0) and len(train_loader) - in_epoch >= 4
                    and step < total_steps):
                diverged.all_reduce_and_check(epoch, step, model=model)  # a collective: no file from NaN weights
                save_latest(latest, model.module, optimizer, scheduler, (loss_meter, acc_meter), args, device,
                            epoch=epoch, step=step, step_in_epoch=in_epoch, best_acc1=best_acc1)
                diverged.last_good = latest
                print0(f"saved: {latest} at step {step} ({in_epoch} of epoch {epoch + 1})")
                if stop:
                    break
            speed.step(args.batch_size)
            prof.step()  # --profile: OUT_DIR/profile/trace_rankR.json
            if step >= total_steps:
                break
        if stopped and in_epoch < len(train_loader) and step < total_steps:  # New: saved mid-epoch above
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
               f"val_acc5={val_acc5:.2f} img/s={(loss_meter.count - before) / epoch_time:.1f} "
               f"eta={speed.eta(total_steps - step)}{speed.spread}")  # own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=(loss_meter.count - before) / epoch_time)

        # New: ---------------------------------------------- checkpoint: rank 0 saves, barrier, all load
        if step % len(train_loader):  # an epoch cut short by --max-steps is not a resume point
            break
        improved = val_acc1 > best_acc1  # val_acc1 is all-reduced, so every rank agrees
        best_acc1 = max(best_acc1, val_acc1)
        if is_main and improved:
            os.makedirs(args.out_dir, exist_ok=True)
            save_atomic({"model": model.module.state_dict(), "epoch": epoch + 1, "val_acc1": val_acc1}, best)
            print0(f"best: epoch={epoch + 1} val_acc1={val_acc1:.2f} saved {best}")
        # Every rank: each one's random state goes in; nobody reads latest.pt before rank 0 has finished writing it.
        save_latest(latest, model.module, optimizer, scheduler, (loss_meter, acc_meter), args, device,
                    epoch=epoch + 1, step=step, step_in_epoch=0, best_acc1=best_acc1)
        diverged.last_good = latest
        # The weights alone, mapped: read only as they are copied in (not the optimizer and RNG states onto the GPU)
        load_weights(model.module, load_checkpoint(latest, map_location="cpu", mmap=True)["model"], latest)
        if step >= total_steps or stopped:
            break
    if vote is not None:  # New: the last vote; every rank started as many
        vote.wait()
    if stopped and step < total_steps:  # New: saved; the scheduler's requeue resumes it (--resume auto)
        print0(f"preempt: SIGUSR1: saved {latest} at step {step}; exit {EX_TEMPFAIL}: requeue the job with "
               "--resume auto to go on from there")
        tb.close()  # the curves so far, flushed (a resumed run goes on from `step`)
        dist.destroy_process_group()
        sys.exit(EX_TEMPFAIL)
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
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="ddp_checkpoint", steps=step,
                                      start_step=start_step, train_loss=loss_meter.avg, val_acc1=val_acc1,
                                      val_samples=val_samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
