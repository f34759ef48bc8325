"""Draw the recipes' TensorBoard curves into one PNG, from the event files themselves (for docs/recipes.md and reports).

    python tools/plot_tb.py runs/tb/ddp_torchrun runs/tb/torch_amp --out docs/tensorboard.png
    tensorboard --logdir runs/tb          # the same curves, live

Each argument is one run's --tb-dir; its folder name labels its lines. Four panels: the training loss every
--tb-every steps, validation top-1 per epoch, the learning rate, and images/s per epoch, all against the
optimizer step. The events are read with tensorboard's own reader, so a resumed run's purged points are gone.
"""

import argparse
import sys
from pathlib import Path

PANELS = [("train/loss", "training loss (mean of the last --tb-every steps)"), ("epoch/val_acc1", "val top-1 (%)"),
          ("train/lr", "learning rate"), ("epoch/images_per_sec", "images/s (epoch)")]


def read_scalars(tb_dir):
    """{tag: [(step, value), ...]}; raises ValueError with a one-line reason when there is nothing to read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(tb_dir).is_dir() or not list(Path(tb_dir).glob("events.out.tfevents.*")):
        raise ValueError(f"{tb_dir} holds no TensorBoard event file (events.out.tfevents.*): pass a recipe's --tb-dir")
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="one or more --tb-dir folders")
    p.add_argument("--out", default="docs/tensorboard.png", help="the PNG to write (default docs/tensorboard.png)")
    args = p.parse_args(argv)
    try:
        runs = {Path(d).name: read_scalars(d) for d in args.runs}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (tag, title) in zip(axes.flat, PANELS, strict=True):
        for name, scalars in runs.items():
            if scalars.get(tag):
                steps, values = zip(*scalars[tag], strict=True)
                ax.plot(steps, values, marker="." if tag.startswith("epoch/") else None, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
