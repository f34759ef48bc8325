"""recipes/fsdp.py: FSDP2 training equals one process on the full batch, sharded checkpoints resume exactly on the
same world size and within float rounding on another, model.pt loads in a plain process, bad checkpoints are one
line, and each rank holds about half of what a DDP rank holds. Real gloo runs on the CPU."""

import re
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from conftest import (
    REPO,
    epoch_lines,
    epoch_losses,
    fsdp_blocks,
    fsdp_counts,
    instrument_env,
    launch,
    load_recipe,
    max_diff,
    params,
    replayed,
    result_of,
    rng_env,
    rng_streams,
    run_direct,
    spawn_gloo,
)
from jobs import error_lines
from reference import Plain, evaluate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from common.data import build_datasets
from common.models import build_model

# 144 samples split evenly over 1, 2 and 3 ranks (global batch 48), so each step sees the same 48 samples whatever
# the world size. tiny has no BatchNorm: its result does not depend on how the batch is split. 49 validation samples
# give rank 0 one batch more than the others (2 ranks: 25 and 24 of 24 per batch; 3 ranks: 17, 16, 16 of 16): each
# forward all-gathers, so rank 0's last one needs the others' empty forwards, or it waits (--dist-timeout 60).
ARGS = ["--arch", "tiny", "--workers", "0", "--batch-size", "48", "--epochs", "3", "--lr", "0.2", "--image-size",
        "16", "--synthetic-train", "144", "--synthetic-val", "49", "--dist-timeout", "60"]
PER_EPOCH = 144 // 48
# A different world size adds the gradients in another order (2 ranks' reduce-scatter vs 3's): last-bit
# differences, grown over 6 more steps.
RESHARD_ATOL = 1e-5

pytestmark = pytest.mark.slow


def first_shards(runs):
    """The shard folder the 2-rank run stopped after epoch 1 wrote (every copy of it resumes from this one)."""
    return torch.load(runs["tmp"] / "first/checkpoint/latest.pt", weights_only=True)["shards"]


