"""Failure drills (issue 7): real 2-process gloo jobs are killed, interrupted, fed bad files and flags, and
made to diverge. Each drill checks the exit code and the message; where the issue sets a time or processes
are killed, also the time taken and that none of the job's processes is left.
docs/failures.md lists what each drill showed."""

import os
import re
import signal
import socket
import time

import pytest
import torch
from conftest import IMAGE_RECIPES, REPO, launch, make_imagefolder, run_direct, spawn_gloo
from jobs import Job, cmdline, error_lines, job_mid_epoch, signal_all, survivors, tracebacks_beyond_multiprocessing

from common.recordio import IndexedRecordReader
from tools.free_port import free_port
from tools.pack_rec import main as pack_rec
from tools.procs import process_table

pytestmark = pytest.mark.slow  # real multi-process jobs, each several seconds
TINY = ["--arch", "tiny", "--workers", "0"]


def sample_errors(stderr):
    """The error lines, less the other rank's "lost the connection" (it says that if it was in a collective
    when the rank with the bad sample exited, before the launcher stopped it)."""
    lost = [line for line in error_lines(stderr) if "error: lost the connection to another rank" in line]
    return [line for line in error_lines(stderr) if line not in lost]


# ----------------------------------------------------------------- drill 1: a rank dies mid-epoch
@pytest.mark.parametrize(("recipe", "message"), [
    # rank 0 is stopped by torchrun, or first finds its peer gone (exit 1); rank 1 is named first either way
    ("ddp_torchrun", r"launch\.sh: job failed: rank 1 \(pid {pid}\) was killed by SIGKILL; rank 0 \(pid \d+\) "
                     r"(was stopped \(SIGTERM\)|exited with code 1)"),
    ("ddp_spawn", r"error: worker 1 \(pid {pid}\) was killed by SIGKILL; the other workers were stopped"),
])
def test_a_rank_killed_mid_epoch_ends_the_job_naming_it(tmp_path, recipe, message):
    job = job_mid_epoch(recipe, tmp_path)
    victim, tree = job.rank_pid(1), job.tree()
    assert len(tree) >= 5, tree  # the launcher, 2 ranks and their DataLoader workers: the check below means something
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)  # what the OOM killer does
    code = job.finish(timeout=60)
    took = time.monotonic() - start
    print(f"drill 1 {recipe}: exit {code} {took:.1f} s after the SIGKILL")  # README numbers: pytest -rP
    assert code == 128 + signal.SIGKILL, job.output()
    assert re.search(message.format(pid=victim), "".join(job.stderr)), job.output()
    assert took < 30, took
    assert not survivors(tree), job.output()
    assert not (tmp_path / "model.pt").exists()


