"""Mixture of experts with expert parallelism: each rank holds some of the experts; tokens travel to them and back.

    ./launch.sh recipes/lm_moe.py 0,1                                    # 2 GPUs: 4 of the 8 experts each (--ep 2)
    ./launch.sh recipes/lm_moe.py 0,1,2,3 --dp 2 --ep 2                  # 2 x 2: each expert on 2 ranks
    ./launch.sh recipes/lm_moe.py 0,1,3 --experts 6                      # 3 GPUs: 2 of 6 experts each (--ep 3)
    ./launch.sh recipes/lm_moe.py 0,1,3                                  # 3 GPUs, 8 experts: --ep 1 (all 8 on each)
    ./launch.sh recipes/lm_moe.py cpu:2                                  # 2 CPU processes (gloo): minutes
    ./launch.sh recipes/lm_moe.py cpu:2 --max-steps 100 --resume auto    # a short run; run it again (any --ep) to go on

What it shows, against lm_ddp.py (diff them: the lesson is what experts, a router and the all-to-all change):
- The model: lm_ddp.py's transformer with each block's MLP replaced by --experts MLPs (of --expert-width units, by
  default 4 x --d-model / --top-k: lm_ddp's active parameters per token) and a router (fp32 logits under bf16
  autocast too; on a GPU its matmul is TF32): a softmax gate, each token's --top-k experts, their gates renormalised
  over the k (k > 1). Dropless (no capacity, no token dropped): every layout computes the one-process model.
- The balance loss (Switch Transformer, GShard): --aux-loss-weight x E x sum_e f_e P_e, the layers' mean (Switch
  weighs each layer's: x --n-layer to match), f_e the share of the global batch's routed rows that expert e got
  (counts all-reduced over every rank), P_e its mean gate probability; 1.0 when balanced. --z-loss-weight: ST-MoE's
  router z-loss (logsumexp of the router's logits, squared), the layers' mean too.
- Expert parallelism (--ep N): rank j of an ep group holds experts j E/N .. (j+1) E/N - 1. Per MoE layer a step:
  route; exchange the per-expert counts (all_to_all_single); send each token to its expert's rank and the outputs
  back (all_to_all_single with uneven splits, AllToAll: its backward is the same exchange the other way); the
  experts run only what arrived, grouped by expert; the outputs combined by the gates. The rest of the model is data
  parallel over all ranks: every rank takes its own slice of the batch (B / world) on a --dp x --ep mesh.
- Gradients, two groups: the dense parameters' all-reduced over every rank; an expert's only over the --dp ranks
  that hold it (never across other experts), both divided by the world size (each rank's expert gradient already
  sums every ep rank's tokens). The clip's norm adds the other ranks' experts (an all-reduce over the ep group).
- Checkpoints as lm_pp.py's (DCP, every parameter under the one-process model's name, experts by their global
  index): --resume on any --ep and --dp. OUT_DIR/model.pt: every expert gathered on rank 0.
- While it trains, after each eval line: the worst layer's most and fewest rows an expert got, the balance loss, and
  the bytes rank 0's AllToAlls sent other ranks a step (the rows, forward and backward; not the counts' exchange).

One MoE layer, 8 experts on --ep 2, top-2 (rank 0 holds experts 0-3, rank 1 experts 4-7)
                rank 0                                   rank 1
    route       its S tokens: top-2 of 8 gates           its S tokens
    counts      -- all_to_all_single: how many rows each rank sends to each expert --
    dispatch    rows for 0-3 stay, rows for 4-7 go   ->  <- rows for 0-3 come           all_to_all_single
    experts     0, 1, 2, 3 on the rows that arrived      4, 5, 6, 7 (grouped by expert)
    combine     outputs go back where each row came from (the same exchange, splits swapped); gate-weighted sum
  Backward: the same two exchanges in reverse order. Dense gradients: all-reduce over all ranks; experts 0-3's over
  the ranks that hold 0-3 (with --dp 2: ranks 0 and 2 on a 2 x 2 mesh).
Plumbing, not the lesson: `harness.` lines and the two harness objects `meter` (the loss, the clock, the NaN watch,
--profile) and `vote` (SIGUSR1's stop vote); common/harness.py. The siblings of lm_ddp.py mark theirs `# New:`.
What each rank computes, holds and sends, each claim with the test that measures it: docs/lm.md.
"""
# launcher: torchrun

