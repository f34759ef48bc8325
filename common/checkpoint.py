"""Checkpoints that fail with one line. Loading: a truncated file, a file of another kind, or weights for another
architecture raise CheckpointError naming the file and the mismatch, before anything is written. Saving: atomic,
and a write the disk refuses (full, I/O error) raises SaveError naming the file and the cause, the previous
checkpoint left whole."""

import atexit
import os
import shutil
import signal

import torch
import torch.distributed

from common.utils import OneLineError, first_line, human, print0


class CheckpointError(OneLineError):
    """The file cannot be resumed from; the message names it and says why."""

    code = 2  # bad input, like a bad flag


class SaveError(OneLineError):
    """A checkpoint could not be written; the message says which and why. The previous one is untouched."""


class _Recorder:
    """The file torch.save writes into, keeping the OSError of a failed write: torch reports it only as
    "[enforce fail at inline_container.cc] unexpected pos", which does not say that the disk is full."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        self.f.flush()


def _free(path):
    try:
        return human(shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free)
    except OSError:
        return "unknown"


def _fsync_folder(path):
    """The folder's entries (a rename) onto the disk, as POSIX asks for a rename to last a crash; where the file system
    cannot fsync a folder (some network ones refuse), it has ordered the rename itself."""
    try:
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def save_atomic(obj, path):
    """torch.save to a temp file in the same folder, then rename over `path` (atomic on POSIX): a crash or a full
    disk mid-write leaves the previous file whole."""
    # One fixed temp name (only rank 0 writes): a write killed halfway is replaced by the next. Two jobs sharing
    # an --out-dir would collide here, as they would on `path` itself.
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            sink = _Recorder(f)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is None:
                    raise
                raise sink.error from None
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        _fsync_folder(path)  # and the new name is: a machine that crashes now still resumes from this save
    except OSError as exc:
        raise SaveError(f"cannot write {path} ({exc.strerror or exc}; {_free(path)} free there): the previous "
                        f"{os.path.basename(path)}, if any, is whole; free some space, then --resume") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cpu_copy(state):
    """A copy of a state_dict (nested dicts and lists of tensors and numbers) in CPU memory, for a thread to write
    while training changes the original in place (--async-save). From a GPU the copy waits for the device: what
    training waits for, instead of the write."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: cpu_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(value) for value in state)
    return state  # a number, a string, None: not changed in place


EX_TEMPFAIL = 75  # sysexits.h: "try again later". A job that saved on a preemption signal exits with it: requeue me


class SignalFlag:
    """True once `signum` has reached this process: a handler that only records it, for the training loop to act on
    at a step boundary (SIGUSR1: SLURM's --signal=USR1@120 asks for a save before the job's end).

    A DataLoader worker forked from this process inherits the handler: there the signal is ignored (a scheduler that
    signals every process of a job reaches the workers too, and SIGUSR1's default action would kill them). Under
    tools/torchrun.py (launch.sh) a rank starts with SIGUSR1 ignored until this handler replaces that, and the
    launcher passes the signal on again every second until this handler is in place: one that came before is not
    lost."""

    def __init__(self, signum):
        self.signum, self.pid, self.count = signum, os.getpid(), 0
        signal.signal(signum, self._handler)
        signal.siginterrupt(signum, False)  # SA_RESTART: a read or wait in C code (gloo, NCCL) goes on after it
        # At its exit Python puts the default action back, which for SIGUSR1 is to die: a signal passed on again
        # while the process exits (the launcher's, each second) would turn its exit 75 or 0 into "killed".
        atexit.register(signal.signal, signum, signal.SIG_IGN)

    def _handler(self, signum, frame):
        if os.getpid() == self.pid:
            self.count += 1

    def __bool__(self):
        return self.count > 0


def find_resume(resume, latest):
    """--resume PATH, or with 'auto' (what a job restarted by MAX_RESTARTS passes) `latest` where it exists,
    else None: a first run starts from scratch, and says so."""
    if resume != "auto":
        return resume
    if os.path.isfile(latest):
        return latest
    print0(f"resume: no {latest} yet, starting from scratch")
    return None


def check_epochs_left(path, start_epoch, epochs):
    """A checkpoint that already ran all `epochs` leaves nothing to resume: a CheckpointError (exit 2), said once
    per node, as it is the same on every rank."""
    if start_epoch >= epochs:
        raise CheckpointError(f"{path} already finished all {epochs} epochs; nothing to resume", all_ranks=False)


