"""Make a JPEG ImageFolder of real photographic content for measuring data loading, with no download.

    python tools/make_jpegs.py data/jpegs --train 20000 --val 1000     # the measuring set (these are the defaults)
    python tools/make_jpegs.py /tmp/tiny --train 128 --val 37 --size 40x30 --odd --corrupt   # a tiny one, for tests

Layout: ROOT/train/<class>/<class>_<k>.JPEG and ROOT/val/<class>/<class>_<k>.JPEG, classes c00, c01, ...; file k of
a split is class k mod --classes, so each class gets an even share. The source is the two photographs scikit-learn
ships (sklearn/datasets/images/china.jpg and flower.jpg, 640x427, what sklearn.datasets.load_sample_image reads).
Each class is a fixed region of one of them (a centre and a scale, the same whatever --seed); a sample is a crop
around its class's region (scale x0.7-1.4, shifted by up to a fifth of its size, the output's aspect, a quarter of
them portrait), resized to --size (portrait swaps it), its brightness (x0.7-1.3) and colour (x0.9-1.1 a channel)
jittered, and saved by PIL at --quality with 4:2:0 chroma. File k of a split depends only on (--seed, split, k):
two runs make byte-identical files, with any --jobs.

Against ImageNet-1k's train files: those average about 400x350 px (most 500 px on the long side, 500x375 or
375x500, some much larger) and about 110 KB a file (ILSVRC-2012 train: about 138 GB over 1,281,167 files), JPEG
quality around 90 from cameras and Flickr, mostly 4:2:0. The default set is ImageNet's typical file in pixels and
quality, a little larger than its mean in pixels (measured, --train 2000 --val 100: mean 469x406 px), and about
half its bytes (52,554 bytes a file there): its crops come from 640x427 photographs that were themselves
JPEG-compressed, mostly enlarged, so they hold less fine detail than camera files. The tool prints what it made.

--odd adds to train/c00/ gray_0.JPEG (1-channel), cmyk_0.JPEG, png_0.JPEG (a PNG named .JPEG) and
progressive_0.JPEG: ImageNet's train set holds grayscale JPEGs, 22 CMYK ones and one PNG named .JPEG, and progressive
JPEGs are common on the web. --corrupt adds there corrupt_0.JPEG (a JPEG cut 40% of the way into its compressed
pixels, as a broken download leaves it: it opens, then PIL's load and torchvision's decode_jpeg both raise) and
notimage_0.JPEG (random bytes). These are counted apart ("+N odd") and left out of the means. Prints one line: files,
seconds, files/s, mean width x height, mean bytes a file. --force replaces ROOT's train/ and val/ (an earlier run's:
none of its files, odd or corrupt, stays beside the new set) and leaves the rest of ROOT. Bad input (a ROOT that is
not empty, without --force; one that cannot be made or written; a bad number): one line on stderr, exit 2. A write
that fails midway (a disk that fills up, a quota, an I/O error): one line naming ROOT, the file and how many files
it holds, exit 1 (the file cut short is removed). make_set() does the same from Python, without the checks.
"""

import argparse
import contextlib
import functools
import importlib.util
import io
import math
import os
import shutil
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ when run as a script
from tools.cli import OneLineParser, unwritable_folder

PHOTOS = ("china.jpg", "flower.jpg")
MAX_CLASSES = 100
SPLITS = ("train", "val")  # split ids 0 and 1 in each file's seed; the odd files use 2
# Class c: (photograph, centre x and y as fractions of it, the crop's short side as a fraction of its height).
REGIONS = [(c % 2, *np.random.default_rng([65, c]).uniform((0.3, 0.3, 0.4), (0.7, 0.7, 0.75)))
           for c in range(MAX_CLASSES)]


class WriteFailed(Exception):
    """A file of the set that could not be written: (its path, why). Raised in a --jobs worker, it reaches the
    parent whole (pickled by its args)."""

    def __str__(self):
        return f"cannot write {self.args[0]} ({self.args[1]})"


