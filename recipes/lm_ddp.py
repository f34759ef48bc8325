"""A language model on real text with DistributedDataParallel: the base of the language-model family.

    ./launch.sh recipes/lm_ddp.py 0,1,3                                  # GPUs 0, 1 and 3, the default corpus
    ./launch.sh recipes/lm_ddp.py 0 --text ~/my_corpus/ --steps 5000     # one GPU, your text (a file or a folder)
    ./launch.sh recipes/lm_ddp.py cpu:2                                  # 2 CPU processes (gloo): minutes
    ./launch.sh recipes/lm_ddp.py cpu:2 --max-steps 100 --resume auto    # a short run; run it again to go on

What it shows, against ddp_torchrun.py (diff them: the lesson is what a transformer on text changes):
- Text, not images: a decoder-only transformer over bytes (common/lm.py: a vocabulary of 256, no tokenizer), the
  Python standard library's own source as the default corpus (no download), --text for yours. --batch-size is the
  GLOBAL batch in sequences of --seq-len bytes.
- Steps, not epochs: --steps is the schedule's length (warm-up, then cosine); step k's sequences depend only on
  --seed, k and the rank, so a resumed run sees what the uninterrupted one would have, and --max-steps N stops after N
  with a checkpoint that --resume auto goes on from, exactly.
- AdamW with weight decay on the matrices only (not on biases, norms or embeddings), gradient clipping by the global
  norm (after DDP's all-reduce every rank clips the same gradient), --amp-dtype bf16 (autocast; no loss scaler).
- Validation on fixed windows, each scored once across ranks: loss in nats per byte and bits per byte (val_bpb).
- Checkpoints: rank 0 writes OUT_DIR/latest.pt (the weights, AdamW's moments, the step), then model.pt (the weights),
  each atomically, at each evaluation, every --save-every N steps, and on SIGUSR1 (a scheduler's warning: then exit
  75, requeue; docs/clusters.md). --async-save: a copy in CPU memory (training waits for that alone), written by a
  thread while training goes on; one save in flight; a crash while it writes leaves the previous files whole.
- --activation-checkpointing: each block's activations are recomputed in backward instead of kept (the
  non-reentrant torch.utils.checkpoint: under DDP the reentrant one fails with "Expected to mark a variable ready
  only once" when a block is checkpointed twice or a parameter is unused; docs/lm.md).
- --compile: each block compiled in place before the DDP wrap (DDP's all-reduces stay eager, between blocks); the
  first step compiles (its `compile:` line: how long); at the end the graphs, recompiles and graph breaks (0 here).
Plumbing, not the lesson: `harness.` lines and the two harness objects `meter` (the loss, the clock, the NaN watch,
--profile) and `vote` (SIGUSR1's stop vote); common/harness.py. The siblings of lm_ddp.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/lm.md.
"""
# launcher: torchrun

