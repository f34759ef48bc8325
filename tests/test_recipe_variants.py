"""The sibling recipes: ddp_launch, ddp_spawn, torch_amp, ddp_checkpoint (real gloo runs on CPU)."""

import ast
import json
import re
import shutil
import subprocess
import sysconfig
import time

import pytest
import torch
from conftest import (
    RECIPES,
    REPO,
    as_if_saved_on_gpu,
    ddp_counts,
    epoch_lines,
    launch,
    load_recipe,
    make_imagefolder,
    params,
    recipe_with_one_line_edited,
    replayed,
    result_of,
    rng_env,
    rng_streams,
    run_direct,
    scaler_resumed_from,
)
from jobs import error_lines

from common.models import build_model

TINY = ["--arch", "tiny", "--workers", "0"]


# ----------------------------------------------------------------------------------- siblings


# `diff BASE RECIPE | grep -c '^[<>]'` as it is now: the bounds are the counts. docs/recipe_shape.md has the table, with
# the counts before the harness moved out of the recipes (c0965cd: dp 148, ddp_launch 48, ddp_spawn 152, torch_amp 217,
# ddp_checkpoint 142, apex_ddp 72, apex_amp 304, mx_face_prefetch 153, fsdp 279). A change to ddp_torchrun.py that its
# siblings share keeps them; a lesson that grows raises its own bound here, with the reason.
# --sync-bn (issue 26) is in the flagship, its launcher siblings, torch_amp, ddp_checkpoint, ddp_compile and apex_ddp;
# dp (DataParallel: no process group), apex_amp, mx_face_prefetch, fsdp and ddp_uneven lack its 3 lines.
# --debug-collectives (issue 42): 2 lines before init_process_group in every recipe with a process group, and DDP's
# process_group= (a line of its own where the DDP call is indented deeper or has another keyword: apex_ddp, apex_amp,
# ddp_compile, ddp_uneven, +1 each); dp has neither (+4).
# --profile and own_ms (issue 42): the same 7 lines in every recipe; speed.watch() times the data wait alone where the
# forward is compiled or waits for other ranks (dp, ddp_compile, fsdp, lm_tp, lm_fsdp_tp: +2 each, +1 against lm_tp),
# none in lm_pp (+1, why), dp's table is no collective (+2); ddp_uneven and torch_amp: diff aligns the loop 2 lines off;
# apex_amp, mx_face_prefetch and ddp_uneven have no --sync-bn, so their watch() times the forward unguarded (+2).
@pytest.mark.parametrize(("base", "recipe", "max_changed"), [
    ("ddp_torchrun", "dp", 138), ("ddp_torchrun", "ddp_launch", 39),
    # ddp_spawn: 136, then 141 with its DataLoader workers forked (a process mp.spawn started spawns its own children:
    # each worker was a new interpreter, 2.3 s of CPU each here); 144 with its threads left to OMP_NUM_THREADS where
    # set (it replaced launch.sh's with os.cpu_count()'s share: a whole machine's cores in a cgroup of a few).
    ("ddp_torchrun", "ddp_spawn", 144),
    # ddp_checkpoint: 129, then 219 with the preemption save (issue 43: SIGUSR1's vote, --save-every, mid-epoch
    # resume with each sample's seed, the bucket layout's backward on resume, and its docstring); 220 with the
    # curves flushed before exit 75; 227 with img/s counting only the images a resumed run trained (the epoch's
    # saved count apart: it was that count over this run's seconds; its epoch line wrapped onto one more line); 228
    # with the step of a resume counted in this run's epochs (the saved count stopped it early on another batch).
    # torch_amp: 176 until issue 57 found its evaluate() without --channels-last's memory_format (182).
    # 202 with --compile (issue 65: the data path measured against a compiled step), torch_amp's and gpu_decode's.
    # Each recipe that resumes writes model.pt atomically (a truncated one after a finished run was never rewritten):
    # torch_amp 203, apex_amp 263; ddp_checkpoint 229 with it and its flags checked on resume (check_same_run, in
    # load_checkpoint: its --epochs check's two lines gone, a docstring line more). apex_ddp 64: its docstring says
    # delay_allreduce takes unused parameters only where every rank leaves out the same ones.
    ("ddp_torchrun", "torch_amp", 203), ("ddp_torchrun", "ddp_checkpoint", 229), ("ddp_torchrun", "apex_ddp", 64),
    # gpu_decode (issue 65): torch_amp's, the data path moved to the main process's device (EncodedImages, collate,
    # decode_batch, DataLoaderX's on_device), --save-every's mid-epoch resume, its docstring, and torch_amp's
    # `# New` tags left off the lines it shares (here they are torch_amp's): 282; 283 without torch_amp's reseed on
    # resume (each sample's augmentation is seeded) and with torch_amp's device_normalize, which it does not need;
    # 280 with its decode_batch normalising by device_normalize too.
    # 286: --compile (issue 65), the docstrings and torch_amp's 2 `# New` tags; 283 without its own --save-every 0 check
    # (harness.check_flags said it first: the recipe's two lines never ran). 295 with a JPEG only nvjpeg refuses decoded
    # on the CPU in the main process, each file of a failed batch alone (a traceback naming no file before). 304 with
    # each sample's box and flip drawn from a generator of its own (crop_box: with --workers 0 the step's dropout drew
    # from the seeded global one in DataLoaderX's thread) and a resume's reseed by its step (dropout's draws anew).
    # 311 with img/s counting only the images a resumed run trained (as ddp_checkpoint).
    # 313 with torch_amp's resumed step counted in this run's epochs (gpu_decode's: the same --batch-size, its step).
    # 314 with common.data's rgb() imported for the files PIL decodes (a 16-bit PNG scaled, not clipped white).
    # 319 with the steps into the epoch saved and the resumed step counted from them in this run's epochs (the saved
    # step less this run's epochs went wrong on another process count, whose padding makes other epochs); 321 with a
    # checkpoint from before in_epoch read from its step, and one this run's epochs cannot place refused in one line.
    # 326 with torch_amp's channels-last and micro-batch lines marked `# New` against ddp_torchrun (gpu_decode keeps
    # them unmarked: not its lesson); 330 with the validation workers started before training (CPython gh-112275);
    # 334 with the normalisation made once (its mean and std copied at each batch waited for the side stream).
    ("torch_amp", "gpu_decode", 334),
    # apex_amp 260: its resumed step counted in this run's epochs (a saved count from another batch stopped it early);
    # 261: torch mode's O2 masters re-made after the DDP wrap (made before it, they kept each rank's own weights).
    # mx_face_prefetch: 150, then 160 with issue 65's device_normalize in the flagship (its RecordIO transforms kept
    # insightface's ToTensor and Normalize(0.5, 0.5) in the workers), 153 since they hand over uint8 as well, 154 with
    # faces of any shape resized to the square (Resize(int) scaled the short side alone: no batch of mixed shapes), 157
    # with ArcFace's fallback past pi - m (its target logit rose again there) and numpy for the train split's indices.
    # apex_amp 265: its schedule made after amp.initialize (a real apex's O1 and O2 replace optimizer.step, and the
    # scheduler made before warned on every rank).
    ("ddp_torchrun", "apex_amp", 265), ("ddp_torchrun", "mx_face_prefetch", 157),
    # ddp_compile: 78, then 81 with what --sync-bn costs it (issue 39) in its docstring and the breaks' reasons; 87
    # with DDP's spurious grad-strides warning explained (tests/test_documented_commands.py checks it is spurious); 91
    # with --bucket-cap-mb below DDPOptimizer's 1 MB first bucket refused, and the order against torch's notes said.
    ("ddp_torchrun", "ddp_compile", 91),
    # ddp_uneven: its training loop is indented under `with Join([model]):` (19 lines, counted twice); 123, then 136
    # with forward_sync_buffers=False and why (issue 39), 140 with the keyword chosen by torch version (2.11 has only
    # broadcast_buffers; the GPU machine's torch). 158 with a last batch of one sample refused where BatchNorm is,
    # fewer samples than ranks said as such, images/s from every rank's images, and the docstring's step weights.
    ("ddp_torchrun", "ddp_uneven", 158),
    # fsdp, ddp_zero and ddp_comm_hooks: their checkpoints are ddp_checkpoint's (sharded, consolidated, with PowerSGD's
    # state): read them against that one. ddp_zero 54 and ddp_comm_hooks 93 before issue 39 (the bucket view, and
    # PowerSGD's device sync on GPUs); fsdp 255 and ddp_comm_hooks 95 before the first GPU run (fsdp's G:N refusal,
    # PowerSGD's cuBLAS workspaces). Then fsdp 262, ddp_zero 57, ddp_comm_hooks 99 until ddp_checkpoint's preemption
    # save (issue 43), which these three do not have yet (they save at epochs' ends): its lines show as theirs; fsdp
    # 410 with --async-save (issue 43: async_save's group, the save in flight, latest.pt named after it ends); 424
    # with latest.pt named at the first step after the write, the writer's copy-ahead off and the default stager
    # named; each +1 for ddp_checkpoint's curves flushed before exit 75. fsdp 393 with the shard folders' scheme in
    # common/checkpoint.py (issue 58: ShardFolders, which the sharded language models share).
    # fsdp 394: the root kept gathered from forward to backward (issue 57). Each +7 for ddp_checkpoint's img/s after
    # a mid-epoch resume. ddp_zero and ddp_comm_hooks each +3 for the refusal of ddp_checkpoint's mid-epoch save.
    # ddp_comm_hooks 235: PowerSGD's error feedback in latest.pt's estimate (the disk check before the first step).
    # fsdp 414: a resume reads only the optimizer states the shards hold (a parameter without a gradient has none;
    # get_state_dict's step made one and the load failed), and --resume of a shard folder named as such; 415 with
    # the --out-dir check before the resume, as ddp_checkpoint's (its comment a line longer); 419 with a line naming
    # the parameters a resume finds no optimizer state for; 422 with a model without a Sequential of blocks said to
    # be sharded at the root alone (inception_v3; a model of the user's own); 423 with the docstring's bf16 command
    # in a folder of its own (a resume refuses a changed --amp-dtype).
    ("ddp_checkpoint", "fsdp", 423), ("ddp_checkpoint", "ddp_zero", 192), ("ddp_checkpoint", "ddp_comm_hooks", 235),
    # lm_tp: the plan, sharded checkpoints (fsdp.py's), loss_parallel, the gradients' layouts, and its block picture.
    # 276 until the preemption save (issue 43): the same lines as lm_ddp's, but its import of common.checkpoint
    # then wraps onto 10 lines, and lm_ddp's backward before a resumed run (DDP's bucket layout) is not its.
    # lm_tp 290 and lm_pp 337 until --async-save (issue 43): lm_ddp's is a thread writing torch.save's file from a
    # CPU copy, theirs dcp.async_save's (its group, the stager, latest.pt named once written, model.pt at the end):
    # both sides of the save block show, and the docstrings' lines. 300 with the plumbing as named calls (issue 58:
    # meter, vote, saves, the family's flags in common/lm.py): the parallelism, its checkpoints, its docstring.
    # 308 with --compile (issue 66): where each block is compiled differs (before DDP, after the plan).
    # 313: lm_ddp's backward before a resumed run under the step's autocast (its amp defined above it). 315: AdamW's
    # implementation kept on a resume (lm.adamw_as_this_torch: lm_ddp's in main(), theirs in load_shards).
    # 319: the model moved to the device after the cut, as lm_pp's (no GPU holds the whole model: at --tp 4 and up
    # the start-up copy was each GPU's peak), and the --out-dir check's comment (before the resume: dcp.load's).
    ("lm_ddp", "lm_tp", 319),  # 310: AdamW's implementation, dtensor=True
    # lm_pp: the stages, the schedule, the loss on the last stage, the clip across stages, DCP checkpoints (lm_tp's).
    # 323 until the preemption save: the wrapped import and the backward, as lm_tp; 427 until issue 58 (the plumbing
    # as named calls, as lm_tp's).
    # 364: the model moved to the device after the cut (lm_ddp's `.to(device)` on the Transformer's line: each GPU
    # held the whole model first), and the default batch 32 on any --pp (the microbatches fit it, not it them).
    # 366: its model line says what Stage needs (lm_ddp's: any module from tokens to logits), and the --out-dir
    # check moved before the resume in both (dcp.load's collectives), which diff no longer aligns.
    ("lm_ddp", "lm_pp", 366),  # 352 until --compile (issue 66), 360 until AdamW's implementation kept on resume
    # lm_fsdp_tp: lm_tp's with a dp dimension: the mesh, meta init, FSDP2, accumulation, the clip across meshes.
    # 302 until --async-save: lm_tp's lines for it, without their `# New` tags (here they are lm_tp's). 324 until
    # issue 58; about 25 of its 309 lines are lm_tp's `# New` tags, which this file leaves off the lines it shares.
    # 321 with evaluation's forwards paired up where a dp rank's windows run out (lm_moe's 3 lines; an empty batch
    # cannot pass attention's view).
    # 324 with lm_tp's model built on the host and moved after the cut (this one builds on the meta device), and
    # evaluation in training's micro-batches (--accum-steps: the whole per-rank batch at once ran out of memory first).
    ("lm_tp", "lm_fsdp_tp", 324),  # 309 until --compile (issue 66), 316 until the paired evaluation
    # lm_moe (issue 67): the MoE layer (router, experts, AllToAll), the dp x ep mesh, two gradient groups instead of
    # DDP, the clip across experts, lm_pp's DCP checkpoints (experts by their global names) and its block picture.
    # 375 before the router in fp32 under autocast and the bytes counted as sent; 386 with evaluation's forwards
    # paired up where a rank's windows run out (an empty batch cannot pass attention's view); 389 with top-1's gate
    # left unnormalised and the rows sent in bf16 under autocast; 390 with model.pt gathered from rank 0's ep group
    # alone (every rank sent its whole state: world_size copies of the dense weights); 392 with --expert-width below 1
    # refused in one line (it was a traceback from nn.Linear, and 0 took the default); 393 with the model moved to the
    # device after the cut (lm_ddp's `.to(device)` on the Transformer's line: no GPU holds every expert at start-up);
    # 403 with --ep and --dp each checked alone (one that does not divide the processes named, not a --dp nobody
    # gave), --experts below 1 refused on its own, and the hint's --ep given with the --dp that goes with it; 407 with
    # lm_ddp's resume backward under autocast (as lm_tp); 409 with AdamW's implementation kept on resume (as lm_tp);
    # 419 with model.pt's experts sent to rank 0 point to point (a gather_object staged every rank's part on rank
    # 0's GPU, each padded to rank 0's whole state: world x its state there, more than every expert); 423 with the
    # default --ep one node's and the counts without bincount (two host reads a layer on a GPU).
    ("lm_ddp", "lm_moe", 423)])
