"""Meters, top-k accuracy, rank-0 printing, one-line errors and the RESULT line."""

import contextlib
import datetime
import faulthandler
import gc
import itertools
import json
import math
import multiprocessing
import os
import re
import resource
import signal
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist


def _rank():
    # Before init_process_group the launcher's RANK is the only source; after it, ask the group.
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def _world_size():
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


DIE_GRACE_SECONDS = 5


def _write_line(stream, text):
    # One write() of the whole line. print() writes the text and the newline separately, and with unbuffered
    # output (PYTHONUNBUFFERED=1, python -u: common in job scripts) lines that two ranks print at the same
    # moment come out spliced together ("...eta=0:00:00[rank 1] error: ...").
    stream.write(f"{text}\n")
    stream.flush()


def print0(*args):
    """print() on rank 0 only, flushed, so N processes do not print N interleaved copies."""
    if _rank() == 0:
        _write_line(sys.stdout, " ".join(map(str, args)))


def _error_line(message, all_ranks):
    prefix = f"[rank {_rank()}] " if all_ranks else ""
    _write_line(sys.stderr, f"{prefix}error: {message}")


def die(message, code=2, all_ranks=False):
    """Exit with one line on stderr. all_ranks=False: the error is the same everywhere, so each node's local
    rank 0 says it (on one node: rank 0 alone); all_ranks=True: every rank says what it saw."""
    local_rank = int(os.environ.get("LOCAL_RANK", _rank()))
    if all_ranks or local_rank == 0:
        _error_line(message, all_ranks)
    elif _world_size() > 1:
        # A launcher stops every rank the moment one exits: if rank 1 got here first, rank 0 would be killed
        # before printing and the job would fail without a word. Rank 0 meets the same check at about the same
        # time and exits within this wait (a heuristic: a rank 0 slower by more than this loses its line).
        time.sleep(DIE_GRACE_SECONDS)
    if dist.is_available() and dist.is_initialized():
        _leave(code)  # with a process group up, a normal exit can abort in its destructors (see _leave)
    sys.exit(code)


def first_line(exc):
    """An exception's first line: torch's errors go on for lines (C++ frames, advice) after what happened."""
    return (str(exc).strip().splitlines() or [""])[0]


class OneLineError(Exception):
    """An error whose message says all the user needs (which file, which sample): printed as one line."""

    code = 1  # the exit code
    all_ranks = True  # each rank says what it saw; False: the same verdict everywhere, said once per node

    def __init__(self, message, all_ranks=None):
        super().__init__(message)
        if all_ranks is not None:  # this error's own, where its class's default does not fit
            self.all_ranks = all_ranks


# The first line of the errors a rank meets when a peer hangs or dies, in gloo's words and NCCL's (a
# DistBackendError; by default NCCL's watchdog aborts the process instead, and launch.sh names the SIGABRT).
TIMEOUT_MARKERS = ("Timed out waiting",  # gloo
                   "Watchdog caught collective operation timeout", "timed out in blocking wait")  # NCCL
LOST_PEER_MARKERS = ("Connection reset by peer", "Connection closed by peer",  # gloo
                     "remote process exited or there was a network error", "ncclRemoteError")  # NCCL
# torch's DETAIL debug level (--debug-collectives): before each collective the ranks compare what they are about to
# call (the op, the tensors' shapes, dtypes and devices), and each raises this where they differ.
MISMATCH_MARKER = "Detected mismatch between collectives on ranks"
# Under DETAIL a collective starts with a monitored barrier, which names the ranks that did not reach it in time.
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?")


def mismatch_line(text):
    """DETAIL's mismatch error (a paragraph of C++ options) as one line: what each rank called, and how they differ."""
    calls = []
    for rank, number, op, shape, dtype in _FINGERPRINT.findall(text):
        tensors = f" of shape [{shape}] {dtype}" if dtype else ""
        calls.append((int(rank), f"rank {rank} called {op}{tensors} (its collective number {number} on that group)"))
    differ = " ".join(text.partition("Collectives differ in the following aspects:")[2].split())
    if len(calls) < 2:
        return f"the ranks called different collectives ({first_line(text)[:300]})"
    said = ", ".join(call for _, call in sorted(calls))
    return f"the ranks called different collectives: {said}" + (f"; they differ in: {differ}" if differ else "")


