"""The run's plumbing, not the lesson: what a recipe needs to fail clearly, stop a diverged run, log and be measured,
and what a researcher may delete or swap for their own tooling when copying a recipe. Recipes import this module
as one name, so every such line reads `harness.NAME(...)` and shows itself for what it is.

    harness.add_flags(parser)             --max-steps, --tb-dir, --tb-every, --profile, --debug-collectives; argparse's
                                          usage and --help once per node, not once per rank
    harness.check_flags(args, world_size) start-up: nan/inf floats, counts below their minimum, an unknown --arch
                                          or one that cannot take the run's image size, a --batch-size the processes
                                          cannot split, --sync-bn without GPUs
    harness.check_gpu(device, backend)    the rank's GPU is visible; launch.sh G:N (N ranks share GPU G): gloo
    harness.check_compiler(device)        torch.compile can build kernels here: a C++ compiler (CPU), a C compiler
                                          and Python's headers (GPU, for Triton)
    harness.cpu_amp_default()             torch_amp.py's default on a CPU: bf16 where it is native, else fp32
    harness.ddp_process_group(timeout)    DDP's group: None, or under --debug-collectives on gloo a plain one (a
                                          COLLECTIVE then): torch's DDP crashes on gloo's checked group
    harness.die(message)                  one line on stderr, exit 2 (said once per node)
    with harness.one_line_errors(): ...   around main(): a lost rank, a timeout, Ctrl-C, DDP's unused-parameter
                                          error, a bad file: one line each instead of a traceback per rank
    harness.check_full_batch(...)         a training set smaller than one global batch
    harness.check_epochs_left(...)        a resumed run that has no epoch left to train
    harness.default_workers(...)          DataLoader workers per process, from the cores this process may use
    harness.broadcast_out_dir_check(...)  --out-dir (and --tb-dir) can hold what the run writes: a COLLECTIVE
    harness.DivergenceCheck(device)       a NaN/inf loss stops the run; its all_reduce_and_check() is a COLLECTIVE
    harness.TensorBoard(...)              rank 0 writes the curves; local
    harness.Throughput(device)            epoch seconds, warm-up-free images/s, the ETA; local
    harness.Profiler(...)                 --profile: torch.profiler over steps 3-6, a trace per rank; local
    harness.gather_profile_table(...)     each rank's share of compute, communication, data, optimizer, idle: a
                                          COLLECTIVE (all-gather)
    harness.gather_result_line(...)       the RESULT line tests and benchmarks read: a COLLECTIVE (all-gather)
    harness.StopVote(flag, group)         the language models' SIGUSR1 vote: its all_reduce_max() is a COLLECTIVE
                                          (ddp_checkpoint.py writes the same lines out: the lesson is there)
    harness.StepMeter(...)                the language models' loop plumbing in one object: the loss meter, the
                                          divergence watch, the clock (tokens/s, own_ms, ETA) and --profile; local
                                          but for its methods named for their collective
    harness.CompileCounts(enabled, device)  --compile's plumbing: the toolchain checked, the counts
                                          (graphs, breaks, recompiles, the first step's time); local but for its
                                          gather_fields(), a COLLECTIVE

No function here performs a collective unless its name says so (all_reduce, broadcast, gather, or process_group:
it makes one): everything else is local and safe under `if is_main:` (tests/test_harness.py walks common/ and runs
the local ones on rank 0 alone).
"""

import collections
import os
import sys
import time

import torch
import torch.distributed as dist

from common.checkpoint import check_epochs_left
from common.compiler import missing_compiler
from common.data import DEFAULT_IMAGE_SIZE, check_full_batch, default_workers
from common.models import check_arch, check_image_size
from common.outputs import broadcast_out_dir_check, held_state_bytes, state_bytes
from common.profiling import Profiler, gather_profile_table
from common.tensorboard_log import TensorBoard
from common.utils import (
    AverageMeter,
    DivergenceCheck,
    Throughput,
    die,
    gather_values,
    nonfinite_flags,
    one_line_errors,
    peak_memory_mb,
    print0,
    result_line,
)

# The smallest value each counting flag takes, by argparse dest; check_flags() checks those a recipe has.
AT_LEAST = {"epochs": 1, "workers": 0, "accum_steps": 1, "prefetch": 1, "embedding_size": 1, "max_steps": 1,
            "image_size": 1, "synthetic_train": 1, "synthetic_val": 1, "tb_every": 1, "warmup_epochs": 0,
            "shard_size": 1, "steps": 1, "warmup_steps": 0, "eval_every": 1, "val_windows": 1,
            "save_every": 1, "aux_loss_weight": 0, "z_loss_weight": 0}  # (a negative weight trains toward the harm)
