"""DDP with torch.amp: autocast + GradScaler, gradient clipping and gradient accumulation done right.

    ./launch.sh recipes/torch_amp.py 0,1,3 --dataset cifar100 --amp-dtype fp16 --channels-last
    ./launch.sh recipes/torch_amp.py 0 --amp-dtype bf16 --accum-steps 4 --clip-grad 1.0
    ./launch.sh recipes/torch_amp.py cpu:2 --arch tiny --epochs 3     # CPU: bf16 if it has native bf16, else fp32
    ./launch.sh recipes/torch_amp.py cpu:2 --arch tiny --epochs 3 --resume runs/torch_amp/checkpoint.pt  # interrupted
    MAX_RESTARTS=3 ./launch.sh recipes/torch_amp.py 0,1,3 --epochs 30 --resume auto  # a dead rank: all restart

What it shows (the rest is recipes/ddp_torchrun.py): torch.amp.autocast(device_type, dtype) around forward and loss
only, and torch.amp.GradScaler(device_type) for fp16, not the deprecated torch.cuda.amp names (small gradients
underflow to zero; bf16 has fp32's range, needs no scaler; default fp16 on GPU, on CPU bf16 if native); clipping after
scaler.unscale_; --accum-steps K with model.no_sync() on the first K-1 micro-batches (--batch-size stays the GLOBAL
batch per optimizer step); --channels-last (NHWC, which tensor cores prefer); and the scaler's state in checkpoint.pt,
which --resume restores (with the same --amp-dtype and --epochs only). --compile compiles the model in place before
DDP (ddp_compile.py's lesson): the fp16 step at its fastest, which the data must keep up with (docs/data.md).

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import contextlib
import datetime
import itertools
import os
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
from common.checkpoint import find_resume, load_same_flags, load_weights, save_atomic
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
    p.add_argument("--batch-size", type=int, help="GLOBAL batch per optimizer step, split evenly across "
                   "processes and --accum-steps (default: 128, rounded down to a multiple of processes x accum-steps)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/torch_amp", help="model.pt and checkpoint.pt go here")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="parameters may get no gradient")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPUs only)")
    # New
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
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # nan/inf, a bad count or --arch, an uneven --batch-size, --sync-bn on CPU
    parts = world_size * args.accum_steps  # New: the global batch splits over processes and micro-batches
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // parts) * parts
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem
    if args.resume and args.resume != "auto" and not os.path.isfile(args.resume):  # New
        harness.die(f"--resume {args.resume}: no such file", all_ranks=True)  # files can differ per node


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device, normalize, memory_format):  # New: memory_format
    """Each rank scores its own shard; the sums are all-reduced, as if one process scored all (every rank calls it)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    for images, targets in loader:
        images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))  # New: as in training
        targets = targets.to(device, non_blocking=True)
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
    micro_batch = batch_per_process // args.accum_steps  # New: --accum-steps micro-batches per process and step
    workers_per_process = harness.default_workers(args.workers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({batch_per_process} per process x {world_size}, micro_batch={micro_batch} x {args.accum_steps} "
           f"accum_steps), workers={workers_per_process} per process")
    # New: the default: fp16 on a GPU; on a CPU bf16 where oneDNN runs it natively (AVX-512, AMX, Arm), else fp32
    amp_name = args.amp_dtype or ("fp16" if device.type == "cuda" else harness.cpu_amp_default())
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32, "fp32": torch.float32}[amp_name]
    if amp_name == "fp32":  # strict fp32: TF32 off too (set on above); a no-op on the CPU, which has no TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format  # New: --channels-last
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
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True,
                              **{**loader_args, "batch_size": micro_batch})  # New: micro-batches
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), **loader_args)
    steps_per_epoch = len(train_loader) // args.accum_steps  # New: a partial accumulation at the end is dropped
    harness.check_full_batch(steps_per_epoch, len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={steps_per_epoch}")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device, memory_format=memory_format)  # New
    if args.sync_bn:  # before the DDP wrap; each BatchNorm all-gathers its statistics in every training forward
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.compile:  # New: in place, before the DDP wrap (ddp_compile.py's lesson): the step compiled, the data not
        model.compile(dynamic=False)  # evaluation's last, smaller batch: a graph of its own
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=args.find_unused_parameters, process_group=harness.ddp_process_group(timeout))
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    # New: fused: GradScaler hands it the inf flag on the device (with a plain SGD, scaler.step() reads it on the host).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, fused=True)
    # New: fused SGD's first step() makes its momentum with empty_like, even when GradScaler skips it: start at 0.
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs)  # per step
    # New: enabled for fp16 only, with bf16 or fp32 its calls pass straight through.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    # New: ----------------------------------------- resume: AMP's checkpoint also holds the scaler's state
    # fp16's scaler keeps the scale it settled on (restarted at 65536, it skips steps to find it again). A disabled
    # (bf16/fp32) scaler saves {}: --amp-dtype must match, and --epochs (the cosine schedule is laid out for them).
    # Checkpoints in full, RNG included: ddp_checkpoint.py.
    run_flags, start_epoch, step = {"amp_dtype": amp_name, "epochs": args.epochs}, 0, 0
    resume = find_resume(args.resume, os.path.join(args.out_dir, "checkpoint.pt"))  # 'auto': the last one, if any
    if resume:
        ckpt = load_same_flags(resume, map_location=device, flags=run_flags,
                               require=("model", "optimizer", "scheduler", "scaler"))
        load_weights(model.module, ckpt["model"], resume)  # a wrong --arch: one line naming the keys
        optimizer.load_state_dict(ckpt["optimizer"])
        for group in optimizer.param_groups:  # a plain SGD's checkpoint would switch fused off (GradScaler then fails)
            group.update(fused=True, foreach=None)
        scaler.load_state_dict(ckpt["scaler"])  # without it fp16 restarts at scale 65536 and skips steps
        start_epoch = ckpt["epoch"]
        step = start_epoch * steps_per_epoch  # this run's count (the saved step: another world size's or batch's)
        scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs, step)
        torch.manual_seed(args.seed + rank + 10_000 * start_epoch)  # no RNG state saved: not epoch 0's draws again
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
        micro_batches = itertools.islice(train_loader, steps_per_epoch * args.accum_steps)  # New: accum-steps
        bar = tqdm(micro_batches, total=steps_per_epoch * args.accum_steps, desc=f"epoch {epoch + 1}", leave=False,
                   disable=not (is_main and sys.stdout.isatty()))
        for i, (images, targets) in enumerate(bar):
            images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))  # New: NHWC
            targets = targets.to(device, non_blocking=True)
            recent.append(images)
            boundary = (i + 1) % args.accum_steps == 0  # New: the step's last micro-batch
            # New: no_sync, gradients accumulate locally; the boundary micro-step's backward all-reduces the sum.
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
                    output = model(images)  # DDP checks here that the last backward reduced every gradient
                    loss = criterion(output, targets)
                # New: backward outside autocast. /K: the K micro-losses add up to the mean over the full batch.
                scaler.scale(loss / args.accum_steps).backward()
            loss_meter.update(loss, images.size(0))  # a tensor: summed on the device, no sync per step
            acc_meter.update(accuracy(output, targets)[0], images.size(0))
            if not scaler.is_enabled():  # fp16: an overflowing step is skipped, which is normal; the scale tells
                diverged.update(step + 1, loss)  # the step this micro-batch belongs to; on the device, no sync
            if not boundary:
                continue
            if args.clip_grad:  # New
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)  # New: skipped if fp16 gradients overflowed (inf/nan)
            scaler.update()
            scheduler.step()  # every optimizer step: warm-up, then cosine
            optimizer.zero_grad(set_to_none=True)
            step += 1
            compiled.step()  # --compile: after the first step, which compiled the model, the 'compile:' line
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"],
                    loss_scale=scaler.get_scale if scaler.is_enabled() else None)
            if tb.on and step % args.tb_every == 0:  # values are read here anyway
                diverged.all_reduce_and_check(epoch, step, scaler.get_scale() if scaler.is_enabled() else None)
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
        with recomputed_batchnorm(model.module), torch.autocast(device.type, dtype=amp_dtype,  # New: as training
                                                               enabled=amp_dtype != torch.float32):
            with torch.compiler.set_stance("force_eager"):  # New: --compile: these few batches want no graphs
                while recent:  # popped: each batch leaves GPU memory once used
                    model.module(recent.popleft())
        # -------------------------------------------------------------------------------- eval
        # DDP copies rank 0's buffers (BatchNorm statistics) to the others as each forward starts, so after the last
        # step every rank holds its own: evaluate everywhere with rank 0's, which model.pt gets.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
        # model.module: DDP's forward broadcasts buffers, a collective that hangs on an empty shard or a lone rank 0.
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):  # New
            val_loss, val_acc1, val_acc5, val_samples = evaluate(model.module, val_loader, criterion, device, normalize,
                                                                 memory_format)
        print0(f"epoch={epoch + 1}/{args.epochs} step={step}/{total_steps} train_loss={loss_meter.avg:.4f} "
               f"train_acc1={acc_meter.avg:.2f} val_loss={val_loss:.4f} val_acc1={val_acc1:.2f} "
               f"val_acc5={val_acc5:.2f} img/s={loss_meter.count / epoch_time:.1f} eta={speed.eta(total_steps - step)}"
               f"{speed.spread}")  # each rank's own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=loss_meter.count / epoch_time)
        # New: after each whole epoch (not one cut short by --max-steps), so an interrupted run can --resume.
        if is_main and step % steps_per_epoch == 0:  # atomic: a crash mid-write keeps the previous checkpoint
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "epoch": epoch + 1, "step": step, "flags": run_flags},
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
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="torch_amp", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples,
                                      **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