# A hang's stacks (issue 42). tools/torchrun.py names a folder in STACKS_ENV for its ranks; each rank registers
# faulthandler there for STACK_SIGNAL, and a rank that meets a collective timeout or a lost peer writes its own stack
# and its error line there instead of printing the line. The launcher then signals the ranks still running, prints
# every rank's stack in rank order, then the error lines, then stops the job (tools/torchrun.py: show_stacks).
STACKS_ENV = "LAUNCH_STACKS_DIR"
STACK_SIGNAL = signal.SIGUSR2  # SIGUSR1 is left for a preemption save; SIGINT and SIGTERM stop the job
_stack_file = []  # the open file faulthandler writes to (it must stay open)


def _stacks_file(kind):
    folder = os.environ.get(STACKS_ENV)
    return os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.{kind}") if folder else None


def _stack_on_signal():
    """faulthandler's handler is C: it writes the Python frames of every thread even while this rank is blocked inside
    a C++ collective, where a Python signal handler would never run. The file exists from now on: the launcher signals
    only a rank whose file exists (before it, STACK_SIGNAL would end the process)."""
    path = _stacks_file("stack")
    if path is None or _stack_file or threading.current_thread() is not threading.main_thread():
        return
    _stack_file.append(open(path, "w"))
    faulthandler.register(STACK_SIGNAL, file=_stack_file[0], all_threads=True)


def _stop_answering():
    """faulthandler lets go of the signal, which is ignored from now on (its default action would end the process)."""
    if _stack_file:
        faulthandler.unregister(STACK_SIGNAL)
    signal.signal(STACK_SIGNAL, signal.SIG_IGN)


def _no_stack_on_signal():
    """Once main() is over (at the interpreter's exit faulthandler would let go of the signal): ignore it, then the
    file goes, and the launcher signals this rank no more."""
    if _stack_file:
        _stop_answering()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_stack_file[0].name)


def _frame_lines(frames):
    """faulthandler's own format, most recent call first: what the launcher reads back for every rank alike."""
    return [f'  File "{filename}", line {lineno} in {name}' for filename, lineno, name in reversed(frames)]


def _own_stack(exc):
    """This rank's stack where the collective failed: the exception's frames from main() down (one_line_errors' own
    frame left out), under the frames that called main(); the other threads as they are now."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name == "one_line_errors":
        tb = tb.tb_next
    if tb is None:
        return []
    caller = tb.tb_frame.f_back  # None where main() runs in the module's own `with one_line_errors():`
    main = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(caller)] if caller is not None else []
    while tb is not None:
        main.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident != threading.main_thread().ident:
            others = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)]
            lines += [f"Thread 0x{ident:016x} (most recent call first):", *_frame_lines(others), ""]
    return lines + [f"Current thread 0x{threading.main_thread().ident:016x} (most recent call first):",
                    *_frame_lines(main)]


def _hang_line(message, exc):
    """The error line of a collective timeout or a lost peer. Under tools/torchrun.py it goes to this rank's file
    with the stack, for the launcher to print after every rank's stack; elsewhere, to stderr as any error line."""
    path = _stacks_file("failed")
    if path is None:
        _error_line(message, all_ranks=True)
        return
    _stop_answering()  # the launcher may signal this rank meanwhile: it has its stack
    text = "\n".join([f"[rank {_rank()}] error: {message}", *_own_stack(exc)]) + "\n"
    with open(path + ".tmp", "w") as f:  # whole or not at all: the launcher reads it the moment it appears
        f.write(text)
    os.replace(path + ".tmp", path)