def load_checkpoint(path, map_location, require=(), mmap=False, same_run_as=None):
    """torch.load(weights_only=True) onto `map_location` (this rank's device, not the one it was saved
    from). `require`: the keys a checkpoint of this recipe must have. mmap=True with map_location="cpu": the file is
    mapped, not read, and only the bytes of the tensors the caller then uses are read from it (torch.load's mmap;
    onto a GPU, every tensor would be copied there, read or not). same_run_as=args, a resume: check_same_run() on the
    checkpoint's "args"."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (PermissionError, FileNotFoundError, IsADirectoryError) as exc:  # the system's own words say it
        raise CheckpointError(f"cannot load {path} ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # truncated (OSError EINVAL from the zip reader), not a zip, pickled objects, OOM
        raise CheckpointError(f"cannot load {path} ({type(exc).__name__}): truncated, or not a checkpoint of "
                              f"these recipes ({first_line(exc)[:200]})") from exc
    missing = [key for key in require if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a checkpoint of this recipe: it has no {missing[:3]} "
                              "(bare weights? start from them with ddp_checkpoint.py --init-from)")
    if same_run_as is not None:
        check_same_run(path, ckpt.get("args", {}), same_run_as)
    return ckpt


# The flags that shape an image recipe's run, which a resume must not change: it continues the run its checkpoint
# started. --epochs lays out the schedule; --seed, --warmup-epochs, the data, the model and --amp-dtype (fsdp's) would
# change its course from here on; a new --lr the optimizer's saved state would silently overrule. --lr's default
# follows --batch-size, which follows the GPU count: compared only at the same batch (at another, the optimizer's saved
# learning rate goes on, and the resume says so).
RUN_FLAGS = ("arch", "dataset", "image_size", "epochs", "warmup_epochs", "seed", "lr", "amp_dtype")


def check_same_run(path, saved, args, flags=RUN_FLAGS):
    """A checkpoint's args (`saved`, vars(args) as it was saved) against this run's: unless each of `flags` it holds
    is the same, a CheckpointError naming each one that differs (exit 2, said once per node: every rank reads the same
    file). At another --batch-size a --lr of its own is not used: a line on rank 0 says the saved rate goes on."""
    other_batch = saved.get("batch_size") != getattr(args, "batch_size", None)
    changed = [f"--{k.replace('_', '-')} {saved[k]} (this run: {getattr(args, k)})" for k in flags
               if k in saved and hasattr(args, k) and saved[k] != getattr(args, k) and not (k == "lr" and other_batch)]
    if changed:
        raise CheckpointError(f"{path} was trained with {', '.join(changed)}; resume with the same flags",
                              all_ranks=False)
    if "lr" in flags and other_batch and saved.get("lr", args.lr) != args.lr:
        print0(f"resume: {path} was trained at --batch-size {saved.get('batch_size')} --lr {saved['lr']:g}: its "
               f"learning rate schedule goes on (this run's --lr {args.lr:g} at --batch-size {args.batch_size} is not "
               f"used)")


def load_same_flags(path, map_location, flags, require=()):
    """load_checkpoint() of a resume point, which holds "epoch", "step" and "flags" (what a resume must match), besides
    `require`; unless its flags equal `flags`, a CheckpointError naming each one that differs (exit 2, said once per
    node: every rank reads the same file)."""
    ckpt = load_checkpoint(path, map_location, require=(*require, "epoch", "step", "flags"))
    changed = [f"--{k.replace('_', '-')} {ckpt['flags'].get(k)} (this run: {v})"
               for k, v in flags.items() if ckpt["flags"].get(k) != v]
    if changed:
        batch = ckpt["flags"].get("batch_size")  # a default batch follows the processes: a requeue on fewer moves it
        hint = (f" (--batch-size {batch}: the global batch, which the data-parallel processes, times --accum-steps "
                f"where there is one, must divide)" if "batch_size" in flags and flags["batch_size"] != batch else "")
        raise CheckpointError(f"{path} was written with {', '.join(changed)}; resume with the same flags{hint}",
                              all_ranks=False)
    return ckpt


def dcp_failure(exc, folder=None):
    """One line for torch.distributed.checkpoint's CheckpointException, which holds every rank's exception with its
    traceback (and is a BaseException: `except Exception` lets it through): the first failure that says something.
    A shard is written by torch.save's zip writer, which drops the OSError that stopped it (a full disk, a quota, an
    I/O error) and raises "[enforce fail at inline_container.cc:N]" instead: `folder` given, the line says so, with
    the space left there."""
    failures = [failure for failure, _ in exc.failures.values()]
    failure = next((f for f in failures if str(f).strip()), failures[0])
    said = f"{type(failure).__name__}: {first_line(failure).split('. ')[0][:200]}"  # torch adds advice after a period
    if folder is not None and "inline_container" in said:
        return (f"a write failed: a full disk, a quota or an I/O error ({said.strip()}); "
                f"{_free(os.path.join(folder, 'x'))} free there")
    return said


class ShardFolders:
    """OUT_DIR/checkpoint/, the sharded checkpoints of fsdp.py and the language models: one folder of DCP shards per
    save, PREFIX_N-RUN (a step or an epoch, then the run's tag, which the recipe broadcasts: no save overwrites the
    folder latest.pt names, so a failed save leaves it whole), and latest.pt, written by rank 0 atomically once every
    rank's shards are written, naming the newest; older folders then go. The dcp calls stay in the recipe. Local:
    no collective (an async save's thread makes its own, on its own group; finish_async waits for them).

        saves = ShardFolders(args.out_dir, run_tag, "step")
        folder = saves.folder(step)                   this save's shards (the pointer's "shards": its name)
        saves.point_latest(pointer)                   rank 0, once dcp.save returned on every rank
        raise saves.failure(exc, folder) from exc     a dcp.CheckpointException (a full disk): one line
        dcp.async_save(..., async_stager=saves.stager(), ...)   copies to plain CPU memory (below)
        saves.start_async(future, pointer, folder)    dcp.async_save's future: one save in flight
        saves.finish_async(only_if_done=False)        waits for it; then rank 0 points latest.pt at it
        raise saves.load_failure(exc, path) from exc  a dcp.load that failed: one line"""

    def __init__(self, out_dir, run_tag, prefix):
        self.root = os.path.join(out_dir, "checkpoint")
        self.latest = os.path.join(self.root, "latest.pt")
        self.run_tag, self.prefix, self.in_flight, self._stager = run_tag, prefix, None, None

    def folder(self, n):
        return os.path.join(self.root, f"{self.prefix}_{n}-{self.run_tag}")

    def point_latest(self, pointer):
        """Rank 0, once every rank's shards are written: latest.pt (atomically) names them; older folders go."""
        save_atomic(pointer, self.latest)
        for old in os.listdir(self.root):  # older shards (a save before, an earlier run's, a killed save's)
            if old.startswith(f"{self.prefix}_") and old != pointer["shards"]:
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def failure(self, exc, folder):
        return SaveError(f"cannot write the shards in {folder} ({dcp_failure(exc, self.root)}): {self.latest}, if "
                         "any, still points at the previous ones; free some space, then --resume")

    def load_failure(self, exc, path):
        return CheckpointError(f"cannot load the shards in {path} ({dcp_failure(exc)}): a shard file is missing or "
                               "truncated, or they hold another model")

    def stager(self):
        """dcp.async_save's stager: the shards copied to plain CPU memory (training waits for that alone), closed
        once written. Not pinned or shared memory, no copy-ahead from a GPU in the writer (else that thread opens a
        CUDA stream on GPU 0, on every rank); named, as the writer is a stager itself whose staging copies twice."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def start_async(self, future, pointer, folder):
        """dcp.async_save's future, its pointer and folder: the save in flight (the last one finished first)."""
        if self._stager is not None:  # its CPU copies go once written
            future.add_done_callback(lambda _, stager=self._stager: stager.close())
            self._stager = None
        self.in_flight = (future, pointer, folder)

    def finish_async(self, only_if_done=False):
        """Every rank: wait for the save in flight to end (its thread's collectives: every rank's shards and the
        metadata written); then rank 0 names it in latest.pt. only_if_done: only if it has ended already (each rank
        at its own step: no collective here). True if a save was finished."""
        if self.in_flight is None or (only_if_done and not self.in_flight[0].done()):
            return False
        from torch.distributed.checkpoint import CheckpointException  # here: only the sharded recipes import DCP

        (future, pointer, folder), self.in_flight = self.in_flight, None
        try:
            future.result()
        except CheckpointException as exc:
            raise self.failure(exc, folder) from exc
        if torch.distributed.get_rank() == 0:  # done on rank 0: every rank's shards and the metadata are written
            self.point_latest(pointer)
            said = folder if self.prefix == "epoch" else f"{self.latest} at step {pointer['step']}"
            print0(f"saved: {said} (written in the background)")
        return True


def load_weights(model, state, path):
    """Strict load that also takes keys saved from a DDP/DataParallel wrapper ("module.conv1.weight"): the prefix goes
    where every key has it and the keys are not the model's own as they are (a model may have a submodule named
    `module`)."""
    expected = model.state_dict()
    if set(state) != set(expected) and state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        found = [f"{what} {keys[:3]}" for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                         ("wrong shape", wrong)) if keys]
        raise CheckpointError(f"{path} does not fit this model (its --arch, and the classes and --image-size of "
                              f"its data): {', '.join(found)}")
    model.load_state_dict(state)
