"""The pipeline bubble of torch's own schedules (GPipe, 1F1B), from the order each stage runs its work in.

    python tools/pp_schedule.py                              # the table: 2 and 4 stages, 2-16 microbatches
    python tools/pp_schedule.py --png docs/pp_timeline.png   # and the timeline picture (4 stages x 8 microbatches)
    python tools/pp_schedule.py --ascii 2 4                  # one timeline as text (recipes/lm_pp.py's docstring)

The order is the schedule's own: each schedule class of torch.distributed.pipelining drives a stand-in stage (no
model, no process group) through its real _step_microbatches(), and the stand-in writes down each forward (F) and
backward (B) it is asked for, in order. Why not the schedules' `pipeline_order` (their per-rank action lists): in
torch 2.14.1 Schedule1F1B's lists the last stage's forwards one microbatch late (F1..Fm instead of F0..Fm-1), which
is not what it runs (tests/test_lm_pp.py pins both).

Then a simulation of that order: every forward takes 1 unit of time, every backward 2 (a backward computes the
gradients of the activations and of the weights: twice a forward's matrix products), the stages are equal, sending
costs nothing; an action starts once its stage is free and its input is there (F of microbatch i on stage s after F
of i on s - 1; B of i on s after B of i on s + 1, or on the last stage after its own F of i). The bubble is the
share of the run a stage spends waiting: 1 - (its busy time) / (the whole run's time), the same on every stage here.
GPipe and 1F1B both come out at the theory's (p - 1) / (m + p - 1) for p stages and m microbatches: 1F1B's gain is
memory, not time (the `in flight` columns: the most microbatches whose activations a stage holds at once, m under
GPipe, p - s on stage s under 1F1B). Interleaved schedules (several stages per rank, a smaller bubble) are left
out: their runtime needs a real multi-stage set-up to drive.
"""

import argparse
import os
import sys

import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
COST = {"F": 1, "B": 2}  # the assumption: unit-time forward, a backward twice as long


class _Recorder:
    """Stands in for a PipelineStage: the schedule asks it for forwards and backwards (and sends, receives and
    shape inference, which it skips), and it writes down each F and B with its microbatch, in the order asked."""

    def __init__(self, index, count):
        self.stage_index, self.num_stages = index, count
        self.is_first, self.is_last = index == 0, index == count - 1
        self.device, self.has_backward, self.actions = torch.device("cpu"), True, []

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.actions.append(("F", mb))

    def backward_one_chunk(self, mb, **kwargs):
        self.actions.append(("B", mb))

    def _no_ops(self, *args, **kwargs):
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _get_init_p2p_neighbors_ops = _no_ops

    def _nothing(self, *args, **kwargs):
        return None

    _prepare_forward_infra = _prepare_backward_infra = clear_runtime_states = perform_reduce_grad = _nothing


def executed_order(schedule, stages, microbatches):
    """[[("F" or "B", microbatch), ...] per stage]: what each stage of `schedule` ("gpipe", "1f1b") runs in one
    training step, in order, read from the schedule class itself."""
    orders = []
    for index in range(stages):
        recorder = _Recorder(index, stages)
        runner = SCHEDULES[schedule](recorder, microbatches, loss_fn=lambda output, target: torch.zeros(()))
        runner.step(target_mbs=[None] * microbatches, return_outputs=False)
        orders.append(recorder.actions)
    return orders


def ir_order(schedule, stages, microbatches):
    """The same, as the schedule's `pipeline_order` lists it (its compute actions, without the idle slots)."""
    runner = SCHEDULES[schedule].__new__(SCHEDULES[schedule])  # _get_pipeline_order reads these two only
    runner._num_stages, runner._n_microbatches = stages, microbatches
    order = runner._get_pipeline_order()
    return [[(a.computation_type.value, a.microbatch_index) for a in order[rank]
             if a is not None and a.computation_type.value in COST] for rank in range(stages)]


