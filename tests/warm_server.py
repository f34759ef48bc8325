"""The warm path's fork server (tests/warm.py starts one per test process): it imports once what every rank of a
recipe imports, then forks a fresh process for each rank a test asks for and runs the recipe in it as `python
RECIPE ARGS` would, in the rank's own environment, working folder and output files.

Protocol, one JSON object a line. In (stdin): {"id", "argv", "env", "cwd", "stdout", "stderr", "threads", "spawn"}
(spawn: the process's multiprocessing spawns its workers as forks of a clean copy of it, tests/warm_mp.py). Out
(stdout): {"id", "pid"} once the rank is forked, {"pid", "status"} when it has ended (status: its exit code, or minus
the signal that killed it, as Popen.returncode). The server ends when its stdin closes; every rank it forked gets
SIGKILL from the kernel when it dies (Linux's parent-death signal), as tools/torchrun.py's ranks do.

What a forked rank does not share with an earlier one: it is forked from this server, which never trains, seeds,
starts a process group, compiles, or starts a thread (checked before each fork), so each rank starts as a new
interpreter would, but for the modules already imported. What it must set itself, because torch reads it once at
import: the thread count (torch.set_num_threads from OMP_NUM_THREADS, as a new interpreter's import would); the
variables torch or Python read only at start-up are refused by tests/warm.py (READ_AT_START).
"""

import ctypes
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import threading

BASE_PATH = sys.path[1:]  # sys.path less this script's folder: a rank's script folder and PYTHONPATH go in front

# What every rank imports before its first step (3 to 4.5 s of CPU a rank): torch, torchvision (its ops import
# torch._dynamo), the distributed packages the recipes use, and the third-party modules common/ imports. And what a
# rank that compiles does once before its first graph, whatever the graph (1.2 s of CPU a process, paid by every
# compiling rank of the suite, about 45): inductor's, AOT autograd's and the C++ codegen's imports, and inductor's
# hash of its own source files, a part of every cache key (torch_key: read and hashed once a process). None of it
# compiles, starts a thread or touches CUDA; torch.utils.cpp_extension is left to the rank, which prints its
# warning at import as a new interpreter does.
import numpy  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._functorch.aot_autograd  # noqa: E402
import torch._inductor.codegen.cpp  # noqa: E402
import torch._inductor.compile_fx  # noqa: E402
import torch._inductor.graph  # noqa: E402
import torch._inductor.lowering  # noqa: E402
import torch._inductor.scheduler  # noqa: E402
import torch.distributed  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
import torch.distributed.pipelining  # noqa: E402
import torch.distributed.tensor.parallel  # noqa: E402
import torch.multiprocessing  # noqa: E402
import torch.utils.tensorboard  # noqa: E402
import torchvision  # noqa: E402
import torchvision.datasets  # noqa: E402
import torchvision.models  # noqa: E402
import torchvision.transforms  # noqa: E402, F401
import warm_mp  # noqa: E402
from torch._inductor.codecache import torch_key  # noqa: E402

torch_key()

PR_SET_PDEATHSIG = 1
LIBC = ctypes.CDLL(None, use_errno=True)
# The signals this server changed or a rank must start with as a rank of tools/torchrun.py does.
RANK_SIGNALS = {signal.SIGCHLD: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler,
                signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_IGN, signal.SIGPIPE: signal.SIG_IGN}


