"""FSDP2 (fully_shard): each rank holds a shard of the parameters, gradients and optimizer state; sharded
checkpoints (torch.distributed.checkpoint) that resume on another number of GPUs.

    ./launch.sh recipes/fsdp.py 0,1,2,3 --dataset cifar100 --arch resnet50 --epochs 30
    ./launch.sh recipes/fsdp.py 0,1 --dataset cifar100 --arch resnet50 --epochs 30 --resume auto  # 4 GPUs' checkpoint
    ./launch.sh recipes/fsdp.py 0,1,2,3 --dataset cifar100 --arch resnet50 --epochs 30 --amp-dtype bf16 \
        --out-dir runs/fsdp_bf16                                                   # its own folder
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
        ./launch.sh recipes/fsdp.py 0,1,2,3 --dataset cifar100     # node 0; NODE_RANK=1 on node 1
    ./launch.sh recipes/fsdp.py cpu:2 --arch tiny --epochs 3 --resume auto               # CPU (gloo)
    ./launch.sh recipes/fsdp.py 0,1 --dataset cifar100 --epochs 30 --async-save   # shards written by a thread

What it shows (the rest is ddp_checkpoint.py's epoch-end checkpoints; no SIGUSR1 save, --save-every or best.pt):
- fully_shard makes each parameter a DTensor sharded along dim 0: a rank holds 1/N of the parameters, gradients and
  optimizer state that DDP keeps whole on every GPU (RESULT: state_bytes_per_rank). A block's parameters are
  all-gathered before its forward and backward and freed after (--no-reshard-after-forward keeps them until backward);
  gradients are reduce-scattered, so each rank's optimizer steps its own shard.
- fully_shard on every block first, then on the root, which takes what is left (stem, head); on the root alone it
  gathers the whole model at once: the peak holds every parameter and gradient unsharded (between steps the
  parameters and the optimizer state stay sharded); a block sharded after its parent is refused. All calls share one
  DeviceMesh (without mesh= each call builds its own).
- Not on ranks that share a GPU (launch.sh G:N, gloo over CUDA): refused with one line. There every DTensor
  collective dies with SIGSEGV (measured on an H200, torch 2.11: training, with FSDP2's own all-gathers, ran;
  gathering model.pt crashed). One rank per GPU (NCCL), or cpu:N.
- --amp-dtype bf16: MixedPrecisionPolicy computes and all-gathers in bf16 and reduces gradients in fp32; shards and
  optimizer state stay fp32. BatchNorm stays fp32 too (bf16 weights beside its fp32 running statistics fail:
  "expected scalar type BFloat16 but found Float"), one group per block's BatchNorm layers (fully_shard on a list):
  17 groups on resnet50, not 53. Needs torch >= 2.6.
- Checkpoints: every rank writes its shard of get_state_dict(model, optimizer) with torch.distributed.checkpoint to
  OUT_DIR/checkpoint/epoch_N-RUN/ (torch.save from rank 0 would write rank 0's shard only); then rank 0 writes
  latest.pt (scheduler, epoch, step, RNG, args, the folder), atomically and last, so it points at complete shards
  only; RUN is new each run, so no save overwrites them. --resume PATH|auto loads them on any number of ranks (DCP
  reshards); on the same number, bitwise the same weights as a run that never stopped (CPU).
- --async-save: dcp.async_save copies the shards to CPU memory (training waits for that alone) and a thread writes
  them while the next epoch trains; its collectives go on a gloo group of their own (async_save needs a CPU backend;
  sharing training's group would interleave two threads' collectives). latest.pt names its folder at the first step
  after the thread is done; one save in flight: the next save, and the job's end, wait for it. A crash while it writes
  leaves latest.pt naming the previous shards, whole (DCP writes .metadata last); the next save removes the half
  folder. docs/benchmarks.md: what training waits with each.
- OUT_DIR/model.pt: the full state_dict, gathered to rank 0's CPU, loadable by a plain model without a process group.
- Evaluation: every forward all-gathers, so a rank whose validation shard has fewer batches runs empty ones. BatchNorm
  buffers are neither sharded nor synchronized: rank 0's are broadcast before evaluating, as in ddp_checkpoint.py.

`harness.` lines are plumbing, not the lesson (common/harness.py); siblings of ddp_torchrun.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/recipes.md.
"""
# launcher: torchrun