ABOVE_ZERO = ("lr", "dist_timeout", "clip_grad")  # rates and seconds: 0 is never meant


def add_flags(parser, collectives=True):
    """The harness's own flags: --max-steps (smoke runs, benchmarks), --tb-dir and --tb-every (TensorBoard), --profile
    (docs/slow.md), and where the recipe has a process group (collectives=True), --debug-collectives
    (docs/failures.md). And argparse's usage once per node (usage_once_per_node)."""
    usage_once_per_node(parser)
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (smoke runs, benchmarks)")
    parser.add_argument("--tb-dir", help="write TensorBoard curves here (rank 0): tensorboard --logdir TB_DIR")
    parser.add_argument("--tb-every", type=int, default=20, help="--tb-dir: the training loss every N optimizer steps")
    add_profile_flag(parser)
    if collectives:
        parser.add_argument("--debug-collectives", action="store_true", help="each collective first checks that "
                            "every rank called the same one, with the same shapes (torch's DETAIL level; slow)")


def usage_once_per_node(parser):
    """argparse's usage block and --help from each node's local rank 0 alone, as die() says its line: a mistyped flag
    on 8 GPUs printed 8 usage blocks. On the other ranks a bad flag goes to die() (nothing printed; exit 2 after its
    grace, so that rank 0 is not stopped before it has said it) and --help prints nothing."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        parser.error = die
        parser.print_help = lambda file=None: None


def add_profile_flag(parser):
    """--profile (the language models take it alone: their other flags differ)."""
    parser.add_argument("--profile", action="store_true", help="profile steps 3-6: OUT_DIR/profile/trace_rankR.json "
                        "per rank and a table of where each rank's step time goes (docs/slow.md)")


def ddp_process_group(timeout):
    """DDP's process_group=: None (the default group), except where the default group is torch's checked gloo group
    (--debug-collectives, or TORCH_DISTRIBUTED_DEBUG=DETAIL, on gloo): then a new plain gloo group of every rank,
    which every rank makes (a COLLECTIVE, as dist.new_group is). torch 2.14.1's DDP dies with SIGSEGV on the checked
    gloo group: its C++ Logger (set_env_variables) casts the group's gloo backend, under DETAIL a
    _ProcessGroupWrapper, to ProcessGroupGloo to read its thread count. DDP's own collectives (the gradient
    all-reduces) then go unchecked; the recipe's, on the default group, are checked. NCCL is not affected."""
    if dist.get_debug_level() != dist.DebugLevel.DETAIL or dist.get_backend() != "gloo":
        return None
    dist.set_debug_level(dist.DebugLevel.OFF)  # the level is read when a group is made: this one unchecked
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        dist.set_debug_level(dist.DebugLevel.DETAIL)


def check_flags(args, world_size=1):
    """The checks every recipe's flags share, on every rank before any collective (a bad flag fails in seconds, not
    at a timeout): one line, exit 2. Flags left None (a default the recipe fills in) are skipped. --batch-size is the
    GLOBAL batch: it must split evenly over `world_size` processes. Local."""
    if nonfinite_flags(args):  # argparse's float() takes nan and inf, and `nan <= 0` is False
        die(f"{nonfinite_flags(args)[0]} is not a finite number")
    flags = vars(args)
    for name, low in AT_LEAST.items():
        if flags.get(name) is not None and flags[name] < low:
            die(f"--{name.replace('_', '-')} {flags[name]} must be >= {low}")
    for name in ABOVE_ZERO:
        if flags.get(name) is not None and flags[name] <= 0:
            die(f"--{name.replace('_', '-')} {flags[name]} must be > 0")
    if "arch" in flags:
        # The image size the recipe will fill in (its check_args, after this) when --image-size is left out.
        default_for = flags.get("dataset") if flags.get("image_size") is None else None
        size = flags.get("image_size") or DEFAULT_IMAGE_SIZE.get(default_for)
        try:
            check_arch(args.arch)
            if size is not None:  # ViTs take 224 px only: one line here instead of a traceback per rank in training
                check_image_size(args.arch, size, default_for)
        except ValueError as exc:
            die(str(exc))
    if flags.get("sync_bn") and not torch.cuda.is_available():  # torch's SyncBatchNorm and DDP refuse CPU tensors
        die("--sync-bn needs GPUs: torch's SyncBatchNorm refuses CPU tensors; leave it out on the CPU")
    batch, accum = flags.get("batch_size"), flags.get("accum_steps") or 1  # accum: torch_amp's micro-batches
    parts = world_size * accum
    if batch is not None and (batch < parts or batch % parts):
        die(f"--batch-size {batch} is the GLOBAL batch and must be a multiple of the {world_size} processes"
            + (f" x {accum} accumulation steps" if accum > 1 else "")
            + f"; try --batch-size {max(1, batch // parts) * parts}")