import argparse
import datetime
import math
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
from torch.distributed.device_mesh import init_device_mesh  # New

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common import harness, lm  # not the lesson: harness. lines are plumbing, lm. lines the workload (text, model)
from common.checkpoint import EX_TEMPFAIL, ShardFolders, SignalFlag, find_resume, load_same_flags, save_atomic
from common.schedule import warmup_cosine
from common.utils import print0

# New: what a resumed run must share with the one that saved: the family's, and the experts' (not --ep nor --dp).
SAME_ON_RESUME = (*lm.SAME_ON_RESUME, "experts", "top_k", "expert_width", "aux_loss_weight", "z_loss_weight")
# New: AdamW's state keyed by parameter name (an expert's global one), not by index: rank 1's first expert is index
# 0 of its optimizer too, so indexed states would collide in one checkpoint and misplace on another --ep.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ------------------------------------------------------------------------------------------- args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_flags(p, "lm_moe", sharded=True)  # New: sharded: OUT_DIR/checkpoint/, DCP shards and latest.pt
    p.add_argument("--batch-size", type=int, help="GLOBAL batch in sequences, split across processes (default: 32; 30 "
                   "on 3)")
    p.add_argument("--experts", type=int, default=8, help="experts in each block's MLP (E)")  # New
    p.add_argument("--top-k", type=int, default=2, help="experts each token goes to (k)")  # New
    p.add_argument("--expert-width", type=int, help="each expert's hidden units (default: 4 x --d-model / --top-k: "
                   "lm_ddp's active parameters per token)")  # New
    p.add_argument("--aux-loss-weight", type=float, default=0.01, help="balance loss weight (layers' mean)")  # New
    p.add_argument("--z-loss-weight", type=float, default=0.0, help="router z-loss weight (layers' mean)")  # New
    p.add_argument("--ep", type=int, help="expert-parallel degree: ranks that split each layer's experts (default: "
                   "the largest that divides --experts and one node's process count)")  # New
    p.add_argument("--dp", type=int, help="replicas of each expert: processes / --ep (the default)")  # New
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
    if args.experts < 1:  # New
        harness.die(f"--experts {args.experts} must be >= 1: the MLPs that replace each block's one")
    if not 1 <= args.top_k <= args.experts:  # New
        harness.die(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}: each token goes to k "
                    "distinct experts")
    if args.expert_width is not None and args.expert_width < 1:  # New
        harness.die(f"--expert-width {args.expert_width} must be >= 1: each expert's hidden units")
    args.expert_width = args.expert_width or max(1, 4 * args.d_model // args.top_k)  # New
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]  # New: the --ep and --dp a job can take
    for flag, value in (("ep", args.ep), ("dp", args.dp)):  # New: each one given, on its own
        if value is not None and value not in divisors:
            harness.die(f"--{flag} {value} must divide the number of processes, {world_size}: try "
                        + " or ".join(", ".join(map(str, divisors)).rsplit(", ", 1)))
    ep_given, dp_given = args.ep is not None, args.dp is not None  # New
    if not ep_given:  # New: from --dp, else the most expert parallelism the experts and one node's processes allow
        node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # (the all-to-alls then stay within a node)
        args.ep = world_size // args.dp if dp_given else math.gcd(args.experts, node, world_size)
    args.dp = args.dp if dp_given else world_size // args.ep  # New
    if args.ep * args.dp != world_size:  # New: both given
        harness.die(f"--dp {args.dp} x --ep {args.ep} is {args.dp * args.ep} processes, not {world_size}: give --ep "
                    "alone (--dp is then processes / --ep)")
    if args.experts % args.ep:  # New: whole experts per rank (the default --ep divides them)
        ep = math.gcd(args.experts, world_size)  # divides both: a layout of whole experts
        harness.die(f"--ep {args.ep}{'' if ep_given else ' (processes / --dp)'} must divide --experts {args.experts}: "
                    f"each rank holds --experts / --ep whole experts; try {f'--dp {world_size // ep} ' * dp_given}"
                    f"--ep {ep}")