def test_diff_against_its_sibling_stays_small(base, recipe, max_changed):
    diff = subprocess.run(["diff", f"recipes/{base}.py", f"recipes/{recipe}.py"], cwd=REPO,
                          capture_output=True, text=True).stdout
    changed = sum(line[:1] in "<>" for line in diff.splitlines())
    assert 0 < changed <= max_changed


# Issue 58: the language models as lessons a researcher can copy. Before it: lm_ddp 322 lines, lm_tp 481, lm_pp 513,
# lm_fsdp_tp 537 (docs/recipe_shape.md); the plumbing is now one named call each (harness.StepMeter, harness.StopVote,
# common/checkpoint.py's ShardFolders, common/lm.py's flags). Issue 66's --compile: 8-9 lines each (lm_ddp 260, lm_pp
# 400 and lm_fsdp_tp 420 before it).
# lm_ddp 270 until its backward before a resumed run took the step's autocast (2 lines); lm_ddp 271, lm_fsdp_tp 430
# and lm_moe 492 until AdamW's implementation was kept on a resume (1 line each). lm_fsdp_tp 434 with its evaluation's
# forwards paired up where a dp rank's windows run out (lm_moe's 3 lines).
def test_every_recipe_that_resumes_asks_every_node_to_see_its_out_dir():
    # A resume loads rank 0's checkpoint on every rank: an --out-dir on each node's own disk would leave the others
    # starting afresh (a hang or replicas apart), so the start-up check must prove every node sees it (shared=True;
    # tests/test_failures.py runs it on ddp_checkpoint and lm_ddp).
    resuming = [r for r in RECIPES if "find_resume(" in (REPO / "recipes" / f"{r}.py").read_text()]
    assert len(resuming) >= 12, resuming
    for recipe in resuming:
        source = (REPO / "recipes" / f"{recipe}.py").read_text()
        call = source[source.index("harness.broadcast_out_dir_check("):]
        call = call[:call.index("\n    #")]  # to the banner or comment that follows it
        assert "shared=True" in call, (recipe, call)
    assert "shared=True" not in (REPO / "recipes" / "ddp_torchrun.py").read_text()  # the check can fail


