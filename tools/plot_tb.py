"""Draw the recipes' TensorBoard curves into one PNG, from the event files themselves (for docs/recipes.md and reports).

    python tools/plot_tb.py runs/tb/ddp_torchrun runs/tb/torch_amp --out docs/tensorboard.png
    tensorboard --logdir runs/tb          # the same curves, live

Each argument is one run's --tb-dir; the shortest end of its path that no other argument's path ends with labels its
lines (runs/exp1/tb and runs/exp2/tb: exp1/tb and exp2/tb), one colour a run in every panel, the legend in the first
panel with a line. Four panels: the training loss every --tb-every steps, validation top-1 per epoch, the learning
rate, and images/s per epoch, all against the optimizer step. The events are read with tensorboard's own reader, so a
resumed run's purged points are gone.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ when run as a script
from tools.cli import OneLineParser, picture_output, save_picture

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


def labels(dirs):
    """Each run's label: the shortest end of its full path (its folder name, else more) that no other run's path
    ends with. Two arguments naming one folder: ValueError."""
    paths = [Path(d).resolve().parts for d in dirs]
    for i, path in enumerate(paths):
        if path in paths[:i]:
            raise ValueError(f"{dirs[i]} is given twice (as {dirs[paths.index(path)]} before it): pass each run once")
    found = []
    for path in paths:
        k = next(k for k in range(1, len(path) + 1) if all(other[-k:] != path[-k:] for other in paths if other != path))
        found.append(str(Path(*path[-k:])))
    return found


def figure(runs):
    """The four panels of `runs` ({label: scalars}); the legend, one entry a run with any point, in the first panel
    that has a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    colours = {name: f"C{i}" for i, name in enumerate(runs)}  # a run's colour is the same in every panel
    for ax, (tag, title) in zip(axes.flat, PANELS, strict=True):
        for name, scalars in runs.items():
            if scalars.get(tag):
                steps, values = zip(*scalars[tag], strict=True)
                ax.plot(steps, values, marker="." if tag.startswith("epoch/") else None, label=name,
                        color=colours[name])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    drawn = [name for name in runs if any(runs[name].get(tag) for tag, _ in PANELS)]
    first = next((ax for ax in axes.flat if ax.lines), None)
    if first is not None:  # a short run has no train/loss point, so the first panel can be empty
        handles = [plt.Line2D([], [], color=colours[name]) for name in drawn]
        first.legend(handles, drawn, fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None):
    p = OneLineParser("plot_tb", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="one or more --tb-dir folders")
    p.add_argument("--out", default="docs/tensorboard.png",
                   help="the picture to write, .png (the default: docs/tensorboard.png), .svg or .pdf; no suffix: .png")
    args = p.parse_args(argv)
    out, problem = picture_output("--out", args.out)  # before the event files are read, not after the drawing
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        runs = dict(zip(labels(args.runs), (read_scalars(d) for d in args.runs), strict=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fig = figure(runs)
    problem = save_picture(fig, "--out", out, dpi=100)  # what the check above cannot see: a full disk, ...
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(runs)} run(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
