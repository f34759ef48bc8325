"""Tensor parallelism (and sequence parallelism) for the language model: each rank holds a slice of every layer.

    ./launch.sh recipes/lm_tp.py 0,1                                     # 2 GPUs, each with half of every layer
    ./launch.sh recipes/lm_tp.py 0,1,2,3 --sequence-parallel             # 4 GPUs; norms on a quarter of the sequence
    ./launch.sh recipes/lm_tp.py 0,1,3 --n-head 6 --d-model 192          # 3 GPUs: --tp must divide the heads
    ./launch.sh recipes/lm_tp.py 0,1,2,3,4,5,6,7 --n-head 8 --sequence-parallel  # 8 GPUs: a head each
    ./launch.sh recipes/lm_tp.py cpu:2                                   # 2 CPU processes (gloo): minutes
    ./launch.sh recipes/lm_tp.py 0,1 --save-every 100 --async-save       # checkpoints written while training goes on

What it shows, against lm_ddp.py (diff them: the lesson is what cutting every layer across ranks changes):
- parallelize_module(model, mesh, plan) on the full model lm_ddp.py builds from --seed: each rank keeps its slices
  (src_data_rank=0 scatters rank 0's), so every layout trains the one-process model to the same numbers (to ~1e-6).
- A block cut Megatron's way (below): q, k, v and mlp.fc by output (ColwiseParallel: n_head / tp heads and 4 d_model
  / tp units per rank, no communication), wo and mlp.proj by input (RowwiseParallel: partial sums, all-reduced).
  Attention runs on plain local tensors, q, k, v viewed with -1 heads (torchtitan's way: DTensor has no CPU rule).
- --sequence-parallel: outside attention and the MLP the activations are cut along the sequence too (T / tp positions
  a rank): each all-reduce becomes a reduce-scatter, then an all-gather before the next cut layer. A norm's gain and
  bias are whole on every rank, but each rank's gradient covers its positions only (Partial): all-reduced once.
- loss_parallel(): each rank's logits are (B, T, 256 / tp); the cross-entropy all-reduces the softmax's max and sum,
  so no rank ever holds all 256. No data parallelism: --tp is the number of processes, all take the whole batch.
  clip_grad_norm_ on DTensors: the global norm (the slices' squares summed across ranks).
- Checkpoints as fsdp.py's (`saves`: common/checkpoint.py's ShardFolders, plumbing): every rank writes its slices
  (torch.distributed.checkpoint) to OUT_DIR/checkpoint/step_N-RUN/, then rank 0 points checkpoint/latest.pt at them;
  --resume on any number of ranks (DCP reshards; bitwise on the same). --async-save: dcp.async_save, a thread writing
  on a gloo group of its own, one in flight. OUT_DIR/model.pt: full weights for common.lm.Transformer, one process
  (with --async-save at the end or a stop).
- --compile: each block compiled in place after parallelize_module: dynamo traces its DTensor ops, collectives
  included, into one graph the blocks share (0 graph breaks).

One block on 2 ranks (D = --d-model, H = --n-head; nn.Linear weights are (out, in)); [SP: ...] = --sequence-parallel
                rank 0                              rank 1
    x           (B, T, D)      [SP: positions 0..T/2]  (B, T, D)      [SP: positions T/2..T]
    ln1         whole gain, bias [SP: its positions]   whole gain, bias [SP: its positions]
                -- (identity; backward: all-reduce)  [SP: all-gather the sequence; backward: reduce-scatter] --
    wq, wk, wv  rows 0..D/2: heads 0..H/2           rows D/2..D: heads H/2..H           ColwiseParallel
    attention   its H/2 heads, plain tensors        its H/2 heads                       no communication
    wo          columns 0..D/2                      columns D/2..D                      RowwiseParallel
                -- all-reduce the partial sums  [SP: reduce-scatter onto the sequence; backward: all-gather] --
    ln2, mlp    as ln1 and attention: fc rows 0..2D | 2D..4D, gelu on its units, proj columns 0..2D | 2D..4D
  Embeddings: tok_emb bytes 0..128 | 128..256, pos_emb positions 0..P/2 | P/2..P (P = --block-size): each rank
  looks up its rows, zeros elsewhere, then all-reduce [SP: reduce-scatter]. Head: bytes 0..128 | 128..256.
Plumbing, not the lesson: `harness.` lines and the two harness objects `meter` (the loss, the clock, the NaN watch,
--profile) and `vote` (SIGUSR1's stop vote); common/harness.py. The siblings of lm_ddp.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/lm.md.
"""
# launcher: torchrun

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # New
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (  # New
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # New
from torch.distributed.tensor import DTensor, Replicate, Shard  # New
from torch.distributed.tensor.experimental import implicit_replication  # New
from torch.distributed.tensor.parallel import (  # New
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness, lm  # not the lesson: harness. lines are plumbing, lm. lines the workload (text, model)
from common.checkpoint import EX_TEMPFAIL, ShardFolders, SignalFlag, find_resume, load_same_flags, save_atomic
from common.schedule import warmup_cosine
from common.utils import print0


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_flags(p, "lm_tp", sharded=True)  # New: sharded: OUT_DIR/checkpoint/, DCP shards and latest.pt
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in sequences: every rank takes all of "
                   "it")  # New
    p.add_argument("--tp", type=int, help="tensor-parallel degree: the number of processes (the default)")  # New
    p.add_argument("--sequence-parallel", action="store_true",  # New
                   help="cut the activations between the cut layers along the sequence too (--seq-len / --tp each)")
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, 1)  # New: 1 data-parallel rank: --batch-size is not split, any size goes
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 20
    args.tp = world_size if args.tp is None else args.tp  # New
    if args.tp != world_size:  # New: one tensor-parallel group of all the processes, no data parallelism
        harness.die(f"--tp {args.tp} must equal the number of processes, {world_size}: lm_tp.py is tensor parallel "
                    f"only (every rank holds a slice of every layer); launch {args.tp} processes or leave --tp out")
    try:
        lm.check_model_flags(args.n_layer, args.n_head, args.d_model, args.seq_len, args.block_size,
                             parallel=args.tp, parallel_flag="--tp")  # New: whole heads and MLP units per rank
    except ValueError as exc:
        harness.die(str(exc))
    if args.sequence_parallel and args.seq_len % args.tp:  # New
        harness.die(f"--sequence-parallel cuts each sequence into --tp {args.tp} equal pieces: --seq-len "
                    f"{args.seq_len} must be a multiple of {args.tp}")


