"""recipes/lm_tp.py (tensor parallel, sequence parallel, loss_parallel) trains the one-process model: the same run of
recipes/lm_ddp.py on 1 process is the reference, launched once. On 2 and 4 ranks, with and without
--sequence-parallel, measured on 2 CPU cores (torch 2.14.1, gloo, fp32, 8 steps of a 2-layer model):
- val_loss: equal to the reference's to the RESULT line's 6 decimals (< 1e-7 relative); asserted at 2e-6 relative.
- the printed step lines (train_loss, val_loss, val_bpb, lr at 4 decimals): equal; asserted within one unit of the
  last printed digit, as a value 1e-7 away can round the other way.
- model.pt: at most 4.4e-6 from the reference's, asserted at 1e-5. Not tighter because of AdamW: a gradient that is
  zero in exact arithmetic (wk's bias: softmax ignores a constant added to every key's score; some coordinates of
  position 0's embedding) is rounding noise in both runs, and AdamW divides it by its own RMS (plus eps 1e-8),
  moving that weight in a direction the noise picks (wk's bias: 3e-6 apart, where the reference moved it 2.4e-6).
  The other tensors agree to 1e-8 .. 1.5e-6.
  The clip is active (the gradient norm is 2.9-5 in these steps, above --clip-grad 1): a local norm would show.
- state_bytes_per_rank: exactly the slices (parameters, gradients, AdamW's two moments) plus the replicated norms and
  row-parallel biases: 346772 bytes a rank on 2, 177044 on 4, against lm_ddp's 686228 (the embeddings' gradients
  come back whole on every rank: without grads_as_params, 365204 and 204692).
- tp 3 (--n-head 3 --d-model 24, against lm_ddp with the same): 256 bytes and 32 positions do not divide by 3;
  DTensor cuts them 86, 86, 84 and 11, 11, 10, and every check above holds at the same tolerances (val_loss equal to
  6 decimals, model.pt 3.2e-6 apart; state bytes 151316, 151316, 149396).
- resume: --max-steps 4, then --resume auto on the same ranks gives the uninterrupted run's model.pt bitwise; the same
  checkpoint resumed on 4 ranks without --sequence-parallel, with --activation-checkpointing (DCP reshards), gives
  the reference's weights to 1e-5 (measured 1.5e-7).
- what each rank saves for backward a step (tests/instrument/lm_claims.py's COUNT_SAVED_DIR, in the runs): 435396
  bytes on 2 ranks, 391876 with --sequence-parallel (43520 fewer: each norm's input, mean and rstd cut in half by
  the sequence); on 4 ranks 303300, and 101572 with --activation-checkpointing (the resume's steps 5-8).
"""

import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import launch, load_recipe, max_diff, params, result_of, spawn_gloo
from jobs import error_lines
from lm_checks import (
    blocks_per_step,
    check_args_refuses,
    claims_env,
    comms_per_step,
    compiled_matches_eager,
    diverged_run_stops_with_one_line,
    kept_at_the_defaults,
    killed_while_saving_resumes_bitwise,
    killed_while_writing_model_pt_leaves_the_last_one,
    one_process_val_loss,
    only,
    plain_steps,
    saved_per_step,
    step_lines,
    stops_and_resumes_bitwise,
    tokens_seen,
)

from common.lm import Transformer, read_text, split, train_batch, val_windows
from tools.lm_bench import comm_table

MODEL = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 32}
TP3_MODEL = {**MODEL, "n_head": 3, "d_model": 24}  # tp 3 divides the heads and the MLP, not 256 bytes or 32 positions
ARGS = ["--n-layer", 2, "--n-head", 4, "--d-model", 32, "--block-size", 32, "--seq-len", 16, "--batch-size", 8,
        "--steps", 8, "--eval-every", 4, "--val-windows", 8]
VAL_RTOL = 2e-6  # measured: equal to 6 decimals (< 1e-7)
WEIGHTS_ATOL = 1e-5  # measured: 4.4e-6 at most (AdamW on gradients that are zero in exact arithmetic; see above)
PRINTED_ATOL = 1.01e-4  # one unit of the printed 4th decimal
STEP = {"n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": 16, "batch": 4,  # tools.lm_bench.step_collectives
        "layouts": ["lm_ddp", "lm_tp", "lm_tp --sequence-parallel"]}
