"""The language models' branches that no other CPU test ran (docs/gpu_only_lines.md's list, issue 66), each run as a
user meets it, on one process (`python recipes/lm_*.py`, forked warm; the branches are the same lines on any world
size) with the tests' 2-layer model:
- a --text that is not there: one line, exit 2;
- a disk that fills as the second checkpoint is written (tests/faults' FAULT_DISK_FULL): one line, exit 1, and
  latest.pt still names the first, which --resume auto goes on from, with --debug-collectives and --profile (their
  lines: the debug level before init, the profile's table at the end);
- --resume auto on a run that has ended: nothing to train, the evaluation alone, the same val_loss;
- a shard cut in half: one line, exit 2;
- lm_ddp (one file, not shards): --async-save's write seen done in the loop and waited for at the end, then the same
  resume past the end; on a slow disk, each write waited for when the next save is due;
- --compile that compiles nothing (the compiled block dropped; TORCH_COMPILE_DISABLE=1): one line, exit 2;
- a resume steps AdamW as this torch's common/lm.py chooses (fused, or foreach where fused leaks), not as the torch
  that saved the checkpoint chose (tests/instrument/lm_claims.py's ADAMW_AS plays the other torch);
- lm_ddp resumed with --compile --amp-dtype bf16: the resume's backward (DDP's bucket order) compiles the step's graph
  under the step's autocast, one training graph; resumed at the end, that graph is no recompile.
"""

import json
import re

import pytest
import torch
from conftest import REPO, instrument_env, recipe_with_one_line_edited, result_of, run_direct, run_script
from jobs import error_lines

from common import lm

TINY = ["--n-layer", 2, "--n-head", 4, "--d-model", 32, "--block-size", 32, "--seq-len", 16, "--batch-size", 8,
        "--steps", 8, "--eval-every", 2, "--val-windows", 8]
FAULTS = {"PYTHONPATH": str(REPO / "tests" / "faults")}
SHARDED = ["lm_tp", "lm_pp", "lm_fsdp_tp", "lm_moe"]


