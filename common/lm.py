"""The language-model family's workload (recipes/lm_*.py): a small decoder-only transformer over bytes, real text
without a download, and batches that depend only on (seed, step, data-parallel rank). Not the lesson: no collective.

- Tokens are bytes (a vocabulary of 256): no tokenizer file, any UTF-8 text works.
- The default text is the Python standard library's own source (the files common/lm_corpus.txt lists), which every
  machine with Python has; --text takes a file or a folder instead (its UTF-8 files, recursively, each followed by
  a blank line; hidden ones and files that are not UTF-8, such as __pycache__, are left out, the latter counted).
- Train/val split: the last VAL_FRACTION of the bytes is validation, the rest training; fixed, no shuffling.
- Step k's batch: window starts drawn by a generator seeded with (seed, k), the global batch of them; data-parallel
  rank r of D takes the r-th of D equal slices. Ranks of one tensor-parallel group pass the same r, so they see the
  same sequences; a resumed run draws what the uninterrupted one would have.
- Validation: fixed, non-overlapping windows from the validation split, rank r of D scoring windows r, r + D, ...,
  so each is scored exactly once however many ranks there are.
"""

import hashlib
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.harness import add_profile_flag, usage_once_per_node

CORPUS_LIST = Path(__file__).with_name("lm_corpus.txt")
VAL_FRACTION = 0.05
VOCAB = 256  # bytes


# ------------------------------------------------------------------------------------------- text
class TextError(ValueError):
    """A --text problem, said in one line (the recipes pass it to harness.die)."""


def corpus_files():
    """(the stdlib's files the corpus lists, the header's python version, byte count and sha256)."""
    lines = CORPUS_LIST.read_text().splitlines()
    header = next(line for line in lines if line.startswith("# python "))
    _, _, version, _, size, _, digest = header.split()
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / name for name in lines if name and not name.startswith("#")], version, int(size), digest


