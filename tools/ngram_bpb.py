"""The bar a language-model recipe must clear: a byte n-gram model's bits per byte on the recipes' validation set.

    python tools/ngram_bpb.py                        # the default corpus, 3 bytes of context, add-k 0.1
    python tools/ngram_bpb.py --text FILE --context 2

Fitted on the same training split the recipes train on (common/lm.py's split), with add-k smoothing:
P(b | c) = (count(c, b) + k) / (count(c) + 256 k), c the `--context` bytes before b. Scored on the targets of the
recipes' validation windows (--seq-len x --val-windows bytes from the start of the validation split), each with the
bytes before it in the text as its context, so the n-gram model never lacks context where the transformer, at a
window's first positions, does. Prints one RESULT line: {"context", "k", "val_bpb", "val_bytes", ...}.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.lm import TextError, read_text, split


def ngram_bpb(train, val, context, k, first, count):
    """Bits per byte of val[first:first + count] under the add-k n-gram model fitted on train (uint8 arrays)."""
    def ids(data, at):  # the context before each position `at`, as one integer
        c = np.zeros(len(at), dtype=np.int64)
        for j in range(context, 0, -1):
            c = c * 256 + data[at - j]
        return c

    at = np.arange(context, len(train))
    ctx = ids(train, at)
    pairs, pair_counts = np.unique(ctx * 256 + train[at], return_counts=True)
    ctx_ids, ctx_counts = np.unique(ctx, return_counts=True)
    text = np.concatenate([train[-context:], val]) if context else val  # val's first bytes: context from train's end
    at = np.arange(first, first + count) + context
    c, b = ids(text, at), text[at].astype(np.int64)

    def lookup(keys, values, query):
        i = np.searchsorted(keys, query).clip(max=len(keys) - 1)
        return np.where(keys[i] == query, values[i], 0)

    p = (lookup(pairs, pair_counts, c * 256 + b) + k) / (lookup(ctx_ids, ctx_counts, c) + 256 * k)
    return float(-np.log2(p).mean())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", help="a UTF-8 file or folder (default: the Python standard library's source)")
    p.add_argument("--context", type=int, default=3, help="bytes of context")
    p.add_argument("--k", type=float, default=0.1, help="add-k smoothing")
    p.add_argument("--seq-len", type=int, default=128, help="the recipes' --seq-len")
    p.add_argument("--val-windows", type=int, default=128, help="the recipes' --val-windows")
    args = p.parse_args(argv)
    if args.context < 0 or args.k <= 0 or not math.isfinite(args.k):
        sys.exit("error: --context must be >= 0 and --k a number > 0")
    try:
        text, where = read_text(args.text)
    except TextError as exc:
        sys.exit(f"error: {exc}")
    train, val = (t.numpy() for t in split(text))
    windows = min(args.val_windows, (len(val) - 1) // args.seq_len)
    bpb = ngram_bpb(train, val, args.context, args.k, 1, windows * args.seq_len)  # targets: val[1 : n*T + 1]
    print(f"data: {where}")
    print("RESULT " + json.dumps({"context": args.context, "k": args.k, "val_bpb": round(bpb, 4),
                                  "val_bytes": windows * args.seq_len, "train_bytes": len(train)}))


if __name__ == "__main__":
    main()