def _leave(code):
    # With a process group whose peers are gone, a normal exit can die in its C++ destructors ("terminate called
    # without an active exception", SIGABRT) instead of exiting with `code`. Nothing is left to save: leave now.
    # os._exit skips the exit handler of multiprocessing that stops a process's daemon children, so stop them here:
    # the DataLoader's workers. One that Ctrl-C had already taken out of its loop (it gets the SIGINT too) no longer
    # checks whether its rank is alive, and could block for good in its own exit, holding the job's output open.
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What unpickling a batch raises when the worker that sent it has exited (its descriptor server is gone). Not every
# OSError: "Too many open files" (EMFILE) raised there must still be seen.
WORKER_GONE = (ConnectionRefusedError, ConnectionResetError, FileNotFoundError, EOFError)


def _quiet_pin_memory_thread(previous):
    """A threading.excepthook that drops one exception: the DataLoader's pin-memory thread (CUDA runs, pin_memory=True)
    dying of WORKER_GONE while it unpickles a batch, because the worker that sent it has exited. A batch
    crosses the process boundary as a file descriptor the receiver fetches from the sender, so a worker that is gone
    leaves "ConnectionRefusedError" (or FileNotFoundError) in the thread. Ctrl-C does exactly that: the signal reaches
    each rank's workers and main thread at once, and without this every rank prints half a traceback before it exits
    (tests/test_gpu.py drill 7). Nothing is lost: a worker that died otherwise is reported by the DataLoader itself in
    the main thread ("DataLoader worker (pid N) is killed by signal", or "Pin memory thread exited unexpectedly")."""
    def hook(args):
        gone = args.exc_type is not None and issubclass(args.exc_type, WORKER_GONE)
        if gone and any(frame.name == "_pin_memory_loop" for frame in traceback.extract_tb(args.exc_traceback)):
            return
        previous(args)
    hook.quiet_pin_memory = True
    return hook


def _ctrl_c_leaves(pid):
    """A SIGINT handler for a rank of a job: leave at once, exit 130, wherever the signal lands. Python's own handler
    raises KeyboardInterrupt at the next bytecode, and that can be inside contextlib's __exit__ while a rank is
    already unwinding from an error (a peer that took Ctrl-C first reset the connection): then it escapes
    one_line_errors with a traceback on that rank (tests/test_gpu.py drill 7). In another process (a DataLoader worker
    forked from this one) and before the process group starts: KeyboardInterrupt, as Python's handler would."""
    def handler(signum, frame):
        if os.getpid() == pid and dist.is_available() and dist.is_initialized():
            _leave(130)
        raise KeyboardInterrupt
    return handler