import argparse
import collections
import copy
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # New
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness  # plumbing, not the lesson: every line that uses it says so
from common.checkpoint import ShardFolders, find_resume, load_checkpoint, save_atomic
from common.data import add_data_flags, build_datasets, device_normalize, prepare_dataset
from common.models import build_model, recomputed_batchnorm
from common.schedule import warmup_cosine
from common.utils import AverageMeter, accuracy, print0


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_data_flags(p)  # --dataset, --data-root, --image-size, ...: build_datasets' flags (common/data.py)
    p.add_argument("--arch", default="resnet18", help="torchvision model name, or tiny / tiny_bn")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, help="GLOBAL batch, split across processes (default: 128; 126 on 3)")
    p.add_argument("--workers", type=int, help="DataLoader workers PER PROCESS (default: its cores - 1, max 16)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 128)")
    p.add_argument("--warmup-epochs", type=float, default=1, help="linear warm-up, then cosine (<= 1/3 of the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/fsdp", help="checkpoint/ (sharded), model.pt")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--amp-dtype", choices=["fp32", "bf16"], default="fp32",  # New
                   help="bf16: compute and all-gather in bf16, reduce gradients in fp32 (MixedPrecisionPolicy)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,  # New
                   help="free each block's gathered parameters after its forward (default); --no-...: keep them "
                        "until backward, one all-gather less per block and step, more memory (and during "
                        "evaluation, which has no backward, the whole model stays gathered)")
    p.add_argument("--resume", help="a checkpoint/latest.pt to continue from, or 'auto': OUT_DIR/checkpoint/latest.pt "
                                    "if it exists; any number of ranks")
    p.add_argument("--async-save", action="store_true",  # New
                   help="write the shards from a thread while training goes on (dcp.async_save); one save in flight")
    harness.add_flags(p)  # --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # one line each: nan/inf, a bad count or --arch, an uneven --batch-size
    if args.batch_size is None:  # the default, rounded down so that it divides: 126 on 3 GPUs, not an error
        args.batch_size = max(1, 128 // world_size) * world_size
    if args.lr is None:  # the linear scaling rule: a k times larger batch takes a k times larger step
        args.lr = 0.1 * args.batch_size / 128
    args.image_size = args.image_size or (224 if args.dataset == "imagefolder" else 32)  # < 64 px: small-image stem
    if args.resume and args.resume != "auto" and os.path.isdir(args.resume):  # a shard folder: latest.pt names one
        harness.die(f"--resume {args.resume} is a folder: give the latest.pt beside it (OUT_DIR/checkpoint/latest.pt"
                    f"), which names its shards", all_ranks=True)
    if args.resume and args.resume != "auto" and not os.path.isfile(args.resume):
        harness.die(f"--resume {args.resume}: no such file", all_ranks=True)  # files can differ per node


# ------------------------------------------------------------------------------------------ model
def blocks(module):
    """The modules that get their own fully_shard: the members with parameters of the outermost Sequentials and
    ModuleLists (a ResNet's residual blocks in layer1..4, a ViT's encoder layers, the tiny models' layers).
    The root keeps the rest (stem, head)."""
    for child in module.children():
        if isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList)):
            yield from (block for block in child if any(True for _ in block.parameters()))
        else:
            yield from blocks(child)


