"""--profile: torch.profiler over a few training steps, one Chrome/Perfetto trace per rank, and where each rank's step
time goes. Plumbing, not a lesson: recipes reach it as harness.Profiler and harness.gather_profile_table.

    prof = harness.Profiler(args.profile, args.out_dir, rank, device)   before the loop (off: every call is a no-op)
    prof.step()                                                          after each optimizer step
    prof.stop()                                                          after the loop: writes what it recorded
    print0(harness.gather_profile_table(prof, device))                   a COLLECTIVE (all-gather): the table

The schedule skips the first STEPS_SKIPPED steps (the warm-up: allocator, cuDNN autotuning, DDP's bucket rebuild,
DataLoader workers starting), then records STEPS_RECORDED steps. A run that stops sooner writes the steps it recorded;
one that stops before the first recorded step writes nothing and says so.

How a step is cut (breakdown()): each instant of the recorded steps gets one label, so the shares add up to 100%.
  data           the loop waits for its next batch (torch's `enumerate(DataLoader)#...` range, or a range named
                 "data" where the batches come from elsewhere or from a prefetching thread)
  optimizer      optimizer.step() and zero_grad() (torch's `Optimizer.step#...` ranges)
  compute        forward and backward: the CPU's operators on the training threads, or on a GPU its kernels
  communication  a collective runs and nothing above does: the rank waits for the others (exposed communication)
  (overlapped)   a collective runs while compute does: hidden behind it, counted in compute, shown on its own
  idle           none of these: Python, kernel launches, waiting for the GPU, a sleeping rank
On a GPU the labels come from the GPU's timeline (its kernels; NCCL's are communication; those launched inside the
optimizer's range are the optimizer's) and data only counts while the GPU has nothing to run. On the CPU the labels
come from the training thread (the one that calls prof.step()), except gloo's collectives, which run on gloo's own
threads and are counted from their start to their end.
"""

import bisect
import json
import os
import re

import torch

from common.utils import gather_values

STEPS_SKIPPED = 2  # the run's first steps: warm-up (the second one is the profiler's own warm-up)
STEPS_RECORDED = 4
_WAITS = re.compile(r"c10d|wait_tensor")  # c10d::allreduce_, _c10d_functional::wait_tensor, ...: collectives
LABELS = ("compute", "communication", "data", "optimizer", "idle")  # add up to 100%; "overlapped" is inside compute


