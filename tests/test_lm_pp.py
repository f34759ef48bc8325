"""recipes/lm_pp.py (pipeline parallel: GPipe and 1F1B over a manual split of the blocks) trains the one-process model:
the same run of recipes/lm_ddp.py on 1 process is the reference, launched once. On 2 and 4 stages, with both
schedules, measured on 2 CPU cores (torch 2.14.1, gloo, fp32, 8 steps of a 4-layer model, 4 and 8 microbatches, 12
validation windows: the last batch of 8 padded):
- val_loss: 4.980583 against the reference's 4.980584 (2e-7 relative: the microbatches' sums add up in another
  order); asserted at 2e-6 relative.
- the printed step lines (train_loss, val_loss, val_bpb, lr at 4 decimals): equal; asserted within one unit of the
  last printed digit, as in test_lm_tp.py.
- model.pt: the Transformer's keys in its order, at most 7.0e-7 from the reference's (blocks.1.attn.wk.bias: AdamW on
  a gradient that is rounding noise, see test_lm_tp.py); asserted at 1e-5.
- state_bytes_per_rank: the stages' bytes add up to the reference's exactly (554120 + 538764 = 1092884 on 2; on 4,
  350792, 203328, 203328 and 335436: the first and the last stage also hold the embeddings and the head, about 0.7
  of a block each here).
- gradients, in-process on 2 stages (the schedule's own step): each stage's equals the one-process full-batch
  gradient to 1.4e-7 of the largest gradient (GPipe and 1F1B alike, 4 microbatches), and after the global clip to
  5e-8; asserted at 2e-6. The gradient's norm is 4.66 here, above --clip-grad 1: the clip is active. Why this test
  and not the runs alone: an active clip and AdamW hide a gradient scaled by a constant (the schedule's division by
  the microbatches left out: the runs above still pass); here it is 4 times the gradient.
- resume: --max-steps 4, then --resume auto on the same ranks gives the uninterrupted run's model.pt bitwise; the
  same checkpoint resumed on 1 process (one stage) under GPipe with --activation-checkpointing gives the reference's
  weights to 1e-5.
- --activation-checkpointing on 2 stages under GPipe (a 1-step run, tests/instrument/lm_claims.py's COUNT_SAVED_DIR):
  a step's bytes saved for backward fall from 534080 to 34368 on stage 0 and from 698384 to 198672 on stage 1.
"""

import json
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import REPO, launch, load_recipe, max_diff, params, result_of, spawn_gloo
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

from common.checkpoint import EX_TEMPFAIL
from common.lm import Transformer, read_text, split, train_batch

MODEL = {"n_layer": 4, "n_head": 4, "d_model": 32, "block_size": 32}
BATCH, SEQ_LEN = 8, 16  # ARGS' sequences a step and bytes a sequence
ARGS = ["--n-layer", 4, "--n-head", 4, "--d-model", 32, "--block-size", 32, "--seq-len", SEQ_LEN, "--batch-size", BATCH,
        "--steps", 8, "--eval-every", 4, "--val-windows", 12]  # 12: the last validation batch padded
VAL_RTOL = 2e-6  # measured: 2e-7
WEIGHTS_ATOL = 1e-5  # measured: 7.0e-7 at most
PRINTED_ATOL = 1.01e-4  # one unit of the printed 4th decimal
GRAD_RTOL = 2e-6  # measured: 1.4e-7 of the largest gradient (5e-8 clipped); a missed division by m: 3 (4x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """launch(devices, *flags) once per (devices, flags) in this module: (the CompletedProcess, its --out-dir). An
    lm_pp run logs each stage's forwards and backwards per schedule call into schedule_log(out) (tests/instrument's
    LOG_PP_DIR)."""
    done = {}

    def run(recipe, devices, *flags):
        key = (recipe, devices, *map(str, flags))
        if key not in done:
            out = tmp_path_factory.mktemp(re.sub(r"\W+", "_", "-".join(key)))
            # What each rank computes and sends, and what autograd saves: tests/instrument/lm_claims.py (the
            # collectives: lm_pp's fp32 runs, but the checkpointed one).
            comms = recipe == "lm_pp" and "--amp-dtype" not in flags and "--activation-checkpointing" not in flags
            env = claims_env(claims(out), comms=comms)
            if recipe == "lm_pp":
                schedule_log(out).mkdir()
                env = {**env, "LOG_PP_DIR": str(schedule_log(out))}
            done[key] = (launch(f"recipes/{recipe}.py", devices, *ARGS, *flags, "--out-dir", out, env=env), out)
        return done[key]

    return run


def schedule_log(out):
    """Where runs() logs an lm_pp run's schedule calls: beside its --out-dir."""
    return out.with_name(f"{out.name}_schedule")


