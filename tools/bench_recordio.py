"""Records/s of the pure-Python RecordIO reader against mxnet's MXIndexedRecordIO (when mxnet imports).

    python tools/bench_recordio.py                          # 5000 random 2-8 KiB records in a temp dir
    python tools/bench_recordio.py --rec-dir DIR            # DIR/train.rec + DIR/train.idx (e.g. from pack_rec.py)
    python tools/bench_recordio.py --records 20000 --order random

Each reader reads every record once (read_idx + unpack, no image decoding) after one warm-up pass,
so both are timed against the page cache, not the disk. One line per reader.
"""

import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack, unpack
from tools.cli import OneLineParser


def make_rec(directory, records, seed=0):
    """DIR/train.rec + train.idx with `records` random payloads of 2-8 KiB, scalar labels."""
    rng = random.Random(seed)
    idx, rec = os.path.join(directory, "train.idx"), os.path.join(directory, "train.rec")
    with RecordWriter(idx, rec) as writer:
        for key in range(records):
            payload = rng.randbytes(rng.randint(2048, 8192))
            writer.write_idx(key, pack(IRHeader(0, float(key % 100), key, 0), payload))
    return idx, rec


def time_reads(read_idx, unpack_fn, keys):
    nbytes = 0
    for key in keys:  # warm-up: page cache, lazy opens
        unpack_fn(read_idx(key))
    t0 = time.perf_counter()
    for key in keys:
        _, payload = unpack_fn(read_idx(key))
        nbytes += len(payload)
    return time.perf_counter() - t0, nbytes


def report(name, seconds, count, nbytes):
    print(f"{name:<12} {count / seconds:>10,.0f} records/s  ({count} records, {nbytes / seconds / 2**20:,.0f} MiB/s)",
          flush=True)


def main(argv=None):
    p = OneLineParser("bench_recordio", description=__doc__.split("\n")[0])
    p.add_argument("--rec-dir", help="read DIR/train.rec + DIR/train.idx instead of generating records")
    p.add_argument("--records", type=int, default=5000, help="records to generate (default 5000)")
    p.add_argument("--order", choices=["sequential", "random"], default="sequential", help="key order")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.rec_dir:
            idx, rec = os.path.join(args.rec_dir, "train.idx"), os.path.join(args.rec_dir, "train.rec")
            missing = [path for path in (idx, rec) if not os.path.isfile(path)]
            if missing:
                p.error(f"--rec-dir {args.rec_dir}: no {' or '.join(missing)} (tools/pack_rec.py writes both)")
        else:
            idx, rec = make_rec(tmp, args.records)
        reader = IndexedRecordReader(idx, rec)
        keys = list(reader.keys)
        if args.order == "random":
            random.Random(0).shuffle(keys)
        print(f"{rec}: {len(keys)} records, {os.path.getsize(rec):,} bytes, {args.order} order")
        seconds, nbytes = time_reads(reader.read_idx, unpack, keys)
        report("pure-python", seconds, len(keys), nbytes)
        try:
            import mxnet as mx
        except Exception as exc:  # with numpy>=1.24 mxnet 1.9.1 fails with AttributeError (np.bool), not ImportError
            print(f"{'mxnet':<12} not run: mxnet does not import here ({type(exc).__name__}: {exc}); "
                  "mxnet 1.9.1 needs numpy<1.24 and python<3.12")
            return 0
        mx_reader = mx.recordio.MXIndexedRecordIO(idx, rec, "r")
        seconds, nbytes = time_reads(mx_reader.read_idx, mx.recordio.unpack, keys)
        report("mxnet", seconds, len(keys), nbytes)
        mx_reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