def files_of(folder):
    return {p.relative_to(folder): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    got = {"tmp": tmp}
    got["straight"] = launch("recipes/fsdp.py", "cpu:2", *ARGS, "--out-dir", tmp / "straight",
                             env=rng_env(tmp / "rng_straight"))
    got["one"] = run_direct("fsdp", *ARGS, "--out-dir", tmp / "one")  # one process, the whole batch
    got["first"] = launch("recipes/fsdp.py", "cpu:2", *ARGS, "--max-steps", PER_EPOCH, "--out-dir", tmp / "first")
    for name in ("r2", "r3", "r1", "r1_other_batch", "wrong_arch", "truncated"):
        shutil.copytree(tmp / "first", tmp / name)
    # r2 with --async-save, rank 0's training forwards 0.3 s slower (tests/faults' FAULT_SLOW): epoch 2's few kB are
    # written while epoch 3 trains, and seen done by one of its steps (the background changes no weight).
    got["r2"] = launch("recipes/fsdp.py", "cpu:2", *ARGS, "--resume", "auto", "--async-save", "--out-dir", tmp / "r2",
                       env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_SLOW": "0:0.3"})
    got["r3"] = launch("recipes/fsdp.py", "cpu:3", *ARGS, "--resume", "auto", "--no-reshard-after-forward",
                       "--out-dir", tmp / "r3",
                       env=rng_env(tmp / "rng_r3", instrument_env(COUNT_FSDP_DIR=tmp / "counts_r3")))
    got["r1"] = run_direct("fsdp", *ARGS, "--resume", "auto", "--out-dir", tmp / "r1", env=rng_env(tmp / "rng_r1"))
    # another global batch: 2 steps an epoch, not 3
    got["r1_other_batch"] = run_direct("fsdp", *ARGS, "--batch-size", "72", "--resume", "auto", "--out-dir",
                                       tmp / "r1_other_batch")
    return got


def test_two_ranks_train_as_one_process_on_the_full_batch(runs):
    straight, one = result_of(runs["straight"]), result_of(runs["one"])
    assert (straight["world_size"], one["world_size"], straight["steps"], one["steps"]) == (2, 1, 9, 9)
    # printed with 4 decimals: 1.5e-4 lets one last digit round the other way
    assert epoch_losses(runs["straight"].stdout) == pytest.approx(epoch_losses(runs["one"].stdout), abs=1.5e-4)
    diff = max_diff(params(runs["tmp"] / "straight/model.pt"), params(runs["tmp"] / "one/model.pt"))
    print(f"2 ranks vs 1 process: weights {diff:.1e} apart (atol {RESHARD_ATOL:.0e})")
    assert diff <= RESHARD_ATOL
    assert straight["val_samples"] == 49 and straight["val_acc1"] > 30  # learns: chance is 10%


def test_resume_on_the_same_world_size_is_bitwise(runs):
    first, resumed = runs["first"], runs["r2"]
    assert result_of(first)["steps"] == PER_EPOCH and result_of(resumed)["steps"] == 3 * PER_EPOCH
    assert f"resume: {runs['tmp'] / 'r2/checkpoint/latest.pt'} at epoch 1 step {PER_EPOCH}" in resumed.stdout
    assert epoch_lines(first.stdout) + epoch_lines(resumed.stdout) == epoch_lines(runs["straight"].stdout)
    a, b = params(runs["tmp"] / "straight/model.pt"), params(runs["tmp"] / "r2/model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # --async-save: epoch 2's save named in latest.pt by a step of epoch 3, before epoch 3's line.
    named = re.search(r"^saved: \S+/epoch_2-\w+ \(written in the background\)$", resumed.stdout, re.M)
    assert named and named.start() < resumed.stdout.index("epoch=3/3"), resumed.stdout


def test_a_resume_with_other_steps_per_epoch_trains_every_epoch_left(runs):
    # Steps counted in this run's epochs (the checkpoint's step 3 is the 48-sample batch's count): with the saved
    # count, epoch 2 ended at step 5, off its boundary, and the run stopped there as if --max-steps had cut it, unsaved.
    proc = runs["r1_other_batch"]
    assert result_of(proc)["steps"] == 3 * 2 and " at epoch 1 step 2" in proc.stdout, proc.stdout
    assert [line.split()[0] for line in epoch_lines(proc.stdout)] == ["epoch=2/3", "epoch=3/3"]
    shards = torch.load(runs["tmp"] / "r1_other_batch/checkpoint/latest.pt", weights_only=True)["shards"]
    assert shards.startswith("epoch_3-"), shards


@pytest.mark.parametrize(("name", "world"), [("r3", 3), ("r1", 1)])
def test_a_checkpoint_from_two_ranks_resumes_on_another_world_size(runs, name, world):
    proc, out = runs[name], runs["tmp"] / name
    assert result_of(proc)["world_size"] == world and result_of(proc)["steps"] == 3 * PER_EPOCH
    assert f"resume: saved with 2 ranks, now {world}: random streams reseeded after epoch 1" in proc.stdout
    # No epoch starts from a random state another epoch (of the straight 2-rank run, or this one) started from.
    straight, streams = rng_streams(runs["tmp"] / "rng_straight"), rng_streams(runs["tmp"] / f"rng_{name}")
    assert sorted(straight) == [(2, rank, epoch) for rank in (0, 1) for epoch in (0, 1, 2)]
    assert sorted(streams) == [(world, rank, epoch) for rank in range(world) for epoch in (1, 2)]
    assert replayed({**straight, **streams}) == {}
    assert epoch_losses(proc.stdout) == pytest.approx(epoch_losses(runs["straight"].stdout)[1:], abs=1.5e-4)
    diff = max_diff(params(out / "model.pt"), params(runs["tmp"] / "straight/model.pt"))
    print(f"2 ranks -> {world}: weights {diff:.1e} from the straight 2-rank run (atol {RESHARD_ATOL:.0e})")
    assert diff <= RESHARD_ATOL
    # Its own checkpoint has one shard file per rank of the new world, in a folder named for this run; the folder
    # it resumed from (the 2-rank run's epoch 1) is gone.
    shards = torch.load(out / "checkpoint/latest.pt", weights_only=True)["shards"]
    assert re.fullmatch(r"epoch_3-[0-9a-f]{6}", shards) and shards != first_shards(runs)
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == sorted([shards, "latest.pt"])
    assert len(list((out / "checkpoint" / shards).glob("*.distcp"))) == world


def test_no_reshard_after_forward_gathers_each_block_once_a_step(runs):
    # r3 (--no-reshard-after-forward, resumed on 3 ranks for epochs 2 and 3), counted in its own processes
    # (tests/instrument's COUNT_FSDP_DIR): a block stays gathered from its forward to its backward, one all-gather a
    # step, where the default (resharded after the forward: tests/test_conformance.py's fsdp case) makes two.
    blocks = fsdp_blocks(build_model("tiny", 10, 16))
    assert len(blocks) == 2, blocks  # tiny: its 2 convolutions; the root keeps the classifier
    for rank in range(3):
        counts = fsdp_counts(runs["tmp"] / "counts_r3", rank)
        # A resume's get_state_dict first runs a step of the fresh optimizer (no gradients, no collective): the
        # counter's optimizer steps start with that one, empty.
        assert counts["steps"][0] == {} and counts["steps"][1:] == [
            {group: {"all_gather": 1, "reduce_scatter": 1} for group in [*blocks, "root"]}] * (2 * PER_EPOCH), (rank,
                                                                                                               counts)


def test_model_pt_loads_into_a_plain_model_and_scores_what_was_printed(runs):
    saved = params(runs["tmp"] / "straight/model.pt")
    assert {type(t) for t in saved.values()} == {torch.Tensor} and {t.dtype for t in saved.values()} == {torch.float32}
    model = build_model("tiny", 10)
    model.load_state_dict(saved)  # strict: the same keys, no prefix, no DTensor
    _, val_set, _ = build_datasets("synthetic", image_size=16, synthetic_train=144, synthetic_val=49)
    _, acc1, samples = evaluate(model, Plain(), val_set)
    assert samples == 49 and acc1 == pytest.approx(result_of(runs["straight"])["val_acc1"], abs=1e-3)


def test_a_checkpoint_of_another_arch_or_with_a_truncated_shard_is_refused(runs):
    tmp = runs["tmp"]
    before = files_of(tmp / "wrong_arch")
    wrong = run_direct("fsdp", *ARGS, "--arch", "tiny_bn", "--amp-dtype", "bf16", "--resume", "auto", "--out-dir",
                       tmp / "wrong_arch")
    assert wrong.returncode == 2
    assert wrong.stderr == (f"error: {tmp / 'wrong_arch/checkpoint/latest.pt'} was trained with --arch tiny (this "
                            "run: tiny_bn), --amp-dtype fp32 (this run: bf16); resume with the same flags\n")
    assert files_of(tmp / "wrong_arch") == before  # nothing written
    shard = tmp / "truncated/checkpoint" / first_shards(runs) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = files_of(tmp / "truncated")
    cut = run_direct("fsdp", *ARGS, "--resume", "auto", "--out-dir", tmp / "truncated")
    assert cut.returncode == 2
    assert cut.stderr.startswith(f"[rank 0] error: cannot load the shards in {shard.parent} (")
    assert cut.stderr.endswith("): a shard file is missing or truncated, or they hold another model\n")
    assert len(cut.stderr.splitlines()) == 1 and "Traceback" not in cut.stdout + cut.stderr
    assert files_of(tmp / "truncated") == before


def test_a_model_with_a_parameter_that_gets_no_gradient_resumes_bitwise(tmp_path):
    # tiny_unused's branch never joins the loss: SGD keeps no momentum for it, so the shards hold none. The resume's
    # get_state_dict steps a fresh optimizer to give every parameter one: asked for, the missing key failed every
    # resume ("Missing key in checkpoint state_dict: optimizer.state.aux_head.weight.momentum_buffer").
    args = [*ARGS, "--arch", "tiny_unused", "--epochs", "2"]
    straight = run_direct("fsdp", *args, "--out-dir", tmp_path / "straight")
    first = run_direct("fsdp", *args, "--max-steps", PER_EPOCH, "--out-dir", tmp_path / "resumed")
    resumed = run_direct("fsdp", *args, "--resume", "auto", "--out-dir", tmp_path / "resumed")
    assert resumed.returncode == 0 and result_of(resumed)["steps"] == 2 * PER_EPOCH, resumed.stderr[-2000:]
    assert ("resume: no optimizer state saved for 2 parameter(s), e.g. aux_head.weight (no gradient before the save): "
            "they go on without one, as in the run that saved them") in resumed.stdout, resumed.stdout
    assert epoch_lines(first.stdout) + epoch_lines(resumed.stdout) == epoch_lines(straight.stdout)
    a, b = params(tmp_path / "straight/model.pt"), params(tmp_path / "resumed/model.pt")
    assert "aux_head.weight" in a and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_without_a_sequential_of_blocks_is_said_to_be_sharded_at_the_root_alone(tmp_path):
    # inception_v3 (torchvision's one such model) keeps its blocks as attributes: blocks() finds none, and fully_shard
    # on the root alone gathers every parameter at once, which the run now says instead of going on in silence.
    proc = run_direct("fsdp", "--arch", "inception_v3", "--image-size", "75", "--batch-size", "2", "--synthetic-train",
                      "4", "--synthetic-val", "2", "--workers", "0", "--epochs", "1", "--max-steps", "1", "--out-dir",
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("fsdp: inception_v3 holds no Sequential or ModuleList of blocks: fully_shard on the root alone gathers "
            "all of it at once; put its blocks in one, or have blocks() yield them") in proc.stdout, proc.stdout
    quiet = run_direct("fsdp", *ARGS, "--max-steps", "1", "--out-dir", tmp_path / "tiny")  # tiny: its layers
    assert quiet.returncode == 0 and "fsdp: tiny holds no" not in quiet.stdout, quiet.stdout


def test_a_disk_that_fills_while_the_shards_are_written_keeps_the_previous_ones(tmp_path):
    # FAULT_DISK_FULL: the second time rank 0 opens its shard file (epoch 2's save), the disk takes 1 kB and refuses
    # the rest with ENOSPC. dcp.save hands the failure to every rank (a CheckpointException). torch's zip writer
    # reports it as "enforce fail at inline_container.cc" only: the line says what that can be, and the space left.
    out = tmp_path / "out"
    proc = launch("recipes/fsdp.py", "cpu:2", *ARGS, "--out-dir", out, timeout=120,
                  env={"PYTHONPATH": str(REPO / "tests/faults"), "FAULT_DISK_FULL": "__0_0.distcp:2:1024"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    latest = torch.load(out / "checkpoint/latest.pt", weights_only=True)
    said = [line for line in error_lines(proc.stderr) if "lost the connection" not in line]
    assert said and all(re.fullmatch(
        rf"\[rank [01]\] error: cannot write the shards in {re.escape(str(out / 'checkpoint'))}/epoch_2-\S+ \(a write "
        r"failed: a full disk, a quota or an I/O error \(RuntimeError: \[enforce fail at inline_container\.cc:\d+\]\); "
        r"[\d.]+ [kMG]B free "
        rf"there\): {re.escape(str(out / 'checkpoint/latest.pt'))}, if any, still points at the previous ones; free "
        r"some space, then --resume", line) for line in said), said
    assert latest["epoch"] == 1 and (out / "checkpoint" / latest["shards"] / "__0_0.distcp").is_file()  # epoch 1's


def test_a_crash_while_an_async_save_writes_leaves_the_last_checkpoint_to_resume_from(runs, tmp_path):
    # Issue 43, --async-save: epoch 2's shards are written by a thread while epoch 3 trains. Every process of the job
    # is killed (SIGKILL, tests/faults' FAULT_KILL_ON_WRITE) as that thread opens rank 0's shard file: latest.pt still
    # names epoch 1's shards, whole, and --resume auto goes on from them to the weights of the run never stopped
    # (the `straight` run above: the thread changes nothing in the weights); the killed save's folder (no .metadata:
    # DCP writes it last) is removed by the next save.
    run = ["recipes/fsdp.py", "cpu:2", *ARGS, "--async-save", "--out-dir", tmp_path]
    killed = launch(*run, env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_KILL_ON_WRITE": "__0_0.distcp:2"})
    assert killed.returncode == -signal.SIGKILL and "FAULT: killing the job as" in killed.stdout, killed.stderr
    assert killed.stdout.count("in the background; training waited") == 2, killed.stdout  # epochs 1 and 2
    # Epoch 1's save was named in latest.pt once written: during epoch 2, or before epoch 2's save at the latest.
    assert re.search(r"^saved: \S+/epoch_1-\w+ \(written in the background\)$", killed.stdout, re.M), killed.stdout
    checkpoints = tmp_path / "checkpoint"
    pointer = torch.load(checkpoints / "latest.pt", weights_only=True)
    assert pointer["epoch"] == 1 and (checkpoints / pointer["shards"] / ".metadata").exists()
    (half,) = [d for d in checkpoints.glob("epoch_2-*")]
    assert not (half / ".metadata").exists()  # the killed save: no metadata, never named by latest.pt
    # Resumed on a slow disk (rank 0's shard file opens 4 s late): epoch 2's save is still being written when epoch
    # 3's is due, and training waits for it there (one save in flight); the weights are the same.
    resumed = launch(*run, "--resume", "auto", env={"PYTHONPATH": str(REPO / "tests" / "faults"),
                                                   "FAULT_SLOW_WRITE": "__0_0.distcp:4"})
    assert result_of(resumed)["steps"] == 3 * PER_EPOCH and f"at epoch 1 step {PER_EPOCH}" in resumed.stdout, (
        resumed.stdout)
    waited = [float(w) for w in re.findall(r"in the background; training waited ([\d.]+) s", resumed.stdout)]
    assert len(waited) == 2 and waited[1] > 1, resumed.stdout  # epochs 2 and 3; at epoch 3's, epoch 2's write
    assert not half.exists() and [d.name for d in checkpoints.glob("epoch_*")] == [
        torch.load(checkpoints / "latest.pt", weights_only=True)["shards"]]
    assert max_diff(params(tmp_path / "model.pt"), params(runs["tmp"] / "straight" / "model.pt")) == 0


def test_bf16_trains_with_batchnorm_and_keeps_fp32_weights(tmp_path):
    # BatchNorm's running statistics are fp32: with its weights gathered in bf16 every forward failed ("expected
    # scalar type BFloat16 but found Float"), so BatchNorm gets fp32 groups of its own (how many: the next test).
    # Two ranks: the groups' all-gathers and reduce-scatters in both dtypes.
    bn = [a if a != "tiny" else "tiny_bn" for a in ARGS]
    fp32 = launch("recipes/fsdp.py", "cpu:2", *bn, "--out-dir", tmp_path / "fp32")
    bf16 = launch("recipes/fsdp.py", "cpu:2", *bn, "--amp-dtype", "bf16", "--out-dir", tmp_path / "bf16")
    assert result_of(bf16)["val_acc1"] > 30 and result_of(bf16)["val_samples"] == 49
    saved = params(tmp_path / "bf16/model.pt")
    assert {t.dtype for k, t in saved.items() if "num_batches" not in k} == {torch.float32}  # fp32 shards, stats
    # bf16's rounding shows in the losses, and it trains as fp32 does
    low, full = epoch_losses(bf16.stdout), epoch_losses(fp32.stdout)
    assert low == pytest.approx(full, abs=0.05) and low != full


def _groups_worker(rank, port, results):
    """Shard resnet18 (8 px) and tiny_bn as fsdp.py does, on 2 gloo ranks: every group's modules, dtype and mesh."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    recipe, got = load_recipe("fsdp"), {}
    for arch, size in (("resnet18", 8), ("tiny_bn", 16)):
        for amp_dtype in ("fp32", "bf16"):
            torch.manual_seed(0)
            model, mesh = build_model(arch, 10, size), init_device_mesh("cpu", (2,))
            recipe.shard(model, mesh, amp_dtype, reshard_after_forward=True)
            names = {module: name for name, module in model.named_modules()}
            states = {module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)}
            groups = [group for state in states for group in state._fsdp_param_groups]
            got[arch, amp_dtype] = {
                "groups": sorted((group.mp_policy.param_dtype == torch.bfloat16,
                                  tuple(sorted(names[m] for m in group.modules))) for group in groups),
                "one mesh": all(group.mesh_info.mesh is mesh for group in groups)}
    # The same step with one group per BatchNorm layer (the layout before): grouping changes the collectives, not
    # the arithmetic. Each rank its own batch; the gradients are reduce-scattered (averaged) across both.
    grads = []
    for grouped in (True, False):
        torch.manual_seed(0)
        model, mesh = build_model("resnet18", 10, 8), init_device_mesh("cpu", (2,))
        if grouped:
            recipe.shard(model, mesh, "bf16", reshard_after_forward=True)
        else:
            bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for norm in [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]:
                fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
            for block in recipe.blocks(model):
                fully_shard(block, mesh=mesh, mp_policy=bf16)
            fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32))
        generator = torch.Generator().manual_seed(rank)
        images, targets = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
    got["grads equal"] = all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
    results[rank] = got
    dist.destroy_process_group()


def test_bf16_groups_a_blocks_batchnorm_layers_together_all_on_one_mesh():
    results = spawn_gloo(_groups_worker)
    assert results[0] == results[1]
    got = results[0]
    # resnet18: 4 layers of 2 BasicBlocks. Each block is a bf16 group (conv1, conv2, downsample's conv); under bf16
    # its BatchNorm layers (bn1, bn2, downsample.1 where it has one: the first block of layers 2-4) are one fp32
    # group; the stem's bn1 is in no block, an fp32 group alone; the root (the stem's conv1, fc) a bf16 group.
    resnet18 = build_model("resnet18", 10, 8)
    residual = [(f"layer{i}.{j}", block) for i in range(1, 5) for j, block in enumerate(getattr(resnet18, f"layer{i}"))]
    assert len(residual) == 8
    blocks = [(True, (name,)) for name, _ in residual] + [(True, ("",))]
    norms = [(False, tuple(sorted([f"{name}.bn1", f"{name}.bn2"] + [f"{name}.downsample.1"] * bool(block.downsample))))
             for name, block in residual] + [(False, ("bn1",))]
    assert got["resnet18", "bf16"]["groups"] == sorted(blocks + norms)
    assert len(got["resnet18", "bf16"]["groups"]) == 2 * 8 + 2  # was 8 + 1 + 20, one group per BatchNorm layer
    assert got["resnet18", "fp32"]["groups"] == sorted((False, name) for _, name in blocks)  # 8 + 1, no norm groups
    # tiny_bn: features = conv, bn, relu, pool, conv, bn, relu, pool, flatten; its members with parameters are the
    # blocks (2 convs, 2 BatchNorm layers). Under bf16 the convs are a group each, both BatchNorm layers (in no
    # other block) one fp32 group, the root (fc) one: 4, was 5.
    tiny = [(True, ("features.0",)), (True, ("features.4",)), (False, ("features.1", "features.5")), (True, ("",))]
    assert got["tiny_bn", "bf16"]["groups"] == sorted(tiny)
    assert got["tiny_bn", "fp32"]["groups"] == sorted((False, (name,)) for name in (
        "features.0", "features.1", "features.4", "features.5", ""))
    # Every fully_shard call got the mesh given to shard() (the recipe builds one): without mesh= each builds its own.
    assert all(report["one mesh"] for key, report in got.items() if key != "grads equal")
    assert got["grads equal"]  # bitwise: one step of resnet18, its BatchNorm layers grouped or one group each


def test_each_rank_holds_half_of_what_a_ddp_rank_holds(tmp_path):
    # resnet18: parameters + gradients + SGD momentum, exactly, from each RESULT line.
    small = ["--arch", "resnet18", "--workers", "0", "--batch-size", "4", "--image-size", "8", "--max-steps", "1",
             "--synthetic-train", "8", "--synthetic-val", "2"]
    ddp = result_of(launch("recipes/ddp_torchrun.py", "cpu:2", *small, "--out-dir", tmp_path / "ddp"))
    fsdp = result_of(launch("recipes/fsdp.py", "cpu:2", *small, "--out-dir", tmp_path / "fsdp"))
    model = build_model("resnet18", 10, 8)  # the 8 px model (its stem)
    full = 3 * sum(p.numel() * 4 for p in model.parameters())
    assert ddp["state_bytes_per_rank"] == [full, full]
    # FSDP2 cuts every parameter along dim 0 as torch.chunk does (rank 0 the larger piece of an odd length): each rank
    # holds its pieces' parameters, gradients and momentum, exactly.
    shards = [3 * 4 * sum(chunks[r].numel() if r < len(chunks) else 0
                          for chunks in (torch.chunk(p, 2) for p in model.parameters())) for r in (0, 1)]
    assert fsdp["state_bytes_per_rank"] == shards and sum(shards) == full  # the shards add up to one copy
    ratio = max(fsdp["state_bytes_per_rank"]) / max(ddp["state_bytes_per_rank"])
    print(f"fsdp/ddp state bytes per rank, resnet18, 2 ranks: {ratio:.4f}")
    assert ratio == pytest.approx(0.5, abs=5e-4)  # docs/recipes.md's 0.50: odd dim 0s cost rank 0 a row each