# ------------------------------------------------------ drill 2: SIGKILL during a checkpoint write
def test_killed_while_writing_a_checkpoint_resumes_from_the_previous_one_exactly(tmp_path):
    # resnet18's checkpoint is 90 MB: its write takes ~100 ms, long enough to be caught in the act.
    args = ["recipes/ddp_checkpoint.py", "cpu:2", "--arch", "resnet18", "--image-size", "16", "--workers", "0",
            "--synthetic-train", "64", "--synthetic-val", "32", "--batch-size", "32", "--epochs", "4"]
    straight = launch(*args, "--out-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "killed"
    job = Job(*args, "--out-dir", out)
    latest, tmp = out / "latest.pt", out / "latest.pt.tmp"
    deadline = time.monotonic() + 120
    def half_written():  # some bytes of the new checkpoint are on disk, not all
        try:
            return latest.exists() and 0 < tmp.stat().st_size < latest.stat().st_size
        except FileNotFoundError:  # renamed in between
            return False

    while True:  # wait for a write of epoch 2 or later: epoch 1's latest.pt is then the previous good one
        assert time.monotonic() < deadline and job.proc.poll() is None, f"no write caught:\n{job.output()}"
        if half_written():
            tree = job.tree()
            signal_all(tree, signal.SIGSTOP)  # freeze everything first, so the kill is known to land inside the write
            if half_written():
                break
            signal_all(tree, signal.SIGCONT)  # the write finished meanwhile: let it go on to the next epoch's write
        time.sleep(0.001)
    signal_all(tree, signal.SIGKILL)
    job.finish(timeout=30)
    assert not survivors(tree)
    saved_epoch = torch.load(latest, weights_only=True)["epoch"]
    print(f"drill 2: killed while writing epoch {saved_epoch + 1}'s checkpoint ({tmp.stat().st_size} bytes written)")
    assert 1 <= saved_epoch < 4  # the last whole checkpoint; the one being written is the half file beside it
    assert 0 < tmp.stat().st_size < latest.stat().st_size

    resumed = launch(*args, "--out-dir", out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: {latest} at epoch {saved_epoch} " in resumed.stdout
    assert not tmp.exists()  # the next save replaced the half-written file
    a = torch.load(tmp_path / "straight/model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(a[name], b[name]) for name in a)  # bitwise the uninterrupted run


# ------------------------------------------------------------------ drill 3: ranks diverge
def stack_blocks(stderr):
    """{rank: its block's lines} of the stacks launch.sh shows after a hang or a lost peer (tools/torchrun.py)."""
    blocks, current = {}, None
    for line in stderr.splitlines():
        header = re.match(r"\[rank (\d+)\] stack:(.*)$", line)
        if header:
            current = blocks.setdefault(int(header[1]), [header[2].strip()] if header[2].strip() else [])
        elif current is not None and line.startswith(("  ", "Main thread ", "Thread ")):
            current.append(line)
        else:
            current = None
    return blocks


def recipe_line(block, recipe="ddp_torchrun"):
    """The source of the innermost frame of recipes/RECIPE.py in a rank's main thread: where that rank is in it."""
    main = block[next(i for i, line in enumerate(block) if line.startswith("Main thread ")):]
    frames = [i for i, line in enumerate(main) if re.match(rf'  File ".*/recipes/{recipe}\.py", line \d+, in ', line)]
    return main[frames[-1] + 1].strip()


@pytest.mark.parametrize(("fault", "says", "stuck"), [
    # rank 1 never reaches the end-of-epoch all_reduce (a Python sleep before it): rank 0 waits there until
    # --dist-timeout.
    ("1:all_reduce:1:hang", r"another rank did not join a collective within --dist-timeout: it hangs, or the "
                            r"ranks took different branches \(.*Timed out waiting 5000ms", "time.sleep(60)"),
    # rank 1 is inside a real collective (a barrier) that rank 0 never joins, where no Python code runs.
    ("1:all_reduce:1:block", r"another rank did not join a collective within --dist-timeout: it hangs, or the "
                             r"ranks took different branches \(.*Timed out waiting 5000ms", "dist.barrier(group="),
    # rank 1 skips the final all_gather and finishes: rank 0's all_gather loses its partner.
    ("1:all_gather:1:skip", r"lost the connection to another rank: it failed or was killed \(.*Connection "
                            r"(reset|closed) by peer", None),
])
def test_diverging_ranks_fail_within_the_dist_timeout_showing_where_each_rank_is(tmp_path, fault, says, stuck):
    timeout = 5
    job = Job("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--max-steps", "3", "--dist-timeout", timeout,
              "--out-dir", tmp_path, env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_COLLECTIVE": fault})
    job.wait_for("FAULT: rank 1")
    start, tree = time.monotonic(), job.tree()
    code = job.finish(timeout=120)
    took = time.monotonic() - start
    print(f"drill 3 {fault}: exit {code} {took:.1f} s after the fault")
    assert code not in (0, None), job.output()
    assert took < timeout + 10, (took, job.output())
    stderr = "".join(job.stderr)
    assert re.search(r"launch\.sh: job failed: rank 0 \(pid \d+\) exited with code 1", stderr), job.output()
    errors = error_lines(stderr)
    assert re.match(r"\[rank 0\] error: " + says, errors[0]), job.output()
    # rank 1 says nothing, or (in the barrier when rank 0 left) that it lost its peer
    assert all(re.match(r"\[rank 1\] error: lost the connection to another rank", line) for line in errors[1:]), errors
    assert "Traceback" not in stderr
    assert not survivors(tree)
    # Where each rank was, before the error lines: one block per rank, in rank order, as Python prints frames.
    lines = stderr.splitlines()
    headers = [i for i, line in enumerate(lines) if re.match(r"\[rank \d\] stack:", line)]
    assert [lines[i][:len("[rank 0]")] for i in headers] == ["[rank 0]", "[rank 1]"], job.output()
    assert headers[-1] < lines.index(errors[0]) < lines.index(next(x for x in lines if "launch.sh: job failed" in x))
    blocks = stack_blocks(stderr)
    assert not any("error:" in line for block in blocks.values() for line in block), blocks
    source = (REPO / "recipes/ddp_torchrun.py").read_text()
    waiting = recipe_line(blocks[0])  # rank 0: in the collective rank 1 never joined, called from this recipe line
    assert waiting in source and ("all_reduce" in waiting if stuck else "gather_result_line" in waiting), blocks[0]
    if stuck:  # rank 1: at the same recipe line, and inside the fault: its sleep, or the C++ barrier
        assert recipe_line(blocks[1]) == waiting, blocks[1]
        assert any(line.strip().startswith(stuck) for line in blocks[1]), blocks[1]
    else:  # rank 1 skipped the all_gather and finished, or was finishing: nothing to show
        assert len(blocks[1]) == 1 and re.fullmatch(r"none, it had ended \((exit code 0|its main\(\) had returned: it "
                                                    r"was exiting)\) before the others stopped", blocks[1][0]), blocks


# Drill 3 under --debug-collectives (torch's DETAIL level): each collective first checks that every rank called the
# same one. rank 1's end-of-epoch all_reduce of the loss sums (sum, count and each rank's own_ms: 4 doubles on 2 ranks),
# with one element more (4 against 5: the shapes differ), or never called (a sleep before it).
MISMATCH = (r"the ranks called different collectives: rank 0 called ALLREDUCE of shape \[4\] Double \(its collective "
            r"number (\d+) on that group\), rank 1 called ALLREDUCE of shape \[5\] Double \(its collective number \1 "
            r"on that group\); they differ in: Tensor Tensor shapes: ")


@pytest.mark.parametrize(("fault", "says"), [
    # Both ranks say what each called. Without the switch the same fault is a timeout on both, or worse, a wrong sum
    # returned on one rank while the other waits (docs/failures.md).
    ("1:all_reduce:1:grow", {0: MISMATCH + "4vs 5", 1: MISMATCH + "5vs 4"}),
    # The check's monitored barrier names the rank that did not come, where the plain timeout cannot.
    ("1:all_reduce:1:hang", {0: r"rank 1 did not reach this collective within --dist-timeout: it hangs, or it "
                                      r"took another branch \(\[Rank 0\]: Ranks 1 failed to pass monitoredBarrier in "
                                      r"5000 ms\)"}),
])
def test_debug_collectives_names_what_each_rank_called(tmp_path, fault, says):
    job = Job("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--max-steps", "3", "--dist-timeout", 5, "--out-dir",
              tmp_path, "--debug-collectives",
              env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_COLLECTIVE": fault})
    job.wait_for("FAULT: rank 1")
    start = time.monotonic()
    code = job.finish(timeout=120)
    print(f"drill 3 {fault} --debug-collectives: exit {code} {time.monotonic() - start:.1f} s after the fault")
    stderr = "".join(job.stderr)
    assert code == 1 and "Traceback" not in stderr and "Segmentation" not in stderr, job.output()  # DDP ran 3 steps
    errors = {int(line[len("[rank "):].split("]")[0]): line.split("error: ", 1)[1] for line in error_lines(stderr)}
    for rank, pattern in says.items():
        assert re.match(pattern, errors[rank]), (rank, errors)
    blocks = stack_blocks(stderr)  # each rank's place: the loss sums' all_reduce at the epoch's end
    assert sorted(blocks) == [0, 1], job.output()
    assert recipe_line(blocks[0]) == recipe_line(blocks[1]), blocks
    assert recipe_line(blocks[0]).startswith("loss_meter.all_reduce(device, ride=speed)"), blocks


def _flight_recorder_worker(rank, port, results):
    import datetime
    import json

    import torch.distributed as dist

    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"  # what docs/failures.md exports; read when the group is made
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.ones(2, 2), 0)
    if rank == 0:  # rank 1 stops here, as a hung rank would: rank 0's third collective times out
        try:
            dist.all_reduce(torch.ones(5))
        except RuntimeError as exc:
            results["error"] = str(exc).splitlines()[0]
    buffer = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())["entries"]
    results[rank] = [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"], e["state"]) for e in buffer]
    while "error" not in results:  # rank 1 stays (in no collective) until rank 0 has timed out and dumped
        time.sleep(0.05)


def test_the_flight_recorder_records_gloos_collectives_on_the_cpu_and_shows_which_rank_is_behind():
    # docs/failures.md: torch 2.14.1 keeps gloo's collectives in the Flight Recorder's buffer (TORCH_FR_BUFFER_SIZE),
    # as NCCL's: each rank's buffer, side by side, says which rank stopped before which collective (what torchfrtrace
    # reports from the dumps; it fails on gloo's in 2.14.1, and gloo has no watchdog to dump on a timeout).
    results = spawn_gloo(_flight_recorder_worker)
    assert "Timed out" in results["error"] or "timed out" in results["error"].lower(), results["error"]
    common = [(1, "gloo:all_reduce", [[3]]), (2, "gloo:broadcast", [[2, 2]])]
    assert [e[:3] for e in results[1]] == common, results[1]  # rank 1: two collectives, then nothing
    assert [e[:3] for e in results[0]] == [*common, (3, "gloo:all_reduce", [[5]])], results[0]
    # gloo leaves every entry "scheduled": it has no watchdog to mark them completed (NCCL's does).
    assert {e[3] for rank in (0, 1) for e in results[rank]} == {"scheduled"}, dict(results)


# ---------------------------------------------------------- drill 4: a sample that does not load
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_corrupt_image_in_one_rank_names_its_index_and_file(tmp_path, workers):
    root = make_imagefolder(tmp_path / "data", train_per_class=8, val_per_class=3)
    bad = root / "train" / "class_1" / "005.png"  # ImageFolder sorts: class_0 has 0-7, so this is sample 13
    bad.write_bytes(b"not a png")
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", "--dataset", "imagefolder", "--data-root", root,
                  "--image-size", "16", "--batch-size", "8", "--arch", "tiny", "--workers", workers,
                  "--out-dir", tmp_path / "out", timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = sample_errors(proc.stderr)
    assert len(errors) == 1, proc.stderr  # only the rank whose shard holds the sample
    assert re.fullmatch(rf"\[rank [01]\] error: train sample 13 \({re.escape(str(bad))}\) does not load: "
                        r"UnidentifiedImageError: cannot identify image file .*", errors[0]), errors
    assert "Traceback" not in proc.stderr
    assert re.search(r"launch\.sh: job failed: rank [01] \(pid \d+\) exited with code 1", proc.stderr)


@pytest.fixture(scope="module")
def faces_with_a_bad_record(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faces")
    make_imagefolder(tmp / "ids", classes=4, train_per_class=10, val_per_class=0, size=16)
    assert pack_rec([str(tmp / "ids" / "train"), str(tmp / "rec"), "--size", "16"]) == 0
    key = 7  # image keys start at 1, so this is sample 6 (in the training split: every 10th is held out)
    offset = IndexedRecordReader(tmp / "rec" / "train.idx", tmp / "rec" / "train.rec").idx[key]
    with open(tmp / "rec" / "train.rec", "r+b") as f:
        f.seek(offset)
        f.write(b"XXXX")
    return tmp / "rec"


@pytest.mark.parametrize("workers", ["0", "1"])  # 0: read in DataLoaderX's thread; 1: in a worker under it
def test_a_corrupt_record_under_dataloaderx_names_its_index_and_key(faces_with_a_bad_record, tmp_path, workers):
    rec = faces_with_a_bad_record
    proc = launch("recipes/mx_face_prefetch.py", "cpu:2", "--rec", rec, "--arch", "tiny", "--image-size", "16",
                  "--batch-size", "8", "--workers", workers, "--out-dir", tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr
    errors = sample_errors(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert re.fullmatch(rf"\[rank [01]\] error: train sample 6 does not load: RecordIOError: "
                        rf"{re.escape(str(rec / 'train.rec'))}: key 7: bad magic 0x58585858 .*", errors[0]), errors
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------- drill 5: a checkpoint that does not fit
RESUMABLE = {  # recipe: (its checkpoint file, extra flags, a flag the checkpoint was not written with, what is said)
    "ddp_checkpoint": ("latest.pt", [], ["--epochs", "3"],
                       "was trained with --epochs 2 (this run: 3); resume with the same flags"),
    # an fp32 run's disabled scaler saved {}, which an fp16 GradScaler cannot load (fp32, not bf16: bf16 convolutions
    # take a slow kernel on a CPU without native bf16, 45-60 s of this test under load for the same check)
    "torch_amp": ("checkpoint.pt", ["--amp-dtype", "fp32"], ["--amp-dtype", "fp16"],
                  "was written with --amp-dtype fp32 (this run: fp16); resume with the same flags"),
    "apex_amp": ("checkpoint.pt", ["--impl", "torch", "--opt-level", "O0"], ["--opt-level", "O2"],
                 "was written with --opt-level O0 (this run: O2); resume with the same flags"),
}


@pytest.mark.parametrize("recipe", sorted(RESUMABLE))
def test_a_wrong_or_truncated_checkpoint_is_refused_and_nothing_is_overwritten(tmp_path, recipe):
    name, extra, other_flags, other_says = RESUMABLE[recipe]
    out = tmp_path / "out"
    args = [f"recipes/{recipe}.py", "cpu:2", "--workers", "0", "--synthetic-train", "64", "--synthetic-val", "32",
            "--batch-size", "32", "--epochs", "2", *extra, "--out-dir", out]
    made = launch(*args, "--arch", "tiny_bn", "--max-steps", "2")  # one whole epoch: a checkpoint to resume
    assert made.returncode == 0, made.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert name in before

    wrong = launch(*args, "--arch", "tiny", "--resume", out / name)
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    messages = {line.split("error: ", 1)[1] for line in error_lines(wrong.stderr)}
    # tiny_bn's features are conv, bn, relu, pool, conv, bn...; tiny's conv, relu, pool, conv... ddp_checkpoint's
    # latest.pt holds its args: the flag is named before the weights are read.
    assert messages == ({f"{out / name} was trained with --arch tiny_bn (this run: tiny); resume with the same flags"}
                        if recipe == "ddp_checkpoint" else
                        {f"{out / name} does not fit this model (its --arch, and the classes and --image-size of its "
                         "data): missing ['features.3.weight', 'features.3.bias'], unexpected ['features.1.weight', "
                         "'features.1.bias', 'features.1.running_mean']"}), wrong.stderr  # each rank says the same
    assert "Traceback" not in wrong.stderr

    cut = tmp_path / "cut.pt"
    cut.write_bytes(before[name][: len(before[name]) // 2])
    # The other two in one process (python RECIPE.py): what is checked is the same on every rank, and it is faster.
    truncated = run_direct(recipe, *args[2:], "--arch", "tiny_bn", "--resume", cut)
    assert truncated.returncode == 2, truncated.stderr[-3000:]
    messages = {line.split("error: ", 1)[1] for line in error_lines(truncated.stderr)}
    assert len(messages) == 1 and messages.pop().startswith(f"cannot load {cut} ("), truncated.stderr
    assert "Traceback" not in truncated.stderr

    other = run_direct(recipe, *args[2:], "--arch", "tiny_bn", *other_flags, "--resume", out / name)
    assert other.returncode == 2, other.stderr[-3000:]
    assert {line.split("error: ", 1)[1] for line in error_lines(other.stderr)} == {f"{out / name} {other_says}"}
    assert "Traceback" not in other.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written, nothing replaced


# ------------------------------------------------------------------------ drill 6: bad flags
@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(("recipe", "flags", "message"), [
    ("ddp_torchrun", ["--batch-size", "1"], "--batch-size 1 is the GLOBAL batch and must be a multiple of the 2 "
                                            "processes; try --batch-size 2"),
    ("ddp_torchrun", ["--workers", "-1"], "--workers -1 must be >= 0"),
    ("ddp_torchrun", ["--arch", "resnet181"], "unknown --arch 'resnet181'; did you mean resnet18, resnet101"),
    ("ddp_torchrun", ["--dataset", "imagefolder", "--data-root", "/no/such/dir"],
     "--data-root '/no/such/dir' has no train/ folder; expected ROOT/train/<class>/*.png|jpg"),
    ("ddp_torchrun", ["--dataset", "imagefolder", "--data-root", "README.md"],
     "--data-root 'README.md' has no train/ folder"),
    ("ddp_launch", ["--batch-size", "3"], "--batch-size 3 is the GLOBAL batch"),  # the legacy launcher, too
    ("ddp_spawn", ["--workers", "-2"], "--workers -2 must be >= 0"),
    ("ddp_torchrun", "busy_port", "MASTER_PORT={port} is already in use"),
])
def test_bad_input_gets_one_line_and_exit_2_before_any_data_is_read(busy_port, recipe, flags, message):
    env = {"MASTER_PORT": str(busy_port)} if flags == "busy_port" else None
    start = time.monotonic()
    proc = launch(f"recipes/{recipe}.py", "cpu:2", "--arch", "tiny", *([] if env else flags), env=env, timeout=60)
    took = time.monotonic() - start
    print(f"drill 6 {recipe} {flags}: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    messages = {line.split("error: ", 1)[1] for line in errors}
    assert len(messages) == 1 and message.format(port=busy_port) in messages.pop(), proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    # Before any data is read or any step taken: the time is the launch (5-6 s here, docs/failures.md), whatever the
    # model and the data would cost; the bound is how busy the machine is, so it is printed above, not asserted.
    assert "data:" not in proc.stdout and "epoch=" not in proc.stdout, proc.stdout


# --------------------------------------------------------------------- drill 7: Ctrl-C, SIGTERM
# Jobs.Job starts each job as a terminal does (job-control signals at their defaults), so these pass whether the
# suite itself runs in a terminal, under CI, or in the background of a script (where SIGINT is ignored).
def shell_code(code):
    """Popen's returncode as a shell reports it: -N (killed by signal N) is 128 + N."""
    return 128 - code if code < 0 else code


LAUNCHERS = ["ddp_torchrun", "ddp_launch", "ddp_spawn"]  # torchrun, torch.distributed.launch, python + mp.spawn


@pytest.mark.parametrize("recipe", ["ddp_torchrun", "ddp_spawn"])
def test_ctrl_c_stops_every_process(tmp_path, recipe):
    job = job_mid_epoch(recipe, tmp_path)
    tree = job.tree()
    assert len(tree) >= 5, tree  # launcher, 2 ranks, their DataLoader workers
    if recipe == "ddp_spawn":  # its ranks fork their DataLoader workers (the recipe's "fork" context): each worker
        # is a copy of its rank, the same command line, not an interpreter that spawn started (a pipe of its own)
        table, ranks = process_table(), [job.rank_pid(rank) for rank in (0, 1)]
        loaders = {rank: [pid for pid in tree if table.get(pid, (None,))[0] == rank] for rank in ranks}
        assert all(loaders.values()), loaders
        assert all(cmdline(pid) == cmdline(rank) for rank in ranks for pid in loaders[rank]), loaders
    start = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: SIGINT to the foreground group
    code = job.finish(timeout=60)
    print(f"drill 7 {recipe}: exit {code} {time.monotonic() - start:.1f} s after SIGINT, {len(tree)} processes")
    assert code == 128 + signal.SIGINT, job.output()
    assert not tracebacks_beyond_multiprocessing("".join(job.stderr)), job.output()
    assert "] stack:" not in "".join(job.stderr), job.output()  # stacks are for a hang, not for Ctrl-C
    assert not survivors(tree), (sorted(tree), job.output())


@pytest.mark.parametrize("recipe", LAUNCHERS)
def test_sigterm_to_the_launcher_stops_every_process(tmp_path, recipe):
    """`kill PID` of the launcher alone (what a scheduler or a user does to a background job): torchrun stops
    every rank and says so; the mp.spawn parent dies of it and torch's spawn gives each worker SIGINT when its
    parent dies (PR_SET_PDEATHSIG), so the workers leave quietly. Either way the shell sees 143."""
    job = job_mid_epoch(recipe, tmp_path)
    tree = job.tree()
    start = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    code = shell_code(job.finish(timeout=60))
    print(f"drill 7 {recipe}: exit {code} {time.monotonic() - start:.1f} s after SIGTERM, {len(tree)} processes")
    assert code == 128 + signal.SIGTERM, job.output()
    if recipe != "ddp_spawn":
        assert "launch.sh: SIGTERM received: all ranks were stopped" in "".join(job.stderr), job.output()
    assert not tracebacks_beyond_multiprocessing("".join(job.stderr)), job.output()
    assert not survivors(tree), (sorted(tree), job.output())


@pytest.mark.parametrize("recipe, stops", [("ddp_torchrun", True), ("ddp_spawn", False)])
def test_a_job_started_with_sigint_ignored(tmp_path, recipe, stops):
    """A script's `cmd &` starts cmd with SIGINT ignored. torchrun installs its own SIGINT handler, so its job
    still stops; a `python` recipe inherits the ignore (Python installs no KeyboardInterrupt handler then) and
    trains on, as Unix intends for a background job; SIGTERM stops it. docs/failures.md says both."""
    # Epochs of 16 steps: the job that ignores SIGINT shows it by finishing one more, soon.
    job = job_mid_epoch(recipe, tmp_path, ignored=(signal.SIGINT, signal.SIGQUIT), samples=1024)
    tree = job.tree()
    os.killpg(job.proc.pid, signal.SIGINT)
    if stops:
        assert job.finish(timeout=60) == 128 + signal.SIGINT, job.output()
    else:
        job.wait_for("epoch=2/", timeout=60)  # it ignored SIGINT and finished another epoch
        assert job.proc.poll() is None, job.output()
        os.kill(job.proc.pid, signal.SIGTERM)
        assert shell_code(job.finish(timeout=60)) == 128 + signal.SIGTERM, job.output()
    assert not survivors(tree), (sorted(tree), job.output())


# ------------------------------------- drill 8: an output place that cannot be written, or fills up


def trained(stdout):
    return re.search(r"^epoch=", stdout, re.M) is not None


@pytest.mark.parametrize("recipe", IMAGE_RECIPES)  # the language models: tests/test_lm.py
def test_every_recipe_checks_its_out_dir_before_the_first_step(tmp_path, recipe):
    in_the_way = tmp_path / "runs_x"
    in_the_way.write_text("a file where the out-dir should go\n")
    extra = ["--rec", "synthetic"] if recipe == "mx_face_prefetch" else []
    start = time.monotonic()
    proc = run_direct(recipe, *TINY, *extra, "--epochs", "5", "--out-dir", in_the_way, timeout=120)
    took = time.monotonic() - start
    print(f"drill 8 {recipe}: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    # (mp.spawn's parent adds which worker it was: "error: worker 0 (pid N) exited with code 2; ...")
    said = [line for line in error_lines(proc.stderr) if not re.match(r"error: worker \d \(pid \d+\) exited", line)]
    assert said == [f"error: --out-dir {in_the_way} is a file, not a folder; pass a folder to write to"], said
    assert not trained(proc.stdout) and "Traceback" not in proc.stderr  # before any training
    assert in_the_way.read_text() == "a file where the out-dir should go\n" and took < 30


def test_a_tb_dir_that_is_a_file_is_refused_naming_tb_dir(tmp_path):
    in_the_way = tmp_path / "tb_x"
    in_the_way.write_text("a file where the TensorBoard folder should go\n")
    proc = run_direct("ddp_torchrun", *TINY, "--out-dir", tmp_path / "out", "--tb-dir", in_the_way, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: --tb-dir {in_the_way} is a file, not a folder; pass a folder to "
                                        "write to"], proc.stderr
    assert not trained(proc.stdout)
    assert not (tmp_path / "out").exists()  # checked with --out-dir, before either is used: nothing left behind


def test_an_out_dir_whose_parent_cannot_be_created_stops_every_rank(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    start = time.monotonic()
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--out-dir", blocker / "runs" / "x", timeout=120)
    print(f"drill 8 parent: exit {proc.returncode} after {time.monotonic() - start:.1f} s")
    assert proc.returncode == 2
    assert error_lines(proc.stderr)[0] == (f"error: cannot write to --out-dir {blocker / 'runs' / 'x'} (Not a "
                                           f"directory at {blocker / 'runs'}); pass a folder you can write to")
    assert len(error_lines(proc.stderr)) == 1 and not trained(proc.stdout)
    assert [p.name for p in tmp_path.iterdir()] == ["not_a_folder"]


def test_too_little_free_space_stops_before_training_saying_both_numbers(tmp_path):
    # FAULT_DISK_FREE: tests/faults/sitecustomize.py makes the disk report 50 kB free (a test double of a full
    # disk). tiny_bn's checkpoint.pt is ~44 kB and model.pt ~23 kB: with the temp copy, more than 50 kB.
    out = tmp_path / "new" / "out"
    start = time.monotonic()
    proc = launch("recipes/torch_amp.py", "cpu:2", *TINY, "--arch", "tiny_bn", "--out-dir", out, timeout=120,
                  env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_DISK_FREE": "51200"})
    print(f"drill 8 free space: exit {proc.returncode} after {time.monotonic() - start:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = error_lines(proc.stderr)
    assert len(said) == 1 and re.fullmatch(
        rf"error: --out-dir {re.escape(str(out))} has 50 kB free, and this run will write 1\d\d kB there "
        r"\(checkpoint\.pt \d\d kB, model\.pt \d\d kB, and a temp copy of the largest for its atomic save\); free "
        r"some space or pass another --out-dir", said[0]), said
    assert not trained(proc.stdout)
    assert not (tmp_path / "new").exists()  # the folders it made to test the disk are gone again


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    # FAULT_DISK_FULL: the second time rank 0 writes latest.pt.tmp (epoch 2), the disk takes 4 kB and refuses
    # the rest with ENOSPC. torch.save itself reports only "unexpected pos"; save_atomic says what happened.
    out = tmp_path / "out"
    proc = launch("recipes/ddp_checkpoint.py", "cpu:2", *TINY, "--epochs", "3", "--synthetic-train", "256",
                  "--batch-size", "64", "--out-dir", out, timeout=120,
                  env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_DISK_FULL": "latest.pt.tmp:2:4096"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"FAULT: {out / 'latest.pt.tmp'} fills the disk after 4096 bytes" in proc.stdout
    said = [line for line in error_lines(proc.stderr) if "lost the connection" not in line]
    assert len(said) == 1 and re.fullmatch(
        rf"\[rank 0\] error: cannot write {re.escape(str(out / 'latest.pt'))} \(No space left on device; [\d.]+ [kMG]B "
        r"free there\): the previous latest\.pt, if any, is whole; free some space, then --resume", said[0]), said
    assert "Traceback" not in proc.stderr
    assert torch.load(out / "latest.pt", weights_only=True)["epoch"] == 1  # epoch 1's, whole
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "latest.pt"]  # no temp file, no model.pt


# The image recipes' checkpoints and the language models' (tests/test_recipe_variants.py: every recipe that resumes
# asks for the check).
LM_TINY = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--steps", "2"]


@pytest.mark.parametrize(("recipe", "flags"), [
    ("ddp_checkpoint", [*TINY, "--resume", "auto"]), ("fsdp", [*TINY, "--resume", "auto"]), ("lm_ddp", LM_TINY),
    ("lm_tp", [*LM_TINY, "--resume", "auto"])],
    ids=["ddp_checkpoint-resumed-on-one-node", "fsdp-resumed-on-one-node", "lm_ddp", "lm_tp-resumed-on-one-node"])
def test_an_out_dir_that_another_node_cannot_see_stops_both_nodes(tmp_path, recipe, flags):
    # Two "nodes" on this box, one process each, each with its own --out-dir: what a folder on each node's local
    # disk looks like. The ranks load what rank 0 saves, so this must stop before training. --resume auto: node 0's
    # folder holds a checkpoint (a one-node run's, requeued onto two nodes), node 1's none: the check comes before the
    # resume, or node 0 would enter dcp.load's collectives (lm_tp, fsdp) or DDP's backward that lays the buckets out
    # (ddp_checkpoint) while node 1 enters the check's: a hang naming nothing.
    if "--resume" in flags:
        earlier = launch(f"recipes/{recipe}.py", "cpu:1", *flags[:-2], "--out-dir", tmp_path / "node0")
        assert earlier.returncode == 0 and list((tmp_path / "node0").rglob("latest.pt")), earlier.stderr
    before = sorted(tmp_path.rglob("*"))
    port = str(free_port())  # below the ephemeral range, kept from other picks (tools/free_port.py)
    jobs = [Job(f"recipes/{recipe}.py", "cpu:1", *flags, "--out-dir", tmp_path / f"node{node}",
                env={"NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for node in (0, 1)]
    start = time.monotonic()
    codes = [job.finish(timeout=120) for job in jobs]
    print(f"drill 8 unshared: exits {codes} after {time.monotonic() - start:.1f} s")
    assert codes == [2, 2], [job.output() for job in jobs]
    for node, job in enumerate(jobs):  # each node's local rank 0 says it, of its own --out-dir
        assert error_lines("".join(job.stderr)) == [
            f"error: --out-dir {tmp_path / f'node{node}'} must be on storage that every node shares: rank 1 on "
            f"{socket.gethostname()} cannot see the file rank 0 wrote there, and would not see its checkpoints; use "
            "a shared folder (NFS, Lustre, a cluster file system)"], job.output()
        assert not trained("".join(job.stdout)) and "step=" not in "".join(job.stdout)
    assert sorted(tmp_path.rglob("*")) == before  # node 0's folder, made for the test file, is gone again
