"""Train every recipe on real images at its defaults, and write the table docs/recipes.md quotes.

    python tools/real_data.py                                   # every recipe, cpu:2, 10 epochs: see bench/real_data.md
    python tools/real_data.py --recipes ddp_torchrun,fsdp --epochs 4 --out runs/real_data
    python tools/real_data.py --export ~/digits                 # only write the ImageFolder (and .rec) tree
    python tools/real_data.py --recipes fsdp --update           # rerun one, keep the other rows

The data: scikit-learn's handwritten digits (1,797 scans of 8x8 px, 10 classes, shipped inside the scikit-learn
package: no download), every fifth image of the collection held out for validation (1,437 train / 360 val). They
are written as a real JPEG ImageFolder at --size px (train/<digit>/*.jpg, val/<digit>/*.jpg), and, for
mx_face_prefetch, packed into train.rec with tools/pack_rec.py (its validation is every 10th image of each
identity, as the recipe holds out).

Each recipe runs through launch.sh with its defaults plus what a user of this data sets: the data, the image size,
the global batch (32 for 1.4k images), the epochs and --no-flip (a mirrored 2 is not a 2). The table: val top-1
after each epoch, the best, and epoch 1's val_loss (BatchNorm's running statistics lagging the weights shows
there). A recipe whose run fails gets its stderr tail and the others still run; exit 1 if any failed. Some of the
recipes in an --out that holds another run's table: --update keeps its other rows, or the tool refuses (a run of two
recipes would replace bench/'s table of all). The recipes start with this interpreter (launch.sh's PYTHON), so
`.venv/bin/python tools/real_data.py` needs no activated virtualenv. Bad flags, and an --export, --data or --out
folder that cannot be made or written: one line, exit 2, before any image is written.
"""

import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # common/ when run as a script
from tools.cli import OneLineParser, unwritable_folder  # noqa: E402

RECIPES = {  # name: (recipe file, devices, flags beyond the shared ones)
    "dp": ("dp", "cpu", []),
    "ddp_torchrun": ("ddp_torchrun", "cpu:2", []),
    "ddp_launch": ("ddp_launch", "cpu:2", []),
    "ddp_spawn": ("ddp_spawn", "cpu:2", []),
    "ddp_checkpoint": ("ddp_checkpoint", "cpu:2", []),
    "apex_ddp": ("apex_ddp", "cpu:2", []),
    # O0: the default O1 is fp16 autocast, 10-50x slower on a CPU than fp32 (on a GPU the default applies).
    "apex_amp": ("apex_amp", "cpu:2", ["--opt-level", "O0"]),
    "torch_amp": ("torch_amp", "cpu:2", []),
    "fsdp": ("fsdp", "cpu:2", []),
    "mx_face_prefetch": ("mx_face_prefetch", "cpu:2", []),
    "ddp_compile": ("ddp_compile", "cpu:2", []),
    "ddp_zero": ("ddp_zero", "cpu:2", []),
    "ddp_uneven": ("ddp_uneven", "cpu:2", []),
    "ddp_comm_hooks": ("ddp_comm_hooks", "cpu:2", []),  # its default: bf16 gradients
}


def digits():
    """(images uint8 [N, 8, 8], labels [N]) from scikit-learn's copy of the UCI handwritten digits."""
    from sklearn.datasets import load_digits  # imported here: only this tool needs scikit-learn

    data = load_digits()
    return (data.images * (255 / 16)).round().clip(0, 255).astype("uint8"), data.target