import argparse
import concurrent.futures
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness, lm  # not the lesson: harness. lines are plumbing, lm. lines the workload (text, model)
from common.checkpoint import EX_TEMPFAIL, SignalFlag, cpu_copy, find_resume, load_same_flags, save_atomic
from common.schedule import warmup_cosine
from common.utils import print0


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_flags(p, "lm_ddp")  # the family's: the model's shape, the text, the schedule, AdamW, the checkpoints
    p.add_argument("--batch-size", type=int, help="GLOBAL batch in sequences, split across processes (default: 32; 30 "
                   "on 3)")
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, world_size)  # nan/inf, a bad count, an uneven --batch-size
    if args.batch_size is None:  # the default, rounded down so that it divides: 30 on 3 GPUs, not an error
        args.batch_size = max(1, 32 // world_size) * world_size
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 20
    try:
        lm.check_model_flags(args.n_layer, args.n_head, args.d_model, args.seq_len, args.block_size)
    except ValueError as exc:
        harness.die(str(exc))


# ------------------------------------------------------------------------------------ checkpoints
def write_checkpoint(state, latest, out_dir):
    """Rank 0: the resume point, atomically (a crash while writing leaves the previous one), then the weights alone."""
    save_atomic(state, latest)
    save_atomic(state["model"], os.path.join(out_dir, "model.pt"))  # the weights alone, atomically too


def finish_async_save(in_flight, latest):
    """Rank 0: wait for the save in flight to be written (a failed write raises here), and say so. None: none now."""
    future, step = in_flight
    future.result()
    print0(f"saved: {latest} and model.pt at step {step} (written in the background)")


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, inputs, targets, rank, world_size, batch, device, amp):
    """Mean loss per byte over every validation window: rank r scores windows r, r + N, ...; sums all-reduced."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, bytes
    mine_x, mine_y = inputs[rank::world_size], targets[rank::world_size]
    for i in range(0, len(mine_x), batch):
        x, y = mine_x[i:i + batch].to(device), mine_y[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        total[1] += y.numel()
    dist.all_reduce(total)
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
        device, backend = harness.check_gpu(device, backend)  # visible? (launch.sh G:N: N ranks on GPU G, gloo)
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
    batch_per_process = args.batch_size // world_size
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({batch_per_process} per process x {world_size}) sequences of {args.seq_len} bytes")
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
    model = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size).to(device)
    if args.activation_checkpointing:  # before DDP: each block's forward runs again in backward, nothing kept inside
        for name, block in model.blocks.items():  # non-reentrant (checkpoint_wrapper's default): DDP-safe
            model.blocks[name] = checkpoint_wrapper(block)  # state_dict keys stay as without it
        wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.blocks.values())
        print0(f"activation checkpointing: {wrapped} of {len(model.blocks)} blocks recompute their forward in backward")
    if args.compile:  # each block in place, before the DDP wrap (torchtitan's order): DDP's hooks stay eager
        for block in model.blocks.values():  # one graph they share; dynamic=False: evaluation's batch, one of its own
            block.compile(dynamic=False)
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                process_group=harness.ddp_process_group(timeout))
    # Weight decay on the matrices (2-D) only: decaying biases, norms' gains or embeddings only hurts (GPT-2, nanoGPT).
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                   **lm.adamw_implementation(dtensor=False))  # fused, or foreach where it leaks
    start_step = 0
    latest = os.path.join(args.out_dir, "latest.pt")
    amp = args.amp_dtype == "bf16"
    size = harness.state_bytes(model.module)  # shared=True: every node must see the latest.pt every rank resumes from
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": size, "latest.pt": 3 * size}, shared=True)
    resume = find_resume(args.resume, latest) if args.resume else None
    if resume:  # every rank loads the same file: no broadcast needed
        flags = {k: getattr(args, k) for k in lm.SAME_ON_RESUME}
        ckpt = load_same_flags(resume, device, flags, require=("model", "optimizer"))  # one line if not, or other flags
        model.module.load_state_dict(ckpt["model"])
        lm.adamw_as_this_torch(ckpt["optimizer"], optimizer)  # its fused/foreach, not the saver's: the load places
        optimizer.load_state_dict(ckpt["optimizer"])  # the step counts by them
        start_step = ckpt["step"]
        print0(f"resume: {resume} at step {start_step}")
        # DDP lays its gradient buckets out again after its first backward, in the order the gradients came, and on
        # 3+ ranks where an element sits in a bucket changes how the all-reduce rounds its sum. One backward now (no
        # step) gives the resumed run the layout the uninterrupted one trained with: its weights stay bitwise the same.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):  # the step's (--compile: its graph)
            logits = model(torch.zeros(batch_per_process, args.seq_len, dtype=torch.long, device=device))
        logits.float().sum().backward()  # the bucket order
        optimizer.zero_grad(set_to_none=True)
    # The rate per step: warm-up, then cosine over --steps; a resumed run takes up the schedule where it stopped.
    scheduler = warmup_cosine(optimizer, 1, args.steps, args.warmup_steps / args.steps, start_step=start_step)
    # ----------------------------------------------------------------------------------- train
    last = min(args.steps, start_step + (args.max_steps or args.steps))  # --max-steps: this run's
    # The loss, the clock (tokens/s, own_ms: each rank's own work), the NaN watch, --profile; the clock starts.
    meter = harness.StepMeter(model, device, args.profile, args.out_dir, rank, forward=model.module,  # data + forward
                              last_good=latest)  # what a divergence's stop names, once a save has written it
    vote = harness.StopVote(preempt, stop_group)  # SIGUSR1: every rank stops after the same step
    step, stop, train_loss, val_loss = start_step, False, None, None
    # --async-save: rank 0's writer thread, and the save it is writing (one at a time: the next waits for it).
    saver, in_flight = concurrent.futures.ThreadPoolExecutor(max_workers=1) if args.async_save else None, None
    while step < last:
        # The same (seed, step) on every rank: rank r takes the r-th slice of one global batch.
        x, y = (t.to(device, non_blocking=True)
                for t in lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, rank, world_size))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # fp32 softmax over the 256 bytes
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages gradients across ranks during backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)  # the same averaged gradient everywhere
        optimizer.step()
        scheduler.step()
        step += 1
        meter.step(step, loss, args.batch_size * args.seq_len)  # tokens (bytes); no host sync
        compiled.step()  # --compile: after the first step, which compiled the blocks, the 'compile:' line
        if in_flight is not None and in_flight[0].done():  # written: said (a failure raised) at the step that sees it
            in_flight = finish_async_save(in_flight, latest)
        stop = vote.all_reduce_max()  # the vote started a step ago: every rank the same answer at the same step
        evaluating = step % args.eval_every == 0 or step == last
        if evaluating or stop or (args.save_every and step % args.save_every == 0):  # --save-every, SIGUSR1
            meter.all_reduce_and_check(step, model)  # a NaN/inf loss or weight stops the run before any save
            if evaluating:
                # -------------------------------------------------------------------------------- eval
                train_loss = meter.all_reduce_loss()  # the mean since the last eval; the clock stops
                val_loss = evaluate(model.module, val_x, val_y, rank, world_size, batch_per_process, device, amp)
                print0(f"step={step}/{args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                       f"val_bpb={lm.bits_per_byte(val_loss):.4f} lr={scheduler.get_last_lr()[0]:.2e} "
                       f"{meter.fields(last - step)}")
            # -------------------------------------------------------------------------------- save
            if is_main:  # the resume point: weights, AdamW's moments, the step (the data follows from it)
                os.makedirs(args.out_dir, exist_ok=True)
                started = time.perf_counter()
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                         "epoch": 0, "flags": {k: getattr(args, k) for k in lm.SAME_ON_RESUME}}
                if args.async_save:  # one save in flight: the last one is written before the next starts
                    if in_flight is not None:
                        finish_async_save(in_flight, latest)
                    # Copied to CPU memory now (the next step changes the weights and moments in place), written
                    # by the thread while training goes on.
                    in_flight = (saver.submit(write_checkpoint, cpu_copy(state), latest, args.out_dir), step)
                    print0(f"saving: {latest} and model.pt at step {step} in the background; training waited "
                           f"{time.perf_counter() - started:.3f} s")
                else:
                    write_checkpoint(state, latest, args.out_dir)
                    print0(f"saved: {latest} and model.pt at step {step}; training waited "
                           f"{time.perf_counter() - started:.3f} s")
            meter.start()  # the clock again, after an evaluation stopped it
            if stop:  # saved; every rank leaves the loop at this step
                break
    meter.stop()  # the clock; --profile writes its trace
    vote.wait()  # the last vote; every rank started as many
    if in_flight is not None:  # the last save in flight is written before the job ends (or exits 75)
        finish_async_save(in_flight, latest)
    if stop and step < last:  # saved; the scheduler's requeue resumes it (--resume auto)
        dist.barrier()  # rank 0's files are whole before any rank exits (torchrun stops the rest at the first)
        print0(f"preempt: SIGUSR1: saved {latest} at step {step}; exit {EX_TEMPFAIL}: requeue the job with "
               "--resume auto to go on from there")
        dist.destroy_process_group()
        sys.exit(EX_TEMPFAIL)
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    if val_loss is None:  # resumed at or past --max-steps / --steps: nothing left to train
        val_loss = evaluate(model.module, val_x, val_y, rank, world_size, batch_per_process, device, amp)
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(meter.gather_profile_table())
    print0(meter.gather_result_line(model, optimizer, recipe="lm_ddp", steps=step, start_step=start_step,
                                    train_loss=train_loss, val_loss=val_loss, val_bpb=lm.bits_per_byte(val_loss),
                                    val_windows=len(val_x), **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
