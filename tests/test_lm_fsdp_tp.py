"""recipes/lm_fsdp_tp.py (FSDP2 across --dp, tensor parallel within --tp) trains the one-process model: the same run
of recipes/lm_ddp.py on 1 process is the reference, launched once. Measured on 2 CPU cores (torch 2.14.1, gloo,
fp32, 8 steps of a 2-layer model) on 2 x 2, 1 x 4, 4 x 1, 3 x 1, 2 x 1, 1 x 2 and 1 x 1 meshes, with and without
--sequence-parallel and --accum-steps 2 (this file runs 2 x 2 with --accum-steps 2, and resumes 2 x 2 on three more):
- val_loss: within 2e-7 relative of the reference's (the RESULT line's 6 decimals: 4.990649 or 4.99065 against
  4.99065); asserted at 2e-6 relative. The printed step lines: equal (asserted within one unit of the last digit).
- model.pt: at most 5.3e-6 from the reference's, asserted at 1e-5: AdamW on gradients that are zero in exact
  arithmetic (wk's bias, as tests/test_lm_tp.py explains); the other tensors agree to ~1e-6. (A gradient summed
  over dp instead of averaged, pytorch/pytorch#162338 on gloo, would not show here: the clip and AdamW undo a uniform
  scale. The spawned check below compares the gradient itself.)
- --accum-steps 2 on 2 x 2 ends where --accum-steps 1 does (and the reference: the same step lines), with as many
  reduce-scatters per step: 3 (one per FSDP2 group: 2 blocks and the root), counted in the recipe's own processes;
  without the gradient-sync switch, 6 (the spawned check below, which also measures what the switch costs).
- FSDP2's all-gathers, per group and step, counted there too: a block 2 (before its forward, again before its
  backward) with --accum-steps 1, 4 with 2 (2K); the root 1 and 2 (K); every group 1 reduce-scatter a step.
- state_bytes_per_rank: each rank's shards (parameters, gradients, AdamW's two moments: 4 fp32 copies): the cut
  layers / (dp x tp), the norms and row-parallel biases / dp, plus AdamW's 4-byte step counters: 173460 bytes a rank
  on 2 x 2, against lm_ddp's 686228 and lm_tp's 177044 on 4 ranks (the norms whole there). At the default model:
  3580180 on 2 x 2, 3566868 on 4 x 1, against lm_tp's 3606804 on 4 and lm_ddp's 14266644.
- resume: the 2 x 2 run stopped at step 4 goes on at 1 x 2 (with --sequence-parallel), 4 x 1 (with
  --activation-checkpointing) and 2 x 1 to the reference's numbers (DCP reshards the 2-D shards).
- what autograd saves and the gradients held (tests/instrument/lm_claims.py's COUNT_SAVED_DIR, in the runs): between
  --accum-steps 2's micro-steps 105088 bytes of gradients a rank (dp times the 43328-byte shard, and the embeddings'
  whole), the shard after the last; --activation-checkpointing (a 1-step 2 x 2 run) saves 67236 bytes a rank for
  backward against 217764.
The slow tier here: 8 launches and 2 spawned processes, 51 s on 2 cores (load 4); 7 of them took 181 s on 2 busy
cores (load 7-8; 143 s of CPU).
"""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import REPO, launch, load_recipe, max_diff, params, result_of, spawn_gloo
from jobs import error_lines
from lm_checks import (
    blocks_per_step,
    check_args_refuses,
    claims_env,
    comms_per_step,
    compiled_matches_eager,
    diverged_run_stops_with_one_line,
    one_process_val_loss,
    only,
    plain_steps,
    saved_per_step,
    step_lines,
    tokens_seen,
)

from common.checkpoint import CheckpointError, load_same_flags
from common.lm import Transformer, read_text, split, train_batch

MODEL = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 32}
ARGS = ["--n-layer", 2, "--n-head", 4, "--d-model", 32, "--block-size", 32, "--seq-len", 16, "--batch-size", 8,
        "--steps", 8, "--eval-every", 4, "--val-windows", 9]  # 9: on dp 2, 5 and 4 windows (the 4th rank's stand-in)
VAL_RTOL = 2e-6  # measured: < 2e-7
WEIGHTS_ATOL = 1e-5  # measured: 5.3e-6 at most (AdamW on gradients that are zero in exact arithmetic)
PRINTED_ATOL = 1.01e-4  # one unit of the printed 4th decimal
GROUPS = MODEL["n_layer"] + 1  # fully_shard groups: each block, then the root (embeddings, ln_f, head)
SLOW = pytest.mark.slow  # a 4-process launch: 15-25 s on 2 cores

def assert_lines_equal(lines, ref_lines):
    for step, values in lines.items():
        for key, value in values.items():
            assert abs(value - ref_lines[step][key]) <= PRINTED_ATOL * max(1.0, abs(value)), (step, key, value)