def claims(out):
    """Where runs() logs a run's tokens, block forwards, collectives (tests/lm_checks.py's claims_env) and what
    autograd saves (COUNT_SAVED_DIR: lm_checks' saved_per_step)."""
    return out.with_name(f"{out.name}_claims")


def schedule_calls(out, world):
    """Each rank's schedule calls in an lm_pp run of runs(), in order: [{"stage", "kind": "step" or "eval",
    "actions": [("F" or "B", microbatch), ...], ...}, ...] per rank."""
    calls = []
    for rank in range(world):
        lines = [json.loads(line) for line in (schedule_log(out) / f"rank{rank}.jsonl").read_text().splitlines()]
        calls.append([{**line, "actions": [tuple(action) for action in line["actions"]]} for line in lines])
    return calls


@pytest.fixture(scope="module")
def reference(runs):
    proc, out = runs("lm_ddp", "cpu:1")
    return result_of(proc), step_lines(proc.stdout), out


# 2 stages: 6-10 s a run on 2 cores, 4 stages 12-20 s (4 processes on 2 cores); the first also runs the reference.
@pytest.mark.slow
@pytest.mark.parametrize("devices", ["cpu:2", "cpu:4"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_trains_the_one_process_model(runs, reference, devices, schedule):
    ref, ref_lines, ref_out = reference
    proc, out = runs("lm_pp", devices, "--schedule", schedule)
    result = result_of(proc)
    pp = int(devices.split(":")[1])
    assert (result["recipe"], result["world_size"], result["pp"], result["schedule"], result["microbatches"]) == (
        "lm_pp", pp, pp, schedule, 2 * pp)
    assert set(ref) | {"pp", "schedule", "microbatches"} == set(result)  # lm_ddp's keys, and these three
    assert result["steps"] == ref["steps"] == 8 and result["val_windows"] == ref["val_windows"]
    assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"], (result["val_loss"], ref)
    lines = step_lines(proc.stdout)
    assert sorted(lines) == sorted(ref_lines) == [4, 8]
    for step, values in lines.items():
        for key, value in values.items():
            assert abs(value - ref_lines[step][key]) <= PRINTED_ATOL * max(1.0, abs(value)), (step, key, value)
    saved, want = params(out / "model.pt"), params(ref_out / "model.pt")
    assert list(saved) == list(want)  # every block once, in the Transformer's order: no stage dropped or repeated one
    assert max_diff(saved, want) <= WEIGHTS_ATOL
    # model.pt is the full model: one process scores it as the run did (through the stages, the last one scoring).
    one_process = one_process_val_loss(out / "model.pt", MODEL, 16, 12)
    assert abs(one_process - result["val_loss"]) <= VAL_RTOL * result["val_loss"]
    # Each rank holds its stage only: together exactly what the one process holds (parameters, gradients, AdamW).
    assert sum(result["state_bytes_per_rank"]) == ref["state_bytes_per_rank"][0]
    assert max(result["state_bytes_per_rank"]) < ref["state_bytes_per_rank"][0] * 2 / pp
    assert f"pipeline: stage 0: block{'s 0-1' if pp == 2 else ' 0'} |" in proc.stdout
    saved = sorted(p.name for p in (out / "checkpoint").iterdir())  # latest.pt and the last save's shards only
    assert len(saved) == 2 and saved[0] == "latest.pt" and saved[1].startswith("step_8-"), saved
    assert len(list((out / "checkpoint" / saved[1]).glob("*.distcp"))) == pp  # a file per stage


@pytest.mark.slow  # the runs above, shared (alone: 6-20 s each)
@pytest.mark.parametrize("devices", ["cpu:2", "cpu:4"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_runs_its_microbatches_in_the_docstring_s_order(runs, devices, schedule):
    # Recorded in the recipe's own processes (tests/instrument's LOG_PP_DIR: PipelineStage.forward_one_chunk and
    # backward_one_chunk, in the order each stage ran them, per schedule.step), on the runs above (m = 2p
    # microbatches: 4 on 2 stages, 8 on 4). Measured: every training step of every stage is tools/pp_schedule.py's
    # executed_order for the same (schedule, p, m) (which the docstring's timeline comes from), and the docstring's
    # rule: 1F1B, stage s of p runs p - s forwards, then one B and one F in turn (B first, of the oldest
    # microbatch), then the last p - s Bs, holding p - s microbatches at most; GPipe every F then every B, holding m.
    # Evaluation (schedule.eval): the m forwards in order, no backward.
    from tools import pp_schedule

    proc, out = runs("lm_pp", devices, "--schedule", schedule)
    assert result_of(proc)["steps"] == 8
    p = int(devices.split(":")[1])
    m = 2 * p
    want = pp_schedule.executed_order(schedule, p, m)
    forwards = [("F", i) for i in range(m)]
    for rank, calls in enumerate(schedule_calls(out, p)):
        steps = [call for call in calls if call["kind"] == "step"]
        evals = [call for call in calls if call["kind"] == "eval"]
        assert len(steps) == 8 and len(evals) == 4, (rank, calls)  # 8 steps; 12 windows in batches of 8, twice
        assert {(c["stage"], c["stages"], c["microbatches"]) for c in calls} == {(rank, p, m)}
        assert {c["schedule"] for c in calls} == {"Schedule1F1B" if schedule == "1f1b" else "ScheduleGPipe"}
        for call in steps:
            assert call["actions"] == want[rank], (rank, call["actions"], want[rank])
        if schedule == "1f1b":
            warm = p - rank  # p - s forwards first
            rule = forwards[:warm] + [a for i in range(m - warm) for a in (("B", i), ("F", warm + i))] + [
                ("B", i) for i in range(m - warm, m)]
        else:
            rule = forwards + [("B", i) for i in range(m)]
        assert want[rank] == rule, (rank, want[rank], rule)
        held = peak = 0
        for kind, _ in steps[0]["actions"]:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == (p - rank if schedule == "1f1b" else m), (rank, peak)
        assert all(call["actions"] == forwards for call in evals), (rank, evals)
    doc = " ".join(load_recipe("lm_pp").__doc__.split())
    assert ("1f1b: p - s forwards first (stage s of p), then one B and one F in turn (the oldest microbatch's "
            "backward first") in doc


@pytest.mark.slow  # the runs above, shared (alone: 6-20 s each)
@pytest.mark.parametrize("devices", ["cpu:2", "cpu:4"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_runs_its_blocks_on_every_microbatch_and_sends_only_to_its_neighbours(runs, devices, schedule):
    # docs/lm.md's table for lm_pp (issue 57), measured in the recipe's own processes on the runs above
    # (tests/instrument/lm_claims.py): the first stage takes step k's whole batch of bytes in m microbatches, in
    # order, the last stage scores their targets, the others receive activations alone; each stage runs its own
    # blocks once per microbatch; per step a stage sends each microbatch's activations (B / m, T, D) to the next
    # stage and receives their gradients back (the same with the one before), and the clip's all-reduce of one
    # number is its only collective (with the stop vote's).
    proc, out = runs("lm_pp", devices, "--schedule", schedule)
    assert result_of(proc)["steps"] == 8
    p = int(devices.split(":")[1])
    m = 2 * p
    train = split(read_text()[0])[0]
    blocks = load_recipe("lm_pp").stage_blocks(MODEL["n_layer"], p)
    for rank in range(p):
        lines = tokens_seen(claims(out), rank)
        for step in range(8):
            x, y = (t.tolist() for t in train_batch(train, step, 0, BATCH, SEQ_LEN, 0, 1))
            fed, scored = ([line["rows"] for line in lines if line["train"] and line["step"] == step
                            and line["where"] == where] for where in ("stage", "targets"))
            assert len(fed) == m, (rank, step, len(fed))  # one forward per microbatch
            if rank == 0:  # the bytes, in microbatch order: the whole batch
                assert [row for rows in fed for row in rows] == x, step
            else:  # activations from the stage before
                assert fed == [None] * m, (rank, step)
            assert [row for rows in scored for row in rows] == (y if rank == p - 1 else []), (rank, step)
        first, end = blocks[rank]
        per_step = blocks_per_step(claims(out), rank)
        for k in plain_steps(8, 4):
            assert per_step[k - 1] == {"forward": (end - first) * m, "recomputed": 0}, (rank, k, per_step)
    sends_only_to_its_neighbours(claims(out), p, 8)


def sends_only_to_its_neighbours(folder, p, steps):
    """What each of p stages sent in an ARGS run, counted into `folder` (claims_env) over `steps` steps: in each step
    of plain_steps, each microbatch's activations to the next stage and their gradients back (m = 2p microbatches),
    and the clip's all-reduce of one number with the stop vote's, nothing else."""
    m = 2 * p
    activation = 4 * BATCH // m * SEQ_LEN * MODEL["d_model"]  # a microbatch's (B / m, T, D), fp32
    for rank in range(p):
        counted = comms_per_step(folder, rank)
        assert len(counted) == steps
        for k in plain_steps(steps, 4):
            p2p = sorted(((op, ranks, size), n) for (op, _, ranks, size), n in counted[k - 1].items()
                         if op in ("send", "recv_"))
            want = sorted([*([(("send", (rank, rank + 1), activation), m), (("recv_", (rank, rank + 1), activation), m)]
                             if rank < p - 1 else []),
                           *([(("send", (rank, rank - 1), activation), m), (("recv_", (rank, rank - 1), activation), m)]
                             if rank > 0 else [])])
            assert p2p == want, (rank, k, counted[k - 1])
            world = tuple(range(p))
            assert only(counted[k - 1], ops={"allreduce_", "all_reduce", "broadcast_", "_allgather_base_",
                                             "_reduce_scatter_base_", "allgather_"}) == [
                (("allreduce_", "step", world, 4), 2)], (rank, k, counted[k - 1])  # the clip's norm, the stop vote
            assert only(counted[k - 1], ops={"item"}) == [
                (("item", "step", "common/harness.py:all_reduce_max", 4), 1)], (rank, k, counted[k - 1])


@pytest.mark.slow  # a 2-process launch with --compile: 10-50 s (inductor's cache cold: its C++ builds)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_compiled_stages_train_as_eager(runs, tmp_path, schedule):
    # issue 66: --compile, each stage's blocks compiled before the schedule takes the stage (4 microbatches; 1F1B
    # interleaves their forwards and backwards, GPipe runs all forwards first): the eager run's losses and weights, no
    # recompile, no graph break, the sends and receives eager between them, each stage's as the eager run's claim
    # (counted by tests/instrument/lm_claims.py alone). Both schedules on 2 stages; 4 stages run the same lines.
    eager, eager_out = runs("lm_pp", "cpu:2", "--schedule", schedule)
    counting = claims_env(tmp_path / "claims", saved=False, blocks=False)
    proc = launch("recipes/lm_pp.py", "cpu:2", *ARGS, "--schedule", schedule, "--compile", "--out-dir",
                  tmp_path / "out", env=counting)
    compiled_matches_eager(proc, eager, 2, tmp_path / "out", eager_out)
    sends_only_to_its_neighbours(tmp_path / "claims", 2, 8)


@pytest.mark.slow  # a 1-step run on 2 stages (6-10 s), and the GPipe run above
def test_activation_checkpointing_keeps_each_block_s_input_alone_on_each_stage(runs):
    # docs/lm.md's table (issue 57), counted in the recipe's own processes (tests/instrument/lm_claims.py's
    # COUNT_SAVED_DIR: what autograd saves from each microbatch's forward on a stage to the stage's next backward,
    # each storage once, parameters left out) on 2 stages under GPipe (4 microbatches of 2 sequences), step 1 with
    # and without --activation-checkpointing: nothing inside a block's forward is kept, only what lies outside the
    # blocks (stage 0: the embeddings' indices; stage 1: the final norm, the head, the loss) and each block's input
    # (B / m, T, D), per block on the stage and microbatch: under half the bytes on each stage.
    _, plain_out = runs("lm_pp", "cpu:2", "--schedule", "gpipe")
    proc, ac_out = runs("lm_pp", "cpu:2", "--schedule", "gpipe", "--activation-checkpointing", "--max-steps", 1)
    assert "activation checkpointing: 2 of 2 blocks recompute their forward in backward" in proc.stdout
    m = 4
    block_input = 4 * BATCH // m * SEQ_LEN * MODEL["d_model"]
    for rank in (0, 1):
        p, a = saved_per_step(claims(plain_out), rank)[0], saved_per_step(claims(ac_out), rank)[0]
        assert len(p) == len(a) == m, (rank, p, a)  # a backward per microbatch

        def total(backwards, key):
            return sum(backward[key] for backward in backwards)

        assert total(p, "saved_in_blocks") > 0 and total(a, "saved_in_blocks") == 0, (rank, p, a)
        blocks = MODEL["n_layer"] // 2  # on each stage
        assert total(a, "saved") == total(p, "saved") - total(p, "saved_in_blocks") + m * blocks * block_input, (
            rank, p, a)
        assert total(a, "saved") < total(p, "saved") / 2, (rank, p, a)
        print(f"stage {rank}: {total(p, 'saved')} bytes saved for backward a step, {total(a, 'saved')} with "
              "--activation-checkpointing")


@pytest.mark.slow  # a 2-step run on 2 stages: 6-10 s
def test_bf16_autocast_runs_inside_each_stage(runs):
    # --amp-dtype bf16, in the recipe's processes (tests/instrument/lm_claims.py: the dtype of each microbatch's
    # output): Stage.forward's own autocast, so the last stage's logits come out bf16; in an fp32 run, fp32.
    for flags, dtype in ((["--amp-dtype", "bf16", "--max-steps", 2], "bfloat16"), (["--schedule", "gpipe"], "float32")):
        _, out = runs("lm_pp", "cpu:2", *flags)
        scored = {line["dtype"] for line in tokens_seen(claims(out), 1) if line["where"] == "targets"}
        assert scored == {dtype}, (flags, scored)


@pytest.mark.slow  # two 2-process launches and one of 1: 20-50 s
def test_resume_is_exact_and_goes_on_with_another_number_of_stages(runs, reference, tmp_path):
    ref, _, ref_out = reference
    straight, straight_out = runs("lm_pp", "cpu:2", "--schedule", "1f1b")
    # The step-4 checkpoint written by --async-save's thread (issue 43): the same shards as dcp.save writes. The run
    # is stopped there as a scheduler stops it: SIGUSR1 to the first stage after its step 3 (tests/faults), the vote
    # stops both stages after step 4; the save in flight is written, then exit 75.
    signal_after_step_3 = {"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_SIGNAL": "0:step=3:self"}
    half = launch("recipes/lm_pp.py", "cpu:2", *ARGS, "--schedule", "1f1b", "--async-save", "--out-dir",
                  tmp_path / "same", env=signal_after_step_3)
    assert half.returncode == EX_TEMPFAIL and "RESULT" not in half.stdout, half.stdout + half.stderr[-3000:]
    assert re.search(r"^preempt: SIGUSR1: saved \S+ at step 4; exit 75", half.stdout, re.M), half.stdout
    assert re.search(r"^saved: \S+/latest\.pt at step 4 \(written in the background\)$", half.stdout, re.M), half.stdout
    shutil.copytree(tmp_path / "same", tmp_path / "other")  # the same step-4 checkpoint, for 1 stage
    resumed = launch("recipes/lm_pp.py", "cpu:2", *ARGS, "--schedule", "1f1b", "--resume", "auto",
                     "--out-dir", tmp_path / "same")
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (4, 8) and "resume: " in resumed.stdout
    assert result["val_loss"] == result_of(straight)["val_loss"]
    assert max_diff(params(tmp_path / "same" / "model.pt"), params(straight_out / "model.pt")) == 0.0  # bitwise
    assert len(list((tmp_path / "same" / "checkpoint").glob("step_*"))) == 1  # step 4's shards removed
    # 2 stages' shards read by 1 (DCP loads by name: one process, a pipeline of one stage, the microbatches a gradient
    # accumulation), another schedule and microbatch count, and blocks that are checkpoint-wrapped (parameter names
    # with _checkpoint_wrapped_module., which the state_dict helpers drop).
    other = launch("recipes/lm_pp.py", "cpu:1", *ARGS, "--activation-checkpointing", "--resume", "auto",
                   "--out-dir", tmp_path / "other", env=claims_env(tmp_path / "claims", comms=False, saved=False))
    result = result_of(other)
    assert (result["start_step"], result["pp"], result["schedule"], result["microbatches"]) == (4, 1, "gpipe", 2)
    assert "activation checkpointing: 4 of 4 blocks recompute their forward in backward" in other.stdout
    # ... and they do (tests/instrument/lm_claims.py, in the run): each block's forward again in backward, for each of
    # the 2 microbatches, in each of steps 5-8 (the first step's count also holds the stage's shape inference; before
    # them, the resume's get_state_dict stepped the fresh optimizer once, with no gradients and no forward).
    per_step = blocks_per_step(tmp_path / "claims", 0)[-4:]
    assert [s["recomputed"] for s in per_step] == [MODEL["n_layer"] * 2] * 4, per_step
    assert per_step[1:] == [{"forward": MODEL["n_layer"] * 2, "recomputed": MODEL["n_layer"] * 2}] * 3, per_step
    assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"]
    assert max_diff(params(tmp_path / "other" / "model.pt"), params(ref_out / "model.pt")) <= WEIGHTS_ATOL


# ------------------------------------------------------------------------------- the gradients
def _stage_gradients(rank, port, results):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    recipe = load_recipe("lm_pp")
    x, y = train_batch(split(read_text()[0])[0], 0, 0, 8, 16, 0, 1)
    torch.manual_seed(0)
    full = Transformer(**MODEL)  # the one-process reference: the whole batch's mean loss, then the clip
    F.cross_entropy(full(x).flatten(0, 1), y.flatten()).backward()
    want = {n: p.grad.clone() for n, p in full.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(full.parameters(), 1.0).item()
    want_clipped = {n: p.grad.clone() for n, p in full.named_parameters()}
    scale = max(g.abs().max().item() for g in want.values())
    seen = {"norm": norm}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = recipe.Stage(Transformer(**MODEL), rank, 2)
        stage, runner = recipe.pipeline(model, rank, 2, torch.device("cpu"), schedule, 4)
        runner.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None, return_outputs=False)
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        total = recipe.clip_grad_norm_across_stages(model.parameters(), 1.0).item()
        seen[schedule] = {"names": sorted(got), "total": total,
                          "grad": max((got[n] - want[n]).abs().max().item() for n in got) / scale,
                          "clipped": max((p.grad - want_clipped[n]).abs().max().item()
                                         for n, p in model.named_parameters()) / scale}
    results[rank] = seen
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: 10-30 s, mostly importing torch and this module
def test_each_stage_gets_the_full_batch_gradient_and_the_global_clip():
    got = spawn_gloo(_stage_gradients)
    norm = got[0]["norm"]
    assert norm > 2, norm  # the clip (at 1) is active: a clip by each stage's own norm would show
    for schedule in ("gpipe", "1f1b"):
        print(schedule, {rank: {k: v for k, v in got[rank][schedule].items() if k != "names"} for rank in (0, 1)})
        # The cut: the embeddings and blocks 0-1 on stage 0, blocks 2-3, the norm and the head on stage 1.
        assert got[0][schedule]["names"][:2] == ["blocks.0.attn.wk.bias", "blocks.0.attn.wk.weight"]
        assert "tok_emb.weight" in got[0][schedule]["names"] and "head.weight" in got[1][schedule]["names"]
        assert len(got[0][schedule]["names"]) + len(got[1][schedule]["names"]) == len(list(
            Transformer(**MODEL).parameters()))
        for rank in (0, 1):
            assert got[rank][schedule]["total"] == pytest.approx(norm, rel=1e-6)  # every stage sees the global norm
            assert got[rank][schedule]["grad"] <= GRAD_RTOL, (schedule, rank, got[rank][schedule])
            assert got[rank][schedule]["clipped"] <= GRAD_RTOL, (schedule, rank, got[rank][schedule])


# ------------------------------------------------------------------------------- the schedules' bubble
def test_the_measured_bubble_is_the_theorys_and_the_docstring_draws_the_tool():
    from tools import pp_schedule

    for p in (2, 4):
        for m in (2, 4, 8, 16):
            gpipe = pp_schedule.measure("gpipe", p, m)
            # Equal stages, a backward = 2 forwards: GPipe's step is (m + p - 1) x 3 units: the theory's bubble.
            assert gpipe["bubble"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m, gpipe)
            assert gpipe["time"] == 3 * (m + p - 1) and gpipe["in_flight"] == [m] * p
            if m >= p:  # 1F1B: the same bubble, and stage s holds p - s microbatches' activations, not m
                one = pp_schedule.measure("1f1b", p, m)
                assert one["bubble"] == pytest.approx(gpipe["theory"], abs=1e-12) and one["time"] == gpipe["time"]
                assert one["in_flight"] == [p - s for s in range(p)], (p, m, one)
    # The order recorded from Schedule1F1B's run: stage 1 of 2 alternates from the start.
    assert pp_schedule.executed_order("1f1b", 2, 4)[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                                           ("B", 2), ("F", 3), ("B", 3)]
    # Why the tool does not read pipeline_order: in torch 2.14.1 Schedule1F1B's lists the last stage's forwards one
    # microbatch late (F1..F4 for 4 microbatches); GPipe's agree. If this fails, torch fixed it.
    assert pp_schedule.ir_order("gpipe", 4, 8) == pp_schedule.executed_order("gpipe", 4, 8)
    ir, ran = pp_schedule.ir_order("1f1b", 2, 4), pp_schedule.executed_order("1f1b", 2, 4)
    assert ir[0] == ran[0] and [mb for kind, mb in ir[1] if kind == "F"] == [1, 2, 3, 4]
    # The recipe's docstring draws 1F1B on 2 stages x 4 microbatches: the tool's lines.
    doc = load_recipe("lm_pp").__doc__
    for line in pp_schedule.ascii_timeline("1f1b", 2, 4).splitlines()[1:]:
        assert line.strip() in doc, line


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("world", "flags", "line"), [
    (2, ["--pp", "4"], "error: --pp 4 must equal the number of processes, 2: lm_pp.py is pipeline parallel only"),
    (2, ["--microbatches", "3"], "error: --microbatches 3 must divide --batch-size 8 (every stage takes the whole "
                                 "batch, in equal pieces: the stages' buffers have one shape); try --batch-size 6"),
    (4, ["--schedule", "1f1b", "--microbatches", "2"], "error: --schedule 1f1b needs at least one microbatch per "
                                                        "stage: --microbatches 2 is below --pp 4"),
    (8, [], "error: --pp 8 stages for --n-layer 4 blocks: each stage holds at least one whole block"),
    (2, ["--microbatches", "0"], "error: --microbatches 0 must be >= 1"),
    (2, ["--n-layer", "0"], "error: --n-layer 0 must be >= 1"),  # the model's own checks (common.lm), as lm_ddp's
])
def test_bad_pp_flags_fail_with_one_line_before_any_collective(world, flags, line, capsys, monkeypatch):
    check_args_refuses("lm_pp", [*ARGS, *flags], world, line, capsys, monkeypatch)


def test_the_defaults_divide_on_any_number_of_stages():
    # The batch is 32 on any --pp (it is in every checkpoint's flags: a resume on another --pp takes the defaults);
    # the microbatches the fewest that divide it and are 2 a stage or more (2 x --pp where that divides 32).
    recipe = load_recipe("lm_pp")
    for world, microbatches in ((1, 2), (2, 4), (3, 8), (4, 8), (5, 16), (8, 16), (12, 32)):
        args = recipe.parse_args(["--n-layer", "12"])
        recipe.check_args(args, world)
        assert (args.pp, args.microbatches, args.batch_size, args.schedule) == (world, microbatches, 32, "gpipe")
    for batch, world, microbatches in ((8, 3, 8), (6, 4, 6), (5, 3, 5)):  # a batch given: 2 x --pp, or the most
        args = recipe.parse_args(["--n-layer", "8", "--batch-size", str(batch)])
        recipe.check_args(args, world)
        assert args.microbatches == microbatches, (batch, world, args.microbatches)
    assert recipe.stage_blocks(4, 3) == [(0, 1), (1, 2), (2, 4)] and recipe.stage_blocks(8, 8)[-1] == (7, 8)


@pytest.mark.slow  # a real 2-process launch: 8-15 s
def test_a_diverged_pipeline_stops_with_one_line_naming_the_last_good_checkpoint(tmp_path):
    # The loss is the last stage's alone: the check's all-reduce stops the first stage too, before step 2's save.
    diverged_run_stops_with_one_line("lm_pp", "cpu:2", ARGS, tmp_path / "out", saved_first=True)
