"""Mixed precision with NVIDIA apex.amp (opt levels O0-O3), or the same levels built from plain torch.

    ./launch.sh recipes/apex_amp.py 0,1,3 --dataset cifar100 --opt-level O1 --impl apex   # real apex
    ./launch.sh recipes/apex_amp.py 0,1,3 --dataset cifar100 --opt-level O2 --epochs 30   # apex, else torch
    ./launch.sh recipes/apex_amp.py cpu:2 --arch tiny_bn --opt-level O2 --impl torch       # CPU (slow fp16)
    ./launch.sh recipes/apex_amp.py 0,1,3 --dataset cifar100 --opt-level O2 --epochs 30 \
        --resume runs/apex_amp/checkpoint.pt                                              # interrupted: go on
    MAX_RESTARTS=3 ./launch.sh recipes/apex_amp.py 0,1,3 --opt-level O2 --resume auto  # a dead rank: all restart

What it shows (the rest is recipes/ddp_torchrun.py): the write-ups' apex pattern, in the order apex requires:
amp.initialize(model, optimizer, opt_level) BEFORE the DDP wrap (apex refuses a wrapped model),
apex.parallel.DistributedDataParallel(delay_allreduce=True), backward inside `with amp.scale_loss(loss, optimizer) as
scaled_loss`, and amp.state_dict() in the checkpoint, restored after amp.initialize. --impl auto uses apex when usable,
else torch (the first line says which). apex removed amp in 25.07; torch.amp replaces it (recipes/torch_amp.py). The
torch mode, beside each apex call in the loop, builds each opt level from plain torch:

    level  apex                                           torch equivalent here
    O0     fp32                                           fp32, no loss scaling
    O1     whitelisted ops in fp16 (patched functions)    autocast(float16) + dynamic GradScaler
    O2     fp16 model, BatchNorm fp32, fp32 master        model.half() with BatchNorm kept fp32; the optimizer
           weights, dynamic loss scaling                  updates fp32 master copies; GradScaler on their grads
    O3     pure fp16 (--keep-batchnorm-fp32 optional),    model.half() (BatchNorm too unless the flag),
           static loss scale 1.0                          no loss scaling, the optimizer steps fp16 weights

The checkpoint holds amp.state_dict() or GradScaler.state_dict() and the flags that wrote it (--resume refuses
others); O2's fp32 masters are re-made from the loaded model, as in apex. apex needs a GPU; on the CPU, where fp16 is
10-50x slower, the default level is O0: give O1-O3 with --arch tiny / tiny_bn.

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
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.apex_compat import ApexUnavailable, apex_build, load_apex
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
    p.add_argument("--batch-size", type=int, help="GLOBAL batch, split across processes (default: 128; 126 on 3)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/apex_amp", help="model.pt and checkpoint.pt go here")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--find-unused-parameters", action="store_true", help="torch DDP only: some get no gradient")
    # New
    p.add_argument("--impl", choices=["auto", "apex", "torch"], default="auto",
                   help="apex.amp + apex DDP (apex), the torch equivalents (torch), or apex when usable (auto)")
    p.add_argument("--opt-level", choices=["O0", "O1", "O2", "O3"],
                   help="default: O1 on a GPU, O0 on a CPU (where fp16 runs 10-50x slower than fp32)")
    p.add_argument("--keep-batchnorm-fp32", action="store_true",
                   help="O3: keep BatchNorm in fp32 (O2 always does; O0 and O1 do not take it)")
    p.add_argument("--resume", help="a checkpoint.pt to continue from (model, optimizer, scheduler, amp), "
                   "or 'auto': OUT_DIR/checkpoint.pt if it exists (for MAX_RESTARTS)")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    args = p.parse_args(argv)
    args.opt_level = args.opt_level or ("O1" if torch.cuda.is_available() else "O0")  # New: said on the impl: line
    return args


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # one line each: nan/inf, a bad count or --arch, an uneven --batch-size
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // world_size) * world_size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem
    if args.keep_batchnorm_fp32 and args.opt_level in ("O0", "O1"):  # New: apex raises at O1; at O0 it does nothing
        harness.die(f"--keep-batchnorm-fp32 is for O2 and O3: at {args.opt_level} BatchNorm already runs in fp32; "
                    "drop it")
    if args.resume and args.resume != "auto" and not os.path.isfile(args.resume):  # New
        harness.die(f"--resume {args.resume}: no such file", all_ranks=True)  # files can differ per node


# New: ------------------------------------------------ apex's O2 and O3 in plain torch (apex does it itself)
def half_model(model, keep_batchnorm_fp32):
    """model.half(), BatchNorm kept fp32 if asked (O2 always): fp32 statistics, its fp16 input cast up, output down."""
    model.half()
    for m in model.modules():
        if keep_batchnorm_fp32 and isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
            m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
            m.register_forward_hook(lambda mod, args, out: out.half())


class Fp32Masters:
    """O2: the optimizer updates fp32 copies of the fp16 weights (small updates vanish in fp16), as apex's O2 does."""

    def __init__(self, optimizer, enabled):
        self.pairs = []  # (fp16 model parameter, its fp32 master copy)
        for group in optimizer.param_groups if enabled else []:
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float16:
                    self.pairs.append((p, p.detach().float().requires_grad_()))
                    group["params"][i] = self.pairs[-1][1]

    def take_grads(self):  # after backward: the fp16 gradients (still scaled) become the masters' fp32 ones
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_back(self):  # after the step: the updated masters into the fp16 model
        for p, master in self.pairs:
            p.copy_(master)

    @torch.no_grad()
    def copy_from_model(self):  # after loading weights: masters re-made from the model, as apex does
        for p, master in self.pairs:
            master.copy_(p)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device, normalize, autocast, half_input):
    """Each rank scores its own shard; the sums are all-reduced, as if one process scored all (every rank calls it)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    for images, targets in loader:
        images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):  # New: as in training
            output = model(images.half() if half_input else images).float()
        acc1, acc5 = accuracy(output, targets, topk=(1, 5))
        loss.update(criterion(output, targets), images.size(0))
        top1.update(acc1, images.size(0))
        top5.update(acc5, images.size(0))
    for meter in (loss, top1, top5):
        meter.all_reduce(device)
    return loss.avg, top1.avg, top5.avg, top1.count


def main():
    args = parse_args()
    # New: the first thing said is which amp runs: apex only when asked for (or auto) and usable.
    impl, why = args.impl, ""
    if impl != "torch":
        try:
            amp, ApexDDP, _ = load_apex(cuda=torch.cuda.is_available())
            impl, why = "apex", f" (apex build: {apex_build()})"  # python-only: slow on a GPU, say so
        except ApexUnavailable as exc:
            if impl == "apex":
                harness.die(str(exc))
            impl, why = "torch", f" (apex unavailable: {exc.short})"
    print0(f"impl: {impl} {args.opt_level}{why}")
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
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True, **loader_args)
    # DistributedSampler pads val with repeated samples; a strided shard counts each sample once.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), **loader_args)
    harness.check_full_batch(len(train_loader), len(train_set), args.batch_size)  # drop_last: else 0 steps
    print0(f"data: {args.dataset} train={len(train_set)} val={len(val_set)} classes={num_classes} "
           f"steps_per_epoch={len(train_loader)}")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device)
    criterion = torch.nn.CrossEntropyLoss()
    # New: torch mode, fused=True lets GradScaler hand the inf flag to the optimizer on the device; with a plain SGD
    # scaler.step() reads it on the host every step (a GPU sync). apex's own scaler reads it anyway.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, fused=impl == "torch")

    # New: ---------------------------------- mixed precision, before the DDP wrap (apex refuses a wrapped model)
    scales_loss = args.opt_level in ("O1", "O2")  # dynamic loss scaling, those levels' default; O3's scale is 1
    autocast = impl == "torch" and args.opt_level == "O1"  # apex's O1 patches torch's functions instead
    half_input = impl == "torch" and args.opt_level in ("O2", "O3")  # apex's O2 and O3 patch the forward instead
    if impl == "apex":
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0,
                                          keep_batchnorm_fp32=True if args.keep_batchnorm_fp32 else None)
    else:  # the docstring's table, in plain torch
        scaler = torch.amp.GradScaler(device.type, enabled=scales_loss)
        if args.opt_level in ("O2", "O3"):
            half_model(model, keep_batchnorm_fp32=args.opt_level == "O2" or args.keep_batchnorm_fp32)
        masters = Fp32Masters(optimizer, enabled=args.opt_level == "O2")
        for p in [p for group in optimizer.param_groups for p in group["params"]]:  # fused SGD after a skipped
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)  # first step: see torch_amp.py
    # New: the schedule after amp.initialize, whose O1 and O2 replace optimizer.step: a scheduler made before it warns
    # on every rank that optimizer.step() was overridden, though the loop steps in the right order.
    scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs)  # per step

    def loss_scale():  # for TensorBoard and the divergence check; O0 and O3 scale nothing (apex says 1.0)
        if impl == "apex":
            return amp.state_dict()["loss_scaler0"]["loss_scale"]
        return scaler.get_scale() if scaler.is_enabled() else 1.0

    # New: resume, in apex's order: initialize, then model, optimizer, amp. "amp" is in the impl's own format.
    run_flags = {"impl": impl, "opt_level": args.opt_level, "keep_batchnorm_fp32": args.keep_batchnorm_fp32,
                 "epochs": args.epochs}  # what a resume must match
    start_epoch, step = 0, 0
    resume = find_resume(args.resume, os.path.join(args.out_dir, "checkpoint.pt"))  # 'auto': the last one, if any
    if resume:
        ckpt = load_same_flags(resume, map_location=device, flags=run_flags,
                               require=("model", "optimizer", "scheduler", "amp"))
        load_weights(model, ckpt["model"], resume)  # a wrong --arch: one line naming the keys
        if impl == "apex":
            # O2 makes its fp32 master weights at the first step: until then the optimizer holds the fp16 model
            # parameters, and loading now would round the saved fp32 momentum. Make them first, then load.
            optimizer._amp_lazy_init()
            optimizer.load_state_dict(ckpt["optimizer"])
            amp.load_state_dict(ckpt["amp"])
        else:
            optimizer.load_state_dict(ckpt["optimizer"])  # O2's masters exist already: the momentum stays fp32
            for group in optimizer.param_groups:  # a plain SGD's checkpoint would switch fused off
                group.update(fused=True, foreach=None)
            scaler.load_state_dict(ckpt["amp"])
            masters.copy_from_model()  # as apex does: the masters re-made from the loaded model
        start_epoch = ckpt["epoch"]
        # The step and the schedule go by this run's steps per epoch (another world size or batch counts others: the
        # saved step, in the old count, ended this run's epochs off their boundaries and it stopped early, unsaved).
        step = start_epoch * len(train_loader)
        scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs, step)
        print0(f"resumed: {resume} epoch={start_epoch} step={step} amp={ckpt['amp']}")
    if impl == "apex":  # New
        model = ApexDDP(model, delay_allreduce=True)  # one all-reduce of all gradients after backward
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    find_unused_parameters=args.find_unused_parameters,
                    process_group=harness.ddp_process_group(timeout))
        masters.copy_from_model()  # O2: the wrap gave every rank rank 0's weights; the masters, made before, follow
    # From here on, augmentation and dropout differ per rank; a resume (no RNG state saved) seeds per epoch, or it
    # would replay epoch 0's random draws.
    torch.manual_seed(args.seed + rank + 10_000 * start_epoch)

    harness.broadcast_out_dir_check(args.out_dir, is_main, {
        "checkpoint.pt": harness.state_bytes(model.module, optimizer), "model.pt": harness.state_bytes(model.module)},
        shared=True, tb_dir=args.tb_dir)  # New: shared: every rank loads checkpoint.pt on a resume
    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * len(train_loader), args.max_steps or float("inf"))
    speed = harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model, forward=model.module)  # own_ms on the epoch line: data + forward
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
            with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):  # New: torch's O1
                output = model(images.half() if half_input else images)  # DDP checks here that the last backward
                loss = criterion(output.float(), targets)  # New: the loss in fp32, whatever the model's dtype
            optimizer.zero_grad()  # New: no argument, apex O2's replacement takes none (torch's default sets None)
            if impl == "apex":  # New
                with amp.scale_loss(loss, optimizer) as scaled_loss:  # unscaled into the (master) grads on exit
                    scaled_loss.backward()  # DDP averages gradients across ranks during backward
                optimizer.step()  # apex patched step() to skip a step whose gradients overflowed
            else:  # New: the same in plain torch
                scaler.scale(loss).backward()  # a disabled scaler (O0, O3) passes the loss as it is
                masters.take_grads()  # O2: the fp16 gradients into the fp32 masters the optimizer steps
                scaler.step(optimizer)  # unscale; skip the step if any gradient is inf/nan
                scaler.update()
                masters.copy_back()  # O2: the stepped masters into the fp16 model
            scheduler.step()  # every optimizer step: warm-up, then cosine
            loss_meter.update(loss, images.size(0))  # a tensor: summed on the device, no sync per step
            acc_meter.update(accuracy(output, targets)[0], images.size(0))
            step += 1
            if not scales_loss:  # New: O1/O2 skip an overflowing step, which is normal; the scale tells
                diverged.update(step, loss)  # on the device: no sync per step
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"], loss_scale=loss_scale)
            if tb.on and step % args.tb_every == 0:  # values are read here anyway
                diverged.all_reduce_and_check(epoch, step, loss_scale() if scales_loss else None)
            speed.step(args.batch_size)
            prof.step()  # --profile: OUT_DIR/profile/trace_rankR.json
            if step >= total_steps:
                break
        epoch_time = speed.stop()  # waits for the device: the host clock runs ahead of queued GPU work
        loss_meter.all_reduce(device, ride=speed)  # with every rank's own_ms: one all-reduce
        acc_meter.all_reduce(device)
        # Before eval and any save: no file from NaN weights. O1/O2: a scale below 1 is divergence (a collective).
        diverged.all_reduce_and_check(epoch, step, loss_scale() if scales_loss else None, model)
        # BatchNorm's running statistics trail the weights (momentum 0.1): after a short or fast epoch, eval's loss
        # explodes. Recompute them with the final weights from the last batches: local, on every rank.
        with recomputed_batchnorm(model.module), torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
            while recent:  # popped: each batch leaves GPU memory once used
                model.module(recent.popleft().half() if half_input else recent.popleft())
        # -------------------------------------------------------------------------------- eval
        # New: buffers (BatchNorm statistics): torch's DDP copies rank 0's to the others at the start of each forward;
        # apex's never does (it broadcasts the parameters once, when it wraps the model). Either way, after the last
        # step every rank holds its own: evaluate everywhere with rank 0's, which model.pt gets.
        for buffer in model.module.buffers():
            dist.broadcast(buffer, 0)
        # model.module: torch DDP's forward broadcasts buffers, a collective: it hangs on an empty shard, a lone rank 0.
        val_loss, val_acc1, val_acc5, val_samples = evaluate(model.module, val_loader, criterion, device, normalize,
                                                             autocast, half_input)
        print0(f"epoch={epoch + 1}/{args.epochs} step={step}/{total_steps} train_loss={loss_meter.avg:.4f} "
               f"train_acc1={acc_meter.avg:.2f} val_loss={val_loss:.4f} val_acc1={val_acc1:.2f} "
               f"val_acc5={val_acc5:.2f} img/s={loss_meter.count / epoch_time:.1f} eta={speed.eta(total_steps - step)}"
               f"{speed.spread}")  # each rank's own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=loss_meter.count / epoch_time)
        # New: after each whole epoch (not one cut short by --max-steps), so an interrupted run can --resume.
        if is_main and step % len(train_loader) == 0:  # atomic: a crash mid-write keeps the previous checkpoint
            save_atomic({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "step": step, "flags": run_flags,
                         "amp": amp.state_dict() if impl == "apex" else scaler.state_dict()},
                        os.path.join(args.out_dir, "checkpoint.pt"))
        if step % len(train_loader) == 0:
            diverged.last_good = os.path.join(args.out_dir, "checkpoint.pt")
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
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="apex_amp", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples,
                                      impl=impl, opt_level=args.opt_level))  # New
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
