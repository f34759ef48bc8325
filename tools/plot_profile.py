"""Draw where each rank's step time goes, from the traces --profile wrote: ranks as rows, time along the steps.

    ./launch.sh recipes/ddp_torchrun.py cpu:2 --dataset synthetic --arch tiny --max-steps 10 --profile
    python tools/plot_profile.py runs/ddp_torchrun/profile --out profile.png            # every recorded step
    python tools/plot_profile.py runs/ddp_torchrun/profile --steps 1 --out profile.png  # the first one alone

Each rank's time is cut as the --profile table cuts it (common/profiling.py: compute, communication while nothing
computes, compute with a collective under it, data, optimizer, idle). Time
counts from each rank's first recorded step: the ranks' steps end together (DDP's all-reduce), so the rows line up.
docs/slow.md shows two: DDP's all-reduce under backward, and a straggler.
"""

import json
import numbers
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.profiling import segments
from tools.cli import OneLineParser, picture_output, save_picture

COLOURS = {"compute": "#4c72b0", "both": "#8172b2", "communication": "#c44e52", "data": "#dd8452",
           "optimizer": "#55a868", "idle": "#eeeeee"}
NAMES = {"both": "compute + a collective (overlapped)", "communication": "communication (waiting)"}


def main(argv=None):
    p = OneLineParser("plot_profile", description=__doc__.split("\n")[0])
    p.add_argument("folder", help="OUT_DIR/profile of a run with --profile (trace_rank0.json, trace_rank1.json, ...)")
    p.add_argument("--out", default="profile.png", help="the picture to write: .png, .svg or .pdf; no suffix: .png")
    p.add_argument("--steps", type=int, help="draw only the first N recorded steps, N >= 1 (default: all)")
    p.add_argument("--title", help="the picture's title (default: the folder)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        return error(f"--steps {args.steps} must be >= 1 (leave it out to draw every recorded step)")
    out, problem = picture_output("--out", args.out)  # before the traces are read: a suffix matplotlib can write
    if problem:  # (none: .png, as savefig adds it) in a folder that can be written
        return error(problem)
    files = sorted(Path(args.folder).glob("trace_rank*.json"), key=lambda f: int(re.findall(r"\d+", f.name)[-1]))
    traces, world = [], None
    for f in files:
        if world and len(traces) >= world:  # an earlier run with more ranks may have left its higher ranks' files
            break
        try:
            trace = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return error(f"{f} cannot be read as JSON ({exc}): run the recipe with --profile again")
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            return error(f"{f} is not a Chrome trace (no traceEvents list): run the recipe with --profile again")
        flaw = bad_event(trace)
        if flaw:
            return error(f"{f} is not a trace --profile wrote ({flaw}): cut short or another tool's; run the recipe "
                         "with --profile again")
        traces.append(trace)
        world = world or trace.get("distributedInfo", {}).get("world_size")  # rank 0's run: how many are its
    files = files[:len(traces)]
    if not files:
        return error(f"no trace_rank*.json in {args.folder}: run a recipe with --profile (at least 3 steps)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Whole training steps only: a run cut short recorded a last step that ran on through eval and the save.
    cut = [segments(trace, complete=min(args.steps or 99, trace.get("completeSteps", 99))) for trace in traces]
    if None in cut:  # a trace cut short, or not --profile's
        return error(f"{files[cut.index(None)]} records no ProfilerStep: a trace of a run with --profile (at least 3 "
                     "steps)")
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(files) + 1.6))
    used = set()
    for row, (steps, pieces) in enumerate(cut):
        start, end = steps[0][0], steps[-1][1]
        y = len(files) - 1 - row  # rank 0 on top
        for label in COLOURS:
            bars = [((a - start) / 1000, (b - a) / 1000) for a, b, lab in pieces if lab == label and a < end]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLOURS[label], edgecolor="none")
                used.add(label)
        for a, _ in steps[1:]:  # where each step begins
            ax.plot([(a - start) / 1000] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.8)
    ax.set_yticks(range(len(files)), [f"rank {len(files) - 1 - y}" for y in range(len(files))])
    ax.set_xlabel("ms from the first recorded step (black ticks: the next step begins)")
    ax.set_title(args.title or str(args.folder))
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in COLOURS if k in used]
    ax.legend(handles, [NAMES.get(k, k) for k in COLOURS if k in used], loc="upper center", ncol=3, fontsize=8,
              bbox_to_anchor=(0.5, -0.35 if len(files) < 3 else -0.22), frameon=False)
    fig.tight_layout()
    try:
        problem = save_picture(fig, "--out", out, dpi=110)
    finally:
        plt.close(fig)
    if problem:
        return error(problem)
    print(f"wrote {out}: {len(files)} ranks")
    return 0


def bad_event(trace):
    """What in `trace` (a dict with a traceEvents list) this tool and common.profiling.segments() cannot read, or
    None: each timed event ("ph" "X" with a "dur") needs a string "name", numbers "ts" and "dur", and a "tid", a GPU's
    an "args" object; distributedInfo's world_size and completeSteps, where there, are counts."""
    number = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
    info = trace.get("distributedInfo", {})
    if not isinstance(info, dict) or not isinstance(info.get("world_size", 1), int):
        return "distributedInfo has no world_size count"
    if not isinstance(trace.get("completeSteps", 0), int):
        return "completeSteps is not a count"
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            return f"traceEvents[{i}] is not an object"
        if e.get("ph") != "X" or "dur" not in e:
            continue
        missing = [key for key in ("name", "ts", "dur", "tid") if key not in e]
        if missing:
            return f"traceEvents[{i}], a timed event, has no {' or '.join(map(repr, missing))}"
        if not isinstance(e["name"], str) or not number(e["ts"]) or not number(e["dur"]):
            return f"traceEvents[{i}]'s name is not a string, or its ts or dur not a number"
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver") and not isinstance(
                e.get("args"), dict):
            return f"traceEvents[{i}], a {e['cat']} event, has no args object"
    return None


def error(message):
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