def write(path, data):
    """path's bytes, or WriteFailed; a file cut short (ENOSPC partway) is removed: it is no sample."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        raise WriteFailed(path, exc.strerror or str(exc)) from None


def class_name(c):
    return f"c{c:02d}"


@functools.cache
def photos():
    """scikit-learn's two sample photographs as RGB images, read once a process (without importing sklearn)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise RuntimeError("make_jpegs needs scikit-learn installed: its two sample photographs are the source")
    folder = Path(spec.submodule_search_locations[0]) / "datasets" / "images"
    return [Image.open(folder / name).convert("RGB") for name in PHOTOS]


def sample(rng, c, size):
    """A sample of class c: a jittered crop around its region, resized to size (swapped when portrait)."""
    which, cx, cy, scale = REGIONS[c]
    photo = photos()[which]
    pw, ph = photo.size
    w, h = size if rng.random() >= 0.25 else size[::-1]
    short = scale * rng.uniform(0.7, 1.4) * ph
    cw, ch = short * w / min(w, h), short * h / min(w, h)
    shrink = max(1, cw / pw, ch / ph)  # the crop must fit in the photograph
    cw, ch = cw / shrink, ch / shrink
    dx, dy = rng.uniform(-0.2, 0.2, 2)
    x0 = max(min(cx * pw + (dx - 0.5) * cw, pw - cw), 0)
    y0 = max(min(cy * ph + (dy - 0.5) * ch, ph - ch), 0)
    im = photo.resize((w, h), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch), reducing_gap=3.0)
    r, g, b = rng.uniform(0.7, 1.3) * rng.uniform(0.9, 1.1, 3)  # brightness, then each channel's gain
    return im.convert("RGB", (r, 0, 0, 0, 0, g, 0, 0, 0, 0, b, 0))  # clipped to 0..255


def encode(im, fmt="JPEG", **options):
    buf = io.BytesIO()
    im.save(buf, fmt, **options)
    return buf.getvalue()


def make_chunk(task):
    """Files start..stop-1 of a split; returns [files, sum of widths, sum of heights, sum of bytes]."""
    root, split, start, stop, classes, size, quality, seed = task
    totals = np.zeros(4, dtype=np.int64)
    for k in range(start, stop):
        c = k % classes
        im = sample(np.random.default_rng([seed, split, k]), c, size)
        data = encode(im, quality=quality, subsampling="4:2:0")
        write(root / SPLITS[split] / class_name(c) / f"{class_name(c)}_{k}.JPEG", data)
        totals += (1, *im.size, len(data))
    return totals