def norm_groups(model):
    """--amp-dtype bf16: the BatchNorm layers, a list for each block that holds any (a ResNet block's bn1, bn2 and
    its downsample's), and one of those outside every block (the stem's; the tiny models', blocks of their own)."""
    def norms(module):
        return [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    groups = [norms(block) for block in blocks(model) if norms(block) != [block]]  # not a BatchNorm block
    grouped = {norm for group in groups for norm in group}
    return [group for group in [*groups, [m for m in norms(model) if m not in grouped]] if group]


def shard(model, mesh, amp_dtype, reshard_after_forward):
    """fully_shard, in place: the BatchNorm groups (bf16), every block, then the root, all on `mesh`."""
    # Parameters are all-gathered in param_dtype for compute; gradients are reduce-scattered in fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if amp_dtype == "bf16" else None,
                                     reduce_dtype=torch.float32)
    if amp_dtype == "bf16":  # BatchNorm in fp32 groups of its own, beside its fp32 running statistics
        for norms in norm_groups(model):  # one all-gather for a block's BatchNorm layers, not one for each
            fully_shard(norms, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                        reshard_after_forward=reshard_after_forward)
    # Blocks first, root last (each call groups the parameters not grouped yet): one all-gather per block.
    for block in blocks(model):
        if not isinstance(block, FSDPModule):  # a BatchNorm layer grouped above
            fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root returns the logits in fp32, so the loss and the accuracy are computed in full precision. Its
    # parameters (stem, head) are kept gathered from forward to backward, which needs them first (torch's advice).
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(mp_policy.param_dtype, torch.float32, torch.float32),
                reshard_after_forward=False)