def read_text(path=None):
    """(the text's bytes as a uint8 tensor, a one-line description). path: a UTF-8 file, a folder (its files, sorted,
    recursively), or None for the default corpus. Raises TextError for a missing or empty path or a file that is not
    UTF-8."""
    if path is None:
        files, version, size, digest = corpus_files()
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise TextError(f"the default corpus needs {missing[0]} (and {len(missing) - 1} more), which this Python "
                            f"does not have (listed in {CORPUS_LIST.name} from Python {version}); pass --text FILE|DIR")
        data = b"".join(f.read_bytes() + b"\n\n" for f in files)
        got = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
        same = "the docs' corpus" if got == digest else f"not the docs' corpus, Python {version}'s: numbers differ"
        where = f"the Python standard library ({len(files)} files of {sysconfig.get_paths()['stdlib']}; {same})"
    else:
        root = Path(path)
        if not root.exists():
            raise TextError(f"--text {path}: no such file or folder")
        if root.is_dir():  # its files, recursively, less hidden ones (.git) and any that is not UTF-8 (__pycache__)
            files = sorted(f for f in root.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(root).parts))
        else:
            files = [root]
        parts, skipped = [], []
        for f in files:
            raw = f.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                if root.is_dir():
                    skipped.append(f.name)
                    continue
                raise TextError(f"--text {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            parts.append(raw + b"\n\n")
        if not parts:
            raise TextError(f"--text {path}: the folder has no UTF-8 text files"
                            + (f" ({len(skipped)} others, e.g. {skipped[0]})" if skipped else ""))
        data = b"".join(parts)
        where = f"{path} ({len(parts)} file{'s' if len(parts) > 1 else ''}" + (
            f"; {len(skipped)} not UTF-8 left out, e.g. {skipped[0]})" if skipped else ")")
    if not data.strip():
        raise TextError(f"--text {path}: empty" if path else "the default corpus is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), where


def split(data):
    """(train, val): the last VAL_FRACTION of the bytes is validation."""
    cut = len(data) - max(1, int(len(data) * VAL_FRACTION))
    return data[:cut], data[cut:]


def check_text(train, val, seq_len, val_windows):
    """One line if the text is too short for a few windows of --seq-len on either side of the split."""
    need = 4 * (seq_len + 1)
    if len(train) < need or len(val) < seq_len + 1:
        raise TextError(f"the text is too short for --seq-len {seq_len}: {len(train)} training and {len(val)} "
                        f"validation bytes, where at least {need} and {seq_len + 1} are needed (validation is the "
                        f"last {VAL_FRACTION:.0%}); use a longer text or a smaller --seq-len")


def train_batch(train, step, seed, batch_size, seq_len, dp_rank, dp_size):
    """Step `step`'s sequences for data-parallel rank dp_rank of dp_size: (inputs, targets), each (B / D, seq_len)
    int64. The global batch's starts come from a generator seeded with (seed, step) alone."""
    with torch.profiler.record_function("data"):  # --profile counts it as waiting for data (common/profiling.py)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(train) - seq_len - 1, (batch_size,), generator=g)
        mine = starts.view(dp_size, batch_size // dp_size)[dp_rank]
        rows = torch.stack([train[s:s + seq_len + 1] for s in mine.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


def val_windows(val, seq_len, count):
    """The validation set: up to `count` non-overlapping windows from the start of the split, (inputs, targets)."""
    n = min(count, (len(val) - 1) // seq_len)
    rows = val[:n * seq_len + 1]
    inputs = rows[:-1].view(n, seq_len).long()
    targets = rows[1:].view(n, seq_len).long()
    return inputs, targets


# ------------------------------------------------------------------------------------------- model
class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (a fused qkv cut column-wise would give rank 0 all of Q
    and part of K). Heads are inferred with -1 in view(): under tensor parallelism each rank holds n_head / tp of
    them, and the same code runs on its local share."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head, self.head_dim = n_head, d_model // n_head  # n_head: all of them, not this rank's share
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.wo = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """d_model -> hidden (4 d_model unless said: GPT-2's) -> d_model, GELU between. An expert of lm_moe.py's is one."""

    def __init__(self, d_model, hidden=None):
        super().__init__()
        hidden = hidden or 4 * d_model
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x)). mlp: a callable that makes the MLP (lm_moe.py's experts and
    their router), else MLP(d_model)."""

    def __init__(self, d_model, n_head, mlp=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = mlp() if mlp else MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token and position embeddings, n_layer blocks (a ModuleDict: names that survive cutting the model into
    pipeline stages), a final norm and an untied head. forward(tokens (B, T)) -> logits (B, T, VOCAB): the loss is
    the recipe's, so tensor parallelism can compute it inside loss_parallel(). mlp: each block's MLP maker (Block)."""

    def __init__(self, n_layer, n_head, d_model, block_size, vocab=VOCAB, mlp=None):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_head, mlp) for i in range(n_layer)})
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.init_weights(n_layer)

    @torch.no_grad()
    def init_weights(self, n_layer):
        """GPT-2's: normal(0, 0.02) weights, zero biases, unit norms; each residual branch's last projection scaled
        by 1/sqrt(2 n_layer), so the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("wo.weight", "proj.weight")) else 0.02
                p.normal_(0.0, std)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x))


def check_model_flags(n_layer, n_head, d_model, seq_len, block_size, parallel=1, parallel_flag="--tp"):
    """One line (ValueError) for a model that cannot be built or cut: heads that do not divide the width, a sequence
    longer than the positions, a parallel degree that does not divide the heads or the MLP's width."""
    for name, value in (("--n-layer", n_layer), ("--n-head", n_head), ("--d-model", d_model), ("--seq-len", seq_len),
                        ("--block-size", block_size)):
        if value < 1:
            raise ValueError(f"{name} {value} must be >= 1")
    if d_model % n_head:
        raise ValueError(f"--n-head {n_head} must divide --d-model {d_model} (each head takes d_model / n_head)")
    if seq_len > block_size:
        raise ValueError(f"--seq-len {seq_len} is above --block-size {block_size}, the positions the model has")
    if n_head % parallel or (4 * d_model) % parallel:
        raise ValueError(f"{parallel_flag} {parallel} must divide --n-head {n_head} and the MLP width 4 x --d-model "
                         f"= {4 * d_model}: each rank takes a whole share of the heads and of the MLP")


def adamw_implementation(dtensor):
    """AdamW's fastest correct setting on the torch in use, as keyword arguments: fused (one kernel over every
    parameter) everywhere but on DTensor parameters under torch 2.10 and 2.11, whose fused AdamW leaks a DTensorSpec
    per parameter each step (pytorch/pytorch#181761, #188174: host memory grows until the job is killed); foreach
    there. Measured on 2 CPU cores, torch 2.14 (docs/lm.md): fused steps the default model's AdamW 6.6x faster than
    the for-loop (the CPU's default) on plain tensors, 3.9x on DTensors, no DTensorSpec left behind."""
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    return {"foreach": True} if dtensor and (major, minor) in ((2, 10), (2, 11)) else {"fused": True}


def adamw_as_this_torch(optim_state, optimizer):
    """A loaded optimizer state dict's fused/foreach made `optimizer`'s (adamw_implementation's choice on this torch),
    not the saver's, before the optimizer loads it: the load places each parameter's step count by them (fused: on
    the parameter's device; foreach: on the host, where its step reads it back), and the steps after run with them.
    optim_state: torch's form ({"param_groups": [...]}) or DCP's flattened one ("param_groups.<name>.fused")."""
    for key in ("fused", "foreach"):
        for group in optim_state.get("param_groups", []):
            group[key] = optimizer.defaults[key]
        for name in [n for n in optim_state if n.startswith("param_groups.") and n.endswith(f".{key}")]:
            optim_state[name] = optimizer.defaults[key]


def bits_per_byte(nats):
    return nats / math.log(2)


# ------------------------------------------------------------------------------------------ flags
# What a resumed run must share with the run that saved (the model, the data and the schedule); not the world size,
# nor a layout flag (--tp, --pp, --dp, ...: the sharded checkpoints reshard).
SAME_ON_RESUME = ("text", "n_layer", "n_head", "d_model", "block_size", "seq_len", "batch_size", "steps",
                  "warmup_steps", "lr", "weight_decay", "clip_grad", "seed", "amp_dtype")


def add_flags(p, name, sharded=False):
    """The flags every language-model recipe shares: the model's shape, the text, the schedule, AdamW, evaluation,
    checkpoints and the harness's own. Each recipe adds --batch-size (whose split is its lesson) and its layout flags.
    sharded: OUT_DIR/checkpoint/ holds DCP shards and a latest.pt naming them (lm_tp, lm_pp, lm_fsdp_tp)."""
    usage_once_per_node(p)  # a mistyped flag: argparse's usage from each node's local rank 0 alone
    p.add_argument("--text", help="a UTF-8 file or a folder of them (default: the Python standard library's source)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256, help="positions the model has: the longest --seq-len")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per training sequence")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps: the schedule's length")
    p.add_argument("--warmup-steps", type=int, help="linear warm-up, then cosine to 0 (default: --steps / 20; at most "
                   "--steps / 3)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on the weight matrices only")
    p.add_argument("--clip-grad", type=float, default=1.0, help="clip the gradient's global norm to this")
    p.add_argument("--amp-dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast, no loss scaler")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (inductor; the "
                   "first step compiles them, needs a C++ compiler on the CPU, gcc and Python.h on a GPU)")
    p.add_argument("--eval-every", type=int, default=250, help="validate (and save) every N steps, and at the end")
    p.add_argument("--save-every", type=int, help="also save every N steps between evaluations; "
                   "SIGUSR1 saves at the next step and exits 75")
    p.add_argument("--async-save", action="store_true", help=(
        "write each checkpoint's shards from a thread while training goes on (dcp.async_save); one save in flight; "
        "model.pt at the end (or a stop)" if sharded else
        "write each checkpoint from a thread while training goes on (a copy in CPU memory first); one save in flight"))
    p.add_argument("--val-windows", type=int, default=128, help="validation windows of --seq-len (fixed)")
    p.add_argument("--seed", type=int, default=0)
    latest = "checkpoint/latest.pt" if sharded else "latest.pt"
    p.add_argument("--out-dir", default=f"runs/{name}", help="model.pt and " + (
        "checkpoint/ (sharded; latest.pt: the resume point)" if sharded else "latest.pt (the resume point)"))
    p.add_argument("--resume", help=f"{latest} of an earlier run, or 'auto': OUT_DIR/{latest} if it exists"
                   + ("; any number of ranks, any layout" if sharded else ""))
    p.add_argument("--max-steps", type=int, help="train at most this many steps in this run, then save (a short run: "
                   "the same command with --resume auto goes on)")
    p.add_argument("--dist-timeout", type=float, default=300, help="seconds a collective waits before failing")
    p.add_argument("--debug-collectives", action="store_true", help="each collective first checks that every rank "
                   "called the same one, with the same shapes (torch's DETAIL level; slow)")
    add_profile_flag(p)  # --profile: a trace per rank and where each rank's step time goes