# ------------------------------------------------------------------------------------------ model
def tp_plan(sequence_parallel):  # New
    """parallelize_module's plan: module name (fnmatch patterns) -> how its weight is cut and its input and output
    laid out. Between the cut layers the residual stream is whole on every rank (Replicate), or with
    --sequence-parallel cut along the sequence (Shard(1): dim 1 of (B, T, D))."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # Embeddings cut by rows (bytes, positions): a rank looks up the rows it holds, zeros for the others; the
        # partial sums are all-reduced, or reduce-scattered onto the sequence. The positions are 1-D (T,): their
        # sequence dim is 0, and (T / tp, D) adds to the bytes' (B, T / tp, D) as (T, D) adds to (B, T, D).
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel
                                   else Replicate()),
        # Attention: q, k, v cut by output (heads), plain local outputs; wo cut by input, the partial sums combined.
        "blocks.*.attn.wq": ColwiseParallel(),
        "blocks.*.attn.wk": ColwiseParallel(),
        "blocks.*.attn.wv": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(output_layouts=between),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=between),
        # The head cut by output (bytes), the logits left a DTensor for loss_parallel.
        "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    # Attention's and the MLP's input made one Replicate DTensor for the cut layers inside: with --sequence-parallel
    # the sequence is all-gathered; either way its gradient (q's, k's and v's summed) is combined by ONE collective
    # in backward (left plain, wq, wk and wv would each all-reduce their own).
    plan.update({name: PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate())
                 for name in ("blocks.*.attn", "blocks.*.mlp")})
    if sequence_parallel:  # the norms on their own positions (without it they stay plain, whole on every rank)
        plan.update({name: SequenceParallel() for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f")})
    return plan


def grads_as_params(model):  # New
    """Each gradient in its parameter's layout, once, before clipping and the step (else each of those ops would
    redistribute it again). Two differ: with --sequence-parallel a norm's gradient sums over the rank's positions only
    (Partial): all-reduced here; an embedding's comes back whole (Replicate): sliced here, no communication."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