def expected_state_bytes(dp, tp):
    """Parameters, gradients and AdamW's exp_avg and exp_avg_sq (4 fp32 copies) of each rank's shards: the cut layers
    over dp x tp ranks, the norms and the row-parallel biases (whole in a tp group) over dp, plus AdamW's 4-byte step
    counter per parameter."""
    model = Transformer(**MODEL)
    whole = sum(p.numel() for n, p in model.named_parameters() if ".ln" in n or n.startswith("ln_f")
                or n.endswith(("wo.bias", "proj.bias")))
    cut = sum(p.numel() for p in model.parameters()) - whole
    assert cut % (dp * tp) == 0 and whole % dp == 0
    return 16 * (cut // (dp * tp) + whole // dp) + 4 * len(list(model.parameters()))


def shard_grad_bytes(dp, tp):
    """The fp32 gradients of each rank's shards, what its optimizer steps: the cut layers over dp x tp ranks, the
    norms and the row-parallel biases over dp (dp 1: a tp slice of every layer)."""
    model = Transformer(**MODEL)
    whole = sum(p.numel() for n, p in model.named_parameters() if ".ln" in n or n.startswith("ln_f")
                or n.endswith(("wo.bias", "proj.bias")))
    cut = sum(p.numel() for p in model.parameters()) - whole
    return 4 * (cut // (dp * tp) + whole // dp)


def fsdp_counts(folder, world):
    """Each rank's FSDP2 collectives in a run launched with counted() (tests/instrument's COUNT_FSDP_DIR): per
    training step, {group: {"all_gather": n, "reduce_scatter": n}}, the groups "blocks.0", "blocks.1" and "root"."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def reduce_scatters(folder, world):
    """Each rank's count of FSDP2 reduce-scatters in a run launched with counted(), all groups and steps."""
    return [sum(group["reduce_scatter"] for step in rank["steps"] for group in step.values())
            for rank in fsdp_counts(folder, world)]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """env for launch(): tests/instrument on PYTHONPATH, counting FSDP2's collectives into a fresh folder (returned
    too)."""
    def env():
        folder = tmp_path_factory.mktemp("fsdp_counts")
        path = os.pathsep.join(filter(None, [str(REPO / "tests" / "instrument"), os.environ.get("PYTHONPATH")]))
        return {"PYTHONPATH": path, "COUNT_FSDP_DIR": str(folder)}, folder

    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory, counted):
    """launch(devices, *flags) once per (recipe, devices, flags) in this module: (the CompletedProcess, its --out-dir,
    the folder of its reduce-scatter counts)."""
    done = {}

    def run(recipe, devices, *flags):
        key = (recipe, devices, *map(str, flags))
        if key not in done:
            out = tmp_path_factory.mktemp(re.sub(r"\W+", "_", "-".join(key)))
            env, counts = counted()
            # What each rank computes and sends, what autograd saves and the gradients held:
            # tests/instrument/lm_claims.py (the collectives: lm_fsdp_tp's runs, but the checkpointed one).
            env = claims_env(claims(out), env,
                             comms=recipe == "lm_fsdp_tp" and "--activation-checkpointing" not in flags)
            done[key] = (launch(f"recipes/{recipe}.py", devices, *ARGS, *flags, "--out-dir", out, env=env), out,
                         counts)
        return done[key]

    return run


def claims(out):
    """Where runs() logs a run's tokens, block forwards, collectives (tests/lm_checks.py's claims_env) and what
    autograd saves (COUNT_SAVED_DIR: lm_checks' saved_per_step)."""
    return out.with_name(f"{out.name}_claims")


@pytest.fixture(scope="module")
def reference(runs):
    proc, out, _ = runs("lm_ddp", "cpu:1")
    return result_of(proc), step_lines(proc.stdout), out


# ------------------------------------------------------------------------------- conformance
@SLOW
def test_a_2x2_mesh_with_accumulation_trains_the_one_process_model(runs, reference):
    # The default mesh on 4 processes, 2 micro-batches a step. Measured, not run here (20-25 s each): 1 x 4 with
    # --sequence-parallel, 4 x 1, 3 x 1, 1 x 1, 2 x 2 with --sequence-parallel; the resumes below run 1 x 2 (with
    # --sequence-parallel), 4 x 1 and 2 x 1 for 4 steps each.
    ref, ref_lines, ref_out = reference
    proc, out, counts = runs("lm_fsdp_tp", "cpu:4", "--accum-steps", 2)
    result = result_of(proc)
    assert (result["recipe"], result["world_size"], result["dp"], result["tp"], result["sequence_parallel"],
            result["accum_steps"]) == ("lm_fsdp_tp", 4, 2, 2, False, 2)
    assert set(ref) | {"dp", "tp", "sequence_parallel", "accum_steps"} == set(result)  # lm_ddp's keys, and these
    assert "could not be resolved" not in proc.stderr and "Parallelize plan key" not in proc.stderr  # the plan matched
    assert result["steps"] == ref["steps"] == 8 and result["val_windows"] == ref["val_windows"]
    assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"], (result["val_loss"], ref)
    lines = step_lines(proc.stdout)
    assert sorted(lines) == sorted(ref_lines) == [4, 8]
    assert_lines_equal(lines, ref_lines)
    assert max_diff(params(out / "model.pt"), params(ref_out / "model.pt")) <= WEIGHTS_ATOL
    one_process = one_process_val_loss(out / "model.pt", MODEL, 16, 9)
    assert abs(one_process - result["val_loss"]) <= VAL_RTOL * result["val_loss"]
    # Each rank holds its shards only; FSDP2's reduce-scatters: one per group and step, however many micro-steps.
    assert ref["state_bytes_per_rank"] == [expected_state_bytes(1, 1)]
    assert result["state_bytes_per_rank"] == [expected_state_bytes(2, 2)] * 4
    assert reduce_scatters(counts, 4) == [GROUPS * 8] * 4
    # The mesh: a tp group is consecutive ranks (a row of the mesh), a dp group every tp-th rank (a column).
    assert ("mesh: dp=2 x tp=2 [[0, 1], [2, 3]]: rank 0 cuts each layer with ranks [0, 1] (tensor parallel) and "
            "shards its slices with ranks [0, 2] (FSDP2)") in proc.stdout
    saved = sorted(p.name for p in (out / "checkpoint").iterdir())  # latest.pt and the last save's shards only
    assert len(saved) == 2 and saved[0] == "latest.pt" and saved[1].startswith("step_8-"), saved
    # Evaluation runs training's micro-batches (batch 8 / dp 2 / accum 2 = 2 windows), not the dp rank's 4: a larger
    # --accum-steps, raised to fit the memory, must not run out of it at the first evaluation
    evaluated = [r["shape"][0] for r in tokens_seen(claims(out), 0) if r["where"] == "model" and not r["train"]]
    assert evaluated and max(evaluated) == 2, evaluated


@SLOW
def test_the_docstring_s_picture_is_where_dcp_finds_each_rank_s_shard(runs):
    # The 2 x 2 run's checkpoint says which rank wrote which rows (DCP's metadata: each chunk's global offset and
    # the file of the rank that wrote it): wq.weight as the docstring draws it; ln1's gain (plain until fully_shard)
    # cut by dp only, each half written once (DCP keeps one copy of what a tp group holds twice).
    from torch.distributed.checkpoint import FileSystemReader

    _, out, _ = runs("lm_fsdp_tp", "cpu:4", "--accum-steps", 2)
    shards = next((out / "checkpoint").glob("step_*"))
    storage = FileSystemReader(str(shards)).read_metadata().storage_data

    def rows(fqn):
        return {int(info.relative_path.split("_")[2]): index.offset[0] for index, info in storage.items()
                if index.fqn == fqn}

    d = MODEL["d_model"]
    assert rows("model.blocks.0.attn.wq.weight") == {0: 0, 1: d // 2, 2: d // 4, 3: 3 * d // 4}
    ln1 = rows("model.blocks.0.ln1.weight")  # {the rank that wrote a half: its first row}
    assert {rank // 2: row for rank, row in ln1.items()} == {0: 0, 1: d // 2} and len(ln1) == 2, ln1


@SLOW
def test_accumulation_equals_the_large_batch_with_one_reduce_scatter_per_step(runs):
    # --accum-steps 2 against --accum-steps 1, the same 2 x 2 run: the same step lines, as many reduce-scatters a step.
    k2, _, k2_counts = runs("lm_fsdp_tp", "cpu:4", "--accum-steps", 2)
    k1, _, k1_counts = runs("lm_fsdp_tp", "cpu:4", "--max-steps", 4, "--async-save")
    assert (result_of(k1)["steps"], result_of(k1)["accum_steps"]) == (4, 1)
    assert step_lines(k1.stdout)[4] == step_lines(k2.stdout)[4]
    assert reduce_scatters(k1_counts, 4) == [GROUPS * 4] * 4  # one per group and step
    assert reduce_scatters(k2_counts, 4) == [GROUPS * 8] * 4  # the same per step: not one per micro-step
    assert "(4 per dp rank x 2, in micro-batches of 2;" in k2.stdout
    assert "(4 per dp rank x 2, in micro-batches of 4;" in k1.stdout


@SLOW
def test_fsdp2_all_gathers_each_block_twice_a_step_and_reduce_scatters_it_once(runs):
    # The docstring's count, in the recipe's own processes (tests/instrument's COUNT_FSDP_DIR: FSDPParamGroup's
    # foreach_all_gather and foreach_reduce, per group, between optimizer steps; evaluation's all-gathers apart), on
    # the module's two 2 x 2 runs. Measured, the same on every rank and every step:
    # --accum-steps 1: each block 2 all-gathers (before its forward; again before its backward, as the forward
    #   resharded it) and 1 reduce-scatter; the root 1 and 1 (kept unsharded from its forward to its backward).
    # --accum-steps 2: each block 4 all-gathers (the docstring's 2K: every micro-step's forward and backward) and 1
    #   reduce-scatter; the root 2 (K: resharded after each backward, the gradient-sync switch notwithstanding) and 1.
    # Evaluation (autograd off), in training's micro-batches (4 windows a dp rank, 2 with --accum-steps 2): 9 windows,
    # dp rank 0 has 5: 2 forwards an evaluation (4 + 1), or 3 (2 + 2 + 1), and dp rank 1 as many (window 0 unscored
    # where its 4 run out, so that the ranks pair up): each block 1 all-gather a forward; the root 1 an evaluation
    # (FSDP2 leaves the root unsharded after its forward: its later forwards gather nothing).
    for flags, k, steps, evaluations, forwards in ((["--max-steps", 4, "--async-save"], 1, 4, 1, 2),
                                                   (["--accum-steps", 2], 2, 8, 2, 3)):
        _, _, folder = runs("lm_fsdp_tp", "cpu:4", *flags)
        for rank, counts in enumerate(fsdp_counts(folder, 4)):
            said = (k, rank, counts)
            assert len(counts["steps"]) == steps, said
            for step, groups in enumerate(counts["steps"], 1):
                assert groups == {"blocks.0": {"all_gather": 2 * k, "reduce_scatter": 1},
                                  "blocks.1": {"all_gather": 2 * k, "reduce_scatter": 1},
                                  "root": {"all_gather": k, "reduce_scatter": 1}}, (step, said)
            assert counts["eval_all_gathers"] == {"blocks.0": forwards * evaluations,
                                                  "blocks.1": forwards * evaluations, "root": evaluations}, said
            assert counts["after_last_step"] == {}, said  # model.pt's gathering is not FSDP2's: DTensor's


@SLOW  # the module's two 2 x 2 runs, shared
def test_a_tp_group_shares_its_dp_share_of_the_batch_and_each_dimension_sends_its_own(runs):
    # docs/lm.md's table for lm_fsdp_tp (issue 57), measured in the recipe's own processes on the module's two 2 x 2
    # runs (tests/instrument/lm_claims.py): the token windows each rank's model received, each step's collectives by
    # kind, group, phase and bytes. Rank r is (dp r // 2, tp r % 2): its tp group [2 (r // 2), 2 (r // 2) + 1], its
    # dp group [r % 2, r % 2 + 2].
    n_layer, seq_len, batch, d = MODEL["n_layer"], 16, 8, MODEL["d_model"]
    train = split(read_text()[0])[0]
    cut = 2 * n_layer + 1  # TP's all-reduces of the residual stream a forward: wo and proj per block, the bytes' rows
    for flags, k, steps in ((["--max-steps", 4, "--async-save"], 1, 4), (["--accum-steps", 2], 2, 8)):
        _, out, _ = runs("lm_fsdp_tp", "cpu:4", *flags)
        micro = batch // 2 // k  # sequences a micro-step: the dp rank's half of the batch, in k pieces
        for rank in range(4):
            dp_rank, tp_group, dp_group = rank // 2, (rank // 2 * 2, rank // 2 * 2 + 1), (rank % 2, rank % 2 + 2)
            lines = tokens_seen(claims(out), rank)
            for step in range(steps):  # its dp rank's half of step k's batch, in k micro-batches, in order
                whole = train_batch(train, step, 0, batch, seq_len, 0, 1)[0].tolist()
                mine = [line["rows"] for line in lines if line["train"] and line["step"] == step]
                assert [len(rows) for rows in mine] == [micro] * k, (flags, rank, step)
                assert [row for rows in mine for row in rows] == whole[dp_rank * 4:dp_rank * 4 + 4], (flags, rank)
            per_step = comms_per_step(claims(out), rank)
            for s in plain_steps(steps, 4):
                step = per_step[s - 1]
                # TP's collectives on the tp group alone, the micro-batch's activations: per micro-step 2L + 1
                # all-reduces forward (and the positions'), 2L + 1 backward
                activation = 4 * micro * seq_len * d
                assert only(step, "forward", {"all_reduce"}) == [
                    (("all_reduce", "forward", tp_group, 4 * seq_len * d), k),
                    (("all_reduce", "forward", tp_group, activation), cut * k)], (flags, rank, s, step)
                assert only(step, "backward", {"all_reduce"}) == [
                    (("all_reduce", "backward", tp_group, activation), cut * k)], (flags, rank, s, step)
                # FSDP2's on the dp group alone (their counts per block: test_fsdp2_all_gathers_... above)
                fsdp = {key[2] for key in step if key[0] in ("_allgather_base_", "_reduce_scatter_base_")}
                assert fsdp == {dp_group}, (flags, rank, s, step)
                # loss_parallel's 3 all-reduces a micro-step on the tp group; the clip across meshes; the stop vote,
                # the one collective over all four ranks; no host read but its ballot
                assert step["all_reduce", "step", tp_group, 4 * micro * seq_len] == 3 * k, (flags, rank, s, step)
                assert [(key, n) for key, n in step.items() if len(key[2]) == 4 and key[0] != "item"] == [
                    (("allreduce_", "step", (0, 1, 2, 3), 4), 1)], (flags, rank, s, step)
                assert only(step, ops={"item"}) == [
                    (("item", "step", "common/harness.py:all_reduce_max", 4), 1)], (flags, rank, s, step)


@SLOW  # a 4-process launch with --compile: 25-90 s (4 ranks compile on 2 cores; inductor's cache cold or not)
@pytest.mark.parametrize(("devices", "flags"), [("cpu:4", ["--accum-steps", 2]), ("cpu:2", ["--tp", 1])],
                         ids=["2x2", "fsdp2_alone"])
def test_compiled_blocks_under_fsdp2_and_tp_train_as_eager(runs, counted, tmp_path, devices, flags):
    # issue 66: --compile on the 2 x 2 mesh with 2 micro-batches a step, each block compiled after the TP plan and
    # before fully_shard; and on a 2 x 1 mesh, where FSDP2 does all the cutting (the plan's tp groups are one rank
    # each: its collectives none; FSDP2's all-gathers and reduce-scatters over both ranks): the eager run's losses and
    # weights, no recompile, no graph break (FSDP2's hooks eager). A 1 x 2 mesh runs the 2 x 2 one's lines with one
    # dp rank. And FSDP2's collectives (tests/instrument's COUNT_FSDP_DIR): each group's all-gathers and
    # reduce-scatters a step, and evaluation's, the eager run's.
    eager, eager_out, eager_counts = runs("lm_fsdp_tp", devices, *flags)
    world = int(devices.split(":")[1])
    env, counts = counted()
    proc = launch("recipes/lm_fsdp_tp.py", devices, *ARGS, *flags, "--compile", "--out-dir", tmp_path, env=env)
    compiled_matches_eager(proc, eager, world, tmp_path, eager_out)
    for compiled, plain in zip(fsdp_counts(counts, world), fsdp_counts(eager_counts, world), strict=True):
        assert len(compiled["steps"]) == 8 and compiled["steps"] == plain["steps"], (compiled, plain)
        assert compiled["eval_all_gathers"] == plain["eval_all_gathers"], (compiled, plain)


@SLOW  # the module's two 2 x 2 runs, shared
def test_between_micro_steps_each_rank_holds_its_gradients_unsharded_across_dp(runs):
    # docs/lm.md's table for lm_fsdp_tp --accum-steps K and the docstring's cost (issue 57): "between micro-steps
    # each rank keeps its gradients UNSHARDED across dp (its tp slice of every layer: dp times the shard it steps)".
    # Measured in the recipe's own processes (tests/instrument/lm_claims.py's COUNT_SAVED_DIR: the bytes of .grad
    # each rank holds just after each backward, FSDP2's unsharded parameters' and the model's own, a DTensor's local
    # shard) on the module's two 2 x 2 runs: with --accum-steps 2, after the first micro-step dp = 2 times the shard
    # (FSDP2 keeps the unsharded gradients, the reduce-scatter switched off) and more: the embeddings' gradients come
    # back from DTensor's embedding backward whole, not cut across tp as their weights are (lm_tp.py's
    # grads_as_params cuts them again; here FSDP2 does, before its reduce-scatter), so a rank holds both tp halves of
    # those; after the last micro-step the shard alone (the reduce-scatter's); with --accum-steps 1, the shard after
    # every step's one backward. Measured: 105088 bytes a rank between micro-steps, 43328 after the last.
    model = Transformer(**MODEL)
    embeddings = 4 * sum(p.numel() for n, p in model.named_parameters() if "emb" in n)
    shard = shard_grad_bytes(2, 2)
    unsharded = shard_grad_bytes(1, 2) + embeddings // 2  # the tp slices, not cut across dp; the embeddings' whole
    assert unsharded == 2 * shard + embeddings // 2
    for flags, k, steps in ((["--max-steps", 4, "--async-save"], 1, 4), (["--accum-steps", 2], 2, 8)):
        _, out, _ = runs("lm_fsdp_tp", "cpu:4", *flags)
        for rank in range(4):
            held = [[backward["grads"] for backward in backwards] for backwards in saved_per_step(claims(out), rank)]
            assert held == [[unsharded] * (k - 1) + [shard]] * steps, (flags, rank, held)
    print(f"lm_fsdp_tp on 2 x 2, --accum-steps 2: {unsharded} bytes of gradients a rank between micro-steps, {shard} "
          "after the step's last")


@SLOW  # a 1-step 2 x 2 run (10-15 s), and the module's 2 x 2 run without checkpointing
def test_activation_checkpointing_keeps_each_block_s_input_alone_on_a_2x2_mesh(runs):
    # docs/lm.md's table (issue 57), counted in the recipe's own processes (tests/instrument/lm_claims.py's
    # COUNT_SAVED_DIR: what autograd saves from the training forward's start to its backward, each storage once, a
    # DTensor's local shard, parameters left out: FSDP2's all-gathered ones too) on 2 x 2, step 1 with and without
    # --activation-checkpointing (the same batch): nothing inside a block's forward is kept, only what lies outside
    # the blocks and each block's input, a dp rank's (B / dp, T, D), whole on each rank of its tp group.
    _, plain_out, _ = runs("lm_fsdp_tp", "cpu:4", "--max-steps", 4, "--async-save")
    proc, ac_out, _ = runs("lm_fsdp_tp", "cpu:4", "--activation-checkpointing", "--max-steps", 1)
    assert "activation checkpointing: 2 of 2 blocks recompute their forward in backward" in proc.stdout
    block_input = 4 * 8 // 2 * 16 * MODEL["d_model"]
    for rank in range(4):
        [p], [a] = saved_per_step(claims(plain_out), rank)[0], saved_per_step(claims(ac_out), rank)[0]
        assert p["saved_in_blocks"] > 0 and a["saved_in_blocks"] == 0, (rank, p, a)
        assert a["saved"] == p["saved"] - p["saved_in_blocks"] + MODEL["n_layer"] * block_input, (rank, p, a)
        assert a["saved"] < p["saved"] / 2, (rank, p, a)
        assert a["grads"] == p["grads"] == shard_grad_bytes(2, 2), (rank, p, a)
    print(f"lm_fsdp_tp on 2 x 2: {p['saved']} bytes saved for backward a rank, {a['saved']} with "
          "--activation-checkpointing")


@SLOW
def test_a_2x2_checkpoint_goes_on_at_1x2_4x1_and_2x1(runs, reference, tmp_path):
    ref, ref_lines, ref_out = reference
    half, half_out, _ = runs("lm_fsdp_tp", "cpu:4", "--max-steps", 4, "--async-save")
    assert result_of(half)["steps"] == 4
    # Written by --async-save's thread (issue 43): the shards dcp.save writes, resumed on other meshes below.
    assert re.search(r"^saved: \S+/latest\.pt at step 4 \(written in the background\)$", half.stdout, re.M), half.stdout
    assert_lines_equal(step_lines(half.stdout), ref_lines)
    # Another model shape does not fit the shards: one line before training (the recipe's check of the flags
    # latest.pt holds; --dp and --tp are not among them).
    recipe = load_recipe("lm_fsdp_tp")
    args = recipe.parse_args([*map(str, ARGS), "--tp", "1", "--d-model", "64"])
    recipe.check_args(args, 2)
    with pytest.raises(CheckpointError, match=r"was written with --d-model 32 \(this run: 64\); resume with the same "
                                              r"flags$"):
        load_same_flags(half_out / "checkpoint" / "latest.pt", "cpu",
                        {k: getattr(args, k) for k in recipe.SAME_ON_RESUME}, require=("shards",))
    # A requeue on 3 processes: a default batch would be 6 there, where the checkpoint's 8 does not divide
    flags = {**{k: getattr(args, k) for k in recipe.SAME_ON_RESUME}, "d_model": 32, "batch_size": 6}
    with pytest.raises(CheckpointError, match=r"was written with --batch-size 8 \(this run: 6\); resume with the same "
                                              r"flags \(--batch-size 8: the global batch, which the data-parallel "
                                              r"processes, times --accum-steps where there is one, must divide\)$"):
        load_same_flags(half_out / "checkpoint" / "latest.pt", "cpu", flags, require=("shards",))
    assert not {"dp", "tp", "sequence_parallel", "accum_steps"} & set(recipe.SAME_ON_RESUME)
    for devices, flags, mesh in [("cpu:2", ["--dp", 1, "--sequence-parallel"], (1, 2)),
                                 ("cpu:4", ["--tp", 1, "--activation-checkpointing"], (4, 1)),
                                 ("cpu:2", ["--tp", 1], (2, 1))]:
        out = tmp_path / f"{mesh[0]}x{mesh[1]}"
        shutil.copytree(half_out, out)  # the same step-4 checkpoint
        proc = launch("recipes/lm_fsdp_tp.py", devices, *ARGS, *flags, "--resume", "auto", "--out-dir", out,
                      env=claims_env(tmp_path / f"{out.name}_claims", comms=False, saved=False))
        result = result_of(proc)
        # Each block's forward once a step, and with --activation-checkpointing once more in backward (counted in the
        # run: tests/instrument/lm_claims.py; before steps 5-8, the resume's get_state_dict steps the fresh optimizer).
        recomputed = MODEL["n_layer"] if "--activation-checkpointing" in flags else 0
        assert blocks_per_step(tmp_path / f"{out.name}_claims", 0)[-4:] == [
            {"forward": MODEL["n_layer"], "recomputed": recomputed}] * 4, mesh
        assert (result["start_step"], result["steps"], result["dp"], result["tp"]) == (4, 8, *mesh), mesh
        assert f"at step 4 (saved on a 2 x 2 mesh, now {mesh[0]} x {mesh[1]})" in proc.stdout
        grid = [list(range(r, r + mesh[1])) for r in range(0, mesh[0] * mesh[1], mesh[1])]  # rows: the tp groups
        assert (f"mesh: dp={mesh[0]} x tp={mesh[1]} {grid}: rank 0 cuts each layer with ranks {grid[0]} (tensor "
                f"parallel) and shards its slices with ranks {[row[0] for row in grid]} (FSDP2)") in proc.stdout
        assert result["state_bytes_per_rank"] == [expected_state_bytes(*mesh)] * (mesh[0] * mesh[1])
        assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"], (mesh, result["val_loss"])
        assert_lines_equal(step_lines(proc.stdout), {8: ref_lines[8]})
        assert max_diff(params(out / "model.pt"), params(ref_out / "model.pt")) <= WEIGHTS_ATOL, mesh
        if "--activation-checkpointing" in flags:
            assert "activation checkpointing: 2 of 2 blocks recompute their forward in backward" in proc.stdout


# ------------------------------------------------------------------------ meta init, accumulation
def _meta_init_and_accumulation(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    recipe = load_recipe("lm_fsdp_tp")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))  # FSDP2 over 2 ranks

    def sharded():  # the recipe's steps: meta, its plan, fully_shard on each block then the root, to_empty
        with torch.device("meta"):
            model = Transformer(**MODEL)
        model = parallelize_module(model, mesh["tp"], recipe.tp_plan(False), src_data_rank=None)
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model.to_empty(device="cpu")

    torch.manual_seed(0)
    one = Transformer(**MODEL)  # the one-process model lm_ddp.py starts from
    # The naive path: the model's own init on the shards, seeded as lm_ddp.py seeds it.
    naive = sharded()
    torch.manual_seed(0)
    naive.init_weights(MODEL["n_layer"])
    # The recipe's: rank 0's full weights, broadcast; each rank keeps its shard.
    loaded = sharded()
    set_model_state_dict(loaded, one.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    results[rank, "init"] = {"one": one.blocks["0"].attn.wq.weight.detach().clone(),
                             "naive": naive.blocks["0"].attn.wq.weight.detach().full_tensor(),
                             "loaded": {k: v.full_tensor() for k, v in loaded.state_dict().items()},
                             "reference": one.state_dict()}
    # One step: each rank's gradient shard is its share of the mean over both ranks' sequences (FSDP2 averages over
    # dp; pytorch/pytorch#162338 reports gloo summing instead), against the one-process model on all of them.
    xs = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    with loss_parallel():
        F.cross_entropy(loaded(xs[rank]).flatten(0, 1), xs[rank].flatten()).backward()
    F.cross_entropy(one(torch.cat(xs)).flatten(0, 1), torch.cat(xs).flatten()).backward()
    grads = {n: p.grad.full_tensor() for n, p in loaded.named_parameters()}
    results[rank, "grads"] = max((grads[n] - p.grad).abs().max().item() for n, p in one.named_parameters())
    results[rank, "grad_scale"] = max(p.grad.abs().max().item() for p in one.parameters())
    loaded.zero_grad(set_to_none=True)
    # Two micro-steps, with the recipe's switch and without: FSDP2's reduce-scatters counted, and the gradients a
    # rank holds between them (the unsharded ones FSDP2 keeps on its unsharded parameters: private attributes).
    calls, real = [0], dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    for switch in (True, False):
        calls[0] = 0
        for micro in range(2):
            if switch:
                loaded.set_requires_gradient_sync(micro == 1)
            with loss_parallel():
                F.cross_entropy(loaded(x).flatten(0, 1), x.flatten()).backward()
            if micro == 0:
                sharded_grads = sum(p.grad.to_local().numel() for p in loaded.parameters() if p.grad is not None)
                unsharded = [fp._unsharded_param.grad for m in loaded.modules() if isinstance(m, FSDPModule)
                             for group in m._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params
                             if hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None]
                held = sum(getattr(g, "_local_tensor", g).numel() for g in unsharded)
        results[rank, switch] = {"reduce_scatters": calls[0], "held": 4 * held, "sharded": 4 * sharded_grads}
        loaded.zero_grad(set_to_none=True)
    dist.destroy_process_group()


@SLOW  # two spawned processes: 15-30 s, most of it importing torch
def test_meta_init_loads_the_reference_where_the_model_s_own_init_duplicates_shards():
    got = spawn_gloo(_meta_init_and_accumulation)  # the naive init warns: DTensor random ops on a CPU mesh
    init = got[0, "init"]
    half = MODEL["d_model"] // 2
    # The one-process weight's halves differ; the naive shards are copies of each other: each rank drew its half
    # from its own generator, seeded alike (DTensor random ops are not sharding-aware on a CPU mesh).
    assert not torch.equal(init["one"][:half], init["one"][half:])
    assert torch.equal(init["naive"][:half], init["naive"][half:])
    # Loaded from rank 0's full weights: exactly the one-process model, every tensor, on both ranks.
    for rank in (0, 1):
        loaded = got[rank, "init"]["loaded"]
        assert loaded.keys() == init["reference"].keys()
        assert all(torch.equal(loaded[k], init["reference"][k]) for k in loaded)
    for rank in (0, 1):  # measured: 3e-8 off, the largest gradient 0.27 (a sum over dp would be that far off)
        assert got[rank, "grads"] < 1e-6 < 1e-3 < got[rank, "grad_scale"], (got[rank, "grads"], got[rank, "grad_scale"])
    # The switch: one reduce-scatter per group for the two micro-steps, not two; in between each rank holds its
    # gradients unsharded (the whole model's here: tp 1, dp 2), twice the sharded ones it holds without the switch.
    params_bytes = 4 * sum(p.numel() for p in Transformer(**MODEL).parameters())
    for rank in (0, 1):
        on, off = got[rank, True], got[rank, False]
        assert (on["reduce_scatters"], off["reduce_scatters"]) == (GROUPS, 2 * GROUPS)
        assert (on["held"], on["sharded"]) == (params_bytes, 0)
        assert (off["held"], off["sharded"]) == (0, params_bytes // 2)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("world", "flags", "line"), [
    (4, ["--dp", "2", "--tp", "3"], "error: --dp 2 x --tp 3 must equal the number of processes, 4"),
    (4, ["--tp", "3"], "error: --dp 1 x --tp 3 must equal the number of processes, 4"),
    (4, ["--dp", "0"], "error: --dp 0 x --tp 2 must equal the number of processes, 4"),
    (4, ["--tp", "4", "--n-head", "2"], "error: --tp 4 must divide --n-head 2 and the MLP width 4 x --d-model = 128"),
    (4, ["--batch-size", "6", "--accum-steps", "2"],
     "error: --batch-size 6 is the GLOBAL batch and must be a multiple of --dp 2 x --accum-steps 2 (the "
     "data-parallel ranks' micro-batches); try --batch-size 4"),
    (3, ["--batch-size", "8"], "error: --batch-size 8 is the GLOBAL batch and must be a multiple of --dp 3 (the"),
    (4, ["--accum-steps", "0"], "error: --accum-steps 0 must be >= 1"),
    (4, ["--sequence-parallel", "--seq-len", "15"],
     "error: --sequence-parallel cuts each sequence into --tp 2 equal pieces: --seq-len 15 must be a multiple of 2"),
])
def test_bad_mesh_and_batch_flags_fail_with_one_line_before_any_collective(world, flags, line, capsys, monkeypatch):
    check_args_refuses("lm_fsdp_tp", [*ARGS, *flags], world, line, capsys, monkeypatch)


def test_the_defaults_pair_ranks_for_tp_and_round_the_batch_to_dp():
    recipe = load_recipe("lm_fsdp_tp")
    for world, mesh, batch in ((1, (1, 1), 32), (2, (1, 2), 32), (3, (3, 1), 30), (4, (2, 2), 32), (6, (3, 2), 30),
                               (8, (4, 2), 32)):
        args = recipe.parse_args([])
        recipe.check_args(args, world)
        assert ((args.dp, args.tp), args.batch_size) == (mesh, batch), world
    args = recipe.parse_args(["--dp", "2", "--accum-steps", "4"])  # --tp: what --dp leaves
    recipe.check_args(args, 8)
    assert (args.dp, args.tp, args.batch_size) == (2, 4, 32)


def test_a_mesh_that_is_not_the_world_stops_a_real_launch_with_one_line(tmp_path):
    proc = launch("recipes/lm_fsdp_tp.py", "cpu:2", *ARGS, "--dp", 2, "--tp", 2, "--out-dir", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert [line.split(" (give one")[0] for line in error_lines(proc.stderr)] == [
        "error: --dp 2 x --tp 2 must equal the number of processes, 2"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@SLOW  # a real 2-process launch: 10-15 s
def test_a_diverged_run_stops_with_one_line_naming_the_last_good_checkpoint(tmp_path):
    diverged_run_stops_with_one_line("lm_fsdp_tp", "cpu:2", [*ARGS, "--tp", 1], tmp_path / "out", saved_first=True)
