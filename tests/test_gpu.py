"""The GPU tier: `python -m pytest -m gpu` on a machine with a GPU. The default run deselects it; asked for where
CUDA cannot run, it fails with one line (tests/conftest.py). Each test runs a CUDA path for real and checks numbers:
every recipe in recipes/ on one GPU under NCCL, N ranks sharing one GPU over gloo (launch.sh G:N), --sync-bn in
every recipe that has it against plain BatchNorm on the whole batch, DataLoaderX's CUDA stream, torch.amp with
CUDA's GradScaler, real apex (vendor/, python-only build) against its torch mode, resume on the GPU (ddp_checkpoint,
ddp_zero's consolidated optimizer, ddp_comm_hooks' PowerSGD state, fsdp's shards), Join with uneven ranks, model
parallelism, and failure drills under NCCL (or gloo over CUDA where there is one GPU).

tests/test_gpu_tier.py checks this file on the CPU: a test per recipe, the flags each launch passes, and that every
text and RESULT key asserted here is one the code can print, so the first GPU run does not fail on a typo.

Tolerances: cuDNN picks its kernels by timing (cudnn.benchmark) and TF32 rounds fp32 matmul inputs, so GPU runs
are not bitwise repeatable; where two runs are compared the tolerance says how far apart they may be and why.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import test_comm_hooks as cpu_hooks  # the CPU tests' runs and expectations, reused for the same runs on the GPU
import test_fsdp as cpu_fsdp
import test_profile as cpu_profile  # the profile table's reader
import test_uneven as cpu_uneven
import torch
import torch.multiprocessing as mp
from conftest import (
    REPO,
    epoch_losses,
    instrument_env,
    launch,
    load_recipe,
    make_imagefolder,
    max_diff,
    params,
    result_of,
    scaler_resumed_from,
)
from jobs import Job, error_lines, job_mid_epoch, survivors, tracebacks_beyond_multiprocessing
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from common.data import SyntheticImages, build_datasets, device_normalize
from common.loader import DataLoaderX
from common.models import build_model
from common.profiling import LABELS

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="the GPU tier needs a CUDA GPU; none here")]
REAL_APEX = importlib.util.find_spec("apex") is not None
# The full build first: a python-only apex runs, but slowly (a host sync per gradient tensor); README 'NVIDIA apex'.
INSTALL_APEX = ("pip install --no-build-isolation --no-deps --config-settings '--build-option=--cpp_ext' "
                "--config-settings '--build-option=--cuda_ext' ./vendor/apex-25.04.tar.gz (vendor/README.md)")
TINY = ["--arch", "tiny", "--workers", "2", "--batch-size", "64"]
# Two ranks need two GPUs under NCCL, which refuses two ranks on one; on a one-GPU box they share it over gloo.
TWO_RANKS = "0,1" if GPUS >= 2 else "0:2"
TWO_RANKS_BACKEND = "nccl" if GPUS >= 2 else "gloo"
# Where two runs' weights are compared: TF32 off in cuBLAS and cuDNN (NVIDIA's override, which wins over the recipes'
# allow_tf32 = True). TF32 rounds matmul and convolution inputs to 10 mantissa bits (2^-11, 5e-4 relative), so a
# kernel that cudnn.benchmark picks in one run and not the other can round the runs apart by about what these
# comparisons must tell apart; in fp32 they differ in the last digits. (torch_amp's switch: --amp-dtype fp32.)
FP32 = {"NVIDIA_TF32_OVERRIDE": "0"}
# torch.compile on the GPU: inductor generates Triton kernels and compiles them in the first step (minutes cold).
COMPILE_TIMEOUT = 900


def timeout_for(recipe):
    return COMPILE_TIMEOUT if recipe == "ddp_compile" else 300


def learned(state):
    """A state_dict's parameters, without BatchNorm's statistics (recomputed at each epoch's end, trained or not)."""
    return {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def initial_weights(arch, num_classes=10, image_size=32, seed=0):
    """The weights a recipe starts from: each runs torch.manual_seed(args.seed), then build_model(args.arch,
    num_classes, args.image_size) on the CPU, then moves the model to its device (torch_amp.py's "model" section).
    tests/test_gpu_tier.py shows on the CPU that a run which cannot move them (--lr 1e-30) saves exactly these."""
    with torch.random.fork_rng(devices=[]):  # this process's own RNG stream stays as it was
        torch.manual_seed(seed)
        return build_model(arch, num_classes, image_size).state_dict()


@torch.no_grad()
def gpu_acc1(model_pt, arch, dataset):
    """A single process's top-1 of the saved weights on the GPU, with the recipes' TF32 setting."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = build_model(arch, 10).cuda().eval()
    model.load_state_dict(params(model_pt))
    correct = sum((model(x.cuda()).argmax(1).cpu() == y).sum().item() for x, y in DataLoader(dataset, batch_size=100))
    return 100.0 * correct / len(dataset)


# --------------------------------------------------------------------- every recipe, one GPU, NCCL

ONE_GPU = {  # every recipe in recipes/ (tests/test_gpu_tier.py checks): its extra flags
    "dp": [], "ddp_torchrun": [], "ddp_launch": [], "ddp_spawn": [], "ddp_checkpoint": [],
    "torch_amp": [],  # fp16 + GradScaler('cuda'), the GPU default
    "apex_ddp": [], "apex_amp": ["--opt-level", "O1"],  # apex where it is installed, else torch (the first line)
    "fsdp": ["--amp-dtype", "bf16", "--arch", "tiny_bn"],  # bf16 compute and all-gathers, BatchNorm in fp32
    "mx_face_prefetch": ["--rec", "synthetic", "--image-size", "32"],
    "ddp_compile": [],  # inductor's Triton kernels, compiled in the first step (COMPILE_TIMEOUT)
    "ddp_zero": [],  # ZeroRedundancyOptimizer's per-rank broadcast, NCCL
    "ddp_uneven": [],  # Join on NCCL (one rank: every batch is its own)
    "ddp_comm_hooks": ["--comm-hook", "powersgd", "--powersgd-start", "2"],  # PowerSGD's CUDA path from step 3
    "gpu_decode": [],  # nvjpeg's decode, the crops and the normalising on the GPU, one batch ahead on a side stream
}
# PowerSGD's hook runs its matrix products in Future callbacks, and torch runs each callback on the next stream of its
# pool of 32; cuBLAS keeps a workspace for every stream it has run on (32 MiB on Hopper). Two callbacks a step: 64 MB
# more each step until all 32 streams hold one (H200, torch 2.11: 1120.6 MB at the end where the other recipes
# peak at 84-114), then no more. recipes/ddp_comm_hooks.py's docstring says so.
PEAK_MEM_MB = {"ddp_comm_hooks": 300 + 32 * 32}
# Top-1 after 3 epochs, above chance (10%) by a margin: mx_face_prefetch's task is harder; PowerSGD at rank 1 is lossy
# by design (80.6 on one CPU process, the same flags). The others reach 99-100 on the CPU.
LEARNS = {"mx_face_prefetch": 30, "ddp_comm_hooks": 60}
# Evaluated in fp32 (TF32) by eager kernels, as gpu_acc1 scores model.pt. ddp_compile too: its compiled evaluation
# fuses BatchNorm into the convolution's epilogue, a rounding difference that may flip one more near-tie (0.41).
FP32_EVAL = {"dp": 0.21, "ddp_torchrun": 0.21, "ddp_launch": 0.21, "ddp_spawn": 0.21, "ddp_checkpoint": 0.21,
             "apex_ddp": 0.21, "ddp_zero": 0.21, "ddp_uneven": 0.21, "ddp_comm_hooks": 0.21, "ddp_compile": 0.41}


@pytest.mark.parametrize("recipe", sorted(ONE_GPU))
def test_every_recipe_learns_on_one_gpu_with_exact_eval(tmp_path, recipe):
    proc = launch(f"recipes/{recipe}.py", "0", *TINY, "--epochs", "3", *ONE_GPU[recipe], "--out-dir", tmp_path,
                  timeout=timeout_for(recipe))
    result = result_of(proc)
    print(f"{recipe}: {json.dumps(result)}")  # README "Verified on GPU": pytest -m gpu -rP
    assert (result["device"], result["world_size"], result["val_samples"]) == ("cuda", 1, 500)
    if recipe != "dp":
        assert "setup: world_size=1 backend=nccl device=cuda" in proc.stdout
    # The CUDA allocator's peak for a tiny model: megabytes, where the CPU's max RSS would be hundreds. PowerSGD's
    # (PEAK_MEM_MB) holds cuBLAS workspaces besides.
    assert 0 < result["peak_mem_mb"] < PEAK_MEM_MB.get(recipe, 300), result
    assert result["val_acc1"] > LEARNS.get(recipe, 80), result  # 10 classes: chance 10%
    if recipe in FP32_EVAL:
        # Each rank's shard, all-reduced, equals one process scoring model.pt; a kernel choice may flip one
        # near-tie of 500, so 0.2 (one sample).
        assert gpu_acc1(tmp_path / "model.pt", "tiny", build_datasets("synthetic")[1]) == pytest.approx(
            result["val_acc1"], abs=FP32_EVAL[recipe])
    if recipe == "ddp_compile":
        # One graph for training (a fixed shape: drop_last), one per evaluation batch size (64, and 500 % 64 = 52),
        # none compiled again, no graph break: a recompile or a break shows here, a model left eager fails the run.
        graphs = (result["compiled_graphs"], result["eval_graphs"], result["recompiles"], result["graph_breaks"])
        assert graphs == (3, 2, 0, 0), result
        assert re.search(r"^compile: 1 graph\(s\) in [\d.]+ s \(the first step", proc.stdout, re.M), proc.stdout
    if recipe == "ddp_comm_hooks":
        assert "comm_hook: powersgd rank=1 from step 3" in proc.stdout  # compressed from the third step on


# ------------------------------------------------------------- the language models, one GPU, NCCL

LM_ONE_GPU = {  # every recipes/lm_*.py (tests/test_gpu_tier.py checks): its extra flags
    "lm_ddp": [], "lm_tp": ["--sequence-parallel"],  # lm_tp on one GPU: --tp 1, its plan over a mesh of one
    "lm_pp": ["--schedule", "1f1b"],  # lm_pp on one GPU: --pp 1, one stage, its 2 microbatches accumulated
    "lm_fsdp_tp": ["--accum-steps", "2"],  # a 1 x 1 mesh on one GPU: FSDP2 over one rank, the gradient-sync switch
    "lm_moe": [],  # lm_moe on one GPU: --ep 1, all 8 experts local, no exchange
}
LM_SHORT = ["--steps", "200", "--eval-every", "100"]  # the default model and batch, a third of the default schedule


@pytest.mark.parametrize("recipe", sorted(LM_ONE_GPU))
def test_every_language_model_learns_on_one_gpu(tmp_path, recipe):
    proc = launch(f"recipes/{recipe}.py", "0", *LM_SHORT, *LM_ONE_GPU[recipe], "--out-dir", tmp_path)
    result = result_of(proc)
    print(f"{recipe}: {json.dumps(result)}")  # before the checks: gpu_bench.py --render --tier reads it from tier.xml
    assert (result["device"], result["world_size"], result["steps"], result["val_windows"]) == ("cuda", 1, 200, 128)
    assert "setup: world_size=1 backend=nccl device=cuda" in proc.stdout
    # 8 bits per byte at random init, 4.76 for the bytes' frequencies alone (tools/ngram_bpb.py --context 0); 200
    # steps reached 3.63 on an H200 (torch 2.11, Python 3.12's corpus) and 3.66 on the CPU (docs/testing.md).
    assert result["val_bpb"] < 4.0, result
    assert 0 < result["peak_mem_mb"] < 2000, result


def test_lm_tp_resumes_on_gpu_without_sequence_parallel(tmp_path):
    # load_shards on CUDA: get_state_dict steps the fresh AdamW, whose foreach path (DTensors take it on CUDA) meets
    # the plain norms beside DTensors when --sequence-parallel is off (recipes/lm_tp.py: implicit_replication).
    args = ["recipes/lm_tp.py", "0", "--steps", "40", "--eval-every", "20"]
    straight = launch(*args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch(*args, "--max-steps", "20", "--out-dir", tmp_path / "pieced", env=FP32)
    resumed = launch(*args, "--resume", "auto", "--out-dir", tmp_path / "pieced", env=FP32)
    assert result_of(first)["steps"] == 20 and result_of(straight)["steps"] == 40
    assert (result_of(resumed)["start_step"], result_of(resumed)["steps"]) == (20, 40)
    # fp32 without TF32 (FP32); kernels may differ between the runs: last digits.
    assert max_diff(params(tmp_path / "pieced/model.pt"), params(tmp_path / "straight/model.pt")) < 1e-5


def test_lm_tp_resumed_from_the_other_adamw_keeps_its_step_counts_where_its_own_does(tmp_path):
    # A checkpoint from a torch that picks the other AdamW on DTensors (tests/instrument's ADAMW_AS plays it: fused on
    # torch >= 2.12, foreach on 2.10-2.11). Fused keeps each parameter's step count on the GPU; foreach (not
    # capturable) on the host, where its bias corrections read it: on the GPU, two host syncs a parameter a step.
    # The load places the counts by the groups it is given, so load_shards gives it this torch's choice first.
    from test_lm_branches import the_other_adamw

    here, there = the_other_adamw(dtensor=True)
    args = ["recipes/lm_tp.py", "0", "--steps", "40", "--eval-every", "20", "--out-dir", tmp_path]
    saved = launch(*args, "--max-steps", "20", env=instrument_env({"ADAMW_AS": json.dumps(there)}))
    assert result_of(saved)["steps"] == 20
    resumed = launch(*args, "--resume", "auto", env=instrument_env(LOG_ADAMW_DIR=tmp_path / "adamw"))
    assert (result_of(resumed)["start_step"], result_of(resumed)["steps"]) == (20, 40)
    log = json.loads((tmp_path / "adamw" / "rank0.json").read_text())
    where = "cuda:0" if here.get("fused") else "cpu"
    assert log["steps"][1:] and all(g == {"fused": None, "foreach": None, **here} for s in log["steps"] for g in s)
    assert all(devices == [where] for devices in log["step_devices"][1:]), log["step_devices"]  # after the load


@pytest.mark.parametrize("recipe", sorted(LM_ONE_GPU))
def test_every_language_model_saves_in_the_background_on_gpu(tmp_path, recipe):
    # --async-save on one GPU (issue 43): the state copied from the GPU to CPU memory, then written by a thread while
    # training goes on (lm_ddp: torch.save's file from its copy; the others: dcp.async_save on a gloo group beside
    # NCCL). The same weights as the synchronous save's run; latest.pt names the last save. On the CPU:
    # tests/test_lm.py and test_lm_tp.py (a crash mid-write).
    args = [f"recipes/{recipe}.py", "0", "--steps", "40", "--eval-every", "20", "--save-every", "10",
            *LM_ONE_GPU[recipe]]
    plain = launch(*args, "--out-dir", tmp_path / "plain", env=FP32)
    in_thread = launch(*args, "--async-save", "--out-dir", tmp_path / "async", env=FP32)
    assert result_of(in_thread)["steps"] == result_of(plain)["steps"] == 40
    print(in_thread.stdout[-1500:])
    assert in_thread.stdout.count(" in the background; training waited ") == 4, in_thread.stdout
    assert params(tmp_path / "async" / ("latest.pt" if recipe == "lm_ddp" else "checkpoint/latest.pt"))["step"] == 40
    diff = max_diff(params(tmp_path / "plain/model.pt"), params(tmp_path / "async/model.pt"))
    print(f"{recipe} --async-save on GPU: max weight difference from the synchronous save's run {diff:.2e}")
    assert diff < 1e-5  # fp32 without TF32 (FP32); kernels may differ between the runs: last digits


def test_lm_ddp_bf16_autocast_tracks_fp32(tmp_path):
    runs = {dtype: result_of(launch("recipes/lm_ddp.py", "0", *LM_SHORT, "--amp-dtype", dtype,
                                    "--out-dir", tmp_path / dtype)) for dtype in ("fp32", "bf16")}
    print(f"lm_ddp bf16 vs fp32: {runs['bf16']['val_loss']} vs {runs['fp32']['val_loss']}")
    # bf16 rounds activations to 8 mantissa bits; the loss it reaches after 200 steps stays within 3% of fp32's.
    assert runs["bf16"]["val_loss"] == pytest.approx(runs["fp32"]["val_loss"], rel=0.03)


# ------------------------------------------------------------------ N ranks sharing one GPU, gloo


# 6 steps of the global batch 32: 2 ranks x 16 or 1 rank x 32 see the same 32 images a step (synthetic data has no
# augmentation). torch_amp's fp32 mode: no autocast and no TF32.
SHARED = ["--workers", "0", "--batch-size", "32", "--max-steps", "6", "--lr", "0.05"]
AMP_FP32 = ["--amp-dtype", "fp32", "--arch", "tiny", *SHARED]


def test_two_ranks_sharing_one_gpu_match_one_rank_on_the_full_batch(tmp_path):
    # Only cuDNN's kernel choice (batch 16 vs 32) differs: fp32 rounding in the last digits, 1e-5 after 6 steps.
    two = launch("recipes/torch_amp.py", "0:2", *AMP_FP32, "--out-dir", tmp_path / "two")
    one = launch("recipes/torch_amp.py", "0", *AMP_FP32, "--out-dir", tmp_path / "one")
    assert result_of(two)["world_size"] == 2 and result_of(one)["world_size"] == 1
    assert "setup: world_size=2 backend=gloo device=cuda" in two.stdout
    assert "setup: world_size=1 backend=nccl device=cuda" in one.stdout
    # Against the weights both runs started from (the recipe's seeded init): 6 steps at lr 0.05 move them by more
    # than 1e-3 (the same run on the CPU: tests/test_gpu_tier.py), so runs that trained nothing fail here.
    initial = initial_weights("tiny")
    assert max_diff(params(tmp_path / "one/model.pt"), initial) > 1e-3  # it trained
    assert max_diff(params(tmp_path / "two/model.pt"), initial) > 1e-3
    assert max_diff(params(tmp_path / "two/model.pt"), params(tmp_path / "one/model.pt")) < 1e-5


# --sync-bn: SyncBatchNorm on 2 ranks x 16 computes what plain BatchNorm on 1 rank x 32 does, weights and running
# statistics, from the same 32 images a step; model.pt loads into the plain-BatchNorm model. The control (plain
# BatchNorm on 2 ranks, what an ignored --sync-bn gives) is torch_amp's test: its running statistics end more than
# 1e-3 from the whole batch's (the same runs on the CPU: statistics 3.8e-2 apart, weights 6e-4), so max_diff over
# both sees it.
SYNC_BN_ARGS = ["--arch", "tiny_bn", *SHARED]


def test_sync_bn_on_two_ranks_matches_batchnorm_on_one_rank_with_the_whole_batch(tmp_path):
    # Issue 26, torch_amp: torch's SyncBatchNorm, with the unsynced control.
    common = ["--amp-dtype", "fp32", *SYNC_BN_ARGS]
    two = launch("recipes/torch_amp.py", TWO_RANKS, *common, "--sync-bn", "--out-dir", tmp_path / "two")
    one = launch("recipes/torch_amp.py", "0", *common, "--out-dir", tmp_path / "one")
    plain = launch("recipes/torch_amp.py", TWO_RANKS, *common, "--out-dir", tmp_path / "plain")
    assert result_of(two)["world_size"] == result_of(plain)["world_size"] == 2 and result_of(one)["world_size"] == 1
    synced, whole, unsynced = (params(tmp_path / run / "model.pt")
                               for run in ("two", "one", "plain"))
    build_model("tiny_bn", 10).load_state_dict(synced)  # strict: the keys of plain BatchNorm
    assert max_diff(synced, whole) < 1e-4
    stats = [k for k in whole if "running_var" in k]
    assert max_diff({k: unsynced[k] for k in stats}, {k: whole[k] for k in stats}) > 1e-3  # the control


SYNC_BN = {  # every other recipe with --sync-bn (tests/test_gpu_tier.py checks the list): its extra flags
    "ddp_torchrun": [], "ddp_launch": [], "ddp_spawn": [], "ddp_checkpoint": [], "ddp_zero": [],
    "ddp_comm_hooks": ["--comm-hook", "none"],  # DDP's own fp32 all-reduce: a 16-bit hook rounds 2 ranks' sum apart
    "apex_ddp": [],  # apex's SyncBatchNorm (convert_syncbn_model) where apex is installed, else torch's
    "ddp_compile": [],  # SyncBatchNorm inside a compiled model
    "gpu_decode": ["--amp-dtype", "fp32"],  # its images decoded on the GPU; fp32 as torch_amp's own test
}
# ddp_compile: the whole batch's BatchNorm is one of inductor's generated reductions, the synced one torch's kernels
# between compiled pieces; a different summation order, still 30x below the control.
SYNC_BN_ATOL = {"ddp_compile": 1e-3}


@pytest.mark.parametrize("recipe", sorted(SYNC_BN))
def test_sync_bn_of_each_recipe_on_two_ranks_matches_batchnorm_on_one_rank(tmp_path, recipe):
    args = [*SYNC_BN_ARGS, *SYNC_BN[recipe]]
    two = launch(f"recipes/{recipe}.py", TWO_RANKS, *args, "--sync-bn", "--out-dir", tmp_path / "two", env=FP32,
                 timeout=timeout_for(recipe))
    one = launch(f"recipes/{recipe}.py", "0", *args, "--out-dir", tmp_path / "one", env=FP32,
                 timeout=timeout_for(recipe))
    assert result_of(two)["world_size"] == 2 and result_of(one)["world_size"] == 1
    assert f"setup: world_size=2 backend={TWO_RANKS_BACKEND} device=cuda" in two.stdout
    synced, whole = params(tmp_path / "two/model.pt"), params(tmp_path / "one/model.pt")
    build_model("tiny_bn", 10).load_state_dict(synced)  # strict: the keys of plain BatchNorm
    diff = max_diff(synced, whole)
    compiled = [line for line in two.stdout.splitlines() if line.startswith("compile: ")]
    print(f"{recipe} --sync-bn on {TWO_RANKS} vs BatchNorm on 0: {diff:.1e} {compiled}")
    assert max_diff(learned(whole), learned(initial_weights("tiny_bn"))) > 1e-3  # it trained
    assert diff < SYNC_BN_ATOL.get(recipe, 1e-4)
    if recipe == "ddp_compile":  # what its docstring says --sync-bn costs: a graph break (plain BatchNorm: none)
        assert result_of(two)["graph_breaks"] > 0 and result_of(one)["graph_breaks"] == 0, compiled


def _batches_of_one_rank(rank, results):
    torch.cuda.set_device(0)  # both ranks on GPU 0, as under launch.sh 0:2
    dataset = SyntheticImages(96, image_size=8)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
    sampler.set_epoch(1)
    plain = [(x.cuda(), y.cuda()) for x, y in DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=1)]
    fast = list(DataLoaderX("cuda", dataset, batch_size=8, sampler=sampler, num_workers=1, pin_memory=True))
    results[rank] = (len(plain), len(fast), all(x.is_cuda for x, _ in fast),
                     all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(plain, fast, strict=True)),
                     [int(y[0]) for _, y in fast])


def test_dataloaderx_gives_each_rank_of_a_shared_gpu_the_dataloaders_batches():
    results = mp.Manager().dict()
    mp.spawn(_batches_of_one_rank, args=(results,), nprocs=2)
    for rank in (0, 1):
        assert results[rank][:4] == (6, 6, True, True), results[rank]
    assert results[0][4] != results[1][4]  # each rank its own shard


def test_dataloaderx_cuda_stream_gives_the_same_batches():
    ds = TensorDataset(torch.randn(257, 3, 8, 8), torch.arange(257))
    plain = [(x.cuda(), y.cuda()) for x, y in DataLoader(ds, batch_size=16, pin_memory=True)]
    fast = list(DataLoaderX("cuda", ds, batch_size=16, pin_memory=True))
    assert len(fast) == len(plain) and all(x.is_cuda for x, _ in fast)
    for (xa, ya), (xb, yb) in zip(plain, fast, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_dataloaderx_keeps_one_side_stream_so_its_epochs_reserve_no_more_memory():
    # The caching allocator keeps a freed block for the stream it was made on: a new side stream each epoch (one of
    # torch's pool of 32) would leave every epoch's batches reserved and unusable (pytorch-image-models#2781).
    loader = DataLoaderX("cuda", TensorDataset(torch.randn(32, 256, 1024)), batch_size=4, pin_memory=True)
    reserved, streams = [], set()
    for _ in range(4):
        for (x,) in loader:  # 4 MiB a batch
            x.mul_(2)  # the step's stream uses it
        streams.add(loader.stream.cuda_stream)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert len(streams) == 1 and reserved == [reserved[0]] * 4, (streams, reserved)


# ------------------------------------------------------------------------------------ torch.amp


def test_torch_amp_fp16_channels_last_with_cuda_grad_scaler_survives_resume(tmp_path):
    args = [*TINY, "--amp-dtype", "fp16", "--channels-last", "--clip-grad", "1.0", "--epochs", "2",
            "--out-dir", tmp_path]
    first = launch("recipes/torch_amp.py", "0", *args, "--max-steps", "32")  # epoch 1 of 2 (32 steps each)
    assert result_of(first)["steps"] == 32 and "amp: fp16 autocast=True grad_scaler=True" in first.stdout
    saved = params(tmp_path / "checkpoint.pt")["scaler"]
    # The tracker counts the steps since the last overflow: 0 if step 32 overflowed (rare, and normal in fp16). The
    # check that it was restored, not restarted, is the last line's, on the final tracker.
    assert saved["scale"] > 0 and "_growth_tracker" in saved, saved  # its value: no bound (0 after an overflow)
    resumed = launch("recipes/torch_amp.py", "0", *args, "--resume", tmp_path / "checkpoint.pt")
    result = result_of(resumed)
    assert result["steps"] == 64 and result["val_acc1"] > 80
    assert scaler_resumed_from(saved) in resumed.stdout  # the resumed run starts from it
    final = params(tmp_path / "checkpoint.pt")["scaler"]
    # Restored, not restarted: 32 more steps on the saved tracker, unless an overflow reset it (and halved the scale).
    assert final["_growth_tracker"] == saved["_growth_tracker"] + 32 or final["scale"] < saved["scale"], final


def test_torch_amp_bf16_learns_without_a_scaler(tmp_path):
    proc = launch("recipes/torch_amp.py", "0", *TINY, "--amp-dtype", "bf16", "--epochs", "3", "--out-dir", tmp_path)
    assert result_of(proc)["val_acc1"] > 80 and "amp: bf16 autocast=True grad_scaler=False" in proc.stdout


# ----------------------------------------------------------------------------------- real apex


SCHEDULER_OVERRIDDEN = "has been overridden after learning rate scheduler"  # torch/optim/lr_scheduler.py's warning


@pytest.mark.skipif(not REAL_APEX, reason=f"the real apex is not installed; {INSTALL_APEX}")
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_amp_matches_its_torch_mode(tmp_path, level):
    args = ["--arch", "tiny_bn", "--workers", "2", "--batch-size", "64", "--epochs", "2", "--lr", "0.05",
            "--opt-level", level]
    runs = {impl: launch("recipes/apex_amp.py", "0", *args, "--impl", impl, "--out-dir", tmp_path / impl)
            for impl in ("apex", "torch")}
    results = {impl: result_of(proc) for impl, proc in runs.items()}
    print(f"apex_amp {level}: {json.dumps(results)}")  # README "Verified on GPU": pytest -m gpu -rP
    print(runs["apex"].stdout.splitlines()[0])  # which apex build these numbers come from
    # The build is on the first line (common/apex_compat.apex_build): "full", or "python-only (...)", slow on a GPU.
    assert runs["apex"].stdout.startswith(f"impl: apex {level} (apex build: ")
    # The schedule is made after amp.initialize: O1 and O2 replace optimizer.step, which torch's scheduler, made
    # before, said on every rank was overridden (tests/fake_apex does not replace it: only the real one tells).
    # torch's own words, not the cookbook's (tests/test_gpu_tier.py checks those): read from torch's source here.
    assert SCHEDULER_OVERRIDDEN in Path(torch.optim.lr_scheduler.__file__).read_text()
    assert SCHEDULER_OVERRIDDEN not in runs["apex"].stderr, runs["apex"].stderr[-2000:]
    for result in results.values():
        assert result["val_acc1"] > 60, results  # 10 classes
    # The same level built two ways: apex patches functions (O1) and keeps its own masters and loss scaler;
    # the losses of the same seed agree to within what fp16 rounding moves in 64 steps.
    assert results["apex"]["train_loss"] == pytest.approx(results["torch"]["train_loss"], abs=0.25), results


@pytest.mark.skipif(not REAL_APEX, reason=f"the real apex is not installed; {INSTALL_APEX}")
def test_apex_ddp_matches_torch_ddp(tmp_path):
    runs = {impl: result_of(launch("recipes/apex_ddp.py", "0", *TINY, "--epochs", "2", "--impl", impl,
                                   "--out-dir", tmp_path / impl)) for impl in ("apex", "torch")}
    print(f"apex_ddp: {json.dumps(runs)}")
    assert runs["apex"]["impl"] == "apex" and runs["apex"]["val_acc1"] > 80
    # fp32 (TF32) through the same model: only cuDNN's kernel choice differs.
    assert runs["apex"]["train_loss"] == pytest.approx(runs["torch"]["train_loss"], abs=1e-3)


O2_RESUME = """
import copy, json, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from apex import amp
from common.checkpoint import load_weights
from common.models import build_model

def fresh():  # as recipes/apex_amp.py initializes apex
    torch.manual_seed(1)
    model = build_model("tiny_bn", 10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32=None, verbosity=0)

model, optimizer = fresh()
x, y = torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
for _ in range(3):
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
weights, state = model.state_dict(), copy.deepcopy(optimizer.state_dict())

def restored(fixed):
    model, optimizer = fresh()
    load_weights(model, weights, "saved")
    if fixed:  # the recipe's order: apex's fp32 masters made first, then the state goes into them
        optimizer._amp_lazy_init()
        optimizer.load_state_dict(state)
    else:  # the other order: the state goes into the fp16 parameters, then apex makes its masters
        optimizer.load_state_dict(state)
        optimizer._amp_lazy_init()
    got = optimizer.state_dict()["state"]
    return all(torch.equal(got[i]["momentum_buffer"], s["momentum_buffer"]) for i, s in state["state"].items())

print(json.dumps({"dtypes": sorted({str(s["momentum_buffer"].dtype) for s in state["state"].values()}),
                  "fixed order exact": restored(True), "old order exact": restored(False)}))
"""


@pytest.mark.skipif(not REAL_APEX, reason=f"the real apex is not installed; {INSTALL_APEX}")
def test_apex_o2_resume_restores_the_fp32_momentum_exactly():
    proc = subprocess.run([sys.executable, "-c", O2_RESUME], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The old order rounded the momentum to fp16 on the way in: the check can see the bug it guards against.
    assert report == {"dtypes": ["torch.float32"], "fixed order exact": True, "old order exact": False}, report
    # ...and the recipe resumes in that order.
    assert ('optimizer._amp_lazy_init()\n            optimizer.load_state_dict(ckpt["optimizer"])'
            in (REPO / "recipes" / "apex_amp.py").read_text())


# -------------------------------------------------------------------------- checkpoints, spawn


def test_ddp_checkpoint_resume_on_gpu(tmp_path):
    data = make_imagefolder(tmp_path / "data")
    args = ["--dataset", "imagefolder", "--data-root", data, "--image-size", "16", "--batch-size", "8",
            "--arch", "tiny", "--workers", "2", "--epochs", "3"]
    straight = launch("recipes/ddp_checkpoint.py", "0", *args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch("recipes/ddp_checkpoint.py", "0", *args, "--max-steps", "7", "--out-dir", tmp_path / "resumed",
                   env=FP32)
    resumed = launch("recipes/ddp_checkpoint.py", "0", *args, "--resume", "auto", "--out-dir", tmp_path / "resumed",
                     env=FP32)
    assert result_of(straight)["steps"] == result_of(resumed)["steps"] == 21 and result_of(first)["steps"] == 7
    assert "at epoch 1 step 7" in resumed.stdout
    # The RNG streams (CPU and CUDA) are restored, so the same batches and augmentations follow; cuDNN's
    # timed kernel choice and atomics leave fp32 differences far below 1e-4 after 14 more steps.
    diff = max_diff(params(tmp_path / "straight/model.pt"), params(tmp_path / "resumed/model.pt"))
    print(f"ddp_checkpoint resume on GPU: max weight difference {diff:.2e}")
    assert max_diff(params(tmp_path / "straight/model.pt"), initial_weights("tiny", 3, 16)) > 1e-3  # it trained
    assert diff < 1e-4


@pytest.mark.parametrize("recipe, devices, flags, data_flag, target, steps", [
    ("ddp_checkpoint", TWO_RANKS, ["--dataset", "imagefolder", "--image-size", "16", "--batch-size", "4", "--arch",
                                   "tiny", "--workers", "2", "--epochs", "2"], "--data-root", "launcher", 30),
    ("lm_ddp", "0", ["--steps", "40", "--eval-every", "20", "--seq-len", "64", "--val-windows", "16"], "--text", "self",
     40)])
def test_a_preemption_save_mid_epoch_resumes_on_gpu(tmp_path, recipe, devices, flags, data_flag, target, steps):
    # SIGUSR1 (tests/faults' FAULT_SIGNAL: the scheduler's warning) after step 3: the stop vote runs on its own gloo
    # group beside NCCL (or beside gloo over CUDA on one GPU), every rank saves (mid-epoch; the language model between
    # evaluations) and exits 75; --resume auto goes on from there. On the CPU: tests/test_preempt.py, bitwise.
    data = make_imagefolder(tmp_path / "data") if recipe == "ddp_checkpoint" else (
        Path(sysconfig.get_paths()["stdlib"]) / "json")  # a small real text every machine has
    args = [*flags, data_flag, data]
    straight = launch(f"recipes/{recipe}.py", devices, *args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch(f"recipes/{recipe}.py", devices, *args, "--out-dir", tmp_path / "run",
                   env={**FP32, "PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_SIGNAL": f"0:step=3:{target}"})
    print(f"{recipe} on {devices}: exit {first.returncode}\n{first.stdout[-1500:]}{first.stderr[-1500:]}")
    assert first.returncode == 75 and "preempt: SIGUSR1: saved" in first.stdout, first.stderr[-3000:]
    assert "launch.sh: the ranks saved and exited 75 (SIGUSR1): requeue the job" in first.stderr
    resumed = launch(f"recipes/{recipe}.py", devices, *args, "--out-dir", tmp_path / "run", "--resume", "auto",
                     env=FP32)
    result = result_of(resumed)
    assert 3 < result["start_step"] <= 6 and result["steps"] == result_of(straight)["steps"] == steps, result
    diff = max_diff(params(tmp_path / "straight/model.pt"), params(tmp_path / "run/model.pt"))
    print(f"{recipe} preempted and resumed on GPU: max weight difference {diff:.2e}")
    assert diff < 1e-4


def test_ddp_zero_consolidates_every_ranks_shard_and_resumes_on_gpu(tmp_path):
    # consolidate_state_dict(to=0) gathers each rank's optimizer shard onto rank 0 (under NCCL through CUDA tensors),
    # which saves the whole SGD state; --resume auto gives each rank its shard back, and its CPU and CUDA RNG streams.
    # The same run on the CPU: test_conformance.py (ddp_zero's resume), test_recipe_variants.py (2 ranks to 3).
    args = ["--arch", "tiny_bn", "--workers", "0", "--batch-size", "32", "--epochs", "2", "--synthetic-train", "256"]
    straight = launch("recipes/ddp_zero.py", TWO_RANKS, *args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch("recipes/ddp_zero.py", TWO_RANKS, *args, "--max-steps", "8", "--out-dir", tmp_path / "resumed",
                   env=FP32)
    saved = params(tmp_path / "resumed/latest.pt")  # epoch 1's: 256 / 32 = 8 steps
    resumed = launch("recipes/ddp_zero.py", TWO_RANKS, *args, "--resume", "auto", "--out-dir", tmp_path / "resumed",
                     env=FP32)
    assert [result_of(proc)["steps"] for proc in (first, resumed, straight)] == [8, 16, 16]
    assert f"setup: world_size=2 backend={TWO_RANKS_BACKEND} device=cuda" in first.stdout
    # Every parameter's momentum, both ranks' shards: rank 0's alone would hold about half of them.
    n_params = len(list(build_model("tiny_bn", 10).parameters()))
    assert saved["epoch"] == 1 and sorted(saved["optimizer"]["state"]) == list(range(n_params)), saved["optimizer"]
    assert all(state["momentum_buffer"].abs().max() > 0 for state in saved["optimizer"]["state"].values())
    assert f"resume: {tmp_path / 'resumed/latest.pt'} at epoch 1 step 8" in resumed.stdout
    diff = max_diff(params(tmp_path / "straight/model.pt"), params(tmp_path / "resumed/model.pt"))
    print(f"ddp_zero resume on {TWO_RANKS}: max weight difference {diff:.2e}")
    assert max_diff(learned(params(tmp_path / "straight/model.pt")), learned(initial_weights("tiny_bn"))) > 1e-3
    assert diff < 1e-4


# PowerSGD's tolerance on the GPU: fp32 kernels that cudnn.benchmark picks per process, and atomics, round the two
# runs apart in the last digits, which PowerSGD's power iteration can amplify; still 100x below how far a resume
# without the saved state ends (0.17 on the CPU, test_comm_hooks.py's control).
POWERSGD_GPU_RESUME_TOLERANCE = 1e-3


def test_ddp_comm_hooks_powersgd_state_survives_a_checkpoint_on_gpu(tmp_path):
    # test_comm_hooks.py's run on TWO_RANKS: PowerSGD's state (error feedback, P and Q, its step count) in latest.pt,
    # CUDA tensors saved from the hook and loaded onto each rank's GPU, and the CUDA RNG stream restored.
    world, per_epoch = 2, cpu_hooks.steps_per_epoch(2)
    args = ["recipes/ddp_comm_hooks.py", TWO_RANKS, *cpu_hooks.FLAGS, "--batch-size", cpu_hooks.batch_for(world),
            "--comm-hook", "powersgd"]
    straight = launch(*args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch(*args, "--max-steps", per_epoch, "--out-dir", tmp_path / "pieced", env=FP32)
    saved = params(tmp_path / "pieced/latest.pt")["comm_hook"]
    resumed = launch(*args, "--resume", "auto", "--out-dir", tmp_path / "pieced", env=FP32)
    assert [result_of(proc)["steps"] for proc in (first, resumed, straight)] == [per_epoch, 2 * per_epoch,
                                                                                 2 * per_epoch]
    assert f"comm_hook: powersgd rank={cpu_hooks.RANK} from step {cpu_hooks.START + 1}" in straight.stdout
    # As test_powersgd_state_survives_a_checkpoint checks on the CPU: keyed by parameter, every element's error.
    assert saved["iter"] == per_epoch
    init = cpu_hooks.initial()
    assert {n: t.shape for n, t in saved["error"].items()} == {n: (p.numel(),) for n, p in init.named_parameters()}
    factors = cpu_hooks.factor_sizes()
    assert set(saved["p"]) == set(saved["q"]) == set(factors) and factors
    assert {n: (saved["p"][n].numel(), saved["q"][n].numel()) for n in factors} == factors
    assert all(saved["error"][n].abs().max() > 0 for n in factors)  # what rank 1 left out, for the next step
    assert f"resume: {tmp_path / 'pieced/latest.pt'} at epoch 1 step {per_epoch}" in resumed.stdout
    assert "holds no PowerSGD state" not in resumed.stdout
    straight_weights = params(tmp_path / "straight/model.pt")
    gap = cpu_hooks.distance(params(tmp_path / "pieced/model.pt"), straight_weights, init.state_dict())
    print(f"ddp_comm_hooks PowerSGD resume on {TWO_RANKS}: {gap:.1e} from the uninterrupted run")
    assert max_diff(straight_weights, init.state_dict()) > 1e-3  # it trained
    assert gap <= POWERSGD_GPU_RESUME_TOLERANCE


def test_fsdp_refuses_ranks_sharing_one_gpu(tmp_path):
    # Over gloo on CUDA every DTensor collective died with SIGSEGV (H200, torch 2.11): 0:2 trained, then crashed
    # gathering model.pt. harness.check_gpu(..., dtensor=True) refuses it before the process group.
    proc = launch("recipes/fsdp.py", "0:2", *cpu_fsdp.ARGS, "--out-dir", tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert error_lines(proc.stderr) == ["error: fsdp.py cannot run 2 ranks on one GPU (launch.sh G:N, gloo over CUDA): "
                                        "torch's DTensor collectives crash there (SIGSEGV); run one rank per GPU (0,1) "
                                        "or try it on cpu:N"], proc.stderr


@pytest.mark.parametrize(("recipe", "why"), [
    ("lm_tp", "torch's DTensor collectives crash there (SIGSEGV)"),
    ("lm_fsdp_tp", "torch's DTensor collectives crash there (SIGSEGV)"),
    ("lm_pp", "gloo's send and recv read a CUDA tensor's address as host memory (no device check)")])
def test_language_models_refuse_ranks_sharing_one_gpu(tmp_path, recipe, why):
    proc = launch(f"recipes/{recipe}.py", "0:2", "--steps", "2", "--out-dir", tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert error_lines(proc.stderr) == [f"error: {recipe}.py cannot run 2 ranks on one GPU (launch.sh G:N, gloo over "
                                        f"CUDA): {why}; run one rank per GPU (0,1) or try it on cpu:N"], proc.stderr


def test_lm_moe_exchanges_tokens_between_two_ranks_on_gpu(tmp_path):
    # --ep 2 on two GPUs (NCCL's all-to-all), or two ranks sharing GPU 0 (0:2: gloo's all-to-all of CUDA tensors,
    # staged through host memory): the loss lands where --ep 1 on one GPU does (TF32 matmuls: not bitwise; the CPU
    # tests prove the layouts exact in fp32).
    args = ["recipes/lm_moe.py", "--steps", "40", "--eval-every", "20"]
    one = result_of(launch(args[0], "0", *args[1:], "--out-dir", tmp_path / "one"))
    proc = launch(args[0], TWO_RANKS, *args[1:], "--out-dir", tmp_path / "two")
    result = result_of(proc)
    assert (result["ep"], one["ep"]) == (2, 1) and f"backend={TWO_RANKS_BACKEND} device=cuda" in proc.stdout
    assert abs(result["val_loss"] - one["val_loss"]) <= 0.01 * one["val_loss"], (result, one)


@pytest.mark.skipif(GPUS < 2, reason="the language models' multi-rank layouts need one GPU per rank (NCCL)")
@pytest.mark.parametrize(("recipe", "devices", "flags"), [
    ("lm_tp", "0,1", ["--sequence-parallel"]), ("lm_pp", "0,1", ["--schedule", "1f1b"]),
    ("lm_fsdp_tp", "0,1", ["--tp", "1", "--accum-steps", "2"]), ("lm_fsdp_tp", "0,1", [])])
def test_language_models_on_two_gpus_learn_as_on_one(tmp_path, recipe, devices, flags):
    # The same 200 steps as on one GPU, cut across 2 (NCCL): the loss lands where lm_ddp's does (TF32 matmuls: not
    # bitwise; the CPU tests prove the layouts exact in fp32).
    one = result_of(launch("recipes/lm_ddp.py", "0", *LM_SHORT, "--out-dir", tmp_path / "one"))
    proc = launch(f"recipes/{recipe}.py", devices, *LM_SHORT, *flags, "--out-dir", tmp_path / "two")
    result = result_of(proc)
    print(f"{recipe} {flags} on {devices}: val_bpb {result['val_bpb']} (lm_ddp on one GPU {one['val_bpb']})")
    assert "setup: world_size=2 backend=nccl device=cuda" in proc.stdout
    assert abs(result["val_loss"] - one["val_loss"]) <= 0.01 * one["val_loss"], (result, one)


@pytest.mark.skipif(GPUS < 2, reason="fsdp.py needs one GPU per rank (NCCL); ranks sharing one are refused")
def test_fsdp_sharded_checkpoint_resumes_on_gpu(tmp_path):
    # test_fsdp.py's run on two GPUs: each rank writes its shard with torch.distributed.checkpoint, rank 0 latest.pt;
    # --resume auto loads the shards onto each GPU and restores the CUDA RNG stream. Bitwise on the CPU; here the
    # straight and resumed runs' kernels may differ (cudnn.benchmark), fp32 (FP32): last digits.
    args = ["recipes/fsdp.py", TWO_RANKS, *cpu_fsdp.ARGS]
    straight = launch(*args, "--out-dir", tmp_path / "straight", env=FP32)
    first = launch(*args, "--max-steps", cpu_fsdp.PER_EPOCH, "--out-dir", tmp_path / "resumed", env=FP32)
    resumed = launch(*args, "--resume", "auto", "--out-dir", tmp_path / "resumed", env=FP32)
    steps = 3 * cpu_fsdp.PER_EPOCH  # --epochs 3
    assert [result_of(proc)["steps"] for proc in (first, resumed, straight)] == [cpu_fsdp.PER_EPOCH, steps, steps]
    assert f"setup: world_size=2 backend={TWO_RANKS_BACKEND} device=cuda" in first.stdout
    assert (f"resume: {tmp_path / 'resumed/checkpoint/latest.pt'} at epoch 1 step {cpu_fsdp.PER_EPOCH}"
            in resumed.stdout)
    assert epoch_losses(first.stdout) + epoch_losses(resumed.stdout) == pytest.approx(
        epoch_losses(straight.stdout), abs=1.5e-4)  # printed with 4 decimals
    shards = params(tmp_path / "resumed/checkpoint/latest.pt")["shards"]
    assert len(list((tmp_path / "resumed/checkpoint" / shards).glob("*.distcp"))) == 2  # one per rank
    weights = params(tmp_path / "resumed/model.pt")
    build_model("tiny", 10).load_state_dict(weights)  # the full state_dict on rank 0's CPU: plain tensors, no prefix
    diff = max_diff(params(tmp_path / "straight/model.pt"), weights)
    print(f"fsdp resume on {TWO_RANKS}: max weight difference {diff:.2e}")
    assert max_diff(weights, initial_weights("tiny", image_size=16)) > 1e-3  # it trained
    assert diff < 1e-4


def test_fsdp_async_save_on_gpu(tmp_path):
    # --async-save on one GPU under NCCL: async_save's own gloo group beside NCCL, the shards staged from the GPU to
    # CPU memory, written by a thread while the next epoch trains; the same weights as the synchronous save's run
    # (the save does not touch training), latest.pt naming the last epoch's whole shards. On the CPU:
    # tests/test_fsdp.py (a crash mid-write).
    args = ["recipes/fsdp.py", "0", *cpu_fsdp.ARGS]
    plain = launch(*args, "--out-dir", tmp_path / "plain", env=FP32)
    in_thread = launch(*args, "--async-save", "--out-dir", tmp_path / "async", env=FP32)
    assert result_of(in_thread)["steps"] == result_of(plain)["steps"] == 3 * cpu_fsdp.PER_EPOCH
    print(in_thread.stdout[-2000:])
    assert in_thread.stdout.count("in the background; training waited") == 3, in_thread.stdout
    pointer = params(tmp_path / "async/checkpoint/latest.pt")
    assert pointer["epoch"] == 3 and (tmp_path / "async/checkpoint" / pointer["shards"] / ".metadata").exists()
    diff = max_diff(params(tmp_path / "plain/model.pt"), params(tmp_path / "async/model.pt"))
    print(f"fsdp --async-save on GPU: max weight difference from the synchronous save's run {diff:.2e}")
    assert diff < 1e-4


def test_ddp_uneven_join_on_gpu_equals_the_reference_over_every_ranks_batches(tmp_path):
    # test_uneven.py's job on TWO_RANKS: --shard-size 20 deals 128 samples out as 68 and 60, so the ranks have 5 and
    # 4 batches; Join shadows the short rank's all-reduces (under NCCL on 2 GPUs), its momentum comes from the long
    # rank. The reference is test_uneven.py's one-process loop over every rank's batches, here on the CPU: the GPU
    # run must land where it does (fp32 on both: last digits). The same loop averaging the last step over the ranks
    # still training, not all of them, ends 0.1 away.
    world, batch = 2, 32
    proc = launch("recipes/ddp_uneven.py", TWO_RANKS, *cpu_uneven.FLAGS, "--batch-size", batch, "--out-dir", tmp_path,
                  env=FP32)
    losses, model, counts = cpu_uneven.reference(world, batch)
    assert len(set(counts)) > 1, counts  # the ranks' batch counts do differ
    assert f"steps_per_epoch={max(counts)} batches_per_rank={counts}" in proc.stdout, proc.stdout
    result = result_of(proc)
    assert (result["world_size"], result["steps"], result["val_samples"]) == (world, cpu_uneven.EPOCHS * max(counts),
                                                                             37), result
    assert f"setup: world_size=2 backend={TWO_RANKS_BACKEND} device=cuda" in proc.stdout
    assert epoch_losses(proc.stdout) == pytest.approx(losses, abs=1.5e-4)  # printed with 4 decimals
    diff = max_diff(params(tmp_path / "model.pt"), model.state_dict())
    print(f"ddp_uneven on {TWO_RANKS}: {diff:.1e} from the CPU reference")
    assert diff < 1e-4
    assert result["val_acc1"] > 30, result  # it learns: 10 classes


def test_ddp_spawn_model_parallel_or_its_refusal(tmp_path):
    if GPUS < 2:  # one GPU: each worker needs two
        proc = launch("recipes/ddp_spawn.py", "0", *TINY, "--model-parallel", "--out-dir", tmp_path)
        assert proc.returncode == 2
        assert "error: --model-parallel needs 2 whole GPUs per worker, 1 visible" in proc.stderr
        return
    devices = "0,1,2,3" if GPUS >= 4 else "0,1"  # 2 workers: NCCL must be told which GPU a barrier uses
    proc = launch("recipes/ddp_spawn.py", devices, *TINY, "--model-parallel", "--epochs", "2", "--out-dir", tmp_path)
    result = result_of(proc)
    assert result["world_size"] == (2 if GPUS >= 4 else 1) and result["val_acc1"] > 80, result
    assert "model-parallel: features on cuda:0, fc on cuda:1 in every worker" in proc.stdout


# ------------------------------------------------------------------- failure drills 1, 3, 7


def test_drill_1_a_killed_rank_ends_the_job(tmp_path):
    job = job_mid_epoch("ddp_torchrun", tmp_path, devices=TWO_RANKS)
    victim, tree = job.rank_pid(1), job.tree()
    os.kill(victim, signal.SIGKILL)
    code = job.finish(timeout=120)
    assert code == 128 + signal.SIGKILL, job.output()
    assert re.search(rf"launch\.sh: job failed: rank 1 \(pid {victim}\) was killed by SIGKILL", "".join(job.stderr))
    assert not survivors(tree, grace=30), job.output()


def test_drill_3_a_hung_rank_fails_the_job_within_the_timeout(tmp_path):
    # Under NCCL the watchdog may abort the waiting rank (SIGABRT) instead of raising: either way, one line.
    job = Job("recipes/ddp_torchrun.py", TWO_RANKS, *TINY, "--max-steps", "3", "--dist-timeout", "10",
              "--out-dir", tmp_path, env={"PYTHONPATH": str(REPO / "tests/faults"),
                                          "FAULT_COLLECTIVE": "1:all_reduce:1:hang"})
    job.wait_for("FAULT: rank 1", timeout=180)
    start, tree = time.monotonic(), job.tree()
    code = job.finish(timeout=180)
    took = time.monotonic() - start
    stderr = "".join(job.stderr)
    print(f"drill 3 on GPU ({TWO_RANKS}): exit {code} {took:.1f} s after the hang\n{stderr[-2000:]}")
    assert code not in (0, None) and took < 10 + 60, job.output()
    said = [line for line in error_lines(stderr) if "did not join a collective within --dist-timeout" in line]
    # NCCL's default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): the watchdog aborts the waiting rank, and launch.sh's line
    # names it, the signal and where to look (tools/torchrun.describe, checked on CPU in test_launch.py).
    assert said or re.search(r"launch\.sh: job failed: rank \d \(pid \d+\) was killed by SIGABRT \(under NCCL, its "
                             r"watchdog aborts a rank whose collective timed out or lost a peer", stderr), stderr
    # Either way the launcher shows where each rank was (tools/torchrun.show_stacks): rank 1, in the fault's sleep,
    # has frames (the CPU drill checks which line).
    assert "[rank 0] stack:" in stderr and "[rank 1] stack:" in stderr, stderr
    assert "(most recent call last):" in stderr.split("[rank 1] stack:")[1].split("[rank ")[0], stderr
    assert not survivors(tree, grace=30), job.output()


def test_debug_collectives_on_gpu(tmp_path):
    # One rank under NCCL: DDP on NCCL's checked group (DETAIL wraps it; ddp_process_group leaves DDP on it, since
    # DDP's Logger takes its NCCL branch there). Its RESULT is the plain run's: the checks change no number.
    plain = launch("recipes/ddp_torchrun.py", "0", *TINY, "--max-steps", "3", "--out-dir", tmp_path / "plain",
                   env=FP32)
    checked = launch("recipes/ddp_torchrun.py", "0", *TINY, "--max-steps", "3", "--debug-collectives", "--out-dir",
                     tmp_path / "checked", env=FP32)
    assert plain.returncode == checked.returncode == 0, checked.stderr[-3000:]  # not DDP's SIGSEGV
    # cudnn.benchmark times its kernels in each run and may pick others: fp32's last digits (FP32: TF32 off).
    assert result_of(plain)["train_loss"] == pytest.approx(result_of(checked)["train_loss"], abs=1e-4)
    # Two ranks (NCCL, or gloo over CUDA tensors on one GPU): rank 1's end-of-epoch all-reduce one element longer.
    job = Job("recipes/ddp_torchrun.py", TWO_RANKS, *TINY, "--max-steps", "3", "--dist-timeout", "10",
              "--debug-collectives", "--out-dir", tmp_path / "two",
              env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_COLLECTIVE": "1:all_reduce:1:grow"})
    job.wait_for("FAULT: rank 1", timeout=180)
    code = job.finish(timeout=180)
    stderr = "".join(job.stderr)
    print(f"--debug-collectives on GPU ({TWO_RANKS}): exit {code}\n{stderr[-2000:]}")
    assert code == 1, job.output()
    said = [line.split("error: ", 1)[1] for line in error_lines(stderr)]
    assert said and all(re.match(r"the ranks called different collectives: rank 0 called ALLREDUCE of shape \[4\] "
                                 r"\w+ .*rank 1 called ALLREDUCE of shape \[5\]", line) for line in said), said


def test_profile_on_gpu(tmp_path):
    # --profile on a GPU: the trace holds the GPU's kernels, and the table is cut on the GPU's timeline (its kernels;
    # NCCL's, or gloo's host ranges on 0:2, are communication) and adds up. own_ms times forwards with CUDA events.
    one = launch("recipes/ddp_torchrun.py", "0", *TINY, "--max-steps", "10", "--profile", "--out-dir",
                 tmp_path / "one")
    two = launch("recipes/ddp_torchrun.py", TWO_RANKS, *TINY, "--max-steps", "10", "--profile", "--out-dir",
                 tmp_path / "two")
    for proc, out, ranks in ((one, tmp_path / "one", 1), (two, tmp_path / "two", 2)):
        result_of(proc)
        rows = cpu_profile.table(proc.stdout)
        print(f"--profile on GPU ({ranks} rank(s)):", rows, cpu_profile.OWN.findall(proc.stdout))
        assert sorted(rows) == list(range(ranks)), proc.stdout
        assert all(sum(row[k] for k in LABELS) == pytest.approx(100, abs=0.3) for row in rows.values()), rows
        # Kernels are counted. Not more than that: the tiny model on an H100 is 4.5% compute and 94% idle (5.5 ms
        # steps of Python and kernel launches the GPU waits for), which is what the table is for (docs/slow.md).
        assert all(row["compute"] > 0.5 for row in rows.values()), rows
        trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
        (own,) = cpu_profile.OWN.findall(proc.stdout)
        assert 0 < float(own[0]) <= float(own[1]), own
    assert all(row["communication"] + row["overlapped"] > 0.5 for row in cpu_profile.table(two.stdout).values())


def test_drill_7_ctrl_c_stops_every_process(tmp_path):
    job = job_mid_epoch("ddp_torchrun", tmp_path, devices=TWO_RANKS)
    tree = job.tree()
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish(timeout=120)
    assert code == 128 + signal.SIGINT, job.output()
    assert not tracebacks_beyond_multiprocessing("".join(job.stderr)), job.output()
    assert not survivors(tree, grace=30), job.output()


# ------------------------------------------------------------------ gpu_decode: nvjpeg, one batch ahead (issue 65)


def gpu_decode_batch(root, size=224, odd=False):
    """recipes/gpu_decode.py's module, the ImageFolder of ROOT/train, and one collated batch of its validation boxes."""
    from tools.make_jpegs import make_set

    make_set(root, train=32, val=2, classes=2, size=(500, 375), jobs=4, odd=odd)
    recipe = load_recipe("gpu_decode")
    files = build_datasets("imagefolder", root, size)[0].dataset
    items = recipe.EncodedImages(files, size, False, False)
    return recipe, files, recipe.collate([items[i] for i in range(len(files))])


def decode_on(recipe, batch, device, files):
    """recipe.decode_batch at 224 px, contiguous, on `device`, its normalize made there once as main() makes it."""
    import collections

    device = torch.device(device)
    return recipe.decode_batch(batch, device, 224, torch.contiguous_format, device_normalize("imagefolder", device),
                               collections.Counter(), "train", files)


def test_gpu_decode_on_the_gpu_is_within_a_level_of_the_cpu_decoder(tmp_path):
    # nvjpeg (hardware or CUDA) against libjpeg-turbo on the same files, gray, CMYK, PNG and progressive ones among
    # them: IDCT and chroma upsampling differ in the last bits, then the same crop and resize on each device.
    recipe, files, batch = gpu_decode_batch(tmp_path, odd=True)
    on_gpu, labels = decode_on(recipe, batch, "cuda", files)
    on_cpu, _ = decode_on(recipe, batch, "cpu", files)
    assert on_gpu.is_cuda and labels.is_cuda and on_gpu.shape == on_cpu.shape == (36, 3, 224, 224)
    levels = (on_gpu.cpu() - on_cpu).abs() * 0.226 * 255  # normalised units back to levels of 255 (std ~0.226)
    print(f"gpu_decode: nvjpeg against the CPU decoder: mean {levels.mean():.3f}, max {levels.max():.1f} levels")
    assert levels.mean() < 1.0 and levels.max() < 64, (levels.mean(), levels.max())


def test_gpu_decode_the_step_cannot_read_a_batch_before_its_decode_and_copy_end(tmp_path):
    # DataLoaderX runs on_device on its side stream; here it ends with a copy queued behind ~0.5 s of GPU sleep.
    # The loop reads each batch at once on the default stream: without the wait on the batch's event it would read
    # the copy's destination before the copy (torch.empty: garbage), and the sums would differ from the CPU's.
    recipe, files, batch = gpu_decode_batch(tmp_path)
    expected, _ = decode_on(recipe, batch, "cpu", files)

    def on_device(b):
        images, labels = decode_on(recipe, b, "cuda", files)
        late = torch.empty_like(images)
        torch.cuda._sleep(int(1e9))  # about half a second of one SM's clock on the side stream
        late.copy_(images)
        return late, labels

    loader = DataLoaderX(torch.device("cuda"), [batch] * 3, batch_size=None, collate_fn=lambda b: b,
                         on_device=on_device)
    for images, _ in loader:
        assert (images.cpu() - expected).abs().mean().item() * 0.226 * 255 < 1.0


def test_gpu_decode_drains_its_stream_before_nvjpeg_writes(tmp_path):
    # pytorch/vision PR #9606: decode_jpeg allocates its outputs on the caller's stream, and nvjpeg writes them from a
    # stream of its own. A block freed on the caller's stream goes back to the allocator at once (stream order), even
    # with reads of it still queued there, so an output may take it and be written before those reads run.
    # decode_batch drains its stream first. Here, on a side stream as DataLoaderX's: blocks the size of the decoded
    # images, filled with 7, their sums queued behind ~0.5 s of GPU sleep, freed, then the batch decoded.

    from PIL import Image

    recipe, files, batch = gpu_decode_batch(tmp_path)
    expected, _ = decode_on(recipe, batch, "cpu", files)
    sizes = [3 * width * height for width, height in (Image.open(path).size for path, _ in files.samples)]
    decode_on(recipe, batch, "cuda", files)  # nvjpeg's decoder made (once a process) before the sleep
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        blocks = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for n in sizes]
        torch.cuda._sleep(int(1e9))  # about half a second of one SM's clock
        sums = [block.sum(dtype=torch.int64) for block in blocks]  # queued: they read after the sleep
        del blocks  # free for the allocator on this stream now; the sums still to read them
        images, _ = decode_on(recipe, batch, "cuda", files)
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [7 * n for n in sizes]  # no decoded pixel landed in a block before its read
    assert (images.cpu() - expected).abs().mean().item() * 0.226 * 255 < 1.0


def test_gpu_decode_a_file_nvjpeg_refuses_is_decoded_on_the_cpu_and_lands_on_the_gpu(tmp_path, monkeypatch):
    # nvjpeg refuses some JPEGs libjpeg-turbo decodes; no file this tier can make is one, so the recipe's decode_jpeg
    # is wrapped to refuse the batch and one file on the GPU: decode_batch then decodes each file alone, that one on
    # the CPU, waits for nvjpeg's stream and copies it over. The batch as the CPU decoder makes it, on the GPU.
    recipe, files, batch = gpu_decode_batch(tmp_path)
    expected, _ = decode_on(recipe, batch, "cpu", files)
    real, refused, calls = recipe.decode_jpeg, batch[0][1], []

    def decode_jpeg(data, *args, device="cpu", **kwargs):
        on_gpu = torch.device(device).type == "cuda"
        calls.append(("list" if isinstance(data, list) else "one", on_gpu))
        if on_gpu and (isinstance(data, list) or data is refused):
            raise RuntimeError("nvjpeg cannot decode this file (a test's stand-in)")
        return real(data, *args, device=device, **kwargs)

    monkeypatch.setattr(recipe, "decode_jpeg", decode_jpeg)
    images, labels = decode_on(recipe, batch, "cuda", files)
    assert images.is_cuda and labels.is_cuda and images.shape == expected.shape
    assert calls[0] == ("list", True) and calls.count(("one", False)) == 1 and calls.count(("one", True)) == len(files)
    assert (images.cpu() - expected).abs().mean().item() * 0.226 * 255 < 1.0
