"""Pipeline parallelism for the language model: each rank holds a run of whole blocks, and microbatches flow through.

    ./launch.sh recipes/lm_pp.py 0,1                                     # 2 GPUs: blocks 0-1 | 2-3, GPipe
    ./launch.sh recipes/lm_pp.py 0,1,3                                   # 3 GPUs: blocks 0 | 1 | 2-3
    ./launch.sh recipes/lm_pp.py 0,1,2,3 --schedule 1f1b --microbatches 8          # 4 GPUs, a block each, 1F1B
    ./launch.sh recipes/lm_pp.py 0,1,2,3,4,5,6,7 --n-layer 8 --schedule 1f1b       # 8 GPUs, a block each
    ./launch.sh recipes/lm_pp.py cpu:2                                   # 2 CPU processes (gloo): minutes
    python tools/pp_schedule.py --ascii 2 4                              # the timelines below, from torch's own

What it shows, against lm_ddp.py (diff them: the lesson is what cutting the model into consecutive pieces changes):
- The cut of write-up 003 (and ddp_spawn.py --model-parallel): the model in pieces, each on its own device, the
  activations handed from one to the next. There one process drives both halves, and while one half computes the
  other waits. Here each piece is a process (a stage), and the batch is cut into --microbatches pieces that follow
  each other through the stages, so that all of them have work most of the time: torch.distributed.pipelining.
- A manual split (torchtitan's way): every rank builds the full model from --seed exactly as lm_ddp.py does (so every
  layout starts from the same weights), then keeps its share of the blocks, whole and in order; the first stage also
  keeps the embeddings, the last the final norm and the head; a PipelineStage wraps the piece. Not the tracer
  pipeline(model, ...): it traces the model into one graph (torch.export) and cuts that, which breaks on control flow
  export cannot trace, and leaves stages of generated code. --pp is the number of processes: no data parallelism,
  every stage takes the whole --batch-size; at most one stage per block.
- --schedule: the order each stage runs its microbatches' forwards (F) and backwards (B) in. gpipe: every F, then
  every B; 1f1b: p - s forwards first (stage s of p), then one B and one F in turn (the oldest microbatch's backward
  first, freeing its activations), then the last Bs. Both idle a share (p - 1) / (m + p - 1) of the step (the
  bubble; m = --microbatches); 1F1B holds the activations of p - s microbatches at most, GPipe of all m
  (tools/pp_schedule.py measures both from torch's own schedules; docs/pp_timeline.png draws them). Interleaved
  schedules (several stages a rank, a smaller bubble) are not here. 1F1B on 2 stages x 4 microbatches (a forward
  takes 1 unit, a backward 2; the numbers are microbatches; . the stage waits):
                   0     2     4     6     8     10    12    14
          stage 0 |F0 F1  .  . B0====F2 B1====F3 B2==== . B3====|
          stage 1 | . F0 B0====F1 B1====F2 B2====F3 B3==== .  .|
- The loss: the schedule calls loss_fn on the last stage, one mean per microbatch, and backward from each;
  scale_grads=True divides the summed gradients by m, so they are the one-process full-batch gradients. The printed
  train_loss is the last stage's (all-reduced with the others' nothing onto rank 0); validation runs the windows
  through the pipeline too (schedule.eval), and the last stage scores the logits as lm_ddp.py does.
- Clipping by the GLOBAL norm: each stage's squared norm, summed across the stages (an all-reduce); each stage
  clipped by its own norm would scale the pieces differently, a gradient no one-process run has.
- Checkpoints: every stage writes its weights and AdamW's state (torch.distributed.checkpoint) under the full model's
  names to OUT_DIR/checkpoint/step_N-RUN/, then rank 0 points checkpoint/latest.pt at them (as lm_tp.py; `saves`:
  common/checkpoint.py's ShardFolders, plumbing); DCP loads by name, so --resume works on any --pp (bitwise on the
  same). OUT_DIR/model.pt: the stages' weights gathered on rank 0, the full state_dict of common.lm.Transformer, for
  one process. --async-save as lm_tp.py's.
- launch.sh G:N (ranks sharing one GPU over gloo) is refused: the stages' activations go by point-to-point send and
  recv, and gloo's hand the tensor's address to its host transport with no device check (ProcessGroupGloo::send);
  one rank per GPU (NCCL), or cpu:N.
- --compile: each stage compiles its own blocks in place before the schedule takes the stage; the sends and receives
  between stages stay eager.
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
import torch.nn as nn  # New
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # New
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # New

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness, lm  # not the lesson: harness. lines are plumbing, lm. lines the workload (text, model)
from common.checkpoint import EX_TEMPFAIL, ShardFolders, SignalFlag, find_resume, load_same_flags, save_atomic
from common.schedule import warmup_cosine
from common.utils import print0

P2P_ON_SHARED_GPU = "gloo's send and recv read a CUDA tensor's address as host memory (no device check)"  # New
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # New: --schedule
# New: AdamW's state keyed by parameter name, not by index: stage 1's first parameter is index 0 too, so indexed
# states from several stages would collide in one checkpoint (and a resume on another --pp would misplace them).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_flags(p, "lm_pp", sharded=True)  # New: sharded: OUT_DIR/checkpoint/, DCP shards and latest.pt
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch in sequences: every stage takes all of "
                   "it, in --microbatches pieces (default: 32 on any --pp, so a checkpoint resumes on another)")  # New
    p.add_argument("--pp", type=int, help="pipeline stages: the number of processes (the default)")  # New
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe",  # New
                   help="the order of the microbatches' forwards and backwards on each stage: gpipe (all forwards, "
                   "then all backwards) or 1f1b (alternating: fewer activations held)")
    p.add_argument("--microbatches", type=int, help="pieces each step's batch is cut into, to flow through the "
                   "stages (default: the fewest that divide --batch-size and are 2 x --pp or more)")  # New
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(args, 1)  # New: 1 data-parallel rank: every stage takes the whole --batch-size
    args.pp = world_size if args.pp is None else args.pp  # New
    if args.pp != world_size:  # New: one pipeline of all the processes, no data parallelism
        harness.die(f"--pp {args.pp} must equal the number of processes, {world_size}: lm_pp.py is pipeline parallel "
                    f"only (every rank holds one stage); launch {args.pp} processes or leave --pp out")
    if args.microbatches is None:  # New: 2 a stage or more (the bubble: (pp - 1) / (m + pp - 1) of a step), dividing
        fits = [m for m in range(args.pp, args.batch_size + 1) if args.batch_size % m == 0]  # (else the error below)
        args.microbatches = next((m for m in fits if m >= 2 * args.pp), fits[-1] if fits else 2 * args.pp)
    if args.microbatches < 1:  # New
        harness.die(f"--microbatches {args.microbatches} must be >= 1")
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 20
    try:
        lm.check_model_flags(args.n_layer, args.n_head, args.d_model, args.seq_len, args.block_size)
    except ValueError as exc:
        harness.die(str(exc))
    if args.pp > args.n_layer:  # New
        harness.die(f"--pp {args.pp} stages for --n-layer {args.n_layer} blocks: each stage holds at least one whole "
                    "block; use fewer processes or more layers")
    if args.batch_size % args.microbatches:  # New: torch cuts the batch with tensor_split: equal pieces only
        harness.die(f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} (every stage "
                    "takes the whole batch, in equal pieces: the stages' buffers have one shape); try --batch-size "
                    f"{max(1, args.batch_size // args.microbatches) * args.microbatches}")
    if args.schedule == "1f1b" and args.microbatches < args.pp:  # New: Schedule1F1B refuses it, with a traceback
        harness.die(f"--schedule 1f1b needs at least one microbatch per stage: --microbatches {args.microbatches} is "
                    f"below --pp {args.pp}; pass --microbatches {args.pp} or more, or --schedule gpipe")


# ------------------------------------------------------------------------------------------ model
def stage_blocks(n_layer, pp):  # New
    """[(first, end)] of the blocks each stage holds: whole blocks, in order, as even as they go (the extra ones on
    the later stages). torchtitan also counts the embeddings and the head as layers; here only blocks count."""
    return [(s * n_layer // pp, (s + 1) * n_layer // pp) for s in range(pp)]


class Stage(nn.Module):  # New
    """Stage `index` of `count` of a Transformer: its blocks, the embeddings on the first stage, the final norm and
    the head on the last, under the full model's names (its state_dict keys are the Transformer's), the rest of the
    model dropped. forward: Transformer.forward's lines for the parts it holds: the first stage takes the bytes
    (B, T), the others the residual stream (B, T, D) from the stage before; the last returns the logits."""

    def __init__(self, model, index, count, amp=False):
        super().__init__()
        first, end = stage_blocks(len(model.blocks), count)[index]
        self.is_first, self.is_last, self.amp = index == 0, index == count - 1, amp
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({name: model.blocks[name] for name in list(model.blocks)[first:end]})
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.amp):  # --amp-dtype bf16
            if self.is_first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
            for block in self.blocks.values():
                x = block(x)
            return self.head(self.ln_f(x)) if self.is_last else x


def loss_fn(logits, targets):  # New: lm_ddp.py's loss, of one microbatch; the schedule calls it on the last stage
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # fp32 softmax over the 256 bytes


def pipeline(model, rank, pp, device, schedule, microbatches):  # New
    """This rank's PipelineStage (point-to-point: activations to rank + 1 and their gradients back from it; the same
    with rank - 1) and the schedule that runs each step's microbatches through it. scale_grads=True: the schedule adds
    up the microbatches' gradients, each of a mean (loss_fn), then divides by their number; the mean of m equal
    pieces' means is the batch's mean, so the result is the one-process full-batch gradient (a loss_fn that sums
    would take scale_grads=False)."""
    stage = PipelineStage(model, rank, pp, device)
    return stage, SCHEDULES[schedule](stage, microbatches, loss_fn=loss_fn, scale_grads=True)


def clip_grad_norm_across_stages(parameters, max_norm):  # New
    """torch.nn.utils.clip_grad_norm_ for a model cut into stages: the norm of the WHOLE gradient (each stage's
    squared norm, summed across the stages by an all-reduce) and one factor for every stage, as torchtitan clips
    under pipelining. Every rank calls it. Returns the global norm."""
    parameters = [p for p in parameters if p.grad is not None]
    squared = torch.nn.utils.get_total_norm([p.grad for p in parameters]) ** 2  # this stage's
    dist.all_reduce(squared)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


# ------------------------------------------------------------------------------------ checkpoints
def load_shards(model, optimizer, path, saves):  # New, as lm_tp.py's
    """Every stage reads its weights and AdamW's state by name from the shards at `path` (any --pp wrote them)."""
    for group in optimizer.param_groups:  # load fills in only the keys asked for: without this one, the scheduler
        group.setdefault("initial_lr", group["lr"])  # would scale the saved step's rate instead of the peak
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)  # this stage's, filled in by load
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise saves.load_failure(exc, path) from exc
    lm.adamw_as_this_torch(optim_state, optimizer)  # its fused/foreach, not the saver's: the load places steps by it
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=FLAT)


