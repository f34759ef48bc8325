"""Preemption (issue 43): SIGUSR1 asks ddp_checkpoint.py for a save at a step every rank agrees on, then exit 75; the
job resumed with --resume auto ends with the weights of a run never stopped, bitwise, on 1, 2 and 3 processes.

The data is the hard case: real JPEGs (scikit-learn's digits, tools/real_data.py) with the recipe's random crop and
flip, loaded by a DataLoader worker per rank, and stops in the middle of an epoch. The signal comes from
tests/faults (FAULT_SIGNAL, a test double of the scheduler's warning) at a step this file draws at random (printed on
failure): to the launcher alone, to one rank alone, to every process of the job (DataLoader workers too), and inside
a save, with a second one inside the next save. Each resumed run's DDP gradient buckets are the uninterrupted run's at
every step (tests/instrument's LOG_BUCKETS_DIR): the recipe's claim for its backward before training. The language
models' drills are in tests/test_lm.py (lm_ddp, 3 processes) and test_lm_tp.py (2), beside the straight runs they
compare with; fsdp.py's --async-save crash in tests/test_fsdp.py.
"""

import json
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, instrument_env, launch, max_diff, params, result_of, run_script
from torch.distributed import run as torch_run

from common.checkpoint import EX_TEMPFAIL
from common.data import SeededSamples, SkipFirst
from tools.real_data import export
from tools.torchrun import saved_and_left, without_sigusr1

GLOBAL_BATCH = 24  # 12 per process on 2, 8 on 3
STEPS_PER_EPOCH = 400 // GLOBAL_BATCH  # 16: 400 training digits (40 a class)
FAULTS = str(REPO / "tests" / "faults")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    assert export(folder, 16, per_class=40) == (400, 100)
    return folder


def args(digits, out):
    return ["--dataset", "imagefolder", "--data-root", digits, "--image-size", "16", "--arch", "tiny",
            "--workers", "1", "--epochs", "2", "--batch-size", str(GLOBAL_BATCH), "--out-dir", out]