# ------------------------------------------------------------------------------------ checkpoints
def load_shards(model, optimizer, path, saves):  # New, as in fsdp.py
    """Every rank reads its part of the sharded checkpoint at `path`, however many ranks wrote it (DCP reshards)."""
    with implicit_replication():  # get_state_dict runs a step of the fresh optimizer: plain norms beside DTensors
        model_state, optim_state = get_state_dict(model, optimizer)  # this world's layout, filled in by load
    for group in optim_state["param_groups"]:  # load fills in only the keys given: without this one, the scheduler
        group.setdefault("initial_lr", group["lr"])  # would scale the saved step's rate instead of the peak
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise saves.load_failure(exc, path) from exc
    lm.adamw_as_this_torch(optim_state, optimizer)  # its fused/foreach, not the saver's: the load places steps by it
    with implicit_replication():
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, inputs, targets, batch, device, amp):
    """Mean loss per byte over every validation window. New: every rank runs every window, each with its slices."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, bytes
    for i in range(0, len(inputs), batch):
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        with loss_parallel():  # New: from the logits cut by bytes, as in training
            total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").to_local()
        total[1] += y.numel()
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = parse_args()
    # ------------------------------------------------------------------------ distributed setup
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    is_main = rank == 0
    check_args(args, world_size)
    # SIGUSR1 (SLURM's --signal=USR1@120) asks for a save and exit 75; the loop acts on it at a step boundary.
    preempt = SignalFlag(signal.SIGUSR1)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"  # one GPU per process; NCCL between GPUs
        device, backend = harness.check_gpu(device, backend, dtensor=True)  # New: dtensor: not launch.sh G:N
        torch.cuda.set_device(device)  # first CUDA call, or each process also opens a context on GPU 0 (write-up 000)
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32: fast, fp32's curves
    else:
        device, backend = torch.device("cpu"), "gloo"
    if args.debug_collectives:  # each collective first checks that every rank called the same one (slow: debugging)
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # before init: TORCH_DISTRIBUTED_DEBUG is read only at import
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # torch's 30 min would leave the others hanging that long
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    stop_group = dist.new_group(backend="gloo", timeout=timeout)  # the stop vote's: it runs beside the step's
    mesh = init_device_mesh(device.type, (args.tp,), mesh_dim_names=("tp",))  # New: the ranks that cut each layer
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"(all of it on every rank: tp={args.tp}, sp={args.sequence_parallel}) sequences of {args.seq_len} bytes")
    # ------------------------------------------------------------------------------------ data
    # YOUR DATA goes here: text as bytes in a uint8 tensor (read_text: a file, a folder, or the default corpus).
    # Every rank reads it whole: a few MB. A corpus of GBs would be memory-mapped instead (np.memmap), as nanoGPT does.
    try:
        text, where = lm.read_text(args.text)
        train_text, val_text = lm.split(text)
        lm.check_text(train_text, val_text, args.seq_len, args.val_windows)
    except lm.TextError as exc:
        harness.die(str(exc))
    val_x, val_y = lm.val_windows(val_text, args.seq_len, args.val_windows)
    print0(f"data: {where} train={len(train_text)} val={len(val_text)} bytes, {len(val_x)} validation windows")
    # ----------------------------------------------------------------------------------- model
    torch.manual_seed(args.seed)  # the same full model on every rank
    # YOUR MODEL goes here: an nn.Module from tokens (B, T) to logits (B, T, vocab).
    model = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size)  # New: on the host, not the GPU
    # New: cut by the plan, which names its layers; each rank keeps its slices of rank 0's (src_data_rank=0 scatters),
    # each layer's weight on the GPU whole only while it is cut: no GPU ever holds the whole model (lm_tp's reason)
    model = parallelize_module(model, mesh, tp_plan(args.sequence_parallel), src_data_rank=0)
    model.to(device)  # New: what the plan left plain (the norms), after the cut
    if args.activation_checkpointing:  # New: after parallelize_module, whose plan names the unwrapped modules
        for name, block in model.blocks.items():  # non-reentrant (checkpoint_wrapper's default): DDP-safe
            model.blocks[name] = checkpoint_wrapper(block)  # state_dict keys stay as without it
        wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.blocks.values())
        print0(f"activation checkpointing: {wrapped} of {len(model.blocks)} blocks recompute their forward in backward")
    if args.compile:  # New: each block in place, after the plan (torchtitan's order): its collectives traced too
        for block in model.blocks.values():  # one graph they share; dynamic=False: evaluation's batch, one of its own
            block.compile(dynamic=False)
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    # Weight decay on the matrices (2-D) only: decaying biases, norms' gains or embeddings only hurts (GPT-2, nanoGPT).
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                   **lm.adamw_implementation(dtensor=True))  # fused, or foreach where it leaks
    start_step = 0
    # New: shard folders step_N-RUN: no save overwrites the one latest.pt points at, so a failed save leaves it whole.
    run_tag = [os.urandom(3).hex()]
    dist.broadcast_object_list(run_tag, src=0)  # every rank writes into the same folder
    saves = ShardFolders(args.out_dir, run_tag[0], "step")  # New: OUT_DIR/checkpoint/: shard folders, latest.pt
    latest = saves.latest  # New: the resume point, naming the newest whole shard folder
    # New: --async-save's thread makes its collectives on a group of its own (never among the step's); gloo: it must.
    save_group = dist.new_group(backend="gloo", timeout=timeout) if args.async_save else None
    # New: every slice counted (a DTensor's global size); shared, and before the resume (else dcp.load may hang)
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": harness.state_bytes(model),
                                                            "checkpoint": 3 * harness.state_bytes(model)}, shared=True)
    resume = find_resume(args.resume, latest) if args.resume else None
    if resume:  # New: every rank reads its own slices of the shards latest.pt names (any number of ranks wrote them)
        flags = {k: getattr(args, k) for k in lm.SAME_ON_RESUME}
        ckpt = load_same_flags(resume, "cpu", flags, require=("shards",))  # one line if not, or other flags
        load_shards(model, optimizer, os.path.join(os.path.dirname(resume), ckpt["shards"]), saves)
        start_step = ckpt["step"]
        print0(f"resume: {resume} at step {start_step}")
    # The rate per step: warm-up, then cosine over --steps; a resumed run takes up the schedule where it stopped.
    scheduler = warmup_cosine(optimizer, 1, args.steps, args.warmup_steps / args.steps, start_step=start_step)
    amp = args.amp_dtype == "bf16"
    # ----------------------------------------------------------------------------------- train
    last = min(args.steps, start_step + (args.max_steps or args.steps))  # --max-steps: this run's
    # The loss, the clock (tokens/s, own_ms: each rank's own work), the NaN watch, --profile; the clock starts.
    meter = harness.StepMeter(model, device, args.profile, args.out_dir, rank,  # New: the data wait alone (forward: TP)
                              last_good=latest)  # what a divergence's stop names, once a save has written it
    vote = harness.StopVote(preempt, stop_group)  # SIGUSR1: every rank stops after the same step
    step, stop, train_loss, val_loss = start_step, False, None, None
    while step < last:
        # New: dp_rank 0 of 1: every rank takes the whole batch of (seed, step), the one lm_ddp.py splits.
        x, y = (t.to(device, non_blocking=True)
                for t in lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, 0, 1))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            # New: the logits are a DTensor (B, T, 256) cut by bytes: each rank holds (B, T, 256 / tp) of it.
            logits = model(x)
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel():  # New: around the loss and its backward: the softmax's max and sum all-reduced
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # fp32 softmax over the 256 bytes
            loss.backward()  # New: each collective's backward: all-reduces (SP: all-gathers, reduce-scatters)
        loss = loss.to_local()  # New: a Replicate DTensor: every rank's local value is the whole mean
        grads_as_params(model)  # New: the norms' Partial gradients all-reduced (SP), the embeddings' sliced
        # New: plain tensors (without SP the norms: whole, the same gradient on every rank) taken as Replicate DTensors
        with implicit_replication():  # beside the slices: else "got mixed torch.Tensor and DTensor"
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # DTensors: the norm over every slice
            optimizer.step()
        scheduler.step()
        step += 1
        meter.step(step, loss, args.batch_size * args.seq_len)  # tokens (bytes); no host sync
        compiled.step()  # --compile: after the first step, which compiled the blocks, the 'compile:' line
        saves.finish_async(only_if_done=True)  # New: written? latest.pt names it now (each rank at its own step)
        stop = vote.all_reduce_max()  # the vote started a step ago: every rank the same answer at the same step
        evaluating = step % args.eval_every == 0 or step == last
        if evaluating or stop or (args.save_every and step % args.save_every == 0):  # --save-every, SIGUSR1
            meter.all_reduce_and_check(step, model)  # a NaN/inf loss or weight stops the run before any save
            if evaluating:
                # -------------------------------------------------------------------------------- eval
                train_loss = meter.all_reduce_loss()  # the mean since the last eval; the clock stops
                val_loss = evaluate(model, val_x, val_y, args.batch_size, device, amp)  # New: all windows
                print0(f"step={step}/{args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                       f"val_bpb={lm.bits_per_byte(val_loss):.4f} lr={scheduler.get_last_lr()[0]:.2e} "
                       f"{meter.fields(last - step)}")
            # -------------------------------------------------------------------------------- save
            # New: every rank writes its slices (DCP), then rank 0 points latest.pt at them: weights, moments, step.
            folder, started = saves.folder(step), time.perf_counter()
            model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's own slices
            pointer = {"shards": os.path.basename(folder), "step": step, "epoch": 0,  # what latest.pt will say
                       "flags": {k: getattr(args, k) for k in lm.SAME_ON_RESUME}}
            if args.async_save:  # New: one save in flight, as fsdp.py: the last one ends and latest.pt names it first
                saves.finish_async()
                future = dcp.async_save({"model": model_state, "optimizer": optim_state}, async_stager=saves.stager(),
                                        storage_writer=dcp.FileSystemWriter(folder, per_thread_copy_ahead=0),
                                        process_group=save_group)
                saves.start_async(future, pointer, folder)
                print0(f"saving: {folder} in the background; training waited {time.perf_counter() - started:.3f} s")
            else:
                try:
                    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)
                except dcp.CheckpointException as exc:  # a full disk, on any rank: every rank gets it
                    raise saves.failure(exc, folder) from exc
                # New: the full weights, gathered slice by slice onto rank 0's CPU (a collective; the others get {}).
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if is_main:  # dcp.save returned on every rank: all shards are written. Now point latest.pt at them.
                    saves.point_latest(pointer)
                    save_atomic(full, os.path.join(args.out_dir, "model.pt"))  # New: loads into Transformer(...)
                    print0(f"saved: {latest} and model.pt at step {step}; training waited "
                           f"{time.perf_counter() - started:.3f} s")
            meter.start()  # the clock again, after an evaluation stopped it
            if stop:  # saved; every rank leaves the loop at this step
                break
    meter.stop()  # the clock; --profile writes its trace
    vote.wait()  # the last vote; every rank started as many
    saves.finish_async()  # New: the last save in flight ends (and latest.pt names it) before the job does
    if args.async_save:  # New: the full weights once, at the end or a stop (gathered at every save: a wait for all)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if is_main:
            save_atomic(full, os.path.join(args.out_dir, "model.pt"))  # loads into Transformer(...)
            print0(f"saved: model.pt at step {step}")
    if stop and step < last:  # saved; the scheduler's requeue resumes it (--resume auto)
        dist.barrier()  # rank 0's files are whole before any rank exits (torchrun stops the rest at the first)
        print0(f"preempt: SIGUSR1: saved {latest} at step {step}; exit {EX_TEMPFAIL}: requeue the job with "
               "--resume auto to go on from there")
        dist.destroy_process_group()
        sys.exit(EX_TEMPFAIL)
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    if val_loss is None:  # resumed at or past --max-steps / --steps: nothing left to train
        val_loss = evaluate(model, val_x, val_y, args.batch_size, device, amp)  # New
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(meter.gather_profile_table())
    # New: state_bytes_per_rank counts each rank's slices (lm_ddp.py holds the whole model everywhere).
    print0(meter.gather_result_line(model, optimizer, recipe="lm_tp", steps=step, start_step=start_step,
                                    train_loss=train_loss, val_loss=val_loss, val_bpb=lm.bits_per_byte(val_loss),
                                    val_windows=len(val_x), tp=args.tp, sequence_parallel=args.sequence_parallel,
                                    **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