def export(folder, size, per_class=None):
    """The digits as an ImageFolder of RGB JPEGs at `size` px under folder/train and folder/val, and a .rec of the
    training split under folder/rec. per_class: keep only the first N training and N // 4 validation images of each
    digit (a small set for tests). Returns (train count, val count)."""
    from PIL import Image

    from tools.pack_rec import main as pack_rec

    images, labels = digits()
    folder, counts = Path(folder), {"train": 0, "val": 0}
    kept = {}
    for i, (pixels, label) in enumerate(zip(images, labels, strict=True)):
        split = "val" if i % 5 == 0 else "train"
        kept[split, label] = kept.get((split, label), 0) + 1
        if per_class and kept[split, label] > (per_class if split == "train" else max(1, per_class // 4)):
            continue
        path = folder / split / str(label) / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(pixels, mode="L").resize((size, size), Image.BILINEAR).convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=95)
        path.write_bytes(buffer.getvalue())
        counts[split] += 1
    if pack_rec([str(folder / "train"), str(folder / "rec"), "--size", str(size)]) != 0:
        raise SystemExit("error: packing the digits into a .rec failed")
    return counts["train"], counts["val"]


def command(name, data, args, out):
    recipe, devices, extra = RECIPES[name]
    if recipe == "mx_face_prefetch":
        source = ["--rec", str(Path(data) / "rec")]
    else:
        source = ["--dataset", "imagefolder", "--data-root", str(data)]
    return [str(REPO / "launch.sh"), f"recipes/{recipe}.py", devices, *source, "--image-size", str(args.size),
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--no-flip", "--out-dir", str(out),
            *extra]


def parse_epochs(stdout):
    """[(epoch, val_loss, val_acc1)] from a recipe's epoch lines."""
    return [(int(e), float(loss), float(acc)) for e, loss, acc in
            re.findall(r"^epoch=(\d+)/\d+ .*?val_loss=(\S+) val_acc1=(\S+)", stdout, re.M)]


def table(rows, args):
    lines = [f"Real images: scikit-learn's digits (1,437 train / 360 val) as a {args.size} px JPEG ImageFolder, "
             f"`cpu:2`, global batch {args.batch_size}, {args.epochs} epochs, `--no-flip`, every other flag at the "
             "recipe's default (resnet18, lr 0.1 x batch / 128 = "
             f"{0.1 * args.batch_size / 128:g}, one epoch of warm-up, cosine; "
             "apex_amp at O0: its default O1 is fp16, 10-50x slower on a CPU; torch_amp at its CPU default: bf16 on a "
             "CPU with native bf16, else fp32; mx_face_prefetch on the .rec of the 1,437, validating on its every "
             "10th image of each digit, as the recipe holds out). Written by `python tools/real_data.py`.",
             "", "| recipe | val top-1 by epoch | best | epoch-1 val_loss | target (>= 98.5%) | minutes |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        if row["epochs"]:
            accs = [acc for _, _, acc in row["epochs"]]
            best = max(accs)
            lines.append(f"| `{row['name']}` | {' '.join(f'{a:.1f}' for a in accs)} | {best:.2f} | "
                         f"{row['epochs'][0][1]:.3f} | {'met' if best >= 98.5 else 'MISSED'} | "
                         f"{row['seconds'] / 60:.1f} |")
        else:
            lines.append(f"| `{row['name']}` | failed (exit {row['code']}) | - | - | MISSED | - |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = OneLineParser("real_data", description=__doc__.split("\n")[0])
    p.add_argument("--recipes", help=f"comma-separated (default: all: {', '.join(RECIPES)})")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch")
    p.add_argument("--size", type=int, default=16, help="image side in px (the 8 px scans are scaled up)")
    p.add_argument("--data", help="where to write the images (default: a temporary folder)")
    p.add_argument("--export", help="only write the ImageFolder and .rec into this folder, then exit")
    p.add_argument("--out", default=str(REPO / "bench"), help="real_data.md and real_data.json go here")
    p.add_argument("--update", action="store_true",
                   help="keep the rows of --out's real_data.json for the recipes not run now (same settings)")
    args = p.parse_args(argv)
    for flag, value, least in (("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1),
                               ("--size", args.size, 8)):
        if value < least:
            p.error(f"{flag} {value} must be at least {least}")
    for flag, folder in [("--export", args.export)] if args.export else [("--data", args.data), ("--out", args.out)]:
        problem = folder and unwritable_folder(f"{flag} {folder}", folder, make=False)  # before the images and the
        if problem:  # runs (nothing is made here)
            p.error(problem)
    if args.export:
        train, val = export(args.export, args.size)
        print(f"wrote {train} train / {val} val images under {args.export} (and {args.export}/rec)")
        return 0
    names = args.recipes.split(",") if args.recipes else list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe: {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept = {}
    if args.update and (out / "real_data.json").is_file():
        earlier = json.loads((out / "real_data.json").read_text())
        same = {k: earlier["settings"].get(k) for k in ("epochs", "batch_size", "size")}
        if same != {"epochs": args.epochs, "batch_size": args.batch_size, "size": args.size}:
            p.error(f"--update: {out / 'real_data.json'} was made with {same}; rerun every recipe instead")
        kept = {row["name"]: row for row in earlier["runs"]}
    elif set(names) != set(RECIPES) and (out / "real_data.json").is_file():
        p.error(f"{out / 'real_data.json'} holds an earlier run's table: --update to rerun only "
                f"{', '.join(names)} in it, or --out elsewhere")
    rows = []

    def save():  # after every recipe: an interrupted run keeps what it measured
        done = {**kept, **{row["name"]: row for row in rows}}
        ordered = [done[name] for name in RECIPES if name in done]
        (out / "real_data.json").write_text(json.dumps({"settings": vars(args), "runs": ordered}, indent=1) + "\n")
        (out / "real_data.md").write_text(table(ordered, args))
        return ordered

    with tempfile.TemporaryDirectory(prefix="digits_") as tmp:
        data = Path(args.data or tmp) / "digits"
        train, val = export(data, args.size)
        print(f"data: {train} train / {val} val digits at {args.size} px in {data}", flush=True)
        for name in names:
            start = time.monotonic()
            proc = subprocess.run(command(name, data, args, Path(tmp) / "runs" / name), cwd=REPO,
                                  capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
            row = {"name": name, "code": proc.returncode, "seconds": round(time.monotonic() - start, 1),
                   "epochs": parse_epochs(proc.stdout) if proc.returncode == 0 else []}
            rows.append(row)
            save()
            if proc.returncode:
                print(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
            else:
                print(f"{name}: " + " ".join(f"{acc:.1f}" for _, _, acc in row["epochs"]) +
                      f" (epoch-1 val_loss {row['epochs'][0][1]:.3f}, {row['seconds']:.0f} s)", flush=True)
    print(table(save(), args))
    return 1 if any(row["code"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