def gather_full_weights(model, is_main, world_size):  # New
    """The full weights, every stage's gathered onto rank 0's CPU (a collective: every rank calls it; the others get
    None), stage 0's names first, in order: they load into common.lm.Transformer."""
    parts = [None] * world_size if is_main else None
    dist.gather_object({k: v.cpu() for k, v in model.state_dict().items()}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if is_main else None


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(schedule, stage, inputs, targets, batch, device):  # New: through the pipeline
    """Mean loss per byte over every validation window. New: every window goes through the pipeline, `batch` at a
    time in the schedule's microbatches (the last batch padded to the full size: the stages' buffers have one shape;
    the padding is not scored); the last stage scores the logits as lm_ddp.py does, and its sums are all-reduced (the
    other stages add zeros), so every rank returns the same."""
    stage.submod.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, bytes
    for i in range(0, len(inputs), batch):
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        n = len(x)
        x, y = (torch.cat([t, t.new_zeros(batch - n, t.size(1))]) for t in (x, y))  # padded to `batch` rows
        logits = schedule.eval(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
        if stage.is_last:  # the logits of the whole batch, here only
            total[0] += F.cross_entropy(logits[:n].float().flatten(0, 1), y[:n].flatten(), reduction="sum")
            total[1] += y[:n].numel()
    dist.all_reduce(total)
    stage.submod.train()
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
        device, backend = harness.check_gpu(device, backend, why=P2P_ON_SHARED_GPU)  # New: not launch.sh G:N
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
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"(all of it through every stage: pp={args.pp}, {args.microbatches} microbatches of "  # New
           f"{args.batch_size // args.microbatches}, schedule {args.schedule}) sequences of {args.seq_len} bytes")
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
    # YOUR MODEL goes here, with Stage's parts (tok_emb, pos_emb, blocks, ln_f, head) and no weight tied across stages.
    model = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size)  # New: on the CPU, whole
    model_bytes = harness.state_bytes(model)  # New: the whole model's, before the cut (model.pt's size)
    model = Stage(model, rank, args.pp, amp=args.amp_dtype == "bf16").to(device)  # New: this rank's piece, alone
    print0("pipeline: " + " | ".join(f"stage {s}: block{f' {a}' if b - a == 1 else f's {a}-{b - 1}'}"  # New
                                     for s, (a, b) in enumerate(stage_blocks(args.n_layer, args.pp)))
           + " (the embeddings on the first, the norm and the head on the last)")
    if args.activation_checkpointing:  # New: this stage's blocks
        for name, block in model.blocks.items():  # non-reentrant (checkpoint_wrapper's default): DDP-safe
            model.blocks[name] = checkpoint_wrapper(block)  # state_dict keys stay as without it
        wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.blocks.values())
        print0(f"activation checkpointing: {wrapped} of {len(model.blocks)} blocks recompute their forward in backward "
               "(stage 0's)")  # New
    if args.compile:  # New: this stage's blocks, each in place, before the schedule takes it: its sends stay eager
        for block in model.blocks.values():  # one graph they share; dynamic=False: evaluation's batch, one of its own
            block.compile(dynamic=False)
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    stage, schedule = pipeline(model, rank, args.pp, device, args.schedule, args.microbatches)  # New
    # Weight decay on the matrices (2-D) only: decaying biases, norms' gains or embeddings only hurts (GPT-2, nanoGPT).
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                   **lm.adamw_implementation(dtensor=False))  # fused, or foreach where it leaks
    start_step = 0
    # New: shard folders step_N-RUN: no save overwrites the one latest.pt points at, so a failed save leaves it whole.
    run_tag = [os.urandom(3).hex()]
    dist.broadcast_object_list(run_tag, src=0)  # every rank writes into the same folder
    saves = ShardFolders(args.out_dir, run_tag[0], "step")  # New: OUT_DIR/checkpoint/: shard folders, latest.pt
    latest = saves.latest  # New: the resume point, naming the newest whole shard folder
    # New: --async-save's thread makes its collectives on a group of its own (never among the step's); gloo: it must.
    save_group = dist.new_group(backend="gloo", timeout=timeout) if args.async_save else None
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": model_bytes, "checkpoint": 3 * model_bytes},
                                    shared=True)  # New: every rank writes and loads its stage's shards there: shared
    resume = find_resume(args.resume, latest) if args.resume else None
    if resume:  # New: every stage reads its own part of the shards latest.pt names (any number of stages wrote them)
        flags = {k: getattr(args, k) for k in lm.SAME_ON_RESUME}
        ckpt = load_same_flags(resume, "cpu", flags, require=("shards",))  # one line if not, or other flags
        load_shards(model, optimizer, os.path.join(os.path.dirname(resume), ckpt["shards"]), saves)
        start_step = ckpt["step"]
        print0(f"resume: {resume} at step {start_step}")
    # The rate per step: warm-up, then cosine over --steps; a resumed run takes up the schedule where it stopped.
    scheduler = warmup_cosine(optimizer, 1, args.steps, args.warmup_steps / args.steps, start_step=start_step)
    # ----------------------------------------------------------------------------------- train
    last = min(args.steps, start_step + (args.max_steps or args.steps))  # --max-steps: this run's
    # The loss, the clock (tokens/s, own_ms: each rank's own work), the NaN watch, --profile; the clock starts.
    # New: None: no own_ms (a stage's forward waits for the one before it; --profile shows each stage's time).
    meter = harness.StepMeter(None, device, args.profile, args.out_dir, rank,
                              last_good=latest)  # what a divergence's stop names, once a save has written it
    vote = harness.StopVote(preempt, stop_group)  # SIGUSR1: every rank stops after the same step
    step, stop, train_loss, val_loss = start_step, False, None, None
    while step < last:
        # New: dp_rank 0 of 1: every stage takes the whole batch of (seed, step), the one lm_ddp.py splits; the first
        # stage feeds in the bytes, the last scores the targets.
        x, y = (t.to(device, non_blocking=True)
                for t in lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, 0, 1))
        optimizer.zero_grad(set_to_none=True)  # New: before the step, which adds up its microbatches' gradients
        losses = []  # New: filled in on the last stage, one loss per microbatch
        # New: every microbatch's forward and backward in the schedule's order: activations sent on to the next
        # stage, their gradients back to the one before; the last stage calls loss_fn on each microbatch.
        schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None, losses=losses,
                      return_outputs=False)
        clip_grad_norm_across_stages(model.parameters(), args.clip_grad)  # New: the whole model's norm
        optimizer.step()
        scheduler.step()
        step += 1
        # New: the loss is the last stage's alone, the mean of m equal pieces' means: the batch's mean.
        loss = torch.stack(losses).mean() if stage.is_last else None
        meter.step(step, loss, args.batch_size * args.seq_len)  # tokens (bytes); no host sync
        compiled.step()  # --compile: after the first step, which compiled the blocks, the 'compile:' line
        saves.finish_async(only_if_done=True)  # New: written? latest.pt names it now (each rank at its own step)
        stop = vote.all_reduce_max()  # the vote started a step ago: every rank the same answer at the same step
        evaluating = step % args.eval_every == 0 or step == last
        if evaluating or stop or (args.save_every and step % args.save_every == 0):  # --save-every, SIGUSR1
            meter.all_reduce_and_check(step, model)  # a NaN/inf loss or weight stops the run before any save
            if evaluating:
                # -------------------------------------------------------------------------------- eval
                train_loss = meter.all_reduce_loss()  # New: the last stage's sum and count, onto every rank
                val_loss = evaluate(schedule, stage, val_x, val_y, args.batch_size, device)  # New: the stages
                print0(f"step={step}/{args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                       f"val_bpb={lm.bits_per_byte(val_loss):.4f} lr={scheduler.get_last_lr()[0]:.2e} "
                       f"{meter.fields(last - step)}")
            # -------------------------------------------------------------------------------- save
            # New: every stage writes its own part (DCP), then rank 0 points latest.pt at them: weights, moments, step.
            folder, started = saves.folder(step), time.perf_counter()
            model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)  # the full model's names
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
                full = gather_full_weights(model, is_main, world_size)  # New: a collective
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
        full = gather_full_weights(model, is_main, world_size)
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
        val_loss = evaluate(schedule, stage, val_x, val_y, args.batch_size, device)  # New
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(meter.gather_profile_table())
    # New: state_bytes_per_rank counts each rank's stage (lm_ddp.py holds the whole model everywhere).
    print0(meter.gather_result_line(model, optimizer, recipe="lm_pp", steps=step, start_step=start_step,
                                    train_loss=train_loss, val_loss=val_loss, val_bpb=lm.bits_per_byte(val_loss),
                                    val_windows=len(val_x), pp=args.pp, schedule=args.schedule,
                                    microbatches=args.microbatches, **compile_fields))  # New
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