# ------------------------------------------------------------------------------------------ model
class AllToAll(torch.autograd.Function):  # New
    """dist.all_to_all_single with uneven splits, differentiable: send[i] rows go to rank i of the group, receive[i]
    come from it. Backward: each row's gradient goes back to the rank it came from (the same call, splits swapped)."""

    sent_bytes = 0  # what this rank sent to the other ranks, forward and backward (the experts' line)

    @staticmethod
    def forward(ctx, rows, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        arrived = rows.new_empty(sum(receive), rows.size(1))
        dist.all_to_all_single(arrived, rows.contiguous(), receive, send, group=group)
        if ctx.needs_input_grad[0]:  # training (evaluation's exchanges are not counted)
            AllToAll.sent_bytes += (sum(send) - send[dist.get_rank(group)]) * rows.size(1) * rows.element_size()
        return arrived

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), grad.size(1))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        AllToAll.sent_bytes += (sum(ctx.receive) - ctx.receive[dist.get_rank(ctx.group)]) * grad.size(1) * \
            grad.element_size()
        return back, None, None, None


class MoE(nn.Module):  # New
    """A block's MLP as E experts (common.lm.MLP each) and a router. forward((B, T, D)) -> (B, T, D): each token's
    output is its k experts' outputs weighted by their gates. Holds all E experts until keep_experts(); after it, its
    share, and the forward exchanges rows with the other ranks of the ep group. A training forward keeps its routing
    in .routed: (rows sent to each expert, the mean gate probability of each, the z-loss), for the balance loss."""

    def __init__(self, d_model, experts, top_k, hidden):
        super().__init__()
        self.n_experts, self.top_k = experts, top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleDict({str(e): lm.MLP(d_model, hidden) for e in range(experts)})  # global names
        self.first, self.ep, self.group, self.routed = 0, 1, None, None

    def keep_experts(self, ep_rank, ep, group):
        """Rank ep_rank of the ep group keeps experts ep_rank E/ep .. (ep_rank + 1) E/ep - 1; the others are freed."""
        share = self.n_experts // ep
        self.first, self.ep, self.group = ep_rank * share, ep, group
        for e in range(self.n_experts):
            if not self.first <= e < self.first + share:
                del self.experts[str(e)]

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        with torch.autocast(x.device.type, enabled=False):  # fp32 logits under --amp-dtype bf16 too (Switch's selective
            logits = self.router(x.float())  # precision: bf16 logits would tie and flip experts; a GPU's matmul: TF32)
        probs = logits.softmax(-1)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (S, k): each token's k experts
        if self.top_k > 1:  # renormalised over the k (k = 1: the probability itself, Switch's: 1.0 has no gradient)
            gates = gates / gates.sum(-1, keepdim=True)
        # Every (token, choice) pair sorted by expert (stable: tokens in order): one block of rows per destination rank.
        order = chosen.flatten().argsort(stable=True)
        # rows for each expert, from this rank: where each one's run starts in that order (bincount: 2 host reads, GPU)
        counts = torch.searchsorted(chosen.flatten()[order], torch.arange(self.n_experts + 1, device=x.device)).diff()
        rows = x[order // self.top_k]
        if torch.is_autocast_enabled(x.device.type):  # bf16 rows: the expert's first layer casts them so anyway
            rows = rows.to(torch.get_autocast_dtype(x.device.type))  # half the bytes through the all-to-alls
        arriving = counts  # one rank holds every expert: nothing to exchange
        if self.ep > 1:  # the counts first: how many rows each rank of the group sends to each of this rank's experts
            arriving = torch.empty_like(counts)
            dist.all_to_all_single(arriving, counts, group=self.group)
        sending, arriving_ = torch.stack([counts, arriving]).view(2, self.ep, -1).tolist()  # the one host read
        send, receive = [sum(c) for c in sending], [sum(c) for c in arriving_]  # rows to and from each ep rank
        if self.ep > 1:  # each row to its expert's rank; arrive in (source rank, expert) order
            rows = AllToAll.apply(rows, send, receive, self.group)
        # Grouped by this rank's experts (sources in rank order within each): one matrix product per expert.
        per_expert = [sum(source[e] for source in arriving_) for e in range(self.n_experts // self.ep)]
        chunk = torch.arange(arriving.numel(), device=x.device).repeat_interleave(arriving, output_size=sum(receive))
        by_expert = (chunk % len(per_expert)).argsort(stable=True)
        pieces = rows[by_expert].split(per_expert)
        out = torch.cat([self.experts[str(self.first + e)](piece) for e, piece in enumerate(pieces)])
        out = out[by_expert.argsort()]  # back in arrival order
        if self.ep > 1:  # each output back to the rank its row came from
            out = AllToAll.apply(out, receive, send, self.group)
        out = out[order.argsort()].view(B * T, self.top_k, D)  # back in (token, choice) order
        if torch.is_grad_enabled():  # training: the routing, for the balance loss
            self.routed = (counts, probs.mean(0), torch.logsumexp(logits, -1).square().mean())
        return (out * gates.unsqueeze(-1)).sum(1).view(B, T, D)


def balance_loss(model, experts):  # New
    """Switch Transformer's load-balancing loss over the global batch, averaged over the layers: E sum_e f_e P_e,
    f_e the share of every rank's routed rows that went to expert e (the counts all-reduced: a collective), P_e the
    mean gate probability (this rank's tokens: averaged over ranks by the gradient's all-reduce). Returns (the loss,
    the router z-loss, the rows each expert got (L, E))."""
    routed = [block.mlp.routed for block in model.blocks.values()]
    load = torch.stack([counts for counts, _, _ in routed])  # int64: exact (float32's counts round past 2^24)
    dist.all_reduce(load)  # every rank's rows per expert: the global batch's balance
    share = load / load.sum(-1, keepdim=True)
    aux = experts * (share * torch.stack([p for _, p, _ in routed])).sum(-1).mean()
    return aux, torch.stack([z for _, _, z in routed]).mean(), load


def all_reduce_gradients(params, group, world_size):  # New
    """One all-reduce of these parameters' gradients (flattened into one buffer) over `group`, divided by the world
    size: each rank's gradient is of its own mean loss."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world_size
    for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def clip_grad_norm_across_experts(dense, experts, max_norm, ep_group):  # New
    """Clip by the whole model's gradient norm: the dense part (the same on every rank) and every expert's, this
    rank's squares summed with the ep group's other experts (an all-reduce of one float)."""
    expert_sq = torch.stack([p.grad.float().square().sum() for p in experts]).sum()
    dist.all_reduce(expert_sq, group=ep_group)
    norm = (torch.stack([p.grad.float().square().sum() for p in dense]).sum() + expert_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(dense + experts, max_norm, norm)
    return norm


# ------------------------------------------------------------------------------------ checkpoints
def load_shards(model, optimizer, path, saves):  # New, as lm_pp.py's
    """Every rank reads the dense weights and its experts (and AdamW's state) by name from the shards at `path`."""
    for group in optimizer.param_groups:  # load fills in only the keys asked for: without this one, the scheduler
        group.setdefault("initial_lr", group["lr"])  # would scale the saved step's rate instead of the peak
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)  # this rank's, filled in by load
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    except dcp.CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise saves.load_failure(exc, path) from exc
    lm.adamw_as_this_torch(optim_state, optimizer)  # its fused/foreach, not the saver's: the load places steps by it
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=FLAT)


def gather_full_weights(model, rank, ep):  # New
    """The full weights onto rank 0's CPU (the others get None): its own state, then from ranks 1 .. ep - 1 their
    experts, one rank at a time (on NCCL each passes through rank 0's GPU alone; a gather_object would stage every
    rank's there, padded to rank 0's whole state). Every other rank holds copies of those and takes no part."""
    full = {k: v.cpu() for k, v in model.state_dict().items() if rank == 0 or (rank < ep and ".experts." in k)}
    if rank == 0:
        for source in range(1, ep):
            received = [None]
            dist.recv_object_list(received, src=source)
            full.update(received[0])
    elif rank < ep:
        dist.send_object_list([full], dst=0)
    return full if rank == 0 else None


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, inputs, targets, rank, world_size, batch, device, amp):
    """Mean loss per byte over every validation window: rank r scores windows r, r + N, ...; sums all-reduced.
    New: every rank runs as many batches: an ep group's forwards exchange rows, so they must pair up."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, bytes
    mine_x, mine_y = inputs[rank::world_size], targets[rank::world_size]
    for i in range(0, -(-len(inputs) // world_size), batch):  # New: the most windows a rank has
        x, y = mine_x[i:i + batch].to(device), mine_y[i:i + batch].to(device)
        scored = len(x) > 0  # New: this rank's windows ran out: window 0's forward all the same, not scored
        x, y = (x, y) if scored else (inputs[:1].to(device), targets[:1].to(device))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        if scored:
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
    # New: dp x ep; an ep group (a row: consecutive ranks, one node's) splits the experts, a dp group (a column)
    # holds the same ones.
    mesh = init_device_mesh(device.type, (args.dp, args.ep), mesh_dim_names=("dp", "ep"))
    ep_group, dp_group, ep_rank = mesh.get_group("ep"), mesh.get_group("dp"), mesh.get_local_rank("ep")
    batch_per_process = args.batch_size // world_size
    print0(f"setup: world_size={world_size} backend={backend} device={device.type} global_batch={args.batch_size} "
           f"({batch_per_process} per process x {world_size}) sequences of {args.seq_len} bytes; dp={args.dp} x "
           f"ep={args.ep}: {args.experts // args.ep} of {args.experts} experts a rank, top-{args.top_k}")  # New
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
    # YOUR MODEL goes here: an nn.Module from tokens (B, T) to logits (B, T, vocab). New: MoE MLPs, every expert.
    model = lm.Transformer(args.n_layer, args.n_head, args.d_model, args.block_size,
                           mlp=lambda: MoE(args.d_model, args.experts, args.top_k, args.expert_width))  # New: CPU
    model_bytes = harness.state_bytes(model)  # New: the whole model's, before the cut (model.pt's size)
    for block in model.blocks.values():  # New: this rank's share of each layer's experts; the rest freed
        block.mlp.keep_experts(ep_rank, args.ep, ep_group)
    model.to(device)  # New: after the cut: no GPU holds every expert (host memory does, once, for the initial weights)
    if args.activation_checkpointing:  # before DDP: each block's forward runs again in backward, nothing kept inside
        for name, block in model.blocks.items():  # non-reentrant (checkpoint_wrapper's default): DDP-safe
            model.blocks[name] = checkpoint_wrapper(block)  # state_dict keys stay as without it
        wrapped = sum(isinstance(b, CheckpointWrapper) for b in model.blocks.values())
        print0(f"activation checkpointing: {wrapped} of {len(model.blocks)} blocks recompute their forward in backward")
    if args.compile:  # New: each block's attention in place; the MoE layer stays eager (its row counts are data)
        for block in model.blocks.values():  # one graph they share; dynamic=False: evaluation's batch, one of its own
            block.attn.compile(dynamic=False)
    compiled = harness.CompileCounts(args.compile, device)  # its toolchain; graphs, breaks, recompiles; a clock
    # New: no DDP: two gradient groups, reduced by hand after backward (all_reduce_gradients).
    experts = [p for n, p in model.named_parameters() if ".experts." in n]  # this rank's: their dp group's
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]  # every rank's
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
                                    shared=True)  # New: every rank writes and loads its shards there: shared
    resume = find_resume(args.resume, latest) if args.resume else None
    if resume:  # New: every rank reads the dense weights and its experts (any --ep wrote them)
        flags = {k: getattr(args, k) for k in SAME_ON_RESUME}
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
    meter = harness.StepMeter(model, device, args.profile, args.out_dir, rank,  # New: the data wait alone
                              last_good=latest)  # what a divergence's stop names, once a save has written it
    vote = harness.StopVote(preempt, stop_group)  # SIGUSR1: every rank stops after the same step
    step, stop, train_loss, val_loss = start_step, False, None, None
    # New: since the last eval line: the rows each expert got, the balance loss summed, steps; all-to-all bytes sent.
    load, aux_sum, since, sent_bytes = 0, torch.zeros((), device=device), 0, 0
    while step < last:
        # The same (seed, step) on every rank: rank r takes the r-th slice of one global batch.
        x, y = (t.to(device, non_blocking=True)
                for t in lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, rank, world_size))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # fp32 softmax over the 256 bytes
        aux, z_loss, step_load = balance_loss(model, args.experts)  # New: all-reduces the rows per expert
        optimizer.zero_grad(set_to_none=True)
        (loss + args.aux_loss_weight * aux + args.z_loss_weight * z_loss).backward()  # New: the all-to-alls' too
        all_reduce_gradients(dense, None, world_size)  # New: the dense gradients over every rank
        all_reduce_gradients(experts, dp_group, world_size)  # New: each expert's over the ranks that hold it
        clip_grad_norm_across_experts(dense, experts, args.clip_grad, ep_group)  # New: the whole model's norm
        optimizer.step()
        scheduler.step()
        step += 1
        meter.step(step, loss, args.batch_size * args.seq_len)  # tokens (bytes); no host sync
        load, aux_sum, since = load + step_load, aux_sum + aux.detach(), since + 1  # New: no host sync
        compiled.step()  # --compile: after the first step, which compiled the blocks, the 'compile:' line
        saves.finish_async(only_if_done=True)  # New: written? latest.pt names it now (each rank at its own step)
        stop = vote.all_reduce_max()  # the vote started a step ago: every rank the same answer at the same step
        evaluating = step % args.eval_every == 0 or step == last
        if evaluating or stop or (args.save_every and step % args.save_every == 0):  # --save-every, SIGUSR1
            meter.all_reduce_and_check(step, model)  # a NaN/inf loss or weight stops the run before any save
            if evaluating:
                # -------------------------------------------------------------------------------- eval
                train_loss = meter.all_reduce_loss()  # the mean since the last eval; the clock stops
                val_loss = evaluate(model, val_x, val_y, rank, world_size, batch_per_process, device, amp)
                worst = int((load.amax(-1) / load.amin(-1)).argmax())  # New: the layer whose max / min is largest
                least, most = map(int, load[worst].aminmax())  # New: its fewest and most rows an expert got
                dist.all_reduce(aux_sum)  # each rank's balance loss weighs its own tokens' gates: their mean
                sent, sent_bytes = AllToAll.sent_bytes - sent_bytes, AllToAll.sent_bytes
                print0(f"step={step}/{args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
                       f"val_bpb={lm.bits_per_byte(val_loss):.4f} lr={scheduler.get_last_lr()[0]:.2e} "
                       f"{meter.fields(last - step)}")
                print0(f"experts: rows max {most} / min {least} (layer {worst}, the worst), balance loss "  # New
                       f"{aux_sum.item() / since / world_size:.4f} (1: even), all-to-all "
                       f"{sent / since / 1e6:.3f} MB a step sent by rank 0 (forward and backward)")
                load, aux_sum, since = 0, torch.zeros((), device=device), 0
            # -------------------------------------------------------------------------------- save
            # New: every rank writes its part (DCP), then rank 0 points latest.pt at them: weights, moments, step.
            folder, started = saves.folder(step), time.perf_counter()
            model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)  # the full model's names
            pointer = {"shards": os.path.basename(folder), "step": step, "epoch": 0,  # what latest.pt will say
                       "flags": {k: getattr(args, k) for k in SAME_ON_RESUME}}
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
                full = gather_full_weights(model, rank, args.ep)  # New: ranks 1 .. ep - 1 send to 0
                if is_main:  # dcp.save returned on every rank: all shards are written. Now point latest.pt at them.
                    saves.point_latest(pointer)
                    save_atomic(full, os.path.join(args.out_dir, "model.pt"))  # New: every expert
                    print0(f"saved: {latest} and model.pt at step {step}; training waited "
                           f"{time.perf_counter() - started:.3f} s")
            meter.start()  # the clock again, after an evaluation stopped it
            if stop:  # saved; every rank leaves the loop at this step
                break
    meter.stop()  # the clock; --profile writes its trace
    vote.wait()  # the last vote; every rank started as many
    saves.finish_async()  # New: the last save in flight ends (and latest.pt names it) before the job does
    if args.async_save:  # New: the full weights once, at the end or a stop (gathered at every save: a wait for all)
        full = gather_full_weights(model, rank, args.ep)
        if is_main:
            save_atomic(full, os.path.join(args.out_dir, "model.pt"))  # every expert
            print0(f"saved: model.pt at step {step}")
    if stop and step < last:  # saved; the scheduler's requeue resumes it (--resume auto)
        dist.barrier()  # rank 0's files are whole before any rank exits (torchrun stops the rest at the first)
        print0(f"preempt: SIGUSR1: saved {latest} at step {step}; exit {EX_TEMPFAIL}: requeue the job with "
               "--resume auto to go on from there")
        dist.destroy_process_group()
        sys.exit(EX_TEMPFAIL)
    # ------------------------------------------------- harness: what tests and benchmarks read, not the lesson
    if val_loss is None:  # resumed at or past --max-steps / --steps: nothing left to train
        val_loss = evaluate(model, val_x, val_y, rank, world_size, batch_per_process, device, amp)
        worst = least = most = None  # New: no experts' line to report
    compile_fields = compiled.gather_fields()  # --compile: every rank's counts (an all-gather), the 'compile:' line
    if args.profile:  # a collective (all-gather): every rank's compute, communication, data, idle
        print0(meter.gather_profile_table())
    # New: state_bytes_per_rank counts each rank's experts and the whole rest.
    print0(meter.gather_result_line(model, optimizer, recipe="lm_moe", steps=step, start_step=start_step,
                                    train_loss=train_loss, val_loss=val_loss, val_bpb=lm.bits_per_byte(val_loss),
                                    val_windows=len(val_x), ep=args.ep, dp=args.dp, experts=args.experts,
                                    top_k=args.top_k, load_max_over_min=round(most / least, 4) if least else None,
                                    load_max=most, load_min=least, load_layer=worst, **compile_fields))
    dist.destroy_process_group()


if __name__ == "__main__":
    with harness.one_line_errors():  # a bad file, a lost rank, Ctrl-C: one line each, not a traceback per rank
        main()
