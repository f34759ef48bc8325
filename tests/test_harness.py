"""No hidden collective in common/: a helper that performs one says so in its name, and every other helper runs on
rank 0 alone (under `if is_main:`, a researcher's first edit) without waiting for the other ranks."""

import argparse
import ast
import datetime
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, spawn_gloo

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "gather", "gather_object",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "all_reduce_coalesced"}
SAYS_SO = ("all_reduce", "all_gather", "gather", "broadcast", "barrier", "reduce", "scatter", "collective",
           "process_group")  # makes one: dist.new_group


def _called(node):
    """(module or object name, attribute) of each call inside `node`: dist.all_reduce -> ("dist", "all_reduce")."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            if isinstance(f, ast.Attribute):
                yield ast.unparse(f.value), f.attr
            elif isinstance(f, ast.Name):
                yield None, f.id


def collective_functions(sources):
    """{name: file} of the functions in `sources` ({file: text}) that perform a collective: a torch.distributed one,
    or a call of a function that does, to any depth. A method is named Class.method; a call reaches every function
    of that name (a method and a function may share one: StepMeter.gather_result_line calls gather_result_line)."""
    functions = {}
    for file, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            for owner in [node] if isinstance(node, ast.ClassDef) else []:
                functions.update({f"{owner.name}.{f.name}": (file, f) for f in owner.body
                                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))})
        functions.update({f.name: (file, f) for f in tree.body if isinstance(f, (ast.FunctionDef,
                                                                               ast.AsyncFunctionDef))})
    collective = set()
    while True:  # to a fixed point: a function calling a collective one is one
        called_names = {name.rsplit(".", 1)[-1] for name in collective}
        grown = {name for name, (_, node) in functions.items() if name not in collective and any(
            (owner in ("dist", "torch.distributed") and attr in COLLECTIVES) or attr in called_names
            for owner, attr in _called(node))}
        if not grown:
            return {name: functions[name][0] for name in sorted(collective)}
        collective |= grown


def hidden(collectives):
    return {name: file for name, file in collectives.items() if not any(word in name for word in SAYS_SO)}


def test_no_helper_in_common_hides_a_collective():
    sources = {p.name: p.read_text() for p in sorted((REPO / "common").glob("*.py"))}
    found = collective_functions(sources)
    assert hidden(found) == {}
    assert found == {"AverageMeter.all_reduce": "utils.py", "DivergenceCheck.all_reduce_and_check": "utils.py",
                     "gather_values": "utils.py", "broadcast_out_dir_check": "outputs.py",
                     "gather_result_line": "harness.py", "ddp_process_group": "harness.py",
                     "gather_profile_table": "profiling.py", "StopVote.all_reduce_max": "harness.py",
                     "StepMeter.all_reduce_and_check": "harness.py", "StepMeter.all_reduce_loss": "harness.py",
                     "StepMeter.gather_profile_table": "harness.py", "StepMeter.gather_result_line": "harness.py",
                     "CompileCounts.gather_fields": "harness.py"}


def test_the_walk_finds_a_collective_hidden_one_call_deep():
    text = ("import torch.distributed as dist\n"
            "def _sum(t):\n    torch.distributed.all_reduce(t)\n"
            "class TB:\n    def log(self, t):\n        _sum(t)\n"
            "def all_reduce_loss(t):\n    _sum(t)\n")
    assert hidden(collective_functions({"tb.py": text})) == {"_sum": "tb.py", "TB.log": "tb.py"}


# ------------------------------------------------------------------------------ rank 0 alone
def _rank0_alone_worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=5))
    if rank == 0:  # every local helper, as `if is_main:` would run it; rank 1 is in no collective meanwhile
        from common import harness
        from common.data import build_datasets, prepare_dataset
        from common.models import build_model, recomputed_batchnorm
        from common.outputs import held_state_bytes, state_bytes
        from common.schedule import warmup_cosine
        from common.utils import AverageMeter, accuracy, human, peak_memory_mb, print0, result_line

        device = torch.device("cpu")
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        parser.add_argument("--arch", default="tiny")
        harness.add_flags(parser)
        args = parser.parse_args(["--tb-dir", results["tb_dir"], "--tb-every", "1"])
        harness.check_flags(args)
        prepare_dataset("synthetic", None)
        train_set, _, classes = build_datasets("synthetic", synthetic_train=16, synthetic_val=8)
        harness.check_full_batch(1, len(train_set), 8)
        model = build_model("tiny_bn", classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = warmup_cosine(optimizer, 1, 2, 1)
        images = torch.stack([train_set[i][0] for i in range(8)])
        targets = torch.tensor([train_set[i][1] for i in range(8)])
        loss_meter, acc_meter, speed = AverageMeter(), AverageMeter(), harness.Throughput(device)
        tb = harness.TensorBoard(args.tb_dir, args.tb_every, True, vars(args))
        check = harness.DivergenceCheck(device)
        speed.watch(model, forward=model)
        prof = harness.Profiler(True, results["tb_dir"], 0, device)
        speed.start()
        for step in (1, 2):
            output = model(images)
            loss = torch.nn.functional.cross_entropy(output, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_meter.update(loss, 8)
            acc_meter.update(accuracy(output, targets)[0], 8)
            check.update(step, loss)
            speed.step(8)
            prof.step()
            tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"])
        seconds = speed.stop()
        prof.stop()
        with recomputed_batchnorm(model):
            model(images)
        tb.epoch(2, device, train_loss=loss_meter.avg, images_per_sec=16 / seconds)
        tb.close()
        print0(result_line(steps=2, eta=str(speed.eta(3)), workers=harness.default_workers(None, 2),
                           state=state_bytes(model, optimizer), held=held_state_bytes(model, optimizer),
                           peak=human(peak_memory_mb(device) * 2**20)))
        results["events"] = len(list(Path(args.tb_dir).glob("events.out.tfevents.*")))
        results["rank0_done"] = True
    else:
        while "rank0_done" not in results:
            time.sleep(0.05)
    dist.barrier()
    if rank == 0:  # the control: a collective on rank 0 alone times out (gloo, 5 s), so the check above could fail
        try:
            dist.all_reduce(torch.ones(1))
            results["control"] = "returned"
        except RuntimeError as exc:
            results["control"] = str(exc).splitlines()[0]
        results["control_done"] = True
    else:
        while "control_done" not in results:
            time.sleep(0.05)
    # No destroy_process_group: after the control's timeout gloo's group is broken; the process just ends.


@pytest.mark.slow  # a 2-process job and gloo's 5 s timeout for the control
def test_every_local_helper_runs_on_rank_0_alone_and_finishes(tmp_path):
    import torch.multiprocessing as mp

    manager = mp.Manager()
    shared = manager.dict(tb_dir=str(tmp_path / "tb"))
    spawn_gloo(_rank0_alone_worker, results=shared)
    assert shared["rank0_done"] and shared["events"] == 1
    assert "Timed out" in shared["control"], shared["control"]


# -------------------------------------------------------------------- DDP's unused parameters
def _unused_worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.models import build_model
    from common.utils import _unused_parameters

    torch.manual_seed(0)
    model = DDP(build_model("tiny_unused", 10))
    images = torch.randn(4, 3, 32, 32)
    try:
        for _ in range(2):  # the second forward finds the first backward's unreduced gradients
            model(images).sum().backward()
        results[rank] = "no error"
    except RuntimeError as exc:
        results[rank] = _unused_parameters(exc)
    dist.destroy_process_group()


def test_compile_counts_times_the_first_step_from_its_compile_not_the_setup_before_it(capsys):
    # Recipes make CompileCounts before DDP's broadcast, the optimizer, a checkpoint's load (lm_fsdp_tp: before
    # fully_shard and the weights' load): that setup (the sleep here) is not the first step's compile time.
    from torch._dynamo.callback import callback_handler

    from common import harness

    block = torch.nn.Linear(4, 4)
    block.compile(backend="eager", dynamic=False)  # dynamo's graph, counted as the recipes' are; no inductor build
    started = time.perf_counter()
    compiled = harness.CompileCounts(True, torch.device("cpu"))
    try:
        time.sleep(3)  # the setup
        block(torch.ones(2, 4)).sum().backward()  # the first step: it compiles
        compiled.step()
        took = time.perf_counter() - started
    finally:
        callback_handler.remove_start_callback(compiled._compile_starts)
        callback_handler.remove_end_callback(compiled._compile_ends)
    line = re.search(r"^compile: 1 graph\(s\) in ([\d.]+) s \(the first step; the rate leaves it out\), 0 graph "
                     r"break\(s\)$", capsys.readouterr().out, re.M)
    assert line and float(line[1]) <= took - 3 + 0.05, (line, took)  # printed to 0.1 s


def test_ddp_unused_parameter_error_becomes_one_line_naming_them():
    # The recipes' loops have no try/except: one_line_errors finds the DDP wrapper in the traceback.
    results = spawn_gloo(_unused_worker)
    assert results[0] == results[1] == (
        "aux_head.weight, aux_head.bias got no gradient (the forward pass skipped them), which DDP rejects by "
        "default; rerun with --find-unused-parameters, or remove the unused layers")


def test_an_error_naming_find_unused_parameters_outside_a_ddp_forward_keeps_its_traceback():
    # DDP's "Expected to mark a variable ready only once" (raised in backward) names the flag too, but is not the
    # unused-parameter error: the handler leaves it alone rather than give the wrong advice.
    from common.utils import _unused_parameters, one_line_errors

    error = RuntimeError("Expected to mark a variable ready only once ... `find_unused_parameters=False` ...")
    assert _unused_parameters(error) is None
    with pytest.raises(RuntimeError, match="mark a variable ready only once"), one_line_errors():
        raise error


# ----------------------------------------------------------------------- the recipes' start-up checks
def test_check_gpu_keeps_the_rank_s_gpu_shares_one_under_launch_sh_g_n_and_refuses_one_not_visible(
        monkeypatch, capsys):
    # No GPU on this box: torch.cuda.device_count is stood in for (4 visible GPUs), the one CUDA call check_gpu makes;
    # torch.device("cuda", i) needs no GPU.
    from common import harness

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("RANKS_PER_GPU", raising=False)
    assert harness.check_gpu(torch.device("cuda", 3), "nccl") == (torch.device("cuda", 3), "nccl")
    monkeypatch.setenv("RANKS_PER_GPU", "3")  # launch.sh 1:3: CUDA_VISIBLE_DEVICES=1, local ranks 0-2 on it
    assert harness.check_gpu(torch.device("cuda", 2), "nccl") == (torch.device("cuda", 0), "gloo")
    monkeypatch.setenv("RANKS_PER_GPU", "1")
    with pytest.raises(SystemExit) as exc:  # torchrun --nproc-per-node 5 on 4 GPUs
        harness.check_gpu(torch.device("cuda", 4), "nccl")
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("[rank 0] error: this rank's GPU is cuda:4 but only 4 GPUs are visible: start "
                                       "one process per listed GPU (./launch.sh RECIPE 0,1 does)\n")


def test_torch_amp_s_cpu_default_is_bf16_only_where_the_cpu_runs_it_natively(monkeypatch):
    # This box's CPU has no native bf16 (AVX2): fp32, saying why. The other answer is the op stood in for (a CPU with
    # AVX-512 or AMX, which no machine of ours has); the op is the one torch.compile's inductor asks the same question.
    from common import harness

    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert harness.cpu_amp_default() == ("bf16" if native else "fp32")
    for has, dtype, says in [(False, "fp32", "this CPU has no native bf16, so bf16 convolutions would take a slow "
                                             "kernel, 5-50x slower than fp32; --amp-dtype bf16 runs it anyway"),
                             (True, "bf16", "where the CPU has native bf16: fp16 is 10-50x slower on CPU")]:
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda has=has: has)
        assert harness.cpu_amp_default() == dtype
        assert harness.cpu_amp_default(why=True).startswith("the CPU default") and says in harness.cpu_amp_default(
            why=True)
    monkeypatch.setattr(torch.ops, "mkldnn", object())  # a torch built without oneDNN has no such op: fp32
    assert harness.cpu_amp_default() == "fp32"


def test_check_gpu_refuses_ranks_sharing_a_gpu_for_a_dtensor_recipe(monkeypatch, capsys):
    # fsdp.py on launch.sh 0:2 trained, then died with SIGSEGV gathering model.pt (gloo over CUDA, H200, torch 2.11).
    from common import harness

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["recipes/fsdp.py"])
    monkeypatch.setenv("RANKS_PER_GPU", "1")  # one rank per GPU: NCCL, as before
    assert harness.check_gpu(torch.device("cuda", 0), "nccl", dtensor=True) == (torch.device("cuda", 0), "nccl")
    monkeypatch.setenv("RANKS_PER_GPU", "2")
    assert harness.check_gpu(torch.device("cuda", 1), "nccl") == (torch.device("cuda", 0), "gloo")  # DDP: shares it
    with pytest.raises(SystemExit) as exc:
        harness.check_gpu(torch.device("cuda", 1), "nccl", dtensor=True)
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "error: fsdp.py cannot run 2 ranks on one GPU (launch.sh G:N, gloo over CUDA): torch's DTensor "
        "collectives crash there (SIGSEGV); run one rank per GPU (0,1) or try it on cpu:N\n")
    with pytest.raises(SystemExit) as exc:  # lm_pp.py's reason: pipelining's sends and receives
        harness.check_gpu(torch.device("cuda", 1), "nccl", why="gloo's send takes a CUDA address as host memory")
    assert exc.value.code == 2 and "on one GPU (launch.sh G:N, gloo over CUDA): gloo's send takes a CUDA address " \
        "as host memory; run one rank per GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "world", "says"), [
    (["--batch-size", "10"], 3, "--batch-size 10 is the GLOBAL batch and must be a multiple of the 3 processes; "
                                "try --batch-size 9"),
    (["--batch-size", "2"], 3, "--batch-size 2 is the GLOBAL batch and must be a multiple of the 3 processes; "
                               "try --batch-size 3"),
    (["--batch-size", "12", "--accum-steps", "4"], 2, "--batch-size 12 is the GLOBAL batch and must be a multiple of "
                                                      "the 2 processes x 4 accumulation steps; try --batch-size 8"),
    (["--sync-bn"], 1, "--sync-bn needs GPUs: torch's SyncBatchNorm refuses CPU tensors; leave it out on the CPU"),
    (["--shard-size", "0"], 1, "--shard-size 0 must be >= 1"),
])
def test_check_flags_refuses_with_one_line(flags, world, says, capsys, monkeypatch):
    from common import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --sync-bn's case, also on a GPU machine
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--accum-steps", type=int, default=1)
    parser.add_argument("--shard-size", type=int)
    parser.add_argument("--sync-bn", action="store_true")
    with pytest.raises(SystemExit) as exc:
        harness.check_flags(parser.parse_args(flags), world)
    assert exc.value.code == 2 and capsys.readouterr().err == f"error: {says}\n"
    harness.check_flags(parser.parse_args(["--batch-size", str(6 * world)]), world)  # divides: no error
    harness.check_flags(parser.parse_args([]), world)  # None: the recipe's default, rounded to divide
