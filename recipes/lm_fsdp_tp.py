"""2-D parallelism for the language model: FSDP2 across the --dp dimension, tensor parallel within each --tp group.

    ./launch.sh recipes/lm_fsdp_tp.py 0,1,2,3                                # 4 GPUs: a 2 x 2 mesh (dp x tp)
    ./launch.sh recipes/lm_fsdp_tp.py 0,1,2,3,4,5,6,7 --tp 4 --accum-steps 2 --sequence-parallel
        # 8 GPUs: a 2 x 4 mesh, 2 micro-batches a step, the norms on a quarter of the sequence
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\
        ./launch.sh recipes/lm_fsdp_tp.py 0,1,2,3 --tp 4    # node 0; NODE_RANK=1 on node 1: TP in a node, FSDP2 across
    ./launch.sh recipes/lm_fsdp_tp.py 0,1,3 --tp 1                           # 3 GPUs: FSDP2 alone, a 3 x 1 mesh
    ./launch.sh recipes/lm_fsdp_tp.py cpu:4 --max-steps 100 --resume auto    # a short run; run it again to go on
    ./launch.sh recipes/lm_fsdp_tp.py cpu:2 --tp 1 --resume auto             # ... or go on on another mesh: 2 x 1

What it shows, against lm_tp.py (diff them: the lesson is what a second, data-parallel dimension changes):
- init_device_mesh(device, (dp, tp), ("dp", "tp")): tp is the inner dimension, so a tp group is consecutive ranks,
  one node's (torchrun numbers a node's ranks together). TP's collectives (activations, several per block) stay
  inside a node; FSDP2's cross nodes: a block's weights all-gathered twice a step (before its forward, and again
  before its backward: freed after the forward, fully_shard's default) and its gradients reduce-scattered once; the
  root (embeddings, ln_f, the head) once each (kept for backward). lm_tp.py's plan cuts each layer within a tp
  group, then fully_shard(mesh=mesh["dp"]) on each block, then the root, cuts the slices again across dp. In that
  order: FSDP2 shards what TP left each rank.
- The data: --batch-size is the GLOBAL batch, split across the dp ranks (common.lm.train_batch with the dp rank);
  the ranks of a tp group take the same sequences (TP cuts the model, not the batch). Validation: dp rank r scores
  windows r, r + dp, ... (each window once), a tp group together; the sums are all-reduced across dp.
- Meta-device init: the model is built on the meta device (shapes, no memory), cut and sharded, then each rank
  allocates its own shards (to_empty) and fills them with set_model_state_dict(broadcast_from_rank0): rank 0 builds
  lm_ddp.py's one-process model from --seed on its CPU, once, at start, and broadcasts it a tensor at a time, each
  rank keeping its shard. So every mesh trains the one-process model to the same numbers, and no rank but 0 ever
  holds the whole model (rank 0 does, briefly; a model too big for one host would load a seed checkpoint with DCP).
  Not the model's own init on the shards: on a CPU mesh DTensor's random ops are not sharding-aware, each rank draws
  its shard from its own generator, and with one seed the shards come out as copies of each other.
- --accum-steps K: K micro-batches a step, model.set_requires_gradient_sync(False) on all but the last: one
  reduce-scatter a step, not K. The cost: between micro-steps each rank keeps its gradients UNSHARDED across dp (its
  tp slice: dp times the shard it steps; the embeddings' whole, uncut across tp too), and each micro-step all-gathers
  the weights again (a block: 2K all-gathers and one reduce-scatter a step).
- Gradients: FSDP2 lays each out as its parameter before reduce-scattering it (lm_tp.py's grads_as_params is its
  job here). Without --sequence-parallel the norms, plain tensors until fully_shard, end up on the dp mesh alone,
  the cut layers on (dp, tp): DTensors on two meshes do not meet in one op, so clip_grad_norm_ (which stacks every
  gradient's norm) is done a mesh at a time. Torch warns once per rank where it redistributes over both dimensions
  in two collectives (the norm: one number a step; the weights gathered for model.pt): harmless at these sizes.
- --sequence-parallel, loss_parallel(), the checkpoints and --async-save: as lm_tp.py. The shards (DCP) resume on
  another mesh: --dp, --tp, --sequence-parallel, --accum-steps may change (2 x 2 onto 1 x 2, 4 x 1, 2 x 1); the
  model's shape and global batch may not (3 x 1 cannot split 32). OUT_DIR/model.pt: full weights, one process.
- --compile: each block compiled in place after the TP plan and before fully_shard (torchtitan's order): FSDP2's
  all-gathers and reduce-scatters run eagerly around each compiled block (0 graph breaks).
- Not here: HSDP (FSDP2 within a node, replicated across nodes: fully_shard on a 2-D (replicate, shard) mesh).

One weight on a 2 x 2 mesh: wq.weight (D, D), cut by rows: ColwiseParallel across tp, then FSDP2 across dp
               tp 0                       tp 1
    dp 0   rank 0: rows 0..D/4        rank 1: rows D/2..3D/4      a row of the mesh: a tp group. The same batch;
    dp 1   rank 2: rows D/4..D/2      rank 3: rows 3D/4..D        TP's all-reduces (SP: reduce-scatters and
           ---------------------      ---------------------       all-gathers) on the activations, every block
           tp slice 0: rows 0..D/2    tp slice 1: rows D/2..D
    a column: a dp group. FSDP2 all-gathers a block's tp slices before its forward and its backward, frees them
    after, and reduce-scatters their gradients (the mean over the dp ranks' batches) onto the shards.
    Placements (_StridedShard(0, split_factor=2), Shard(0)): dp cuts each tp slice, not the whole weight. The norms
    without --sequence-parallel (plain until fully_shard): cut across dp only, ranks 0 and 1 holding the same half.
Plumbing, not the lesson: `harness.` lines, `meter`, `vote` and `saves`, as in lm_tp.py. Changes to lm_tp.py: `# New:`.
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
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,  # New
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard  # New
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
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

SAME_ON_RESUME = lm.SAME_ON_RESUME  # New: not --dp, --tp, --sequence-parallel or --accum-steps: DCP reshards


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_flags(p, "lm_fsdp_tp", sharded=True)  # sharded: OUT_DIR/checkpoint/, DCP shards and latest.pt
    p.add_argument("--batch-size", type=int, help="GLOBAL batch in sequences, split across the --dp ranks (default: "
                   "32; 30 on --dp 3)")  # New
    p.add_argument("--dp", type=int, help="FSDP2 degree: tp groups (default: the processes / --tp)")  # New
    p.add_argument("--tp", type=int, help="tensor-parallel degree: processes per tp group, consecutive ranks "
                   "(default: 2 where the processes are even, else 1; or the processes / --dp)")  # New
    p.add_argument("--sequence-parallel", action="store_true",
                   help="cut the activations between the cut layers along the sequence too (--seq-len / --tp each)")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per step: one reduce-scatter per step "
                   "(FSDP2's set_requires_gradient_sync), unsharded gradients kept between them")  # New
    return p.parse_args(argv)


def check_args(args, world_size):
    harness.check_flags(argparse.Namespace(**{**vars(args), "batch_size": None}))  # New: the batch against --dp below
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 20
    if args.tp is None:  # New: TP in pairs where the processes pair up (or what --dp leaves), the rest is dp
        args.tp = world_size // args.dp if args.dp else 2 if world_size % 2 == 0 else 1
    if args.dp is None:  # New
        args.dp = world_size // args.tp if args.tp > 0 else 0
    if args.dp < 1 or args.tp < 1 or args.dp * args.tp != world_size:  # New: one mesh holds every process
        harness.die(f"--dp {args.dp} x --tp {args.tp} must equal the number of processes, {world_size} (give one "
                    "and the other is the quotient): FSDP2 across --dp, tensor parallel within each group of --tp")
    parts = args.dp * args.accum_steps  # New: each dp rank's share of the batch, in --accum-steps micro-batches
    if args.batch_size is None:  # New: the default, rounded down so that it divides: 30 on --dp 3
        args.batch_size = max(1, 32 // parts) * parts
    elif args.batch_size < parts or args.batch_size % parts:  # New
        harness.die(f"--batch-size {args.batch_size} is the GLOBAL batch and must be a multiple of --dp {args.dp}"
                    + (f" x --accum-steps {args.accum_steps}" if args.accum_steps > 1 else "")
                    + f" (the data-parallel ranks' micro-batches); try --batch-size "
                    f"{max(1, args.batch_size // parts) * parts}")
    try:
        lm.check_model_flags(args.n_layer, args.n_head, args.d_model, args.seq_len, args.block_size,
                             parallel=args.tp, parallel_flag="--tp")
    except ValueError as exc:
        harness.die(str(exc))
    if args.sequence_parallel and args.seq_len % args.tp:
        harness.die(f"--sequence-parallel cuts each sequence into --tp {args.tp} equal pieces: --seq-len "
                    f"{args.seq_len} must be a multiple of {args.tp}")


# ------------------------------------------------------------------------------------------ model
def tp_plan(sequence_parallel):
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


def clip_grad_norm_across_meshes(model, max_norm):  # New
    """clip_grad_norm_ for parameters on two meshes (DTensors on different meshes do not meet in one op:
    clip_grad_norm_ raises): without --sequence-parallel the norms, plain tensors until fully_shard, are sharded on
    the dp mesh alone, the cut layers on (dp, tp). The norm of each mesh's gradients, over all their shards (a
    collective), then the norm of those: the global norm, by which every gradient is scaled."""
    on_mesh = {}
    for p in model.parameters():
        on_mesh.setdefault(p.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in on_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in on_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


# ------------------------------------------------------------------------------------ checkpoints
def load_shards(model, optimizer, path, saves):
    """Every rank reads its part of the sharded checkpoint at `path`, however many ranks wrote it (DCP reshards)."""
    # New: no implicit_replication (lm_tp.py's): fully_shard made every parameter a DTensor, the norms too.
    model_state, optim_state = get_state_dict(model, optimizer)  # this world's layout, filled in by load
    for group in optim_state["param_groups"]:  # load fills in only the keys given: without this one, the scheduler
        group.setdefault("initial_lr", group["lr"])  # would scale the saved step's rate instead of the peak
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise saves.load_failure(exc, path) from exc
    lm.adamw_as_this_torch(optim_state, optimizer)  # its fused/foreach, not the saver's: the load places steps by it
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, inputs, targets, dp_rank, dp, dp_group, batch, device, amp):
    """Mean loss per byte over every validation window. New: dp rank r scores windows r, r + dp, ... (a tp group
    together); the sums are all-reduced across dp. Every rank runs as many forwards (each all-gathers a block's
    shards across dp): a rank whose windows ran out runs window 0 again, unscored."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, bytes
    mine_x, mine_y = inputs[dp_rank::dp], targets[dp_rank::dp]  # New
    for i in range(0, len(inputs[::dp]), batch):  # New: dp rank 0's count of windows, the most any rank has
        x, y = mine_x[i:i + batch].to(device), mine_y[i:i + batch].to(device)  # New
        scored = len(x) > 0  # New: out of windows (its whole tp group alike): a forward all the same, not scored
        x, y = (x, y) if scored else (inputs[:1].to(device), targets[:1].to(device))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        if scored:
            with loss_parallel():  # from the logits cut by bytes, as in training (all-reduces in the tp group)
                total[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").to_local()
            total[1] += y.numel()
    dist.all_reduce(total, group=dp_group)  # New: a tp group's ranks hold the same sums: across dp only
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
        device, backend = harness.check_gpu(device, backend, dtensor=True)  # dtensor: not launch.sh G:N
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
    # New: rank r at (r // tp, r % tp): a row is a tp group (consecutive ranks), a column a dp group.
    mesh = init_device_mesh(device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()  # New: which share of the batch this rank's tp group takes
    per_dp = args.batch_size // args.dp  # New
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({per_dp} per dp rank x {args.dp}, in micro-batches of {per_dp // args.accum_steps}; the same on each "
           f"rank of a tp group) sequences of {args.seq_len} bytes, sequence_parallel={args.sequence_parallel}")  # New
    print0(f"mesh: dp={args.dp} x tp={args.tp} {mesh.mesh.tolist()}: rank 0 cuts each layer with ranks "
           f"{mesh['tp'].mesh.tolist()} (tensor parallel) and shards its slices with ranks {mesh['dp'].mesh.tolist()} "
           "(FSDP2)")  # New
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
    # New: rank 0 alone builds the one-process model lm_ddp.py starts from (--seed, on its CPU), once: the weights
    # every rank loads below. The other ranks never hold the whole model.
    torch.manual_seed(args.seed)
    full = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size).state_dict() if is_main else {}
    # YOUR MODEL goes here: an nn.Module from tokens (B, T) to logits (B, T, vocab), whose plan names its layers.
    with torch.device("meta"):  # New: shapes only: no memory, and its init draws nothing
        model = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size)
    # New: each rank's slices of the meta model (nothing to scatter), its tp group's plan
    model = parallelize_module(model, mesh["tp"], tp_plan(args.sequence_parallel), src_data_rank=None)
    if args.activation_checkpointing:  # after parallelize_module, whose plan names the unwrapped modules
        for name, block in model.blocks.items():  # non-reentrant (checkpoint_wrapper's default)
            model.blocks[name] = checkpoint_wrapper(block)  # state_dict keys stay as without it
        wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.blocks.values())
        print0(f"activation checkpointing: {wrapped} of {len(model.blocks)} blocks recompute their forward in backward")
    if args.compile:  # New: each block in place, after the plan, before fully_shard (torchtitan's order): FSDP2 eager
        for block in model.blocks.values():  # one graph they share; dynamic=False: evaluation's batch, one of its own
            block.compile(dynamic=False)
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    # New: FSDP2 across dp, on each block (two all-gathers and one reduce-scatter a step), then the root.
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device=device)  # New: each rank allocates its own shards (not initialized)
    # New: rank 0's full tensors broadcast one at a time; each rank copies its shard of each into its own.
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    # Weight decay on the matrices (2-D) only: decaying biases, norms' gains or embeddings only hurts (GPT-2, nanoGPT).
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                                   **lm.adamw_implementation(dtensor=True))  # fused, or foreach where it leaks
    start_step = 0
    # Shard folders step_N-RUN: no save overwrites the one latest.pt points at, so a failed save leaves it whole.
    run_tag = [os.urandom(3).hex()]
    dist.broadcast_object_list(run_tag, src=0)  # every rank writes into the same folder
    saves = ShardFolders(args.out_dir, run_tag[0], "step")  # OUT_DIR/checkpoint/: shard folders, latest.pt
    latest = saves.latest  # the resume point, naming the newest whole shard folder
    # --async-save's thread makes its collectives on a group of its own (never among the step's); gloo: it must.
    save_group = dist.new_group(backend="gloo", timeout=timeout) if args.async_save else None
    # every slice counted (a DTensor's global size); shared, and before the resume (else dcp.load may hang)
    harness.broadcast_out_dir_check(args.out_dir, is_main, {"model.pt": harness.state_bytes(model),
                                                            "checkpoint": 3 * harness.state_bytes(model)}, shared=True)
    resume = find_resume(args.resume, latest) if args.resume else None
    if resume:  # every rank reads its own slices of the shards latest.pt names (any mesh wrote them)
        flags = {k: getattr(args, k) for k in lm.SAME_ON_RESUME}
        ckpt = load_same_flags(resume, "cpu", flags, require=("shards",))  # one line if not, or other flags
        load_shards(model, optimizer, os.path.join(os.path.dirname(resume), ckpt["shards"]), saves)
        start_step = ckpt["step"]
        print0(f"resume: {resume} at step {start_step} (saved on a {ckpt.get('mesh', '?')} mesh, now "
               f"{args.dp} x {args.tp})")  # New
    # The rate per step: warm-up, then cosine over --steps; a resumed run takes up the schedule where it stopped.
    scheduler = warmup_cosine(optimizer, 1, args.steps, args.warmup_steps / args.steps, start_step=start_step)
    amp = args.amp_dtype == "bf16"
    # ----------------------------------------------------------------------------------- train
    last = min(args.steps, start_step + (args.max_steps or args.steps))  # --max-steps: this run's
    # The loss, the clock (tokens/s, own_ms: each rank's own work), the NaN watch, --profile; the clock starts.
    meter = harness.StepMeter(model, device, args.profile, args.out_dir, rank,  # own_ms: the data wait (forward: FSDP2)
                              last_good=latest)  # what a divergence's stop names, once a save has written it
    vote = harness.StopVote(preempt, stop_group)  # SIGUSR1: every rank stops after the same step
    step, stop, train_loss, val_loss = start_step, False, None, None
    while step < last:
        # New: this dp rank's share of the batch (its tp group's ranks take the same), in --accum-steps micro-batches.
        xs, ys = (t.to(device, non_blocking=True).chunk(args.accum_steps)
                  for t in lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, dp_rank, args.dp))
        optimizer.zero_grad(set_to_none=True)  # New: once a step, before the micro-batches
        loss = 0.0  # New
        for micro, (x, y) in enumerate(zip(xs, ys, strict=True)):  # New
            # New: reduce-scatter on the last micro-step only; before it each rank sums its unsharded gradients.
            model.set_requires_gradient_sync(micro == args.accum_steps - 1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(x)  # a DTensor (B, T, 256) cut by bytes: each rank holds (B, T, 256 / tp) of it
            with loss_parallel():  # around the loss and its backward: the softmax's max and sum all-reduced
                micro_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / args.accum_steps  # New
                micro_loss.backward()  # New: TP's collectives; on the last micro-step FSDP2's reduce-scatters too
            loss = loss + micro_loss.detach().to_local()  # New: the step's mean over its micro-batches
        # New: no grads_as_params (lm_tp.py's): FSDP2 laid each gradient out as its parameter before reduce-scattering.
        clip_grad_norm_across_meshes(model, args.clip_grad)  # New: the global norm, over every shard on both meshes
        optimizer.step()
        scheduler.step()
        step += 1
        meter.step(step, loss, args.batch_size * args.seq_len)  # tokens (bytes); no host sync
        compiled.step()  # --compile: after the first step, which compiled the blocks, the 'compile:' line
        saves.finish_async(only_if_done=True)  # written? latest.pt names it now (each rank at its own step)
        stop = vote.all_reduce_max()  # the vote started a step ago: every rank the same answer at the same step
        evaluating = step % args.eval_every == 0 or step == last
        if evaluating or stop or (args.save_every and step % args.save_every == 0):  # --save-every, SIGUSR1
            meter.all_reduce_and_check(step, model)  # a NaN/inf loss or weight stops the run before any save
            if evaluating:
                # -------------------------------------------------------------------------------- eval
                train_loss = meter.all_reduce_loss()  # the mean since the last eval; the clock stops
                val_loss = evaluate(model, val_x, val_y, dp_rank, args.dp, mesh.get_group("dp"),  # New: in
                                    per_dp // args.accum_steps, device, amp)  # training's micro-batches (memory)
                print0(f"step={step}/{args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                       f"val_bpb={lm.bits_per_byte(val_loss):.4f} lr={scheduler.get_last_lr()[0]:.2e} "
                       f"{meter.fields(last - step)}")
            # -------------------------------------------------------------------------------- save
            # Every rank writes its slices (DCP), then rank 0 points latest.pt at them: weights, moments, step.
            folder, started = saves.folder(step), time.perf_counter()
            model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's own slices
            pointer = {"shards": os.path.basename(folder), "step": step, "epoch": 0, "mesh": f"{args.dp} x {args.tp}",
                       "flags": {k: getattr(args, k) for k in lm.SAME_ON_RESUME}}  # New: the mesh it was saved on
            if args.async_save:  # one save in flight, as fsdp.py: the last one ends and latest.pt names it first
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
                # The full weights, gathered slice by slice onto rank 0's CPU (a collective; the others get {}).
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if is_main:  # dcp.save returned on every rank: all shards are written. Now point latest.pt at them.
                    saves.point_latest(pointer)
                    save_atomic(full, os.path.join(args.out_dir, "model.pt"))  # loads into Transformer(...)
                    print0(f"saved: {latest} and model.pt at step {step}; training waited "
                           f"{time.perf_counter() - started:.3f} s")
            meter.start()  # the clock again, after an evaluation stopped it
            if stop:  # saved; every rank leaves the loop at this step
                break
    meter.stop()  # the clock; --profile writes its trace
    vote.wait()  # the last vote; every rank started as many
    saves.finish_async()  # the last save in flight ends (and latest.pt names it) before the job does
    if args.async_save:  # the full weights once, at the end or a stop (gathered at every save: a wait for all)
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
        val_loss = evaluate(model, val_x, val_y, dp_rank, args.dp, mesh.get_group("dp"), per_dp // args.accum_steps,
                            device, amp)
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(meter.gather_profile_table())
    # New: state_bytes_per_rank counts each rank's shards: 1 / (dp x tp) of the cut layers, 1 / dp of the norms.
    print0(meter.gather_result_line(model, optimizer, recipe="lm_fsdp_tp", steps=step, start_step=start_step,
                                    train_loss=train_loss, val_loss=val_loss, val_bpb=lm.bits_per_byte(val_loss),
                                    val_windows=len(val_x), dp=args.dp, tp=args.tp,
                                    sequence_parallel=args.sequence_parallel, accum_steps=args.accum_steps,
                                    **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