@contextlib.contextmanager
def one_line_errors(ctrl_c=True):
    """Around main(): the failures a user causes or meets get one line and an exit code instead of a traceback
    per rank. OneLineError: its message. A rank whose peer died, or that waited at a collective the others
    never joined, says which of the two it was (the peer's own error is above, or in the launcher's report).
    Ctrl-C (ctrl_c=True): exit 130 quietly; under torchrun, launch.sh says it once. Anything else keeps its
    traceback. A collective timeout or a lost peer under tools/torchrun.py (launch.sh): the launcher shows every
    rank's Python stack, in rank order, then the error lines (_hang_line).

    After a normal return it freezes the garbage collector (gc.freeze): the interpreter's exit would otherwise walk
    every object torch and torchvision made in one last collection, 0.5-0.9 s of CPU in each process of a job.
    Nothing the recipes need is left to it: their files, loaders and process group are closed by then. It is for a
    script's main(), which the process leaves next: code that goes on running after it (a notebook) would never
    collect the reference cycles alive at that moment.

    From its start on (for the rest of the process), a DataLoader pin-memory thread whose worker is gone dies quietly
    (_quiet_pin_memory_thread)."""
    if not getattr(threading.excepthook, "quiet_pin_memory", False):  # once per process, for its lifetime
        threading.excepthook = _quiet_pin_memory_thread(threading.excepthook)
    previous_sigint = signal.getsignal(signal.SIGINT)
    own_sigint = (ctrl_c and previous_sigint is signal.default_int_handler
                  and threading.current_thread() is threading.main_thread())
    if own_sigint:  # Ctrl-C leaves quietly wherever it lands, not only where KeyboardInterrupt reaches the except below
        signal.signal(signal.SIGINT, _ctrl_c_leaves(os.getpid()))
    _stack_on_signal()  # under tools/torchrun.py: this rank's stack on the launcher's signal, when another one hangs
    try:
        yield
        gc.freeze()
    except OneLineError as exc:
        die(str(exc), code=exc.code, all_ranks=exc.all_ranks)
    except KeyboardInterrupt:
        if not ctrl_c:
            raise
        if dist.is_available() and dist.is_initialized():
            _leave(130)
        sys.exit(130)
    except RuntimeError as exc:  # torch.distributed.DistBackendError is one too
        first = first_line(exc)
        unused = _unused_parameters(exc)
        if unused:  # the same model on every rank: said once per node, exit 1
            die(unused, code=1)
        if any(marker in first for marker in TIMEOUT_MARKERS):
            why = "another rank did not join a collective within --dist-timeout: it hangs, or the ranks took different"
            _hang_line(f"{why} branches ({first})", exc)
        elif any(marker in first for marker in LOST_PEER_MARKERS):
            _hang_line(f"lost the connection to another rank: it failed or was killed ({first})", exc)
        elif missing := _MISSING.search(first):
            _hang_line(f"rank {missing[1].strip()} did not reach this collective within --dist-timeout: it hangs, "
                       f"or it took another branch ({first})", exc)
        elif MISMATCH_MARKER in first:
            _hang_line(mismatch_line(str(exc)), exc)
        else:
            raise
        _leave(1)
    finally:
        if own_sigint:
            signal.signal(signal.SIGINT, previous_sigint)
        _no_stack_on_signal()


def _unused_parameters(exc):
    """DDP's error for parameters that got no gradient (a page of text naming indices), as one line naming them, or
    None. DDP raises it at the start of the next forward, so the DistributedDataParallel whose forward raised it is in
    the traceback (a frame's `self`): the names come from its module, and the training loop needs no try/except of its
    own. An error that mentions find_unused_parameters from anywhere else (backward's "mark a variable ready only
    once") is not this one: None, and it keeps its traceback."""
    if "find_unused_parameters" not in str(exc):
        return None
    from torch.nn.parallel import DistributedDataParallel

    from common.models import unused_parameters_error

    tb = exc.__traceback__
    while tb is not None:
        wrapper = tb.tb_frame.f_locals.get("self")
        if isinstance(wrapper, DistributedDataParallel):
            return unused_parameters_error(exc, wrapper.module)
        tb = tb.tb_next
    return None