@pytest.mark.parametrize(("recipe", "most"), [("lm_ddp", 273), ("lm_tp", 380), ("lm_pp", 410), ("lm_fsdp_tp", 436),
                                             ("lm_moe", 502)])  # lm_moe 479 before its --expert-width check,
# 481 before the model moved to the device after the cut, not before it, 482 before its --ep and --dp checks said
# which flag is wrong (10 lines), 493 before model.pt's experts came point to point (6 lines). One line each (lm_ddp
# 272, lm_fsdp_tp 434, lm_moe 499 before) since a divergence's stop names latest.pt (StepMeter's last_good=);
# lm_fsdp_tp 436 with its evaluation in training's micro-batches (its last call wraps). lm_moe 502 with its default
# --ep one node's (the all-to-alls across nodes before) and its counts without bincount's two host reads on a GPU.
def test_the_language_models_stay_lean(recipe, most):
    assert len((REPO / "recipes" / f"{recipe}.py").read_text().splitlines()) <= most


def test_the_flagship_imports_few_names_from_common_and_stays_short():
    # Issue 30: at most 10 names from common/ (26 before the harness moved out), and about 200 lines: 222 then (215
    # before --profile and own_ms, 213 before --debug-collectives), 263 at c0965cd, 282 at its largest
    # (docs/recipe_shape.md).
    text = (REPO / "recipes" / "ddp_torchrun.py").read_text()
    names = [alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
             and node.module and node.module.split(".")[0] == "common" for alias in node.names]
    # 11 and 225 lines with issue 65's device_normalize: the workers hand over uint8, the device normalises (its
    # import, and the two lines that make it).
    assert len(names) <= 11 and "harness" in names, names
    assert len(text.splitlines()) <= 225  # 222, then the docstring's pointer to docs/recipes.md's claims (issue 57)
    # The issue's own measure of the AMP lesson's diff, `diff ddp_torchrun.py torch_amp.py | wc -l`: 241 at c0965cd;
    # 231, then 240 with evaluation's images in --channels-last's memory format (issue 57 found them NCHW); 260 with
    # --compile (issue 65: the step the data path must keep up with, compiled as ddp_compile.py compiles it): 259;
    # 262 with model.pt written atomically (a resumed run that finished would never write a truncated one again).
    diff = subprocess.run(["diff", "recipes/ddp_torchrun.py", "recipes/torch_amp.py"], cwd=REPO, capture_output=True,
                          text=True).stdout
    assert len(diff.splitlines()) <= 262