def simulate(orders):
    """{(stage, kind, microbatch): (start, end)} for per-stage orders, each action as early as its stage and its
    input allow (COST's durations). Raises RuntimeError if the orders deadlock (an action waiting for one that a
    stage's earlier action waits for)."""
    stages, done, free, nxt = len(orders), {}, [0] * len(orders), [0] * len(orders)
    while any(nxt[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                need = ((s - 1, "F", mb) if s > 0 else None) if kind == "F" else (
                    (s + 1, "B", mb) if s < stages - 1 else (s, "F", mb))
                if need is not None and need not in done:
                    break
                start = max(free[s], done[need][1] if need else 0)
                done[(s, kind, mb)] = (start, start + COST[kind])
                free[s], nxt[s], progressed = start + COST[kind], nxt[s] + 1, True
        if not progressed:
            waiting = [order[n:n + 1] for order, n in zip(orders, nxt, strict=True)]
            raise RuntimeError(f"the orders deadlock: the stages wait at {waiting}")
    return done


def measure(schedule, stages, microbatches):
    """{"bubble": the share of the step each stage waits (the largest), "theory": (p - 1) / (m + p - 1),
    "time": the step in forward units, "in_flight": per stage, the most microbatches forwarded and not yet
    backwarded at once}."""
    orders = executed_order(schedule, stages, microbatches)
    spans = simulate(orders)
    total = max(end for _, end in spans.values())
    busy = [sum(COST[kind] for kind, _ in order) for order in orders]
    in_flight = []
    for order in orders:
        held = peak = 0
        for kind, _ in order:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        in_flight.append(peak)
    return {"bubble": max(1 - b / total for b in busy), "theory": (stages - 1) / (microbatches + stages - 1),
            "time": total, "in_flight": in_flight}


def table(stage_counts=(2, 4), microbatch_counts=(2, 4, 8, 16)):
    lines = ["| stages | microbatches | GPipe bubble | 1F1B bubble | (p-1)/(m+p-1) "
             "| held on stage 0: GPipe | 1F1B |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in stage_counts:
        for m in microbatch_counts:
            g = measure("gpipe", p, m)
            f = measure("1f1b", p, m) if m >= p else None  # Schedule1F1B refuses fewer microbatches than stages
            lines.append(f"| {p} | {m} | {g['bubble']:.3f} | " + (f"{f['bubble']:.3f}" if f else "refused")
                         + f" | {g['theory']:.3f} | {g['in_flight'][0]} | " + (str(f["in_flight"][0]) if f else "-")
                         + " |")
    return "\n".join(lines)


def ascii_timeline(schedule, stages, microbatches):
    """One line per stage, 3 characters a time unit: F3 a forward of microbatch 3, B3==== its backward, . idle."""
    spans = simulate(executed_order(schedule, stages, microbatches))
    total = max(end for _, end in spans.values())
    rows = []
    for s in range(stages):
        cells = [" . "] * total
        for (stage, kind, mb), (start, end) in spans.items():
            if stage == s:
                cells[start] = f"{kind}{mb}".ljust(3, "=" if kind == "B" else " ")
                for t in range(start + 1, end):
                    cells[t] = "==="
        rows.append(f"stage {s} |" + "".join(cells).rstrip() + "|")
    ruler = " " * 9 + "".join(f"{t:<3}" if t % 2 == 0 else "   " for t in range(total + 1)).rstrip()
    return "\n".join([f"{schedule}, {stages} stages x {microbatches} microbatches (time: F = 1, B = 2)", ruler,
                      *rows])


def png(path, stages=4, microbatches=8):
    """GPipe above 1F1B: which stage runs which microbatch's F or B when, and the idle time between."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 1.0 + 0.75 * 2 * stages), sharex=True)
    colors = plt.get_cmap("tab20").colors
    for ax, schedule in zip(axes, ("gpipe", "1f1b"), strict=True):
        result = measure(schedule, stages, microbatches)
        for (s, kind, mb), (start, end) in simulate(executed_order(schedule, stages, microbatches)).items():
            shade = colors[(2 * mb) % 20] if kind == "F" else colors[(2 * mb + 1) % 20]
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=shade, edgecolors="black")
            ax.text((start + end) / 2, s, f"{kind}{mb}", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        ax.invert_yaxis()
        ax.set_title(f"{'GPipe' if schedule == 'gpipe' else '1F1B'}: {stages} stages x {microbatches} microbatches, "
                     f"bubble {result['bubble']:.3f} (theory {result['theory']:.3f}); stage 0 holds "
                     f"{result['in_flight'][0]} microbatches' activations at most", fontsize=10)
    axes[-1].set_xlabel("time (a forward = 1, a backward = 2; white: the stage waits)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--png", help="write the timeline picture (4 stages x 8 microbatches, GPipe and 1F1B) here")
    p.add_argument("--ascii", nargs=2, type=int, metavar=("STAGES", "MICROBATCHES"),
                   help="print GPipe's and 1F1B's timelines for this many stages and microbatches instead")
    args = p.parse_args(argv)
    if args.ascii:
        stages, microbatches = args.ascii
        if stages < 1 or microbatches < stages:
            print(f"error: --ascii needs 1 <= STAGES <= MICROBATCHES (1F1B's rule), not {stages} {microbatches}",
                  file=sys.stderr)
            return 2
        print(ascii_timeline("gpipe", stages, microbatches) + "\n\n" + ascii_timeline("1f1b", stages, microbatches))
        return 0
    print(table())
    if args.png:
        png(args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