def one_error(proc, code, pattern):
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = error_lines(proc.stderr)
    assert len(said) == 1 and re.fullmatch(r"(\[rank 0\] )?error: " + pattern, said[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def step_4s_disk_is_full(out):
    """The one line (a pattern) of a run whose disk filled as step 4's shards were written in out/checkpoint."""
    return (re.escape(f"cannot write the shards in {out / 'checkpoint'}/") + r"step_4-\S+ \(.*No space left on "
            r"device.*\): " + re.escape(str(out / "checkpoint" / "latest.pt")) + r", if any, still points at the "
            r"previous ones; free some space, then --resume")


def profile_table(stdout):
    return re.search(r"^profile: ", stdout, re.M) is not None


def the_other_adamw(dtensor):
    """(this torch's AdamW implementation, the other one) for common.lm.adamw_implementation(dtensor): fused <->
    foreach, what another torch picks (ADAMW_AS plays it)."""
    here = lm.adamw_implementation(dtensor=dtensor)
    return here, {"foreach": True} if here.get("fused") else {"fused": True}


def as_the_other_torch(recipe, folder):
    """env for a resume whose common.lm.adamw_implementation picks what this torch does not (fused <-> foreach), with
    each optimizer step's fused/foreach logged into `folder` (tests/instrument/lm_claims.py), and those flags: what
    the checkpoint, written here, holds is the other."""
    _, there = the_other_adamw(dtensor=recipe in ("lm_tp", "lm_fsdp_tp"))
    return ({**instrument_env(LOG_ADAMW_DIR=folder), "ADAMW_AS": json.dumps(there)},
            {"fused": None, "foreach": None, **there})


def adamw_steps(folder):
    """Rank 0's logged optimizer steps: [[{"fused", "foreach"} of each param group], ...]."""
    return json.loads((folder / "rank0.json").read_text())["steps"]


@pytest.mark.parametrize("recipe", SHARDED)
def test_a_sharded_language_model_s_failures_are_one_line_and_a_resume_past_the_end_evaluates(recipe, tmp_path):
    out = tmp_path / "out"
    missing = run_direct(recipe, *TINY, "--text", tmp_path / "nowhere", "--out-dir", out)
    one_error(missing, 2, re.escape(f"--text {tmp_path / 'nowhere'}: no such file or folder"))
    # Step 4's save: rank 0's second shard file takes 1 kB, then ENOSPC. Every rank gets dcp.save's exception.
    full = run_direct(recipe, *TINY, "--debug-collectives", "--out-dir", out,
                      env={**FAULTS, "FAULT_DISK_FULL": "__0_0.distcp:2:1024"})
    one_error(full, 1, step_4s_disk_is_full(out))
    latest = torch.load(out / "checkpoint" / "latest.pt", weights_only=True)
    assert latest["step"] == 2
    # Resumed where common/lm.py picks the other AdamW (tests/instrument: as another torch would, the checkpoint's
    # groups saying this one's): each step runs the resuming run's (set_state_dict had put the checkpoint's back).
    env, chosen = as_the_other_torch(recipe, tmp_path / "adamw")
    resumed = run_direct(recipe, *TINY, "--resume", "auto", "--debug-collectives", "--profile", "--out-dir", out,
                         env=env)
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (2, 8) and profile_table(resumed.stdout), resumed.stdout
    steps = adamw_steps(tmp_path / "adamw")  # get_state_dict's step of the fresh optimizer, then steps 3-8
    assert len(steps) == 7 and all(group == chosen for groups in steps for group in groups), steps
    again = run_direct(recipe, *TINY, "--resume", "auto", "--out-dir", out)
    ended = result_of(again)
    assert (ended["start_step"], ended["steps"]) == (8, 8) and not re.search(r"^step=", again.stdout, re.M)
    assert ended["val_loss"] == result["val_loss"]  # the same weights, evaluated again
    shard = out / "checkpoint" / torch.load(out / "checkpoint" / "latest.pt", weights_only=True)["shards"] / \
        "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut = run_direct(recipe, *TINY, "--resume", "auto", "--out-dir", out)
    one_error(cut, 2, re.escape(f"cannot load the shards in {shard.parent} (") + r".*\): a shard file is missing or "
              r"truncated, or they hold another model")


def test_lm_ddp_waits_for_its_background_save_and_a_resume_past_the_end_evaluates(tmp_path):
    out = tmp_path / "out"
    run = run_direct("lm_ddp", *TINY, "--async-save", "--debug-collectives", "--profile", "--out-dir", out)
    result = result_of(run)
    written = re.findall(r"^saved: \S+ and model.pt at step (\d) \(written in the background\)$", run.stdout, re.M)
    assert written == ["2", "4", "6", "8"], run.stdout  # each seen done in the loop or waited for, step 8's at the end
    assert profile_table(run.stdout), run.stdout
    again = run_direct("lm_ddp", *TINY, "--resume", "auto", "--out-dir", out)
    ended = result_of(again)
    assert (ended["start_step"], ended["steps"], ended["val_loss"]) == (8, 8, result["val_loss"])
    # A slow disk (each latest.pt.tmp's open sleeps 1 s): each save is still being written when the next one is due,
    # two steps on; training waits for it there (one save in flight), and the weights are the same.
    slow = run_direct("lm_ddp", *TINY, "--async-save", "--out-dir", tmp_path / "slow",
                      env={**FAULTS, "FAULT_SLOW_WRITE": "latest.pt.tmp:1.0"})
    assert re.findall(r"^saved: \S+ and model.pt at step (\d) \(written in the background\)$", slow.stdout,
                      re.M) == ["2", "4", "6", "8"], slow.stdout
    waited = re.findall(r"^saving: \S+ and model.pt at step (\d) in the background; training waited ([\d.]+) s$",
                        slow.stdout, re.M)
    assert [step for step, _ in waited] == ["2", "4", "6", "8"] and all(float(s) >= 0.5 for _, s in waited[1:]), waited
    assert result_of(slow)["val_loss"] == result["val_loss"]


def test_lm_ddp_resumed_compiled_under_bf16_compiles_the_step_s_graph_once_and_steps_this_torch_s_adamw(tmp_path):
    out = tmp_path / "out"
    bf16 = [*TINY, "--amp-dtype", "bf16", "--out-dir", out]
    assert result_of(run_direct("lm_ddp", *bf16, "--max-steps", 2))["steps"] == 2  # latest.pt: this torch's AdamW
    env, chosen = as_the_other_torch("lm_ddp", tmp_path / "adamw")
    resumed = run_direct("lm_ddp", *bf16, "--compile", "--resume", "auto", env=env)
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (2, 8)
    steps = adamw_steps(tmp_path / "adamw")
    assert len(steps) == 6 and all(group == chosen for groups in steps for group in groups), steps
    # The resume's backward (DDP's bucket order) runs under the step's autocast: it compiles the step's one graph,
    # and the first step none of its own (outside autocast: an fp32 graph, then the bf16 one: 2). Evaluation's one.
    assert re.findall(r"^compile: (\d+) graph\(s\) in [\d.]+ s \(the first step; ", resumed.stdout, re.M) == ["1"]
    assert (result["compiled_graphs"], result["eval_graphs"], result["recompiles"]) == ([2], [1], [0]), result
    # Resumed at --steps: no step, and that backward's graph is not one compiled again during training.
    ended = run_direct("lm_ddp", *bf16, "--compile", "--resume", "auto")
    result = result_of(ended)
    assert (result["start_step"], result["steps"]) == (8, 8) and not re.search(r"^step=", ended.stdout, re.M)
    assert (result["compiled_graphs"], result["eval_graphs"], result["recompiles"]) == ([2], [1], [0]), result
    assert re.search(r"^compile: 2 graph\(s\) a rank, 1 of them for evaluation; 0 compiled again during training; ",
                     ended.stdout, re.M), ended.stdout


def test_a_compile_that_compiles_nothing_stops_with_one_line(tmp_path):
    # torch.compile(block) with its result dropped (the mistake compiling in place, block.compile(), avoids): every
    # block trains eager without an error, so harness.CompileCounts stops the run after the first step, with one line.
    # Run from a copy of lm_ddp with that one line edited (tools/gpu_only_lines.py credits the copy's other lines).
    dropped = recipe_with_one_line_edited(tmp_path, "lm_ddp", "            block.compile(dynamic=False)\n",
                                          "            torch.compile(block, dynamic=False)\n")
    proc = run_script([dropped, *TINY, "--compile", "--out-dir", tmp_path / "out"])
    one_error(proc, 2, re.escape("--compile compiled no graph in the first step: compile in place "
                                 "(module.compile()), or put the module torch.compile(module) returns back in the "
                                 "model"))
    assert re.findall(r"^step=\S+", proc.stdout, re.M) == [] and not (tmp_path / "out" / "model.pt").exists()
    # TORCH_COMPILE_DISABLE=1 makes torch.compile hand every module back as it was: said before any step.
    off = run_direct("lm_ddp", *TINY, "--compile", "--out-dir", tmp_path / "off", env={"TORCH_COMPILE_DISABLE": "1"})
    one_error(off, 2, re.escape("torch.compile is switched off in this environment (TORCH_COMPILE_DISABLE=1): unset "
                                "it to compile"))
    assert "step=" not in off.stdout


def test_lm_fsdp_tp_stops_on_sigusr1_with_exit_75_and_resumes_to_the_same_weights(tmp_path):
    # The scheduler's warning (tests/faults: SIGUSR1 to the rank after its step 3): the vote stops it after step 4,
    # saved; exit 75 (requeue me). lm_fsdp_tp's multi-rank runs are shared by its claims tests, which a stop would
    # change: its exit's lines are the same on one process. --resume auto then ends where the run never stopped ends.
    straight = run_direct("lm_fsdp_tp", *TINY, "--out-dir", tmp_path / "straight")
    stopped = run_direct("lm_fsdp_tp", *TINY, "--out-dir", tmp_path / "stopped",
                         env={**FAULTS, "FAULT_SIGNAL": "0:step=3:self"})
    assert stopped.returncode == 75 and "RESULT" not in stopped.stdout, stopped.stdout + stopped.stderr[-3000:]
    assert re.search(r"^preempt: SIGUSR1: saved \S+ at step 4; exit 75", stopped.stdout, re.M), stopped.stdout
    resumed = run_direct("lm_fsdp_tp", *TINY, "--resume", "auto", "--out-dir", tmp_path / "stopped")
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (4, 8)
    assert result["val_loss"] == result_of(straight)["val_loss"]
    saved, whole = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("stopped", "straight"))
    assert all(torch.equal(saved[k], whole[k]) for k in whole) and saved.keys() == whole.keys()


def test_a_background_save_that_fills_the_disk_is_one_line_and_latest_keeps_the_last_whole_one(tmp_path):
    # --async-save: step 4's shards are written by a thread while training goes on, and the disk fills as rank 0's
    # file is written; the failure reaches the loop when the save is next looked at (ShardFolders.finish_async): the
    # same one line, exit 1, and latest.pt still names step 2's shards, written whole.
    out = tmp_path / "out"
    full = run_direct("lm_tp", *TINY, "--async-save", "--out-dir", out,
                      env={**FAULTS, "FAULT_DISK_FULL": "__0_0.distcp:2:1024"})
    one_error(full, 1, step_4s_disk_is_full(out))
    latest = torch.load(out / "checkpoint" / "latest.pt", weights_only=True)
    assert latest["step"] == 2 and (out / "checkpoint" / latest["shards"] / ".metadata").is_file()