def test_every_mutation_edit_applies_to_a_recipe():
    # tools/mutation_check.py leaves out an edit whose text no recipe holds: a line reworded since made two mutants
    # silent (join_buffer_sync from 93e663f, lm_resume_bucket_layout from 0aaa427), each run by no mutant at all.
    from tools import mutation_check

    mutants = mutation_check.plan(RECIPES, mutation_check.EDITS)
    assert {e.name for e in mutation_check.EDITS} - {e.name for _, e, _ in mutants} == set()
    # No two edits make the same mutant of a recipe: a twin runs other tests, which may miss what the first's notice
    # (compile_result, a dropped compile's result, on torch_amp and gpu_decode was compile_dropped's mutant, run
    # without the only test that compiles them: missed in the 2026-11-30 full run). An edit of common/ is one mutant
    # on purpose under each family's test (async_named_early: fsdp's crash drill and lm_tp's).
    made = {}
    for recipe, edit, _ in mutants:
        if not edit.file:
            mutant = (REPO / "recipes" / f"{recipe}.py").read_text().replace(edit.old, edit.new)
            assert made.setdefault((recipe, mutant), edit.name) == edit.name, (recipe, edit.name, made[recipe, mutant])


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_sibling_marks_its_additions_with_one_tag(recipe):
    # The flagship has none; a sibling marks what it adds `# New` (a line) or `# New: why` (a block below it), and
    # no other spelling, so a reader can grep one tag.
    text = (REPO / "recipes" / f"{recipe}.py").read_text()
    tags = re.findall(r"#\s*(new|added|lesson)\b", text.split('"""', 2)[2], re.I)  # below the docstring
    if recipe in ("ddp_torchrun", "lm_ddp"):  # the two families' bases
        assert tags == []
    else:
        assert len(tags) >= 2 and set(tags) == {"New"}, tags
    assert "YOUR DATA goes here" in text and "YOUR MODEL goes here" in text  # the seams, with what they must return


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_follows_the_contract(recipe):
    text = (REPO / "recipes" / f"{recipe}.py").read_text()
    assert text.startswith('"""') and f"./launch.sh recipes/{recipe}.py" in text.split('"""')[1]
    head = "\n".join(text.splitlines()[:60])  # where launch.sh looks for it
    assert re.search(r"^# launcher: (torchrun|torch\.distributed\.launch|python)$", head, re.M)
    for name in ("rank", "local_rank", "world_size", "device", "is_main"):
        assert re.search(rf"\b{name}\b", text.split("distributed setup")[1].split("# ----")[0]), name
    assert re.search(rf'(harness|meter)\.gather_result_line\([^)]*recipe="{recipe}"', text)  # meter: the LMs
    assert 'if __name__ == "__main__":' in text


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_with_a_process_group_takes_debug_collectives(recipe, capsys):
    # --debug-collectives (docs/failures.md): torch's DETAIL level, set before the process group is made (the level
    # counts when a group is made; TORCH_DISTRIBUTED_DEBUG is read at import), and DDP on a plain group under it (torch
    # 2.14.1's DDP dies of SIGSEGV on gloo's checked one). Drill 3 and tests/test_conformance.py run it.
    text = (REPO / "recipes" / f"{recipe}.py").read_text()
    if recipe == "dp":  # DataParallel: one process, no process group, nothing to check
        with pytest.raises(SystemExit):
            load_recipe(recipe).parse_args(["--debug-collectives"])
        assert "unrecognized arguments: --debug-collectives" in capsys.readouterr().err
        return
    assert load_recipe(recipe).parse_args(["--debug-collectives"]).debug_collectives
    setup = text.split("distributed setup")[1]
    assert -1 < setup.find("dist.set_debug_level(dist.DebugLevel.DETAIL)") < setup.find("dist.init_process_group(")
    assert len(re.findall(r"\bDDP\(model,", text)) == text.count("process_group=harness.ddp_process_group(timeout)")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_takes_profile_and_prints_each_ranks_own_ms(recipe):
    # --profile and own_ms (docs/slow.md): the profiler steps right after each optimizer step and stops after the loop;
    # its table is gathered only under --profile (an all-gather); own_ms rides on the epoch's loss all-reduce (no
    # collective of its own); the forward is timed only where it is the rank's own work (DDP's inner module).
    text = (REPO / "recipes" / f"{recipe}.py").read_text()
    assert load_recipe(recipe).parse_args(["--profile"]).profile
    train = text.split("# ----------------------------------------------------------------------------------- train")[1]
    if recipe.startswith("lm_"):  # harness.StepMeter holds the profiler and the clock (issue 58): its step() steps
        # both after each optimizer step; stop() after the loop; the table gathered only under --profile
        # (and last_good=latest: what a divergence's stop names once a save wrote it)
        made = re.findall(r"meter = harness\.StepMeter\((\w+), device, args\.profile, args\.out_dir, rank([^)]*)\)",
                          re.sub(r"#.*", "", train))  # less the comments
        made = [(model, re.sub(r"\s", "", rest)) for model, rest in made]
        assert made == [{"lm_ddp": ("model", ",forward=model.module,last_good=latest"),
                         "lm_pp": ("None", ",last_good=latest")}.get(recipe, ("model", ",last_good=latest"))]
        assert text.count("meter.step(step, ") == 1 and text.count("meter.all_reduce_loss()") == 1
        assert re.search(r"meter\.stop\(\).*\n(.*\n){0,30} +if args\.profile:.*\n +print0\(meter\.gather_profile_table"
                         r"\(\)\)", text)
        assert "{meter.fields(last - step)}\")" in text
        return
    assert "prof = harness.Profiler(args.profile, args.out_dir, rank, device)" in train
    assert len(re.findall(r"^( +)speed\.step\(.*\n\1prof\.step\(\)", text, re.M)) == text.count("prof.step()") == 1
    assert re.search(r"prof\.stop\(\).*\n +if args\.profile:.*\n +print0\(harness\.gather_profile_table\(prof, "
                     r"device\)\)", text)
    assert text.count("loss_meter.all_reduce(device, ride=speed)") == 1 and "{speed.spread}\")" in text
    watch = re.findall(r"speed\.watch\(model(, forward=(?:None if args\.sync_bn (?:or args\.compile )?else )?"
                       r"model\.module)?\)", text)
    forward = ", forward=None if args.sync_bn else model.module" if "args.sync_bn" in text else ", forward=model.module"
    if "args.compile" in text and recipe != "ddp_compile":  # --compile: the forward's hooks would break its graph
        forward = forward.replace("args.sync_bn", "args.sync_bn or args.compile")
    assert watch == ([] if recipe == "lm_pp" else [forward] if "DDP(" in text and recipe != "ddp_compile" else
                     [""]), watch  # the forward only where it waits for no other rank (--sync-bn's does)
    # The step ends after the loop's own logging (TensorBoard, its divergence check: a collective), so the next
    # data wait starts there.
    assert not re.search(r"speed\.step\(.*\n.*\n *tb\.step\(", text), "speed.step() before tb.step()"