UNRESOLVED = "could not be resolved"  # parallelize_module's warning for a plan key that names no module: it only warns


def expected_state_bytes(tp, model=MODEL):
    """Per rank: parameters, gradients and AdamW's exp_avg and exp_avg_sq (4 fp32 copies) of the rank's slices, the
    norms and the row-parallel layers' biases whole (Replicate), plus AdamW's 4-byte step counter per parameter. A
    dimension tp does not divide (the 256 bytes of the embedding and the head, the positions of --block-size, on 3
    ranks) is cut as DTensor's Shard cuts it (torch.chunk's way): ceil(n / tp) rows a rank, the last ranks what is
    left (256 on 3: 86, 86, 84)."""
    net = Transformer(**model)
    cut_dim = {"tok_emb.weight": 0, "pos_emb.weight": 0, "head.weight": 0}  # RowwiseParallel embeddings; the head
    for name, _ in net.named_parameters():
        if name.endswith(("wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "fc.weight",
                          "fc.bias")):
            cut_dim[name] = 0  # ColwiseParallel: by output
        elif name.endswith(("wo.weight", "proj.weight")):
            cut_dim[name] = 1  # RowwiseParallel: by input (its bias whole)
    per_rank = []
    for rank in range(tp):
        held = 0
        for name, param in net.named_parameters():
            if name not in cut_dim:
                held += param.numel()
                continue
            n = param.shape[cut_dim[name]]
            chunk = -(-n // tp)
            held += max(0, min(chunk, n - rank * chunk)) * param.numel() // n
        per_rank.append(16 * held + 4 * len(list(net.parameters())))
    return per_rank


COUNTED = {("lm_tp", "cpu:2"), ("lm_tp", "cpu:2", "--sequence-parallel")}  # the runs whose collectives a test reads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """launch(devices, *flags) once per (devices, flags) in this module: (the CompletedProcess, its --out-dir)."""
    done = {}

    def run(recipe, devices, *flags):
        key = (recipe, devices, *map(str, flags))
        if key not in done:
            out = tmp_path_factory.mktemp(re.sub(r"\W+", "_", "-".join(key)))
            # What each rank computes and sends, logged by tests/instrument/lm_claims.py into claims(out).
            done[key] = (launch(f"recipes/{recipe}.py", devices, *ARGS, *flags, "--out-dir", out,
                                env=claims_env(claims(out), comms=key in COUNTED)), out)
        return done[key]

    return run


def claims(out):
    """Where runs() logs a run's tokens, block forwards, collectives (tests/lm_checks.py's claims_env) and what
    autograd saves (COUNT_SAVED_DIR)."""
    return out.with_name(f"{out.name}_claims")


@pytest.fixture(scope="module")
def reference(runs):
    proc, out = runs("lm_ddp", "cpu:1")
    return result_of(proc), step_lines(proc.stdout), out


SLOW = pytest.mark.slow  # about 20 s each on 2 cores (4 ranks on 2 cores: 25 s); the first also runs the reference


def trains_the_one_process_model(runs, devices, flags, model, sp):
    """lm_tp on `devices` with ARGS and `flags` (and --sequence-parallel if `sp`) against lm_ddp on 1 process with the
    same: the RESULT keys, val_loss, the printed step lines, model.pt (and one process scoring it), each rank's state
    bytes, the checkpoint folder. Returns (the largest weight difference, val_loss's relative difference)."""
    ref_proc, ref_out = runs("lm_ddp", "cpu:1", *flags)
    ref, ref_lines = result_of(ref_proc), step_lines(ref_proc.stdout)
    proc, out = runs("lm_tp", devices, *flags, *(["--sequence-parallel"] if sp else []))
    result = result_of(proc)
    tp = int(devices.split(":")[1])
    assert (result["recipe"], result["world_size"], result["tp"], result["sequence_parallel"]) == ("lm_tp", tp, tp, sp)
    assert set(ref) | {"tp", "sequence_parallel"} == set(result)  # lm_ddp's keys, and these two
    assert UNRESOLVED not in proc.stderr and "Parallelize plan key" not in proc.stderr  # every plan key matched
    assert result["steps"] == ref["steps"] == 8 and result["val_windows"] == ref["val_windows"]
    assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"], (result["val_loss"], ref)
    lines = step_lines(proc.stdout)
    assert sorted(lines) == sorted(ref_lines) == [4, 8]
    for step, values in lines.items():
        for key, value in values.items():
            assert abs(value - ref_lines[step][key]) <= PRINTED_ATOL * max(1.0, abs(value)), (step, key, value)
    weights = max_diff(params(out / "model.pt"), params(ref_out / "model.pt"))
    assert weights <= WEIGHTS_ATOL
    # model.pt is the full model: one process scores it as the run did (every rank, all windows, loss_parallel).
    one_process = one_process_val_loss(out / "model.pt", model, 16, 8)
    assert abs(one_process - result["val_loss"]) <= VAL_RTOL * result["val_loss"]
    # Each rank holds its slices only (gradients included: the embeddings' come back whole and are cut again).
    assert ref["state_bytes_per_rank"] == expected_state_bytes(1, model)
    assert result["state_bytes_per_rank"] == expected_state_bytes(tp, model)
    assert max(result["state_bytes_per_rank"]) < ref["state_bytes_per_rank"][0]
    saved = sorted(p.name for p in (out / "checkpoint").iterdir())  # latest.pt and the last save's shards only
    assert len(saved) == 2 and saved[0] == "latest.pt" and saved[1].startswith("step_8-"), saved
    return weights, abs(result["val_loss"] - ref["val_loss"]) / ref["val_loss"]


@pytest.mark.parametrize(("devices", "sp"), [("cpu:2", False), pytest.param("cpu:2", True, marks=SLOW),
                                             pytest.param("cpu:4", False, marks=SLOW),
                                             pytest.param("cpu:4", True, marks=SLOW)])
def test_tensor_parallel_trains_the_one_process_model(runs, devices, sp):
    trains_the_one_process_model(runs, devices, [], MODEL, sp)
    assert len(set(expected_state_bytes(int(devices.split(":")[1])))) == 1  # tp divides every cut dimension here


@SLOW  # two launches, of 1 process and of 3: 25-40 s
def test_tensor_parallel_on_3_ranks_cuts_the_bytes_and_positions_unevenly(runs):
    # The docstring's `lm_tp.py 0,1,3 --n-head 6 --d-model 192`, small: 3 heads of 8, an MLP of 96 (3 divides both),
    # where the 256 bytes of the embedding and the head and the 32 positions are cut 86, 86, 84 and 11, 11, 10
    # (DTensor's Shard: ceil-sized pieces first). The same checks as above, at the same tolerances; measured: val_loss
    # equal to the RESULT line's 6 decimals, model.pt 3.2e-6 from lm_ddp's (wk's bias, as above), the step lines equal,
    # and each rank's state bytes its own slices': 151316, 151316 and 149396.
    weights, val = trains_the_one_process_model(runs, "cpu:3", ["--n-head", 3, "--d-model", 24], TP3_MODEL, False)
    print(f"tp 3: model.pt {weights:.2e} from lm_ddp's, val_loss {val:.1e} relative")
    # the uneven slices, from the run's own RESULT line: rank 2 holds less
    assert result_of(runs("lm_tp", "cpu:3", "--n-head", 3, "--d-model", 24)[0])["state_bytes_per_rank"] == [
        151316, 151316, 149396] == expected_state_bytes(3, TP3_MODEL)


@SLOW  # two 1-step runs of the default model on 2 processes: 8-15 s
def test_sequence_parallel_at_the_defaults_keeps_77_mib_where_86_were(tmp_path):
    # docs/lm.md's figures, in the recipe's own processes at its defaults (every rank the whole batch of 32 sequences
    # of 128 bytes, half of each block's heads and MLP): 86.5 MiB kept for backward a rank without
    # --sequence-parallel, 77.3 MiB with it, the difference all outside attention and the MLP's cut layers.
    whole, cut = kept_at_the_defaults("lm_tp", tmp_path, "--sequence-parallel")
    assert round(whole[0] / 2**20, 1) == 86.5 and round(cut[0] / 2**20, 1) == 77.3


@SLOW  # a 2-process launch with --compile: 15-50 s (inductor's cache cold: its C++ builds)
@pytest.mark.parametrize("flags", [["--sequence-parallel"], []], ids=["sp", "plain"])
def test_compiled_blocks_trace_the_slices_collectives_and_train_as_eager(runs, tmp_path, flags):
    # issue 66: --compile after parallelize_module, with --sequence-parallel (each block's all-gathers and
    # reduce-scatters inside its graph) and without (the all-reduce of wo's and proj's partial sums inside it): the
    # eager run's losses and weights, no recompile, no graph break. The plan's two programs, on 2 processes; 4 and 3
    # (uneven slices) run the same lines. And the collectives the compiled blocks run (tests/instrument/lm_claims.py,
    # counting alone; inductor's in-place all_reduce_ counted as the all_reduce it replaces): each step's, by kind,
    # phase, group and bytes, the eager run's.
    eager, eager_out = runs("lm_tp", "cpu:2", *flags)
    counting = claims_env(tmp_path / "claims", saved=False, blocks=False)
    proc = launch("recipes/lm_tp.py", "cpu:2", *ARGS, *flags, "--compile", "--out-dir", tmp_path / "out",
                  env=counting)
    compiled_matches_eager(proc, eager, 2, tmp_path / "out", eager_out)
    for rank in (0, 1):
        compiled, plain = comms_per_step(tmp_path / "claims", rank), comms_per_step(claims(eager_out), rank)
        assert len(compiled) == len(plain) == 8
        for k in plain_steps(8, 4):
            assert plain[k - 1] and compiled[k - 1] == plain[k - 1], (rank, k, compiled[k - 1], plain[k - 1])


@SLOW
def test_a_stop_on_sigusr1_resumes_bitwise(runs, tmp_path):
    # Issue 43's drill (tests/lm_checks.py): rank 0 alone gets SIGUSR1; both ranks save their DCP shards at the agreed
    # step, latest.pt names them, exit 75; resumed, the weights equal the straight run's above, bitwise. With
    # --async-save: the stop's save (and step 4's, if still in flight) is written before exit 75, and model.pt too.
    _, out = runs("lm_tp", "cpu:2")
    stops_and_resumes_bitwise("lm_tp", "cpu:2", [*ARGS, "--async-save"], tmp_path, out, 8)


@SLOW
def test_a_crash_while_an_async_save_writes_leaves_the_last_checkpoint_to_resume_from(runs, tmp_path):
    # Issue 43, --async-save (tests/lm_checks.py): dcp.async_save's thread writes step 4's shards while steps 5-8
    # train; the job is killed as it opens rank 0's shard of step 8: latest.pt names step 4's shards, whole, and the
    # half folder (no .metadata: DCP writes it last) is removed by the resumed run's next save.
    _, out = runs("lm_tp", "cpu:2")
    killed_while_saving_resumes_bitwise("lm_tp", "cpu:2", ARGS, tmp_path, out, "__0_0.distcp", "checkpoint/latest.pt")
    pointer = torch.load(tmp_path / "checkpoint/latest.pt", weights_only=True)
    assert pointer["step"] == 8 and (tmp_path / "checkpoint" / pointer["shards"] / ".metadata").exists()
    assert [d.name for d in (tmp_path / "checkpoint").glob("step_*")] == [pointer["shards"]]


@SLOW  # the drill takes the real path (torchrun, new interpreters): 20-30 s; and the 4-step run
def test_a_kill_while_model_pt_is_written_leaves_the_last_model_pt_whole(runs, tmp_path):
    # Issue 58 (tests/lm_checks.py): after each save's DCP shards and latest.pt, rank 0 writes the gathered model.pt
    # (steps 4 and 8); the job is SIGKILLed after the first write() to step 8's (save_atomic's model.pt.tmp).
    # model.pt is step 4's, bitwise the 4-step run's: measured 0 apart; with a plain torch.save(full, model.pt) it
    # does not load (a truncated zip archive).
    _, half_out = runs("lm_tp", "cpu:2", "--sequence-parallel", "--max-steps", 4)
    killed_while_writing_model_pt_leaves_the_last_one("lm_tp", "cpu:2", [*ARGS, "--sequence-parallel"], tmp_path,
                                                      MODEL, half_out)


@pytest.mark.slow
def test_resume_is_exact_and_dcp_reshards_onto_another_tp(runs, reference, tmp_path):
    ref, _, ref_out = reference
    straight, straight_out = runs("lm_tp", "cpu:2", "--sequence-parallel")
    half, half_out = runs("lm_tp", "cpu:2", "--sequence-parallel", "--max-steps", 4)  # shared with the kill below
    assert result_of(half)["steps"] == 4
    shutil.copytree(half_out, tmp_path / "same")
    shutil.copytree(half_out, tmp_path / "other")  # the same step-4 checkpoint, for 4 ranks
    resumed = launch("recipes/lm_tp.py", "cpu:2", *ARGS, "--sequence-parallel", "--resume", "auto",
                     "--out-dir", tmp_path / "same")
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (4, 8) and "resume: " in resumed.stdout
    assert result["val_loss"] == result_of(straight)["val_loss"]
    assert max_diff(params(tmp_path / "same" / "model.pt"), params(straight_out / "model.pt")) == 0.0  # bitwise
    assert [p.name for p in (tmp_path / "same" / "checkpoint").glob("step_*")][0].startswith("step_8-")
    assert len(list((tmp_path / "same" / "checkpoint").glob("step_*"))) == 1  # step 4's shards removed
    # 2 ranks' slices (norms Replicate DTensors) loaded by 4 ranks whose norms are plain tensors, and whose blocks
    # are checkpoint-wrapped (parameter names with _checkpoint_wrapped_module., which the state_dict helpers drop).
    other = launch("recipes/lm_tp.py", "cpu:4", *ARGS, "--activation-checkpointing", "--resume", "auto",
                   "--out-dir", tmp_path / "other",
                   env=claims_env(tmp_path / "claims", comms=False))
    result = result_of(other)
    assert (result["start_step"], result["tp"], result["sequence_parallel"]) == (4, 4, False)
    assert "activation checkpointing: 2 of 2 blocks recompute their forward in backward" in other.stdout
    # ... and they do (tests/instrument/lm_claims.py, in the run): each block's forward again in backward, in each of
    # steps 5-8 (before them, the resume's get_state_dict stepped the fresh optimizer once, with no forward).
    for rank in range(4):
        assert blocks_per_step(tmp_path / "claims", rank)[-4:] == [
            {"forward": MODEL["n_layer"], "recomputed": MODEL["n_layer"]}] * 4, rank
    # What autograd keeps for backward in steps 5-8 (lm_claims.py's COUNT_SAVED_DIR, each rank), against the straight
    # run on 4 ranks without checkpointing (the same batches): nothing inside a block's forward, only what lies
    # outside the blocks and each block's input, a Replicate (B, T, D) whole on every rank: under half the bytes.
    _, plain_out = runs("lm_tp", "cpu:4")
    block_input = 4 * 8 * 16 * MODEL["d_model"]
    for rank in range(4):
        plain = saved_per_step(claims(plain_out), rank)[4:8]
        ac = saved_per_step(tmp_path / "claims", rank)[-4:]
        for k, ([p], [a]) in enumerate(zip(plain, ac, strict=True), 5):  # one backward a step
            assert p["saved_in_blocks"] > 0 and a["saved_in_blocks"] == 0, (rank, k, p, a)
            assert a["saved"] == p["saved"] - p["saved_in_blocks"] + MODEL["n_layer"] * block_input, (rank, k, p, a)
            assert a["saved"] < p["saved"] / 2, (rank, k, p, a)
    print(f"lm_tp on 4 ranks: {p['saved']} bytes saved for backward a rank, {a['saved']} with "
          "--activation-checkpointing")
    assert abs(result["val_loss"] - ref["val_loss"]) <= VAL_RTOL * ref["val_loss"]
    assert max_diff(params(tmp_path / "other" / "model.pt"), params(ref_out / "model.pt")) <= WEIGHTS_ATOL


# ------------------------------------------------------------------------------- the collectives
@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=SLOW)])
def test_every_rank_computes_the_whole_batch_and_each_step_sends_what_the_docstring_draws(runs, sp):
    # docs/lm.md's table for lm_tp (issue 57), measured in the recipe's own processes on the conformance runs above
    # (tests/instrument/lm_claims.py): the token windows each rank's model received, and each step's collectives by
    # kind, group, phase and bytes (DTensor's, as they run).
    proc, out = runs("lm_tp", "cpu:2", *(["--sequence-parallel"] if sp else []))
    n_layer, seq_len, batch, d = MODEL["n_layer"], 16, 8, MODEL["d_model"]
    train, val = split(read_text()[0])
    windows = val_windows(val, seq_len, 8)[0].tolist()
    for rank in (0, 1):
        lines = tokens_seen(claims(out), rank)
        for step in range(8):  # computes: every rank the whole batch of step k (no data parallelism)
            whole = train_batch(train, step, 0, batch, seq_len, 0, 1)[0].tolist()
            assert [line["rows"] for line in lines if line["train"] and line["step"] == step] == [whole], step
        assert [row for line in lines if not line["train"] and line["step"] == 4 for row in line["rows"]] == windows
    activation, positions = 4 * batch * seq_len * d, 4 * seq_len * d  # fp32 (B, T, D) and (T, D)
    cut = len(Transformer(**MODEL).blocks) * 2 + 1  # wo and proj per block, the token embedding (or the head's input)
    params = len(list(Transformer(**MODEL).parameters()))
    for rank in (0, 1):
        steps = comms_per_step(claims(out), rank)
        for k in plain_steps(8, 4):
            step = steps[k - 1]
            if not sp:  # per block 2 all-reduces forward (wo, proj), 2 in backward (attention's and the MLP's input)
                assert only(step, "forward") == [(("all_reduce", "forward", (0, 1), positions), 1),
                                                 (("all_reduce", "forward", (0, 1), activation), cut)], (k, step)
                assert only(step, "backward") == [(("all_reduce", "backward", (0, 1), activation), cut)], (k, step)
            else:  # each all-reduce a reduce-scatter of the same bytes, then an all-gather of a rank's positions
                assert only(step, "forward") == [
                    (("all_gather_into_tensor", "forward", (0, 1), activation // 2), cut),
                    (("reduce_scatter_tensor", "forward", (0, 1), positions), 1),
                    (("reduce_scatter_tensor", "forward", (0, 1), activation), cut)], (k, step)
                assert only(step, "backward") == [
                    (("all_gather_into_tensor", "backward", (0, 1), positions // 2), 1),
                    (("all_gather_into_tensor", "backward", (0, 1), activation // 2), cut),
                    (("reduce_scatter_tensor", "backward", (0, 1), activation), cut)], (k, step)
            # the loss inside loss_parallel(): 3 all-reduces of a float per position (no rank holds all 256 logits);
            # the clip: one all-reduce of each parameter's local norm; with SP each norm's gain and bias gradient
            # all-reduced once (grads_as_params); the stop vote; no host read but its ballot
            norms = [(("all_reduce", "step", (0, 1), 4 * d), 2 * (2 * n_layer + 1))] if sp else []
            assert only(step, "step") == sorted([
                (("all_reduce", "step", (0, 1), 4 * batch * seq_len), 3),
                (("all_reduce", "step", (0, 1), 4 * params), 1), *norms, (("allreduce_", "step", (0, 1), 4), 1),
                (("item", "step", "common/harness.py:all_reduce_max", 4), 1)]), (k, step)
        assert blocks_per_step(claims(out), rank) == [{"forward": n_layer, "recomputed": 0}] * 8


@SLOW  # the conformance runs above, shared
def test_sequence_parallel_cuts_the_norms_activations_each_rank_saves_for_backward(runs):
    # docs/lm.md's table for lm_tp --sequence-parallel (issue 57), counted in the recipe's own processes
    # (tests/instrument/lm_claims.py's COUNT_SAVED_DIR: what autograd saves from each training forward's start to its
    # backward, each storage once, a DTensor's local shard, parameters left out) on the 2-rank runs with and without
    # it: the same model and batches. Sequence parallelism cuts what lies between the cut layers along the sequence:
    # each LayerNorm (2 a block, and the final one) keeps its (B, T / tp, D) input and its mean and rstd (B, T / tp)
    # instead of (B, T, D) and (B, T); the cut layers' inputs are all-gathered whole, and kept so, as without it.
    _, plain_out = runs("lm_tp", "cpu:2")
    _, sp_out = runs("lm_tp", "cpu:2", "--sequence-parallel")
    batch, seq_len, d, tp = 8, 16, MODEL["d_model"], 2
    norms = 2 * MODEL["n_layer"] + 1
    fall = norms * 4 * batch * (seq_len - seq_len // tp) * (d + 2)  # fp32: the input's D floats, mean and rstd
    for rank in (0, 1):
        plain, sp = saved_per_step(claims(plain_out), rank), saved_per_step(claims(sp_out), rank)
        assert len(plain) == len(sp) == 8
        for k, ([p], [s]) in enumerate(zip(plain, sp, strict=True), 1):  # one backward a step
            assert s["saved"] < p["saved"], (rank, k, p, s)
            assert p["saved"] - s["saved"] == fall, (rank, k, p, s)
            assert s["grads"] == p["grads"], (rank, k, p, s)  # the same slices' gradients (grads_as_params after)
    print(f"lm_tp on 2 ranks: {plain[-1][0]['saved']} bytes saved for backward a rank, {sp[-1][0]['saved']} with "
          "--sequence-parallel")


def _count_collectives(rank, port, results):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    recipe = load_recipe("lm_tp")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    counts = {}
    for sp in (False, True):
        for n_layer in (1, 2):
            torch.manual_seed(0)
            model = parallelize_module(Transformer(n_layer, 4, 32, 32), mesh, recipe.tp_plan(sp), src_data_rank=0)
            x = torch.randint(0, 256, (2, 16))
            forward, backward = CommDebugMode(), CommDebugMode()
            with forward:
                logits = model(x)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
                with backward:
                    loss.backward()
            counts[(sp, n_layer)] = [{str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
                                     for mode in (forward, backward)]
    from tools.lm_bench import step_collectives

    results[rank] = counts, step_collectives(rank, **STEP)[0]  # and one whole step's, with their bytes (profiler)
    dist.destroy_process_group()


@pytest.mark.slow  # 30 s: two spawned processes import torch and this module; the work itself takes 3 s
def test_each_block_costs_the_collectives_the_docstring_draws():
    counts, steps = spawn_gloo(_count_collectives)[0]

    def per_block(sp):  # a second block's collectives: the difference between 2 layers and 1
        return [{op: two[op] - one.get(op, 0) for op in two}
                for one, two in zip(counts[(sp, 1)], counts[(sp, 2)], strict=True)]

    # Without SP: wo's and proj's all-reduce forward; attention's and the MLP's input gradients in backward (one
    # each: PrepareModuleInput makes q, k and v share one input, whose gradients are summed before the all-reduce).
    assert per_block(False) == [{"all_reduce": 2}, {"all_reduce": 2}]
    # With SP: each all-reduce is a reduce-scatter, then an all-gather before attention and the MLP; backward mirrors.
    assert per_block(True) == [{"reduce_scatter_tensor": 2, "all_gather_into_tensor": 2}] * 2
    # Around the blocks, one layer: 2 embeddings forward; the head's input gradient backward (SP: and its gather).
    assert counts[(False, 1)] == [{"all_reduce": 4}, {"all_reduce": 3}]
    assert counts[(True, 1)] == [{"reduce_scatter_tensor": 4, "all_gather_into_tensor": 3},
                                 {"reduce_scatter_tensor": 3, "all_gather_into_tensor": 4}]
    # Bytes, per rank, of a whole step (tools/lm_bench.py --comm's table, at this size): DDP all-reduces every
    # gradient once; TP's activations; SP moves the same bytes as TP (ring: an all-reduce is a reduce-scatter then an
    # all-gather) plus the norms' gradients, all-reduced by grads_as_params.
    model = Transformer(STEP["n_layer"], STEP["n_head"], STEP["d_model"], 2 * STEP["seq_len"])
    norms = sum(p.numel() for n, p in model.named_parameters() if ".ln" in n or n.startswith("ln_f"))
    table = comm_table(steps)
    assert steps["lm_ddp"] and {op for op, _ in steps["lm_ddp"]} == {"all-reduce"}
    assert table["lm_ddp"][1] == 4 * sum(p.numel() for p in model.parameters())  # fp32, each gradient once
    logits_stats = 4 * STEP["batch"] * STEP["seq_len"]  # loss_parallel: a float per position, 3 all-reduces
    assert [size for _, size in steps["lm_tp"]].count(logits_stats) == 3
    assert table["lm_tp --sequence-parallel"][2] - table["lm_tp"][2] == 4 * norms  # ring: 2 (n-1)/n = 1 on 2 ranks


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("world", "flags", "line"), [
    (2, ["--tp", "4"], "error: --tp 4 must equal the number of processes, 2: lm_tp.py is tensor parallel only"),
    (4, ["--tp", "4", "--n-head", "2"], "error: --tp 4 must divide --n-head 2 and the MLP width 4 x --d-model = 128"),
    (2, ["--sequence-parallel", "--seq-len", "15"],
     "error: --sequence-parallel cuts each sequence into --tp 2 equal pieces: --seq-len 15 must be a multiple of 2"),
])
def test_bad_tp_flags_fail_with_one_line_before_any_collective(world, flags, line, capsys, monkeypatch):
    check_args_refuses("lm_tp", [*ARGS, *flags], world, line, capsys, monkeypatch)


def test_a_tp_that_is_not_the_world_size_stops_a_real_launch_with_one_line(tmp_path):
    proc = launch("recipes/lm_tp.py", "cpu:2", *ARGS, "--tp", 4, "--out-dir", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert [line.split(": lm_tp.py")[0] for line in error_lines(proc.stderr)] == [
        "error: --tp 4 must equal the number of processes, 2"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow  # a real 2-process launch: 15 s
def test_a_diverged_tensor_parallel_run_stops_with_one_line_naming_the_last_good_checkpoint(tmp_path):
    diverged_run_stops_with_one_line("lm_tp", "cpu:2", ARGS, tmp_path / "out", saved_first=True)


@pytest.mark.slow  # two spawned processes: 15 s
def test_activation_bytes_per_rank_fall_with_sequence_parallel_and_checkpointing():
    # tools/lm_bench.py --activations at a small size: what each rank keeps for backward (saved_tensors_hooks, each
    # storage once). Tensor parallelism cuts attention's and the MLP's insides; sequence parallelism also the residual
    # stream and the norms; checkpointing keeps each block's input alone. At the defaults (docs/benchmarks.md):
    # 68.3 MiB per DDP rank of 16 sequences, 86.5 per TP rank of all 32, 77.3 with SP, 9.1 with both.
    from functools import partial

    from tools.lm_bench import activations_per_rank

    got = spawn_gloo(partial(activations_per_rank, n_layer=2, n_head=4, d_model=32, seq_len=16, batch=8))
    assert got[0] == got[1]
    b = got[0]
    assert b["lm_tp --sequence-parallel"] < b["lm_tp"]
    assert b["lm_tp --sequence-parallel"] < 2 * b["lm_ddp"]  # per sequence: a TP rank takes all 8, a DDP rank 4
    assert b["lm_ddp --activation-checkpointing"] < b["lm_ddp"] / 2
    assert b["lm_tp --sequence-parallel --activation-checkpointing"] < b["lm_tp --sequence-parallel"] / 2