def bucket_layouts(folder):
    """Each rank's DDP gradient buckets at each step of a run with tests/instrument's LOG_BUCKETS_DIR=folder: [[bucket
    index, [the shape of each parameter in it, in its order]], ...] per forward with autograd on, per rank."""
    return [[json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(folder.glob("rank*.jsonl"))]


@pytest.fixture(scope="module")
def straight(digits, tmp_path_factory):
    """The runs never stopped, per process count: their weights, RESULT and bucket layouts (bucket_layouts)."""
    runs = {}

    def get(processes):
        if processes not in runs:
            out = tmp_path_factory.mktemp(f"straight{processes}")
            result = result_of(launch("recipes/ddp_checkpoint.py", f"cpu:{processes}", *args(digits, out),
                                      env=instrument_env(LOG_BUCKETS_DIR=out / "buckets")))
            assert result["steps"] == 2 * STEPS_PER_EPOCH and result["start_step"] == 0
            runs[processes] = (params(out / "model.pt"), result, bucket_layouts(out / "buckets"))
        return runs[processes]
    return get


def stopped_then_resumed(digits, tmp_path, processes, fault, *flags, env=None, resume=True, refusals=False):
    """The run with FAULT_SIGNAL=fault: exit 75 and a whole latest.pt; then (resume) --resume auto to the end, its
    bucket layouts counted (tests/instrument; tests/faults, the other sitecustomize, is on the stopped run's path).
    refusals: first, the resumes of that mid-epoch save that are refused (another global batch; the recipes that
    resume from an epoch's end only)."""
    out = tmp_path / "run"
    first = launch("recipes/ddp_checkpoint.py", f"cpu:{processes}", *args(digits, out), *flags,
                   env={"PYTHONPATH": FAULTS, "FAULT_SIGNAL": fault, **(env or {})})
    said = f"fault {fault}\nstdout:\n{first.stdout}\nstderr:\n{first.stderr[-3000:]}"
    assert first.returncode == EX_TEMPFAIL, said
    assert "RESULT" not in first.stdout, said
    assert f"launch.sh: the ranks saved and exited {EX_TEMPFAIL} (SIGUSR1): requeue the job" in first.stderr, said
    saved = torch.load(out / "latest.pt", weights_only=True)  # whole: torch.load reads it
    assert f"preempt: SIGUSR1: saved {out / 'latest.pt'} at step {saved['step']}; exit {EX_TEMPFAIL}" in first.stdout
    assert not list(out.glob("*.tmp")), said
    if refusals:
        assert saved["step_in_epoch"], saved
        other = launch("recipes/ddp_checkpoint.py", f"cpu:{processes}", *args(digits, out), "--resume", "auto",
                       "--batch-size", str(GLOBAL_BATCH // 2))  # its steps would be other samples
        assert other.returncode == 2 and (
            f"error: {out / 'latest.pt'} was saved at step {saved['step_in_epoch']} of epoch {saved['epoch'] + 1} "
            f"with --batch-size {GLOBAL_BATCH} (global); resume it with the same --batch-size") in other.stderr, (
            other.stderr)
        for recipe in ("ddp_zero", "ddp_comm_hooks"):  # they would train the epoch's first steps twice
            other = launch(f"recipes/{recipe}.py", f"cpu:{processes}", *args(digits, out), "--resume", "auto")
            assert other.returncode == 2 and (
                f"error: {out / 'latest.pt'} was saved {saved['step_in_epoch']} steps into epoch {saved['epoch'] + 1}; "
                "this recipe resumes from an epoch's end: resume it with recipes/ddp_checkpoint.py") in (
                other.stderr.splitlines()), other.stderr
    if not resume:
        return first, saved, None, None, None
    resumed = launch("recipes/ddp_checkpoint.py", f"cpu:{processes}", *args(digits, out), "--resume", "auto",
                     env=instrument_env(LOG_BUCKETS_DIR=tmp_path / "buckets"))
    result = result_of(resumed)
    assert result["start_step"] == saved["step"] and result["steps"] == 2 * STEPS_PER_EPOCH
    return first, saved, result, params(out / "model.pt"), bucket_layouts(tmp_path / "buckets")


def signal_step(rng, epoch):
    """A step of that epoch whose stop leaves 4 steps or more of it (else the epoch's own save comes first: one
    case below), drawn at random."""
    return rng.randint(1, STEPS_PER_EPOCH - 7) + epoch * STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.parametrize("processes, target, epoch", [(2, "launcher", 0), (3, "self", 1), (1, "job", 1)])
def test_a_stop_mid_epoch_resumes_bitwise(digits, straight, tmp_path, processes, target, epoch):
    # launcher: SLURM's --signal=B:USR1 (the batch shell passes it to srun, srun to launch.sh). self: one rank alone;
    # the vote tells the others. job: --signal=USR1 without B, every process of the job, DataLoader workers too.
    seed = random.randrange(10**6)
    step = signal_step(random.Random(seed), epoch)
    signalled = processes - 1 if target == "self" else 0  # one rank alone: the last
    fault = f"{signalled}:step={step}:{target}"
    # MAX_RESTARTS: a save for a requeue is not a failure to restart from (a launch.sh restart would run it again).
    first, saved, result, weights, layouts = stopped_then_resumed(digits, tmp_path, processes, fault,
                                                                  env={"MAX_RESTARTS": "2"}, refusals=processes == 2)
    where = f"seed {seed}, {fault}, saved at step {saved['step']} ({saved['step_in_epoch']} into its epoch)"
    assert first.stdout.count("setup: world_size=") == 1, where  # started once: not restarted
    # The signal lands after step `step` (tests/faults waits for it there): the next step's vote carries it, and the
    # ranks read that vote one step later.
    assert saved["step"] == step + 1 and saved["epoch"] == epoch and saved["step_in_epoch"] > 0, where
    assert len(saved["rng"]) == len(saved["meters"]) == processes, where
    reference, straight_result, straight_layouts = straight(processes)
    # The recipe's claim: its backward before training gives the resumed steps DDP's buckets as the run never
    # stopped had them at those steps (its first step, alone, has DDP's first layout: gradients in the parameters'
    # order). Without it, the first resumed step has that first layout: on 3 ranks a sum rounded otherwise, which
    # the weights below show only now and then (an update an ulp off often rounds the same).
    left = 2 * STEPS_PER_EPOCH - saved["step"]
    assert straight_layouts[0][0] != straight_layouts[0][1], "DDP rebuilt no bucket: the check below shows nothing"
    assert [rank[-left:] for rank in layouts] == [rank[-left:] for rank in straight_layouts], where
    assert max_diff(weights, reference) == 0, where
    assert result["train_loss"] == straight_result["train_loss"], where  # the epoch's sums went on from the save


@pytest.mark.slow
def test_signals_inside_saves_and_near_an_epochs_end(digits, straight, tmp_path):
    # The first signal lands while --save-every's save at step 5 is writing (rank 0 inside torch.save, the others at
    # its barrier): the job stops at the next steps, with a save of its own; a second signal, to every process while
    # that save writes, changes nothing. Then one 3 steps before epoch 1's end: the epoch's own save is the stop's.
    fault = "0:save=1:launcher,0:save=2:job"
    first, saved, _, weights, _ = stopped_then_resumed(digits, tmp_path, 2, fault, "--save-every", "5")
    assert "saved: " + str(tmp_path / "run" / "latest.pt") + " at step 5 (5 of epoch 1)" in first.stdout
    assert saved["step"] == 7, saved["step"]  # step 6's vote carries it (step 5's was cast before the save)
    assert max_diff(weights, straight(2)[0]) == 0
    # (Not resumed: that is the epoch-end checkpoint every run writes, and tests/test_conformance.py resumes it.)
    late = STEPS_PER_EPOCH - 3  # agreed at step 14 of 16: fewer than 4 left
    first, saved, _, _, _ = stopped_then_resumed(digits, tmp_path / "late", 2, f"0:step={late}:launcher",
                                                 resume=False)
    assert (saved["epoch"], saved["step"], saved["step_in_epoch"]) == (1, STEPS_PER_EPOCH, 0)
    assert "val_acc1=" in first.stdout  # the epoch ended as usual: evaluated, then saved


# ------------------------------------------------------------------------- the parts, without a job
def test_the_launcher_stops_restarting_only_for_a_save():
    class Failure:
        def __init__(self, exitcode):
            self.exitcode = exitcode

    assert saved_and_left({0: Failure(75), 1: Failure(75)})
    assert saved_and_left({0: Failure(75), 1: Failure(-signal.SIGTERM)})  # stopped by torchrun after rank 0 left
    assert not saved_and_left({0: Failure(1), 1: Failure(75)})  # a failure beside it: restart as before
    assert not saved_and_left({0: Failure(-signal.SIGTERM)})
    assert not saved_and_left({0: Failure(-signal.SIGKILL), 1: Failure(75)})


def test_seeded_samples_augment_alike_in_any_order_and_leave_the_stream_alone():
    class Noisy(torch.utils.data.Dataset):  # torchvision's draws, and other libraries' (Python's, NumPy's)
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(3) + i + random.random() + float(np.random.rand())

    data = SeededSamples(Noisy(), seed=3)
    forward = [data[i] for i in range(10)]
    torch.manual_seed(0)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    backward = [data[i] for i in reversed(range(10))][::-1]
    after = torch.get_rng_state(), random.getstate(), np.random.get_state()[1]
    assert torch.equal(after[0], before[0]) and after[1] == before[1] and (after[2] == before[2]).all()  # untouched
    assert all(torch.equal(a, b) for a, b in zip(forward, backward, strict=True))
    data.set_epoch(1)
    assert not torch.equal(data[0], forward[0])  # another epoch, another crop


def test_skip_first_leaves_out_a_resumed_epochs_start_once():
    sampler = SkipFirst(torch.utils.data.distributed.DistributedSampler(range(20), num_replicas=2, rank=1, seed=0))
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.skip = 4
    assert list(sampler) == whole[4:] and list(sampler) == whole and len(sampler) == 10 and sampler.epoch == 1


def test_signal_flag_counts_in_its_process_and_not_in_a_forked_child(tmp_path):
    code = ("import os, signal, sys, time\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from common.checkpoint import SignalFlag\n"
            "flag = SignalFlag(signal.SIGUSR1)\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1); os._exit(10 + flag.count)\n"
            "_, status = os.waitpid(child, 0)\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
            "print(os.waitstatus_to_exitcode(status), flag.count)\n")
    script = tmp_path / "flag.py"
    script.write_text(code)
    proc = run_script([script, REPO], timeout=60)  # a process of its own, forked from the warm server
    assert proc.stdout.split() == ["10", "1"], proc.stderr  # the child survived it and counted nothing


def test_the_launcher_passes_sigusr1_on_and_keeps_it_from_torchruns_own_stop():
    # /proc/PID/status's SigCgt: once a rank has its recipe's handler, the launcher stops sending it again.
    # And one that comes while the launcher imports torch (launch.sh ignored it until then) is kept for later.
    code = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); import tools.torchrun as t\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "signal.signal(signal.SIGUSR1, signal.SIG_DFL); before = t.handles(os.getpid(), signal.SIGUSR1)\n"
            "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
            "print(t.EARLY_SIGUSR1, before, t.handles(os.getpid(), signal.SIGUSR1), "
            "t.handles(os.getpid(), signal.SIGUSR2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [f"[{int(signal.SIGUSR1)}]", "False", "True", "False"], proc.stderr
    # torchrun's help suggests --signals-to-handle SIGUSR1 for SLURM: that stops the ranks at once, with no save.
    args = torch_run.parse_args(["--signals-to-handle", "SIGTERM, SIGUSR1,SIGINT", "--nproc-per-node=2", "r.py"])
    assert without_sigusr1(args).signals_to_handle == "SIGTERM,SIGINT"


# ------------------------------------------------------------------------- a recipe without the save
@pytest.mark.slow
def test_a_recipe_without_the_save_ignores_sigusr1_to_every_process(tmp_path):
    # ddp_torchrun.py has no preemption save: its ranks start with SIGUSR1 ignored (tools/torchrun.py), their
    # DataLoader workers inherit that, and the launcher passes it on: nothing dies, the run ends as usual.
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", "--arch", "tiny", "--workers", "1", "--epochs", "1",
                  "--out-dir", tmp_path, env={"PYTHONPATH": FAULTS, "FAULT_SIGNAL": "1:step=2:job"})
    assert result_of(proc)["steps"] == 16 and "FAULT: rank 1 sends SIGUSR1 to job at step=2" in proc.stdout
    assert "launch.sh: SIGUSR1 received: passed on to the 2 rank(s)" in proc.stderr