class AverageMeter:
    """Running sum and count; all_reduce() makes them global so every rank reports the same average.

    update() takes a float or a tensor. A tensor is summed where it lives, so on a GPU the training loop never
    waits for the device (loss.item() every step would: the CPU could not queue step N+1 while step N runs);
    reading .avg is the one sync, at the end of the epoch."""

    def __init__(self):
        self.sum = 0.0
        self.count = 0

    def update(self, value, n=1):
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float64)  # fp64 sums: fp32 drifts over a long epoch
        self.sum = self.sum + value * n
        self.count += n

    @property
    def avg(self):
        return float(self.sum) / max(self.count, 1)

    def all_reduce(self, device, ride=None):
        """Sum over ranks (no-op without a process group). device: cuda for nccl, cpu for gloo. ride: a Throughput
        whose epoch own_ms goes along in the same all-reduce (each rank's number at its index, zeros elsewhere: the
        sum is every rank's), so the epoch line's spread costs no collective of its own."""
        world, rank = _world_size(), _rank()
        own = [0.0] * world
        if ride is not None:
            own[rank] = ride.own_ms
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([float(self.sum), float(self.count), *own], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            self.sum, self.count, own = t[0].item(), int(t[1].item()), t[2:].tolist()
        if ride is not None:
            ride.own_ms_per_rank = own
        return self


class Throughput:
    """Training speed with the first step left out: it pays the warm-up (allocator, cudnn autotune,
    DDP bucket rebuild). start() as an epoch begins, step(images) after each optimizer step, stop() as the
    epoch's steps end (it returns the epoch's seconds).

    On a GPU the host runs ahead of the device by up to the launch queue, so the host clock alone counts images
    not yet computed. The clock is read after synchronize() at the boundaries only (start, the first step,
    stop), never per step: a sync per step would stall the queue this class measures. On the CPU synchronize()
    is a no-op, so the same lines run there."""

    def __init__(self, device):
        self.synchronize = torch.get_device_module(device.type).synchronize  # torch.cuda's, torch.cpu's, ...
        self.device = device
        self.images, self.seconds, self.steps = 0, 0.0, 0
        self.first_step_at = None  # unix time the first step ended: launch-to-first-step overhead
        self._epoch_start = self._since = None
        self._images = self._steps = 0  # this epoch's, counted from _since
        # watch(): this rank's own work per step, in ms (the epoch's mean), and every rank's after all_reduce(ride=)
        self.own_ms, self.own_ms_per_rank = 0.0, None
        self._step_end = self._forward_start = None  # stamps: time.monotonic(), or (a forward's) a CUDA event
        self._own_step, self._own_epoch = [], []  # (start, end) stamp pairs: this step's, this epoch's

    def watch(self, model, forward=None):
        """Time this rank's own work in each training step, the part no other rank can slow down: from the end of
        the last step (step(), after the loop's own logging) until `model` (what the loop calls) is called, i.e.
        waiting for data, plus the forward of `forward` (DDP: model.module, which runs after DDP's broadcast of the
        buffers, a wait for every rank, and before backward's gradient all-reduce, another). Leave forward out where
        the forward itself waits for other ranks (FSDP's all-gathers, tensor parallel's all-reduces, SyncBatchNorm's
        all-gathers): the data wait alone. A straggler, slow in its data or its forward, shows as the largest
        own_ms; under DDP every rank's wall-clock step is the same, since the others wait for it. With gradient
        accumulation: the first micro-batch's data wait and every micro-batch's forward.
        Forward hooks, local. The data wait is the host's clock (on a GPU too: a wait the GPU's queue hides is still
        the rank's); the forward, on a GPU, CUDA events read at stop(): no sync per step."""
        model.register_forward_pre_hook(self._called, prepend=True)  # before any other pre-hook (FSDP's gather)
        if forward is not None:
            forward.register_forward_pre_hook(self._forward_starts)
            forward.register_forward_hook(self._forward_ends)

    def _stamp(self):
        """The forward's marks: a recorded CUDA event on a GPU, else the clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.monotonic()  # (perf_counter is the epoch's clock, read after a sync)

    def _called(self, *_):
        if self._step_end is not None:  # the step's first call (micro-batches: later calls follow a backward)
            self._own_step.append((self._step_end, time.monotonic()))
            self._step_end = None

    def _forward_starts(self, *_):
        if self._epoch_start is not None:
            self._forward_start = self._stamp()

    def _forward_ends(self, *_):
        if self._forward_start is not None:
            self._own_step.append((self._forward_start, self._stamp()))
            self._forward_start = None

    def _now(self):
        self.synchronize(self.device)
        return time.perf_counter()

    def start(self):
        self._epoch_start = self._since = self._now()
        self._images = self._steps = 0
        self._step_end, self._own_step, self._own_epoch = time.monotonic(), [], []

    def step(self, images):
        if self.first_step_at is None:  # the warm-up step: measured from its end
            self._since = self._now()
            self.first_step_at = time.time()
        else:
            self._images += images
            self._steps += 1
            self._own_epoch += self._own_step
        self._own_step, self._step_end = [], time.monotonic()

    def stop(self):
        """The epoch's seconds, start() to now; adds its steps (the first step of the run left out)."""
        now = self._now()  # after synchronize(): every recorded event has completed
        if self.first_step_at is not None:
            self.images, self.steps = self.images + self._images, self.steps + self._steps
            self.seconds += now - self._since
        self.own_ms = sum(1000 * (b - a) if isinstance(a, float) else a.elapsed_time(b)  # clock, or events
                          for a, b in self._own_epoch) / max(self._steps, 1)  # an epoch of the warm-up step alone: 0
        seconds, self._images, self._steps = now - self._epoch_start, 0, 0
        self._epoch_start = self._step_end = self._forward_start = None  # eval's forwards are not timed
        self._own_step, self._own_epoch = [], []
        return seconds

    @property
    def spread(self):
        """The epoch line's field: own_ms=MIN-MAX over ranks, their ratio and the slowest rank (after
        AverageMeter.all_reduce(ride=this)); empty before that, or where watch() was not called."""
        ranks = self.own_ms_per_rank
        if not ranks or not max(ranks) > 0:
            return ""
        slowest = max(range(len(ranks)), key=ranks.__getitem__)
        ratio = f"{max(ranks) / min(ranks):.2f}" if min(ranks) > 0 else "-"
        return f" own_ms={min(ranks):.1f}-{max(ranks):.1f}(max/min {ratio}, rank {slowest})"

    @property
    def running(self):
        """Between start() and stop()."""
        return self._epoch_start is not None

    @property
    def images_per_sec(self):
        return self.images / self.seconds if self.seconds else 0.0

    def eta(self, steps_left):
        return datetime.timedelta(seconds=round(steps_left * self.seconds / max(self.steps, 1)))


def accuracy(output, target, topk=(1,)):
    """Top-k accuracy in percent of the batch, one 0-d tensor per k, on the output's device (no host sync)."""
    maxk = min(max(topk), output.size(1))
    pred = output.topk(maxk, dim=1).indices
    correct = pred.eq(target.unsqueeze(1))
    return [correct[:, : min(k, maxk)].any(dim=1).float().mean() * 100.0 for k in topk]


def peak_memory_mb(device):
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def human(size):
    """Bytes for a person: 812 kB, 1.4 MB, 3.2 GB."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.0f} kB"


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return value


def result_line(**fields):
    """The one machine-readable line tests, benchmarks and scripts grep for: RESULT {json}. Strict JSON: a value
    that is not finite (a NaN loss) is written as null, which jq and JSON.parse accept; NaN they refuse."""
    return "RESULT " + json.dumps(_strict(fields), sort_keys=False, allow_nan=False)


def nonfinite_flags(args):
    """The float flags given as nan or inf (argparse's float() takes both, and `--lr nan <= 0` is False)."""
    return [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()
            if isinstance(value, float) and not math.isfinite(value)]


def local_shard(t):
    """This rank's part of a tensor: a sharded DTensor's local shard (FSDP), any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


# ------------------------------------------------------------------------------------------- divergence
DIVERGED = 3  # the exit code of a run stopped because it diverged (docs/failures.md)


class Diverged(OneLineError):
    code = DIVERGED
    all_ranks = False  # every rank reached the same verdict (all_reduce_and_check): said once


class DivergenceCheck:
    """Stops a run whose loss stopped being finite, before it writes a file from its weights.

    update(step, loss) after each optimizer step keeps, on the loss's device, the first step whose loss was not
    finite: no host sync, so a GPU loop keeps queueing ahead. all_reduce_and_check() is read where a recipe reads
    values anyway (each epoch's end, the TensorBoard steps): it is a collective, an all-reduce (MIN) of the first bad
    step, so every rank reaches the same verdict even when one rank alone met a bad batch, and no rank is left
    waiting in a collective the others skipped. It raises Diverged (exit 3, one line) on every rank.

    fp16 with a loss scaler: a step whose gradients overflow is skipped and the scale halved, which is normal, so
    such recipes do not call update(); they pass loss_scale= to the check, and a scale below 1 (17 skips in a row
    from 65536: the gradients overflow fp16 even unscaled) is divergence."""

    NEVER = 2**62

    def __init__(self, device):
        self.first_bad = torch.full((), self.NEVER, dtype=torch.int64, device=device)
        self.checked = 0  # the last step found good
        # The newest checkpoint this run wrote (or resumed from): the recipe sets it. Named only where it exists: a
        # language model sets its latest.pt once, which a save writes only when the checkpoint is whole.
        self.last_good = None

    def update(self, step, loss):
        finite = torch.isfinite(loss.detach()).to(self.first_bad.device, non_blocking=True)  # model parallel: 2 GPUs
        self.first_bad = torch.minimum(self.first_bad, torch.where(finite, self.NEVER, step))

    def all_reduce_and_check(self, epoch, step, loss_scale=None, model=None):
        """A collective: every rank calls it at the same steps. epoch counts from 0, as the loops do. model: also
        check its parameters and buffers (this rank's shards), as before a save: an fp16 run's skipped steps keep
        the weights finite, but its BatchNorm statistics take in the overflowing activations all the same."""
        scale_bad = step if loss_scale is not None and not loss_scale >= 1 else self.NEVER
        weights_bad = self.NEVER
        if model is not None:
            tensors = [local_shard(t) for t in itertools.chain(model.parameters(), model.buffers())
                       if t.is_floating_point()]
            # .to(): a model split over two GPUs (ddp_spawn --model-parallel) gives flags on both
            finite = torch.stack([torch.isfinite(t).all().to(self.first_bad.device) for t in tensors]).all()
            weights_bad = torch.where(finite, self.NEVER, step).to(self.first_bad.device)
        verdict = torch.stack([self.first_bad, torch.as_tensor(scale_bad, device=self.first_bad.device),
                               torch.as_tensor(weights_bad, device=self.first_bad.device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
        loss_bad, scale_bad, weights_bad = verdict.tolist()
        if loss_bad == scale_bad == weights_bad == self.NEVER:
            self.checked = step
            return
        what = (f"the training loss stopped being finite at step {loss_bad}" if loss_bad != self.NEVER else
                "the fp16 loss scale fell below 1 (every step skipped for overflowing gradients)"
                if scale_bad != self.NEVER else
                "the loss stayed finite, but the weights or BatchNorm statistics did not")
        kept = (f"the last good checkpoint is {self.last_good}" if self.last_good and os.path.exists(self.last_good)
                else "this run wrote no checkpoint")
        where = "" if epoch is None else f"in epoch {epoch + 1}, "  # None: a step-based run (the language models)
        raise Diverged(f"training diverged {where}steps {self.checked + 1}-{step}: {what}. Nothing "
                       f"was saved from these weights; {kept}. Likely causes: a learning rate too high for this "
                       "batch (--lr), fp16 without a loss scaler, or inf/NaN in the data")



def gather_values(value, device):
    """Every rank's `value` (a number, or a list of numbers of the same length on every rank), in rank order, on
    every rank: a collective (a world of one: [value]).

    It returns once the process group has let go of the tensors it sent. gloo's worker thread frees a finished
    collective's tensors a moment after the caller moves on; when that is a run's last collective and the moment
    falls after Python has begun to shut down, the freeing thread aborts the whole process (SIGABRT, "terminate
    called without an active exception") after a run that succeeded: 4 of 75 benchmark runs here. Waiting for the
    tensors' weak references to die, while Python is still running, rules that out for these tensors."""
    value = [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    mine = torch.tensor(value, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    values = [t.tolist() for t in everyone]  # a 0-d tensor's: a float
    refs = [weakref.ref(t) for t in (mine, *everyone)]
    del mine, everyone
    deadline = time.monotonic() + 10
    while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
        time.sleep(0.001)  # with the GIL released, so the worker thread can free them
    return values