def run_rank(request, server_fds):
    """In the forked child: become the rank, run the recipe, exit as the interpreter would. Never returns."""
    code = 1
    try:
        os.setsid()  # a process group of its own, as torchrun's ranks: a timeout kills it and its DataLoader workers
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        for sig, action in RANK_SIGNALS.items():
            signal.signal(sig, action)
        for fd in server_fds:  # its pipes to the client (0 and 1) are replaced below
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # cached by this server's mkdtemp (LOCKS): read again from the rank's TMPDIR
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
        if unbuffered:
            sys.stdout.reconfigure(write_through=True)
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
        torch.set_num_threads(request["threads"])
        compile_in_turn(env)
        torch.seed()  # the default generators from the OS's entropy, as a new interpreter seeds them (torch's CPU one,
        numpy.random.seed()  # numpy's global one); Python's random reseeds itself in a forked child
        os.chdir(request["cwd"])
        script = os.path.abspath(request["argv"][0])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *extra, *BASE_PATH]
        sys.argv = [script, *request["argv"][1:]]
        if request.get("spawn"):  # a `python` job (ddp_spawn's mp.spawn): its workers forked from a clean copy
            warm_mp.install(BASE_PATH)
        code = run_as_main(script, extra)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def compile_in_turn(env):
    """The ranks of a job run inductor one graph at a time, so that each graph is lowered once and the other ranks load
    it from inductor's FX graph cache (its C++ builds are shared already, under a lock of its own). Started together,
    every rank of a job missed the cache and lowered the same graphs itself: about 11 s of CPU a rank for resnet18.
    A lock file named for the job (its MASTER_ADDR and MASTER_PORT) is held around torch.compile's call into its
    default backend, inductor, and around inductor's compile of each forward and backward graph (a backward can
    compile lazily, at the first backward). Inductor at its defaults does not communicate while it holds it, so no
    rank waits for another that waits for the lock; the settings that make it or the partitioner agree across ranks
    at compile time (distributed autotuning, overlap scheduling, spmd_check, ...) are off, and a job that set one
    would hang here. The graphs, their counts and their numbers are the same; ranks whose graphs differ (tensor
    parallelism's, a pipeline's stages) gain nothing and compile one after another."""
    if int(env.get("WORLD_SIZE", "1")) < 2 or "MASTER_PORT" not in env:
        return
    path = os.path.join(LOCKS, f"compile-{env.get('MASTER_ADDR')}-{env['MASTER_PORT']}.lock")
    held = threading.local()

    def in_turn(function):
        def call(*args, **kwargs):
            if getattr(held, "locked", False):  # inside the outer call: the lock is this thread's already
                return function(*args, **kwargs)
            with open(path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                held.locked = True
                try:
                    return function(*args, **kwargs)
                finally:
                    held.locked = False
                    fcntl.flock(lock, fcntl.LOCK_UN)
        return call

    wrapper = torch._TorchCompileInductorWrapper  # what torch.compile's default backend calls: into inductor
    original = wrapper.__call__

    def first_call(self, *args, **kwargs):  # inductor is imported by now: its inner compile in turn too
        from torch._inductor import compile_fx

        compile_fx._compile_fx_inner = in_turn(compile_fx._compile_fx_inner)
        wrapper.__call__ = in_turn(original)
        return wrapper.__call__(self, *args, **kwargs)

    wrapper.__call__ = first_call


def run_as_main(script, extra):
    """sitecustomize (the first on PYTHONPATH, as Python imports it at start-up), the script as __main__, then what
    the interpreter's exit does: wait for the non-daemon threads, run the atexit functions, flush. The exit code."""
    import runpy

    try:
        warm_mp.import_sitecustomize(extra)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = warm_mp.exit_code(exc.code)
    except BaseException as exc:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    warm_mp.exit_as_the_interpreter_does()
    if code == -signal.SIGINT:  # Python ends on an uncaught KeyboardInterrupt by SIGINT, as the shell expects
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


LOCKS = tempfile.mkdtemp(prefix="cookbook-warm-")  # compile_in_turn's lock files, removed when the server ends


def serve():
    sys.stdout.flush()
    torch.set_num_threads(1)  # the server computes nothing; each rank sets its own
    import gc

    gc.freeze()  # what the imports made is shared with every rank, copied only where a rank writes to it
    wake_r, wake_w = warm_mp.watch_children()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of the suite: its ranks get it from the terminal
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a rank's signal to its parent is the launcher's, not this
    stdin, pending = sys.stdin.buffer.raw, b""

    def say(message):
        os.write(1, (json.dumps(message) + "\n").encode())

    while True:
        requested, ended = warm_mp.wait_ready(stdin, wake_r)
        for pid, code in ended:
            say({"pid": pid, "status": code})
        if requested:
            data = os.read(stdin.fileno(), 65536)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if threading.active_count() != 1 or torch.distributed.is_initialized():
                    raise RuntimeError("the warm server has a thread or a process group: it cannot fork clean ranks")
                pid = os.fork()
                if pid == 0:
                    run_rank(request, (wake_r, wake_w))
                say({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    try:
        serve()
    finally:
        shutil.rmtree(LOCKS, ignore_errors=True)