# --------------------------------------------------------------------------------- ddp_launch


def test_ddp_launch_accepts_all_three_local_rank_spellings(monkeypatch):
    parse = load_recipe("ddp_launch").parse_args
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert parse(["--local-rank=3"]).local_rank == 3  # torch >= 2.0's launcher
    assert parse(["--local_rank", "2"]).local_rank == 2  # old launchers, the write-ups' code
    assert parse([]).local_rank == 0
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun / --use-env
    assert parse([]).local_rank == 1
    assert parse(["--local-rank=0"]).local_rank == 0  # the launcher's flag wins


# ---------------------------------------------------------------------------------- ddp_spawn


@pytest.mark.slow
def test_ddp_spawn_worker_errors_end_the_program(tmp_path):
    # A sample that does not load: one line from the worker that read it, then the exit the parent saw.
    root = make_imagefolder(tmp_path / "data", train_per_class=8, val_per_class=3)
    bad = root / "train" / "class_1" / "005.png"
    bad.write_bytes(b"not a png")
    start = time.monotonic()
    proc = launch("recipes/ddp_spawn.py", "cpu:2", "--dataset", "imagefolder", "--data-root", root,
                  "--image-size", "16", "--batch-size", "8", *TINY, "--out-dir", tmp_path / "out")
    assert proc.returncode == 1, proc.stderr
    assert re.search(rf"^\[rank ([01])\] error: train sample 13 \({re.escape(str(bad))}\) does not load: "
                     r"UnidentifiedImageError", proc.stderr, re.M), proc.stderr
    assert re.search(r"^error: worker [01] \(pid \d+\) exited with code 1; the other workers were stopped$",
                     proc.stderr, re.M), proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60
    # Any other error in a worker: the program ends with that worker's traceback (tiny's pooling of 1x1 images).
    proc = launch("recipes/ddp_spawn.py", "cpu:2", "--image-size", "1", *TINY, "--max-steps", "1",
                  "--out-dir", tmp_path / "out")
    assert proc.returncode == 1
    assert re.search(r"^error: worker [01] failed", proc.stderr, re.M)
    assert "Traceback" in proc.stderr and "Output size is too small" in proc.stderr


# ---------------------------------------------------------------------------------- torch_amp

@pytest.mark.slow
def test_fp16_trains_and_the_scaler_state_survives_resume(tmp_path):
    small = [*TINY, "--batch-size", "32", "--lr", "0.05", "--synthetic-train", "256", "--synthetic-val", "50",
             "--image-size", "16", "--amp-dtype", "fp16", "--clip-grad", "1.0", "--epochs", "2", "--out-dir", tmp_path]
    first = launch("recipes/torch_amp.py", "cpu:2", *small, "--resume", "auto", "--max-steps", "8")  # epoch 1 of 2
    assert result_of(first)["steps"] == 8 and "grad_scaler=True" in first.stdout
    assert f"resume: no {tmp_path / 'checkpoint.pt'} yet, starting from scratch" in first.stdout
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 1 and saved["scaler"]["scale"] > 0 and saved["scaler"]["_growth_tracker"] == 8
    as_if_saved_on_gpu(tmp_path / "checkpoint.pt")  # --resume loads it with map_location=this rank's device
    resumed = launch("recipes/torch_amp.py", "cpu:2", *small, "--resume", "auto")  # what MAX_RESTARTS reruns
    assert result_of(resumed)["steps"] == 16
    assert "resumed: " in resumed.stdout and "'_growth_tracker': 8}" in resumed.stdout
    assert scaler_resumed_from(saved["scaler"]) in resumed.stdout  # the GPU tier checks the same text
    # A scaler that was not restored would count from 0 again and end at 8.
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["scaler"]["_growth_tracker"] == 16
    finished = launch("recipes/torch_amp.py", "cpu:2", *small, "--resume", tmp_path / "checkpoint.pt")
    assert finished.returncode != 0 and "already finished all 2 epochs; nothing to resume" in finished.stderr
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temp file
    changed = launch("recipes/torch_amp.py", "cpu:2", *small[:-4], "--epochs", "3", "--out-dir", tmp_path,
                     "--resume", tmp_path / "checkpoint.pt")
    assert changed.returncode == 2 and (f"{tmp_path / 'checkpoint.pt'} was written with --epochs 2 (this run: 3); "
                                        "resume with the same flags") in changed.stderr