def check_gpu(device, backend, dtensor=False, why=None):
    """The GPU and backend this rank uses: the recipe's `device` (cuda:LOCAL_RANK) and `backend` ("nccl"), checked.
    A GPU that is not visible (more processes than GPUs) fails with one line on every rank. Under launch.sh G:N
    (RANKS_PER_GPU=N: N ranks share GPU G, for debugging) rank r takes GPU r // N over gloo: NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected"), gloo shares it through host memory. Local.

    dtensor=True (a recipe whose state is DTensors: FSDP2, tensor parallel): G:N is refused with one line. Measured on
    an H200 with torch 2.11: over gloo on CUDA tensors every functional collective, so every DTensor redistribute,
    dies with SIGSEGV (c10d's own all_gather_into_tensor works, which is why FSDP2 trains and then fsdp.py crashed
    gathering model.pt), while the same DTensor gather on a CPU mesh works. why="...": refused the same way, for
    that reason (lm_pp.py: gloo's send and recv hand the tensor's address to a host transport, no device check)."""
    ranks_per_gpu = int(os.environ.get("RANKS_PER_GPU", 1))
    why = why or ("torch's DTensor collectives crash there (SIGSEGV)" if dtensor else None)
    if ranks_per_gpu > 1 and why:
        die(f"{os.path.basename(sys.argv[0])} cannot run {ranks_per_gpu} ranks on one GPU (launch.sh G:N, gloo over "
            f"CUDA): {why}; run one rank per GPU (0,1) or try it on cpu:N")
    if ranks_per_gpu > 1:
        device, backend = torch.device("cuda", device.index // ranks_per_gpu), "gloo"
    if device.index >= torch.cuda.device_count():
        die(f"this rank's GPU is cuda:{device.index} but only {torch.cuda.device_count()} GPUs are visible: start "
            "one process per listed GPU (./launch.sh RECIPE 0,1 does)", all_ranks=True)
    return device, backend


def check_compiler(device):
    """torch.compile's toolchain for `device` (common/compiler.py): one line and exit 2 where it is missing, before
    any process group. Local."""
    missing = missing_compiler(device)
    if missing:
        die(missing)


def cpu_amp_default(why=False):
    """torch_amp.py's --amp-dtype on a CPU when none is given: "bf16" where oneDNN runs bf16 natively (AVX-512 or
    AVX2-VNNI-2 on x86, Arm with bf16: the check torch.compile's inductor makes too), else "fp32". Without it a bf16
    convolution takes aten's slow reference kernel: resnet18's backward at 8 px, a micro-batch of 32, took 8-12 s
    against 0.24 s in fp32 on an AVX2 EPYC (docs/testing.md). why=True: the sentence the recipe's amp: line shows.
    Local."""
    try:
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: no fast bf16 convolution either
        native = False
    if not why:
        return "bf16" if native else "fp32"
    if native:
        return "the CPU default where the CPU has native bf16: fp16 is 10-50x slower on CPU"
    return ("the CPU default here: this CPU has no native bf16, so bf16 convolutions would take a slow kernel, "
            "5-50x slower than fp32; --amp-dtype bf16 runs it anyway")


def gather_result_line(device, speed, model, optimizer, peaks=None, rate_key="images_per_sec", **fields):
    """The one machine-readable line tests, benchmarks and scripts grep for (RESULT {json}): `fields`, the warm-up-free
    images/s and the first step's end (from `speed`, a Throughput), and every rank's peak memory and the bytes of
    parameters, gradients and optimizer state it holds (a sharded tensor counts its local shard: FSDP and DDP
    compare exactly). A COLLECTIVE: every rank calls it (two all-gathers); rank 0 prints what it returns. peaks: the
    peaks in MB where one process drives several GPUs (dp.py), instead of gathering each process's own. rate_key:
    the name of speed's rate (the language models count tokens: "tokens_per_sec")."""
    peaks = peaks or [round(p, 1) for p in gather_values(peak_memory_mb(device), device)]
    held = [int(b) for b in gather_values(held_state_bytes(model, optimizer), device)]
    world_size = fields.pop("world_size", dist.get_world_size() if dist.is_initialized() else 1)  # dp.py passes it
    fields = {"recipe": fields.pop("recipe"), "world_size": world_size, **fields}  # the line's first two keys
    fields = {k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()}  # floats: 6 places
    return result_line(**fields, device=device.type, **{rate_key: round(speed.images_per_sec, 2)},
                       peak_mem_mb=max(peaks), peak_mem_mb_per_rank=peaks, state_bytes_per_rank=held,
                       first_step_end_unix=speed.first_step_at)


class StopVote:
    """SIGUSR1 (a scheduler's warning, docs/clusters.md) reaches the ranks at different times, and they must stop after
    the same step. all_reduce_max() after each step starts an all-reduce (MAX) of this rank's `flag` on `group`, a gloo
    group of its own (it runs beside the step's collectives), and returns the vote started one step earlier, which
    ran under this step: no step waits for it, and every rank reads the same vote at the same step. wait() after the
    loop: the last vote ends (every rank started as many). ddp_checkpoint.py writes these lines out in its loop."""

    def __init__(self, flag, group):
        self.flag, self.group, self.work, self.ballot = flag, group, None, None

    def all_reduce_max(self):
        """A COLLECTIVE (async): True on every rank once any rank's flag was set a step ago."""
        agreed = self.work is not None and self.work.wait() and self.ballot.item() > 0
        self.ballot = torch.tensor([float(bool(self.flag))])
        self.work = dist.all_reduce(self.ballot, dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def wait(self):
        if self.work is not None:
            self.work.wait()


class StepMeter:
    """The language models' loop plumbing, one object: the training loss (an AverageMeter summed on the device), the
    divergence watch (DivergenceCheck), the clock (Throughput: tokens/s after the first step, own_ms, the ETA) and
    --profile (Profiler). Local, but for the methods whose names say their collective.

        meter = harness.StepMeter(model, device, args.profile, args.out_dir, rank, forward=None, last_good=None)
                                                 the clock starts; own_ms: the data wait, and forward's where given
                                                 (Throughput.watch: DDP's model.module); model None: no own_ms;
                                                 last_good: the latest.pt a divergence's stop names once it exists
        meter.start()                            the clock runs again, after an evaluation stopped it
        meter.step(step, loss, tokens)           after each optimizer step: no host sync; loss None where this rank
                                                 has none (a pipeline stage before the last): the clock alone
        meter.all_reduce_and_check(step, model)  a NaN/inf loss or weight stops the run (exit 3): before eval, save
        meter.all_reduce_loss()                  the clock stops; the mean loss since the last call, with every rank's
                                                 own_ms in the same all-reduce
        meter.fields(steps_left)                 the eval line's "tok/s=... eta=... own_ms=..."
        meter.stop()                             the clock, and --profile's trace written
        meter.gather_profile_table(), meter.gather_result_line(model, optimizer, **fields)"""

    def __init__(self, model, device, profile, out_dir, rank, forward=None, last_good=None):
        self.device, self.loss, self.train_loss = device, AverageMeter(), None
        self.speed, self.diverged = Throughput(device), DivergenceCheck(device)
        self.diverged.last_good = last_good  # latest.pt: written only once a save is whole (or the resume point)
        self.profiler = Profiler(profile, out_dir, rank, device)  # --profile: steps 3-6
        if model is not None:
            self.speed.watch(model, forward=forward)
        self.speed.start()

    def start(self):
        if not self.speed.running:  # stopped by an evaluation: a save between evaluations stays timed
            self.speed.start()

    def step(self, step, loss, tokens):
        if loss is not None:
            self.loss.update(loss, 1)  # a tensor: summed on the device, no sync per step
            self.diverged.update(step, loss)
        self.speed.step(tokens)
        self.profiler.step()  # --profile: OUT_DIR/profile/trace_rankR.json

    def all_reduce_and_check(self, step, model):
        """A COLLECTIVE (an all-reduce, MIN): every rank calls it at the same steps."""
        self.diverged.all_reduce_and_check(None, step, model=model)

    def all_reduce_loss(self):
        """A COLLECTIVE (an all-reduce): the mean training loss over every rank since the last call."""
        self.speed.stop()
        self.loss.all_reduce(self.device, ride=self.speed)  # with every rank's own_ms: one all-reduce
        self.train_loss, self.loss = self.loss.avg, AverageMeter()
        return self.train_loss

    def fields(self, steps_left):
        speed = self.speed
        return f"tok/s={speed.images_per_sec:.0f} eta={speed.eta(steps_left)}{speed.spread}"

    def stop(self):
        self.speed.stop()
        self.profiler.stop()  # --profile: writes the steps it recorded

    def gather_profile_table(self):
        """A COLLECTIVE (an all-gather): every rank's compute, communication, data, idle; for rank 0 to print."""
        return gather_profile_table(self.profiler, self.device)

    def gather_result_line(self, model, optimizer, **fields):
        """A COLLECTIVE (two all-gathers): the RESULT line, with tokens/s."""
        return gather_result_line(self.device, self.speed, model, optimizer, rate_key="tokens_per_sec", **fields)


class CompileCounts:
    """--compile's plumbing (the language models, torch_amp.py, gpu_decode.py): its toolchain checked, and
    torch._dynamo's counters read as ddp_compile.py reads them (which writes them out: the lesson is there). Local
    but for gather_fields; without --compile every method does nothing.

        compiled = harness.CompileCounts(args.compile, device)  after the compile call, before any step: the toolchain
                                         (one line and exit 2 without it); the compile's clock starts as the first
                                         compile does (the first step's, or lm_ddp's resumed backward just before
                                         it): setup and a checkpoint's load are not the compile's time
        compiled.step()                  after each step; after this run's first, which compiled the blocks, the
                                         'compile:' line, and with no graph at all one line and exit 2 (the module
                                         torch.compile(block) returns, dropped)
        compiled.gather_fields()         a COLLECTIVE (all-gather): every rank's compiled_graphs, eval_graphs (compiled
                                         with autograd off), recompiles (with it on, after the first step: a new shape
                                         or a changed guard; 0 where no step ran) and graph_breaks, each a list in rank
                                         order, for RESULT; rank 0 prints the closing 'compile:' line ({} without
                                         --compile)

    Which graphs are evaluation's: dynamo's compile callbacks note autograd's mode as each compile starts."""

    KEYS = ("compiled_graphs", "eval_graphs", "recompiles", "graph_breaks")

    def __init__(self, enabled, device):
        self.enabled, self.device, self.first, self.graphs = enabled, device, None, {True: 0, False: 0}
        if enabled:
            check_compiler(device)
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._compile_starts)
            callback_handler.register_end_callback(self._compile_ends)
        self.started = None  # the first compile's start: the clock

    @staticmethod
    def graphs_and_breaks():
        """Graphs dynamo compiled in this process, and its graph breaks by their reason's first line."""
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"], collections.Counter(
            reason.splitlines()[0] for reason, count in counters["graph_break"].items() for _ in range(count))

    def _compile_starts(self, args):
        if self.started is None:
            self.started = time.perf_counter()
        self._starting = (torch.is_grad_enabled(), self.graphs_and_breaks()[0])

    def _compile_ends(self, args):
        grad, before = self._starting
        self.graphs[grad] += self.graphs_and_breaks()[0] - before

    def step(self):
        if not self.enabled or self.first is not None:
            return
        self.first, breaks = self.graphs[True], self.graphs_and_breaks()[1]
        if self.first == 0:
            die("--compile compiled no graph in the first step: compile in place (module.compile()), or put the "
                "module torch.compile(module) returns back in the model", all_ranks=True)
        print0(f"compile: {self.first} graph(s) in {time.perf_counter() - self.started:.1f} s (the first step; the "
               f"rate leaves it out), {sum(breaks.values())} graph break(s)")

    def gather_fields(self):
        if not self.enabled:
            return {}
        breaks = self.graphs_and_breaks()[1]
        # With no step run (a resume at --steps), a training graph is no recompile: lm_ddp's backward before the loop.
        recompiles = 0 if self.first is None else self.graphs[True] - self.first
        mine = [sum(self.graphs.values()), self.graphs[False], recompiles, sum(breaks.values())]
        fields = {key: [int(rank[i]) for rank in gather_values(mine, self.device)] for i, key in enumerate(self.KEYS)}
        said = {key: str(v[0]) if len(set(v)) == 1 else f"{min(v)}-{max(v)}" for key, v in fields.items()}
        why = "; ".join(f"{count} x {reason}" for reason, count in breaks.items())
        print0(f"compile: {said['compiled_graphs']} graph(s) a rank, {said['eval_graphs']} of them for evaluation; "
               f"{said['recompiles']} compiled again during training; {said['graph_breaks']} graph break(s)"
               + (f" (rank 0: {why}; TORCH_LOGS=graph_breaks shows where)" if breaks else ""))
        return fields


__all__ = ["CompileCounts", "DivergenceCheck", "Profiler", "StepMeter", "StopVote", "TensorBoard", "Throughput",
           "add_flags", "add_profile_flag", "broadcast_out_dir_check", "check_compiler", "check_epochs_left",
           "check_flags", "check_full_batch", "check_gpu", "default_workers", "die", "gather_profile_table",
           "gather_result_line", "one_line_errors", "peak_memory_mb", "state_bytes"]