class Profiler:
    """torch.profiler for --profile; a no-op when enabled is False. Local: no collective."""

    def __init__(self, enabled, out_dir, rank, device):
        self.path = os.path.join(out_dir, "profile", f"trace_rank{rank}.json")
        self.shares, self.prof, self.calls, self._recorded = None, None, 0, False
        if not enabled:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # torch's CUDA build on a machine without one: Kineto logs "ERROR ... gpuGetDeviceCount failed"
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when the profiler first starts; 6: silent
        schedule = torch.profiler.schedule(skip_first=STEPS_SKIPPED - 1, wait=0, warmup=1, active=STEPS_RECORDED,
                                           repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._save)
        self.prof.start()

    def step(self):
        if self.prof is not None:
            self.calls += 1
            self.prof.step()

    def stop(self):
        """Stops the profiler and writes the trace: here, after training, not at step 6 inside the loop (that would
        stall a step and count as its data wait). Local."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        complete = min(self.calls - STEPS_SKIPPED, STEPS_RECORDED)  # a run cut short: its last recorded step runs
        if not self._recorded or complete < 1:  # on to stop(), through eval and the save; none before: nothing
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        with open(self.path) as f:
            trace = json.load(f)
        trace["completeSteps"] = complete  # for tools/plot_profile.py: the steps that are whole training steps
        with open(self.path, "w") as f:
            json.dump(trace, f)
        self.shares = breakdown(trace, complete=complete)

    def _save(self, prof):
        self._recorded = True  # the schedule's end (or stop()): the results stay in `prof` until stop() writes them


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return merged


def _inside(ts, ranges):
    """Whether ts falls in one of the merged `ranges`."""
    i = bisect.bisect_right(ranges, [ts, float("inf")]) - 1
    return i >= 0 and ranges[i][0] <= ts < ranges[i][1]


def segments(trace, complete=None):
    """A Chrome trace (torch.profiler's export_chrome_trace, as a dict) -> (the recorded steps' (start, end) in us,
    and the labelled pieces (start, end, label) that cover them: label one of LABELS, or "both" (compute and a
    collective at once)), or None where no step was recorded. complete: how many recorded steps to count, the first
    ones (the rest ran on after training). See the module's docstring."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])  # the host's (a GPU's timeline repeats them as gpu_user_annotation)
    marks = marks[:complete] if complete is not None else marks
    if not marks:
        return None
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in marks]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    # The training thread's ranges (the one that steps the profiler): a prefetching thread's loader is not a wait.
    host = [e for e in events if e["tid"] == marks[0]["tid"] and e.get("cat") in ("cpu_op", "user_annotation")]
    data = _union(span(e) for e in host if e["name"].startswith("enumerate(DataLoader)#") or e["name"] == "data")
    optimizer = _union(span(e) for e in host if e["name"].startswith(("Optimizer.step#", "Optimizer.zero_grad#")))
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    comm = [span(e) for e in events if e["name"].startswith("gloo:")]  # on gloo's own threads, start to end
    start, end = min(s for s, _ in steps), max(e for _, e in steps)
    if device:  # a GPU: its timeline; a kernel launched in the optimizer's range is the optimizer's
        launches = {e["args"].get("correlation"): e["ts"] for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver")}
        launched = lambda e: launches.get(e["args"].get("correlation"), e["ts"])  # noqa: E731
        device = [e for e in device if start <= launched(e) < end]  # launched in the recorded steps
        # The optimizer's: launched (as the trace shows) inside its range; NCCL's stay communication (ZeRO's).
        optimizer = _union(span(e) for e in device if not is_comm(e) and _inside(
            launches.get(e["args"].get("correlation"), -1.0), optimizer))
        comm += [span(e) for e in device if is_comm(e)]
        compute = _union(span(e) for e in device if not is_comm(e))
        end = max([end] + [e["ts"] + e["dur"] for e in device])  # the GPU trails the host: to its last kernel's end
        order = ("optimizer", "both", "compute", "communication", "data")
        waits = []
    else:  # the CPU: the training thread's operators (forward, backward: CPU autograd runs on the caller's thread),
        # less those that wait for a collective (DTensor's wait_tensor, and the operators around it)
        compute = _union(span(e) for e in host if e.get("cat") == "cpu_op")
        waits = _union(span(e) for e in host if e.get("cat") == "cpu_op" and _WAITS.search(e["name"]))
        order = ("data", "wait", "optimizer", "both", "compute", "communication")
    sets = {"data": data, "optimizer": optimizer, "compute": compute, "communication": _union(comm), "waits": waits}
    # Sweep: cut [start, end) at every boundary; each piece takes the first label of `order` active in it ("both":
    # compute and communication at once); neighbours with one label are one piece.
    cuts = sorted({start, end, *(t for ranges in sets.values() for r in ranges for t in r if start < t < end)})
    pieces = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        active = {name for name, ranges in sets.items() if _inside((a + b) / 2, ranges)}
        if "waits" in active:  # an operator blocked on a collective is not computing
            active.discard("compute")
        if {"compute", "communication"} <= active:
            active.add("both")
        elif "communication" in active:  # a collective and no compute: waiting, also inside optimizer.step (ZeRO)
            active.add("wait")
        label = next((name for name in order if name in active), "idle")
        label = "communication" if label == "wait" else label
        if pieces and pieces[-1][2] == label and pieces[-1][1] == a:
            pieces[-1] = (pieces[-1][0], b, label)
        else:
            pieces.append((a, b, label))
    return steps[:-1] + [(steps[-1][0], end)], pieces  # the last step runs on to the GPU's last kernel


def breakdown(trace, complete=None):
    """segments(), summed: {"steps": N, "step_ms": the mean recorded step, and each of LABELS plus "overlapped": its
    share of the steps in %, the five LABELS adding up to 100}, or None where no step was recorded."""
    cut = segments(trace, complete)
    if cut is None:
        return None
    steps, pieces = cut
    start, end = steps[0][0], steps[-1][1]
    totals = dict.fromkeys((*LABELS, "both"), 0.0)
    for a, b, label in pieces:
        totals[label] += b - a
    whole = (end - start) or 1.0
    shares = {name: 100 * totals[name] / whole for name in totals}
    shares["compute"] += shares.pop("both")
    shares["overlapped"] = 100 * totals["both"] / whole
    return {"steps": len(steps), "step_ms": (end - start) / 1000 / len(steps), **shares}


def gather_profile_table(profiler, device):
    """Every rank's breakdown, as a table for rank 0 to print. A COLLECTIVE (an all-gather): every rank calls it."""
    row = profiler.shares or {}
    rows = gather_values([row.get(k, float("nan")) for k in ("steps", "step_ms", *LABELS, "overlapped")], device)
    where = os.path.join(os.path.dirname(profiler.path), "trace_rank*.json")
    recorded = [r for r in rows if r[0] == r[0]]  # NaN: that rank recorded nothing
    if not recorded:
        return (f"profile: nothing recorded: the run ended before step {STEPS_SKIPPED + 1}, the first one profiled "
                f"(steps 1-{STEPS_SKIPPED} are warm-up); run at least {STEPS_SKIPPED + 1} steps")
    steps = sorted({int(r[0]) for r in recorded})  # ranks with uneven inputs (ddp_uneven.py) may differ
    lines = [f"profile: this run's steps {STEPS_SKIPPED + 1}-{STEPS_SKIPPED + steps[-1]}, traces in {where} "
             "(chrome://tracing or https://ui.perfetto.dev)",
             f"{'rank':>4} {'step_ms':>8} {'compute':>8} {'communication':>14} {'(overlapped)':>13} {'data':>6} "
             f"{'optimizer':>10} {'idle':>6}"]
    for rank, (count, step_ms, compute, comm, data, opt, idle, overlapped) in enumerate(rows):
        if count != count:
            lines.append(f"{rank:>4} nothing recorded: it took fewer than {STEPS_SKIPPED + 1} steps")
            continue
        lines.append(f"{rank:>4} {step_ms:>8.1f} {compute:>7.1f}% {comm:>13.1f}% {f'({overlapped:.1f}%)':>13} "
                     f"{data:>5.1f}% {opt:>9.1f}% {idle:>5.1f}%" + (f" ({int(count)} steps)" if len(steps) > 1 else ""))
    lines.append("shares of each rank's recorded steps: compute + communication + data + optimizer + idle = 100%; "
                 "communication is time a collective ran while the rank computed nothing (waiting for the others); "
                 "(overlapped) is collective time hidden behind compute, counted in compute")
    return "\n".join(lines)