# ----------------------------------------------------------------------------- ddp_checkpoint


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    """3 epochs straight, and 1 epoch + stop + resume for 2 (on 2 ranks, and on 1), on PNGs with random
    augmentation and workers; every run logs each epoch's RNG state (tests/instrument) into tmp/rng_<run>, and the
    2-rank runs each torch.load call into tmp/loads_<run>."""
    tmp = tmp_path_factory.mktemp("ckpt")
    data = make_imagefolder(tmp / "data")
    args = ["--dataset", "imagefolder", "--data-root", data, "--image-size", "16", "--batch-size", "8",
            "--arch", "tiny", "--workers", "1", "--epochs", "3"]
    straight = launch("recipes/ddp_checkpoint.py", "cpu:2", *args, "--out-dir", tmp / "straight",
                      env={**rng_env(tmp / "rng_straight"), "LOG_LOADS_DIR": str(tmp / "loads_straight")})
    first = launch("recipes/ddp_checkpoint.py", "cpu:2", *args, "--max-steps", "7", "--out-dir", tmp / "resumed",
                   env=rng_env(tmp / "rng_resumed"))
    as_if_saved_on_gpu(tmp / "resumed" / "latest.pt")  # every rank loads it with map_location=its own device
    shutil.copytree(tmp / "resumed", tmp / "one")
    resumed = launch("recipes/ddp_checkpoint.py", "cpu:2", *args, "--resume", "auto", "--out-dir", tmp / "resumed",
                     env={**rng_env(tmp / "rng_resumed"), "LOG_LOADS_DIR": str(tmp / "loads_resumed")})
    one = run_direct("ddp_checkpoint", *args, "--resume", "auto", "--out-dir", tmp / "one",
                     env=rng_env(tmp / "rng_one"))
    return {"tmp": tmp, "data": data, "args": args, "straight": straight, "first": first, "resumed": resumed,
            "one": one}


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_bitwise(checkpoint_runs):
    straight, first, resumed = (checkpoint_runs[k] for k in ("straight", "first", "resumed"))
    assert result_of(straight)["steps"] == result_of(resumed)["steps"] == 21 and result_of(first)["steps"] == 7
    assert "resume: " in resumed.stdout and "at epoch 1 step 7" in resumed.stdout
    assert epoch_lines(first.stdout) + epoch_lines(resumed.stdout) == epoch_lines(straight.stdout)
    a, b = params(checkpoint_runs["tmp"] / "straight/model.pt"), params(checkpoint_runs["tmp"] / "resumed/model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)


def torch_loads(folder):
    """{rank: [(file, map_location, mmap), ...]} in call order, from tests/instrument's LOG_LOADS_DIR logs."""
    loads = {}
    for log in sorted(folder.glob("*.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            loads.setdefault(entry["rank"], []).append((entry["file"], entry["map_location"], entry["mmap"]))
    return loads


@pytest.mark.slow
def test_each_epoch_every_rank_maps_only_the_weights_onto_the_cpu_and_a_resume_loads_all_onto_its_device(
        checkpoint_runs):
    # The per-epoch reload maps latest.pt (mmap) onto the CPU and copies in the weights alone: loading the whole
    # checkpoint (optimizer, every rank's RNG state) onto each rank's GPU every epoch just for them cost every rank
    # the file's full size in reads and GPU memory. A resume needs all of it, onto the rank's device.
    tmp = checkpoint_runs["tmp"]
    reload, resume = ("latest.pt", "'cpu'", True), ("latest.pt", "device(type='cpu')", False)
    assert torch_loads(tmp / "loads_straight") == {rank: [reload] * 3 for rank in (0, 1)}  # one per epoch
    assert torch_loads(tmp / "loads_resumed") == {rank: [resume] + [reload] * 2 for rank in (0, 1)}  # epochs 2, 3


@pytest.mark.slow
def test_resumed_random_streams_continue_on_the_same_world_size_and_replay_no_epoch_on_another(checkpoint_runs):
    tmp = checkpoint_runs["tmp"]
    straight, pieced, one = (rng_streams(tmp / f"rng_{run}") for run in ("straight", "resumed", "one"))
    assert sorted(straight) == [(2, rank, epoch) for rank in (0, 1) for epoch in (0, 1, 2)]
    assert pieced == straight  # each rank goes on from its own saved state: the augmentation of a run never stopped
    one_proc = checkpoint_runs["one"]
    assert result_of(one_proc)["world_size"] == 1 and result_of(one_proc)["steps"] == 21
    assert "resume: saved with 2 ranks, now 1: random streams reseeded after epoch 1" in one_proc.stdout
    assert sorted(one) == [(1, 0, 1), (1, 0, 2)]
    # Nothing in ddp_checkpoint draws from a rank's stream during an epoch now (issue 43: each sample's augmentation
    # has a seed of its own, the train loader's worker seeds a generator of their own), so each epoch of a rank
    # starts from the state the one before did, and replays nothing: a model's dropout would draw, and move it.
    # What must not happen: one rank starting from another's state, or the reseeded run from the straight run's
    # (reseeding with seed + rank again would: rank 0's epoch-0 state; its dropout masks once more).
    owners = replayed({**straight, **{(world, rank + 10, epoch): d for (world, rank, epoch), d in one.items()}})
    assert all(len({rank for rank, _ in who}) == 1 for who in owners.values()), owners


@pytest.mark.slow
def test_best_is_saved_only_when_accuracy_improves(checkpoint_runs):
    out = checkpoint_runs["straight"].stdout
    accs = [float(re.search(r"val_acc1=([\d.]+)", line).group(1)) for line in epoch_lines(out)]
    improved = [e + 1 for e, acc in enumerate(accs) if acc > max(accs[:e], default=float("-inf"))]
    assert [int(n) for n in re.findall(r"^best: epoch=(\d+)", out, re.M)] == improved
    best = torch.load(checkpoint_runs["tmp"] / "straight/best.pt", weights_only=True)
    assert best["epoch"] == improved[-1] and best["val_acc1"] == pytest.approx(max(accs), abs=0.01)
    latest = torch.load(checkpoint_runs["tmp"] / "straight/latest.pt", weights_only=True)
    assert latest["epoch"] == 3 and len(latest["rng"]) == 2 and latest["args"]["epochs"] == 3


@pytest.mark.slow
def test_init_from_weights_with_module_prefix_and_a_wrong_arch(checkpoint_runs, tmp_path):
    trained = params(checkpoint_runs["tmp"] / "straight/model.pt")
    torch.save({f"module.{k}": v for k, v in trained.items()}, tmp_path / "wrapped.pt")  # as a DDP/DP wrapper saves
    args = ["--dataset", "imagefolder", "--data-root", checkpoint_runs["data"], "--image-size", "16",
            "--batch-size", "8", *TINY, "--max-steps", "1", "--lr", "1e-9", "--out-dir", tmp_path / "out"]
    proc = run_direct("ddp_checkpoint", *args, "--init-from", tmp_path / "wrapped.pt")
    assert f"init: weights from {tmp_path / 'wrapped.pt'}" in proc.stdout
    assert result_of(proc)["val_acc1"] == result_of(checkpoint_runs["straight"])["val_acc1"]
    wrong = run_direct("ddp_checkpoint", *args, "--arch", "resnet18", "--init-from", tmp_path / "wrapped.pt")
    assert wrong.returncode == 2
    assert "wrapped.pt does not fit this model (its --arch, and the classes and --image-size of its data): missing " \
           "['conv1.weight'" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ddp_comm_hooks", "ddp_zero"])
def test_init_from_and_a_resume_with_other_epochs_in_the_checkpoint_lessons_siblings(recipe, tmp_path):
    # ddp_checkpoint's --init-from and its --epochs check, as its siblings with checkpoints have them (on one
    # process: the same lines on any world size). --init-from the first run's model.pt at a learning rate too small
    # to move it: the first run's accuracy again.
    args = [*TINY, "--synthetic-train", "64", "--synthetic-val", "32", "--batch-size", "32", "--image-size", "16",
            "--epochs", "1"]
    first = run_direct(recipe, *args, "--out-dir", tmp_path / "first")
    start = tmp_path / "first" / "model.pt"
    init = run_direct(recipe, *args, "--lr", "1e-9", "--max-steps", "1", "--init-from", start,
                      "--out-dir", tmp_path / "init")
    assert f"init: weights from {start}" in init.stdout, init.stdout
    assert result_of(init)["val_acc1"] == result_of(first)["val_acc1"]
    # ... and the other flags that shape the run (common.checkpoint.check_same_run): a new --lr the optimizer's saved
    # state would silently overrule, a --seed that would change the data's order from here on.
    more = run_direct(recipe, *args[:-1], "2", "--seed", "7", "--lr", "0.4", "--resume",
                      tmp_path / "first" / "latest.pt", "--out-dir", tmp_path / "more")
    assert more.returncode == 2 and error_lines(more.stderr) == [
        f"error: {tmp_path / 'first' / 'latest.pt'} was trained with --epochs 1 (this run: 2), --seed 0 (this run: "
        "7), --lr 0.025 (this run: 0.4); resume with the same flags"], more.stderr
    assert "Traceback" not in more.stderr and not (tmp_path / "more" / "latest.pt").exists()


@pytest.mark.slow
def test_a_truncated_checkpoint_is_refused_and_nothing_is_overwritten(checkpoint_runs, tmp_path):
    good = (checkpoint_runs["tmp"] / "straight/latest.pt").read_bytes()
    (tmp_path / "latest.pt").write_bytes(good[: len(good) // 2])
    proc = run_direct("ddp_checkpoint", *TINY, "--resume", "auto", "--out-dir", tmp_path)
    assert proc.returncode == 2
    # Printed by every rank that fails to load (here the one rank), so it names the rank.
    assert proc.stderr.strip().startswith(f"[rank 0] error: cannot load {tmp_path / 'latest.pt'} (")
    assert "truncated, or not a checkpoint" in proc.stderr
    assert (tmp_path / "latest.pt").read_bytes() == good[: len(good) // 2]


# -------------------------------------------------------------------------------- ddp_compile
@pytest.mark.slow
def test_ddp_compile_stops_when_torch_compile_compiled_nothing_and_without_a_cpp_compiler(tmp_path):
    # The order a probe found to compile zero graphs under DDP without an error: torch.compile(model), its result
    # dropped (as if it compiled in place, as model.compile() does). The recipe counts dynamo's graphs after step 1.
    dropped = recipe_with_one_line_edited(tmp_path, "ddp_compile", "    model.compile(dynamic=False)\n",
                                          "    torch.compile(model, dynamic=False)\n")
    proc = launch(dropped, "cpu:2", *TINY, "--max-steps", "2", "--out-dir", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    says = ("error: torch.compile compiled no graph: compile in place (model.compile()), or train through the module "
            "torch.compile(model) returns")
    assert sorted(error_lines(proc.stderr)) == [f"[rank {r}] {says}" for r in (0, 1)], proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()
    # inductor on the CPU compiles C++: without a working compiler, one line before any process group.
    started = time.time()
    proc = launch("recipes/ddp_compile.py", "cpu:1", *TINY, "--out-dir", tmp_path / "out",
                  env={"CXX": "/no/such/g++"})
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: torch.compile on the CPU needs a C++ compiler and none works here: install g++ (apt install g++) or "
        "point CXX at one"], proc.stderr
    assert time.time() - started < 60
    # TORCH_COMPILE_DISABLE=1 makes torch.compile hand the model back as it was: said there too, not after step 1.
    off = run_direct("ddp_compile", *TINY, "--out-dir", tmp_path / "off", env={"TORCH_COMPILE_DISABLE": "1"})
    assert off.returncode == 2 and error_lines(off.stderr) == [
        "error: torch.compile is switched off in this environment (TORCH_COMPILE_DISABLE=1): unset it to compile"
    ], off.stderr


def test_compile_on_a_gpu_needs_a_c_compiler_and_python_headers(monkeypatch, tmp_path):
    # Issue 39: on a GPU inductor's kernels go through Triton, which builds its launcher from C with $CC, gcc or clang
    # (triton/runtime/build.py) and includes Python.h. ddp_compile checks both before any process group, on every
    # device; here the check itself runs, given the GPU it would get.
    import torch.utils._triton

    from common.compiler import missing_compiler  # harness.check_compiler's reason, checked in ddp_compile.py
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)  # the GPU's Triton (test_error_paths: none)
    assert missing_compiler(gpu) is None and missing_compiler(torch.device("cpu")) is None  # gcc, g++, the headers
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert missing_compiler(gpu) == ("torch.compile on a GPU needs a C compiler for Triton's kernel launcher and none "
                                     "is here: install gcc (apt install gcc) or point CC at one")
    monkeypatch.setenv("CC", "/usr/bin/gcc")  # Triton takes $CC as it is
    assert missing_compiler(gpu) is None
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
    assert missing_compiler(gpu) == (f"torch.compile on a GPU needs Python's C headers for Triton's kernel launcher, "
                                     f"and {tmp_path} has no Python.h: install them (apt install python3-dev, or your "
                                     f"Python's -dev package)")


# ----------------------------------------------------------------------------------- ddp_zero
@pytest.mark.slow
def test_zero_checkpoint_from_two_ranks_resumes_on_three_as_plain_ddp_resumes_it(tmp_path):
    # Issue 27: consolidate_state_dict(to=0) on every rank makes rank 0's checkpoint the whole optimizer, a plain
    # SGD state_dict. Stopped after epoch 1 of 2 on 2 ranks, it resumes on 3: ddp_zero (each rank takes its new shard)
    # and ddp_checkpoint (plain SGD) from the same file must train alike (both reseed the 3 ranks' streams alike).
    common = ["--arch", "tiny_bn", "--workers", "0", "--epochs", "2", "--batch-size", "30", "--synthetic-train", "120"]
    rng = tmp_path / "rng"
    first = launch("recipes/ddp_zero.py", "cpu:2", *common, "--max-steps", "4", "--out-dir", tmp_path / "two",
                   env=rng_env(rng))
    assert result_of(first)["steps"] == 4
    saved = torch.load(tmp_path / "two" / "latest.pt", weights_only=True)
    n_params = len(list(build_model("tiny_bn", 10).parameters()))
    assert saved["epoch"] == 1 and sorted(saved["optimizer"]["state"]) == list(range(n_params))  # every shard
    as_if_saved_on_gpu(tmp_path / "two" / "latest.pt")  # each rank loads it with map_location=its own device
    shutil.copytree(tmp_path / "two", tmp_path / "plain")
    zero = launch("recipes/ddp_zero.py", "cpu:3", *common, "--resume", "auto", "--out-dir", tmp_path / "two",
                  env=rng_env(rng))
    plain = launch("recipes/ddp_checkpoint.py", "cpu:3", *common, "--resume", "auto", "--out-dir", tmp_path / "plain")
    for proc in (zero, plain):
        assert result_of(proc)["world_size"] == 3 and result_of(proc)["steps"] == 8, proc.stdout
        assert "resume: saved with 2 ranks, now 3: random streams reseeded after epoch 1" in proc.stdout
    # Reseeded on 3 ranks: no epoch of the resumed run starts from an RNG state an epoch of the first run had.
    streams = rng_streams(rng)
    assert sorted(streams) == [(2, 0, 0), (2, 1, 0), (3, 0, 1), (3, 1, 1), (3, 2, 1)], sorted(streams)
    assert replayed(streams) == {}
    resumed, reference = params(tmp_path / "two" / "model.pt"), params(tmp_path / "plain" / "model.pt")
    assert max((resumed[k].float() - reference[k].float()).abs().max().item() for k in resumed) < 1e-6


@pytest.mark.slow
def test_zero_gives_each_of_three_ranks_about_a_third_of_the_optimizer_state(tmp_path):
    # state_bytes_per_rank = parameters + gradients (whole on every rank) + this rank's momentum shard. resnet18's 62
    # parameter tensors, assigned greedily by size: every momentum on exactly one rank, each rank about 1/3.
    (tmp_path / "counts").mkdir()
    proc = launch("recipes/ddp_zero.py", "cpu:3", "--arch", "resnet18", "--workers", "0", "--image-size", "8",
                  "--batch-size", "6", "--synthetic-train", "24", "--synthetic-val", "6", "--max-steps", "2",
                  "--out-dir", tmp_path, env={"PYTHONPATH": str(REPO / "tests/instrument"),
                                              "COUNT_DDP_DIR": str(tmp_path / "counts")})
    held = result_of(proc)["state_bytes_per_rank"]
    weights = sum(p.numel() * 4 for p in build_model("resnet18", 10, 8).parameters())
    # parameters_as_bucket_view=True: each step shares the stepped parameters in one broadcast per rank (tests/
    # instrument counts them), where torch's default makes one per parameter tensor, 62 here.
    assert len(list(build_model("resnet18", 10, 8).parameters())) == 62
    assert [c["zero_broadcasts_per_step"] for c in ddp_counts(tmp_path / "counts")] == [[3, 3]] * 3
    shards = [h - 2 * weights for h in held]
    assert sum(shards) == weights, (shards, weights)
    assert max(shards) <= 1.25 * weights / 3 and min(shards) >= 0.75 * weights / 3, [s / weights for s in shards]
