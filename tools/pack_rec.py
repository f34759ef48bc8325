"""Pack an ImageFolder tree (one sub-folder per identity) into insightface's train.rec + train.idx, no mxnet needed.

    python tools/pack_rec.py SRC_DIR OUT_DIR [--quality 95] [--size 112]

Labels are the sorted sub-folder names numbered 0..K-1 (as torchvision's ImageFolder numbers them). Images
are re-encoded as RGB JPEG (resized to SIZE x SIZE with --size). Layout, as in faces_emore:
    key 0                   header: label (first identity key, end key)
    keys 1 .. N             one image each: scalar label = class id
    keys N+1 .. N+K         one per identity: label (start, end) = its range of image keys, end exclusive
Read it back with common.recordio.MXFaceDataset(OUT_DIR). Bad input: one line on stderr, exit 2.
"""

import argparse
import io
import os
import sys
from collections import namedtuple
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.data import rgb
from common.recordio import IRHeader, RecordWriter, pack
from tools.cli import OneLineParser

# torchvision's ImageFolder extensions: the same files become samples here and there.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Key ranges are stored as float32 labels, which hold every integer only up to 2**24.
MAX_KEY = 1 << 24

PackResult = namedtuple("PackResult", ["identities", "images", "bytes"])


class PackError(Exception):
    """Unusable input; the one-line message says which file or folder and why."""


def list_images(src):
    """[(class_name, [image paths])] sorted like ImageFolder (names, then a sorted recursive walk)."""
    src = Path(src)
    if not src.is_dir():
        raise PackError(f"{src}: not a directory")
    classes = sorted(entry.name for entry in os.scandir(src) if entry.is_dir())
    if not classes:
        raise PackError(f"{src}: no class folders (expected SRC_DIR/<identity>/<image files>)")
    listing = []
    for name in classes:
        files = []
        for dirpath, _, filenames in sorted(os.walk(src / name, followlinks=True)):
            files += [Path(dirpath) / f for f in sorted(filenames)  # not macOS's hidden `._name.jpg` metadata
                      if f.lower().endswith(IMG_EXTENSIONS) and not f.startswith(".")]
        if not files:
            # An identity with no images would still get a label, so a classifier head would have a dead row.
            raise PackError(f"{src / name}: no image files ({', '.join(IMG_EXTENSIONS)})")
        listing.append((name, files))
    return listing


def encode_jpeg(path, quality, size=None):
    try:
        with Image.open(path) as image:
            image = rgb(image)  # also forces the full decode, so a truncated file fails here; 16 bits scaled to 8
    except (OSError, ValueError, SyntaxError) as exc:  # UnidentifiedImageError: an OSError; a broken PNG chunk: Syntax
        raise PackError(f"{path}: cannot read image ({exc})") from None
    except Image.DecompressionBombError as exc:  # over PIL's pixel limit: a scan this size is worth resizing first
        raise PackError(f"{path}: {exc}; resize it first (or raise PIL.Image.MAX_IMAGE_PIXELS)") from None
    if size:
        image = image.resize((size, size), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def pack_folder(src, out, quality=95, size=None):
    """Write OUT/train.rec and OUT/train.idx from the tree at SRC; returns PackResult(identities, images, bytes).

    Writes to temporary names and renames at the end, so a failed run leaves no half-written dataset.
    """
    listing = list_images(src)
    num_images = sum(len(files) for _, files in listing)
    first_identity = 1 + num_images
    end = first_identity + len(listing)
    if end > MAX_KEY:
        raise PackError(f"{src}: {num_images} images + {len(listing)} identities exceed the 2**24 keys "
                        "a float32 label can address")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rec, idx = out / "train.rec", out / "train.idx"
    tmp_rec, tmp_idx = out / "train.rec.partial", out / "train.idx.partial"
    try:
        with RecordWriter(tmp_idx, tmp_rec) as writer:
            # Record 0 first: the counts are known up front, and sequential readers meet the header first.
            writer.write_idx(0, pack(IRHeader(0, [first_identity, end], 0, 0), b""))
            key, ranges = 1, []
            for label, (_, files) in enumerate(listing):
                start = key
                for path in files:
                    writer.write_idx(key, pack(IRHeader(0, float(label), key, 0), encode_jpeg(path, quality, size)))
                    key += 1
                ranges.append((start, key))
            for start_end in ranges:
                writer.write_idx(key, pack(IRHeader(0, list(start_end), key, 0), b""))
                key += 1
            num_bytes = writer.tell()
        os.replace(tmp_rec, rec)
        os.replace(tmp_idx, idx)
    finally:
        for tmp in (tmp_rec, tmp_idx):
            tmp.unlink(missing_ok=True)
    return PackResult(len(listing), num_images, num_bytes)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def quality_int(text):
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 1..100, got {value}")
    return value


def main(argv=None):
    p = OneLineParser("pack_rec", description=__doc__.split("\n")[0])
    p.add_argument("src", metavar="SRC_DIR", help="one sub-folder of images per identity")
    p.add_argument("out", metavar="OUT_DIR", help="gets train.rec and train.idx (created if missing)")
    p.add_argument("--quality", type=quality_int, default=95, help="JPEG quality (default 95)")
    p.add_argument("--size", type=positive_int, help="resize every image to SIZE x SIZE (default: keep)")
    args = p.parse_args(argv)
    try:
        result = pack_folder(args.src, args.out, quality=args.quality, size=args.size)
    except (PackError, OSError) as exc:  # OSError: OUT_DIR not writable, disk full (the message names the path)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"packed {result.identities} identities, {result.images} images into "
          f"{Path(args.out) / 'train.rec'} ({result.bytes} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