def odd_files(size, quality, seed, odd, corrupt):
    """{name: bytes} of the --odd and --corrupt files, all made from one sample of the first class."""
    rng = np.random.default_rng([seed, 2, 0])
    im = sample(rng, 0, size)
    jpeg = encode(im, quality=quality, subsampling="4:2:0")
    files = {}
    if odd:
        files |= {"gray": encode(im.convert("L"), quality=quality), "png": encode(im, "PNG"),
                  "cmyk": encode(im.convert("CMYK"), quality=quality, subsampling="4:2:0"),
                  "progressive": encode(im, quality=quality, subsampling="4:2:0", progressive=True)}
    if corrupt:
        scan = jpeg.index(b"\xff\xda")  # start of scan: the headers end, the compressed pixels follow
        files |= {"corrupt": jpeg[: scan + (len(jpeg) - scan) * 2 // 5], "notimage": b"\0" + rng.bytes(len(jpeg) - 1)}
    return files


def make_set(root, train=20000, val=1000, classes=10, size=(500, 375), quality=90, seed=0, jobs=1, odd=False,
             corrupt=False):
    """Write the set under root (see the module's docstring); returns the summary numbers."""
    start = time.perf_counter()
    root = Path(root)
    for split in SPLITS:
        for c in range(classes):
            (root / split / class_name(c)).mkdir(parents=True, exist_ok=True)
    photos()  # read here once: forked workers inherit them (others read them on first use)
    step = max(1, min(256, math.ceil((train + val) / (4 * jobs))))
    tasks = [(root, split, i, min(i + step, n), classes, tuple(size), quality, seed)
             for split, n in enumerate((train, val)) for i in range(0, n, step)]
    if jobs > 1:
        with Pool(jobs) as pool:
            totals = sum(pool.imap_unordered(make_chunk, tasks))
    else:
        totals = sum(map(make_chunk, tasks))
    extra = odd_files(tuple(size), quality, seed, odd, corrupt)
    for name, data in extra.items():
        write(root / "train" / class_name(0) / f"{name}_0.JPEG", data)
    files, width, height, nbytes = (int(t) for t in totals)
    return dict(files=files, extra=len(extra), seconds=time.perf_counter() - start, mean_width=width / files,
                mean_height=height / files, mean_bytes=nbytes / files)


def size_arg(text):
    w, sep, h = text.partition("x")
    if not (sep and w.isdigit() and h.isdigit() and 8 <= int(w) <= 8192 and 8 <= int(h) <= 8192):
        raise argparse.ArgumentTypeError(f"wants WIDTHxHEIGHT, each 8 to 8192, not {text!r}")
    return int(w), int(h)


def main(argv=None):
    p = OneLineParser("make_jpegs", description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="the folder to make (new or empty)")
    p.add_argument("--train", type=int, default=20000, help="train files in all, spread over the classes")
    p.add_argument("--val", type=int, default=1000, help="val files in all, spread over the classes")
    p.add_argument("--classes", type=int, default=10, help=f"classes, 2 to {MAX_CLASSES} (default 10)")
    p.add_argument("--size", type=size_arg, default=(500, 375), help="WxH of landscape files (default 500x375)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality, 1 to 100 (default 90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes (default: all CPUs)")
    p.add_argument("--odd", action="store_true", help="add grayscale, CMYK, PNG and progressive files")
    p.add_argument("--corrupt", action="store_true", help="add a truncated JPEG and a file of random bytes")
    p.add_argument("--force", action="store_true",
                   help="replace the train/ and val/ of a ROOT that is not empty (an earlier run's)")
    args = p.parse_args(argv)
    for name, lo, hi, why in (("classes", 2, MAX_CLASSES, ""), ("train", args.classes, None, " (one a class)"),
                              ("val", args.classes, None, " (one a class)"), ("quality", 1, 100, ""),
                              ("jobs", 1, None, ""), ("seed", 0, None, "")):
        value = getattr(args, name)
        if value < lo or (hi is not None and value > hi):
            p.error(f"--{name} must be {f'{lo} to {hi}' if hi else f'at least {lo}'}{why}, not {value}")
    if args.root.exists() and not args.root.is_dir():
        p.error(f"{args.root} is a file: pass an empty or new folder")
    if args.root.exists() and any(args.root.iterdir()) and not args.force:
        p.error(f"{args.root} is not empty: pass an empty or new folder (or --force to write into it)")
    if importlib.util.find_spec("sklearn") is None:  # before any file is made
        p.error("scikit-learn is not installed, and its two sample photographs are the source: "
                "pip install -r requirements-dev.txt")
    problem = unwritable_folder(args.root, args.root)  # made here, before any file: a folder that cannot be written
    if problem:  # is one line
        p.error(problem)
    if args.force:  # an earlier run's files, a larger set's or its corrupt ones, must not stay among the new
        for split in SPLITS:
            shutil.rmtree(args.root / split, ignore_errors=True)
    try:
        s = make_set(args.root, train=args.train, val=args.val, classes=args.classes, size=args.size,
                     quality=args.quality, seed=args.seed, jobs=args.jobs, odd=args.odd, corrupt=args.corrupt)
    except WriteFailed as exc:  # a disk that filled up midway: how far it got, not a traceback from a worker
        held = sum(f.is_file() for split in SPLITS for f in (args.root / split).rglob("*"))
        print(f"make_jpegs: error: {exc}; {held:,} files of the set are written in {args.root}: "
              "free some space or pass another ROOT, then run again with --force", file=sys.stderr)
        return 1
    extra = f" (+{s['extra']} odd)" if s["extra"] else ""
    print(f"make_jpegs: {s['files']:,} files{extra} in {s['seconds']:.1f} s (--jobs {args.jobs}): "
          f"{s['files'] / s['seconds']:,.0f} files/s, mean {s['mean_width']:.0f}x{s['mean_height']:.0f} px, "
          f"mean {s['mean_bytes']:,.0f} bytes a file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