# ------------------------------------------------------------------------------------ checkpoints
def rng_state(device):  # New
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def load_shards(model, optimizer, path, saves):
    """Every rank reads its part of the sharded checkpoint at `path`, however many ranks wrote it (DCP reshards)."""
    model_state, optim_state = get_state_dict(model, optimizer)  # this world's layout, filled in by load
    # get_state_dict steps a fresh optimizer once to give every parameter its state (momentum); the saving run's SGD
    # made none for a parameter that never had a gradient (an unused branch): only the states the shards hold are read
    # and set (strict=False: a parameter without one has none, as in the run that saved them).
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata if os.path.isfile(
        os.path.join(path, ".metadata")) else None  # none: dcp.load below says what is wrong
    unsaved = [] if saved is None else [name for name, state in optim_state["state"].items()
                                        if not any(f"optimizer.state.{name}.{key}" in saved for key in state)]
    for name in unsaved:
        del optim_state["state"][name]
    if unsaved:  # said: a shard set that lost a parameter's state would resume it from none too
        print0(f"resume: no optimizer state saved for {len(unsaved)} parameter(s), e.g. {unsaved[0]} (no gradient "
               "before the save): they go on without one, as in the run that saved them")
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise saves.load_failure(exc, path) from exc
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(strict=False))  # every model key was loaded above (dcp.load: strict)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, criterion, device, normalize):
    """Each rank scores its own shard; the sums are all-reduced, as if one process scored all (every rank calls it)."""
    model.eval()
    loss, top1, top5 = AverageMeter(), AverageMeter(), AverageMeter()
    # Each forward all-gathers parameters, a collective: a rank with fewer batches (37 samples on 2 ranks) runs
    # empty forwards until the others are done, or they would wait for it forever.
    batches = torch.tensor(len(loader), device=device)
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    empty = torch.zeros(0, *loader.dataset.dataset[0][0].shape, device=device)
    shard = iter(loader)
    for _ in range(int(batches)):
        images, targets = next(shard, (None, None))
        if images is None:
            model(empty)
            continue
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
        device, backend = harness.check_gpu(device, backend, dtensor=True)  # visible? not launch.sh G:N (gloo)?
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
    torch.manual_seed(args.seed)  # same initial weights everywhere: each rank keeps its slice of them
    # YOUR MODEL goes here: an nn.Module from a batch (N, C, H, W) to logits (N, num_classes).
    model = build_model(args.arch, num_classes, args.image_size).to(device)
    if not any(True for _ in blocks(model)):  # inception_v3's blocks are attributes; so may be yours
        print0(f"fsdp: {args.arch} holds no Sequential or ModuleList of blocks: fully_shard on the root alone gathers "
               "all of it at once; put its blocks in one, or have blocks() yield them")
    # One mesh for every fully_shard call: without mesh= each builds its own.
    shard(model, init_device_mesh(device.type, (world_size,)), args.amp_dtype, args.reshard_after_forward)
    torch.manual_seed(args.seed + rank)  # from here on, augmentation and dropout differ per rank
    criterion = torch.nn.CrossEntropyLoss()
    # After fully_shard: the optimizer must hold the sharded (DTensor) parameters, and its state is sharded too.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = warmup_cosine(optimizer, args.epochs, len(train_loader), args.warmup_epochs)  # per step
    # Shard folders epoch_N-RUN: no save overwrites the one latest.pt points at, so a failed save leaves it whole.
    run_tag = [os.urandom(3).hex()]
    dist.broadcast_object_list(run_tag, src=0)  # every rank writes into the same folder
    # OUT_DIR/checkpoint/: the shard folders and latest.pt, which rank 0 points at the newest whole one, an async save
    # in flight (common/checkpoint.py: no collective)
    saves = ShardFolders(args.out_dir, run_tag[0], "epoch")
    latest = saves.latest
    # New: --async-save's writer thread makes collectives (the plan, the results) while training makes its own: on a
    # group of their own, so the two never interleave. A CPU backend: async_save refuses a group without one.
    save_group = dist.new_group(backend="gloo", timeout=timeout) if args.async_save else None
    # Before the resume and the first step: an --out-dir that cannot hold the checkpoints, or that another node cannot
    # see (every rank loads latest.pt; a node that resumed from a file the others lack would wait in dcp.load's
    # collectives), fails now, not after hours of training. New: state_bytes counts all the shards together.
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"checkpoint": harness.state_bytes(model, optimizer),
                                                            "model.pt": harness.state_bytes(model)},
                                    shared=True, tb_dir=args.tb_dir)
    start_epoch, step, best_acc1 = 0, 0, float("-inf")
    resume = find_resume(args.resume, latest)  # 'auto': latest.pt if there is one (what MAX_RESTARTS reruns)
    if resume:
        ckpt = load_checkpoint(resume, map_location="cpu", require=(  # same_run_as: the --arch the shards fit, --epochs
            "shards", "scheduler", "epoch", "step", "best_acc1", "rng", "args"), same_run_as=args)
        load_shards(model, optimizer, os.path.join(os.path.dirname(resume), ckpt["shards"]), saves)
        start_epoch, best_acc1 = ckpt["epoch"], ckpt["best_acc1"]
        # The step and the schedule go by this run's steps per epoch (another world size or batch counts others: the
        # saved step, in the old count, ended this run's epochs off their boundaries and it stopped early, unsaved).
        step = start_epoch * len(train_loader)
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
                   f"after epoch {start_epoch} (the shards are resharded)")
        print0(f"resume: {resume} at epoch {start_epoch} step {step} best_acc1={best_acc1:.2f}")

    # ----------------------------------------------------------------------------------- train
    total_steps = min(args.epochs * len(train_loader), args.max_steps or float("inf"))
    speed = harness.Throughput(device)
    prof = harness.Profiler(args.profile, args.out_dir, rank, device)  # --profile: steps 3-6
    speed.watch(model)  # own_ms on the epoch line: waiting for data (FSDP's forward all-gathers)
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
            output = model(images)  # each block all-gathers its parameters, and frees them after its forward
            loss = criterion(output, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # each block's gradients are reduce-scattered (averaged): every rank keeps its shard
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
            if saves.finish_async(only_if_done=True):  # New: written: latest.pt names it now (each rank at its step)
                diverged.last_good = latest
            if step >= total_steps:
                break
        epoch_time = speed.stop()  # waits for the device: the host clock runs ahead of queued GPU work
        loss_meter.all_reduce(device, ride=speed)  # with every rank's own_ms: one all-reduce
        acc_meter.all_reduce(device)
        diverged.all_reduce_and_check(epoch, step, model=model)  # before eval and any save: no file from NaN weights
        # BatchNorm's running statistics trail the weights (momentum 0.1): after a short or fast epoch, eval's loss
        # explodes. Recompute them with the final weights from the last batches, on every rank.
        # New: FSDP's forward all-gathers: every rank runs as many batches (the same number of steps) in this loop.
        with recomputed_batchnorm(model):
            while recent:  # popped: each batch leaves GPU memory once used
                model(recent.popleft())
        # -------------------------------------------------------------------------------- eval
        # Buffers (BatchNorm statistics) are not sharded: each rank's follow its own batches. Evaluate everywhere
        # with rank 0's, which model.pt and the checkpoint get (as DDP would have, which broadcasts them).
        for buffer in model.buffers():
            dist.broadcast(buffer, 0)
        val_loss, val_acc1, val_acc5, val_samples = evaluate(model, val_loader, criterion, device, normalize)
        print0(f"epoch={epoch + 1}/{args.epochs} step={step}/{total_steps} train_loss={loss_meter.avg:.4f} "
               f"train_acc1={acc_meter.avg:.2f} val_loss={val_loss:.4f} val_acc1={val_acc1:.2f} "
               f"val_acc5={val_acc5:.2f} img/s={loss_meter.count / epoch_time:.1f} eta={speed.eta(total_steps - step)}"
               f"{speed.spread}")  # each rank's own work per step: a straggler has the max
        tb.epoch(step, device, train_loss=loss_meter.avg, train_acc1=acc_meter.avg, val_loss=val_loss,
                 val_acc1=val_acc1, val_acc5=val_acc5, images_per_sec=loss_meter.count / epoch_time)

        # New: --------------------------------------- checkpoint: every rank saves its shard, rank 0 last
        if step % len(train_loader):  # an epoch cut short by --max-steps is not a resume point
            break
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state(device))  # a collective: every rank calls it
        best_acc1 = max(best_acc1, val_acc1)  # val_acc1 is all-reduced, so every rank agrees
        folder, started = saves.folder(epoch + 1), time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's own shard
        pointer = {"shards": os.path.basename(folder), "scheduler": copy.deepcopy(scheduler.state_dict()),
                   "epoch": epoch + 1, "step": step, "best_acc1": best_acc1, "rng": rngs,
                   "args": vars(args)}  # what latest.pt will say
        if args.async_save:  # New: one save in flight: the last one ends, and latest.pt names it, before the next
            if saves.finish_async():
                diverged.last_good = latest
            # Staged: copied to CPU memory now (training changes the weights next), then written by a thread. Its
            # writer copies nothing ahead from a GPU (else that thread opens a CUDA stream on GPU 0, on every rank);
            # a DefaultStager named (the writer is a stager itself, whose staging copies each shard twice).
            writer = dcp.FileSystemWriter(folder, per_thread_copy_ahead=0)
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
            future = dcp.async_save({"model": model_state, "optimizer": optim_state}, storage_writer=writer,
                                    async_stager=stager, process_group=save_group)
            future.add_done_callback(lambda _, stager=stager: stager.close())  # its CPU copies go once written
            saves.start_async(future, pointer, folder)
            print0(f"saving: {folder} in the background; training waited {time.perf_counter() - started:.3f} s")
        else:
            try:
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)
            except dcp.CheckpointException as exc:  # a full disk, on any rank: every rank gets it
                raise saves.failure(exc, folder) from exc
            if is_main:  # dcp.save returned on every rank: all shards are written. Now point latest.pt at them.
                saves.point_latest(pointer)
            print0(f"saved: {folder}; training waited {time.perf_counter() - started:.3f} s")
            diverged.last_good = latest
        if step >= total_steps:
            break
    saves.finish_async()  # New: the last save in flight ends (and latest.pt names it) before the job does
    # ------------------------------------------------------------------------------------ save
    # The full weights, gathered shard by shard onto rank 0's CPU (a collective: every rank calls it; the others
    # get an empty dict). Plain tensors, no prefix: they load into build_model(arch, classes, image_size) anywhere.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "model.pt")
        save_atomic(full, path)  # atomic: a resumed run that finished would not write it again
        print0(f"saved: {path}")
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    prof.stop()  # --profile: writes the steps it recorded
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(harness.gather_profile_table(prof, device))
    tb.close()
    # state_bytes_per_rank: parameters + gradients + optimizer state in each rank's memory, its shards only.
    print0(harness.gather_result_line(device, speed, model, optimizer, recipe="fsdp", steps=step,
                                      train_loss=loss_meter.avg, val_acc1=val_acc1, val_samples=val_samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
