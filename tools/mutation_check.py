"""Delete the cookbook's lessons from the recipes, one at a time, and report which deletions the tests miss.

    python tools/mutation_check.py                               # every edit on every recipe, one at a time: 270
    python tools/mutation_check.py --jobs 2                      # two at a time: 255 took 69 min (2026-11-30)
    python tools/mutation_check.py --recipes torch_amp --edits unscale,no_sync
    python tools/mutation_check.py --out bench/mutation.json     # also write the results as JSON

For each recipe and each edit whose text the recipe contains, it copies the working tree to a scratch folder,
applies the edit there (never to this tree), and runs the tests that guard that recipe: one mapping, GUARDS, names
the recipes each edit is tried on and their tests (by default each recipe of the edit's family that holds its text,
and that recipe's conformance cases). Edits whose description starts "same numbers, ..." keep every number and break
what a rank computes, holds or sends (docs/recipes.md's table): the tests that notice them measure it inside the
recipes' own processes (tests/instrument). An edit is "noticed"
when they fail, "MISSED" when they pass. Exit 0 when every edit was noticed, 1 otherwise.
"""

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edit:
    name: str
    pitfall: str
    old: str
    new: str
    file: str = ""  # a file of common/ the edit goes into instead of the recipe (the recipe's tests guard it)


# ShardFolders.start_async (fsdp.py and the sharded language models) pointing latest.pt at a save as it starts.
NAMED_EARLY = ("        self.in_flight = (future, pointer, folder)\n",
               "        self.in_flight = (future, pointer, folder)\n"
               "        if torch.distributed.get_rank() == 0:\n            self.point_latest(pointer)\n")
EDITS = [
    Edit("set_epoch", "no sampler.set_epoch(epoch): every epoch replays the same order",
         "train_sampler.set_epoch(epoch)", "pass"),
    Edit("bn_broadcast", "no broadcast of rank 0's BatchNorm buffers before evaluating",
         "dist.broadcast(buffer, 0)", "pass"),
    Edit("global_batch", "the global --batch-size not divided across processes",
         "batch_per_process = args.batch_size // world_size", "batch_per_process = args.batch_size"),
    Edit("eval_module", "evaluation through the DDP wrapper, not model.module",
         "evaluate(model.module,", "evaluate(model,"),
    Edit("save_module", "saving the wrapper's state_dict (keys with 'module.')",
         "torch.save(model.module.state_dict(), path)", "torch.save(model.state_dict(), path)"),
    Edit("map_location", "torch.load without map_location (onto the GPU it was saved from)",
         "map_location=device", "map_location=None"),
    Edit("unscale", "clipping fp16 gradients without scaler.unscale_ first",
         "scaler.unscale_(optimizer)", "pass"),
    Edit("loss_division", "accumulated micro-batch losses not divided by --accum-steps",
         "scaler.scale(loss / args.accum_steps)", "scaler.scale(loss)"),
    Edit("no_sync", "an all-reduce on every micro-batch (no model.no_sync())",
         "contextlib.nullcontext() if boundary else model.no_sync()", "contextlib.nullcontext()"),
    Edit("resume_reseed", "a resume without the saved RNG state reseeds with seed + rank: epoch 0's draws again",
         "args.seed + rank + 10_000 * start_epoch", "args.seed + rank"),
    Edit("eval_lockstep", "FSDP: a rank whose validation shard ran out stops joining the others' all-gathers",
         "model(empty)", "pass"),
    Edit("divergence_check", "no divergence check: a NaN run trains on, exits 0 and saves its NaN weights",
         "diverged.all_reduce_and_check(", "(lambda *args, **kwargs: None)("),
    Edit("lm_divergence_check", "no divergence check: a NaN run trains on, exits 0 and saves its NaN weights",
         "meter.all_reduce_and_check(", "(lambda *args, **kwargs: None)("),
    Edit("fused_sgd", "AMP with a for-each SGD: GradScaler reads the inf flag on the host every step (a GPU sync)",
         "weight_decay=5e-4, fused=", "weight_decay=5e-4, foreach="),
    Edit("bn_recompute", "eval with BatchNorm statistics that trail the weights (not recomputed from the last batches)",
         "recent.append(", "(lambda *batch: None)("),
    Edit("compile_result", "torch.compile(model) used as if in place: its result dropped, the model trains eager",
         "model.compile(dynamic=False)", "torch.compile(model, dynamic=False)"),
    Edit("consolidate", "ZeRO: rank 0 saves its optimizer without consolidate_state_dict on every rank first",
         "optimizer.consolidate_state_dict(to=0)", "pass"),
    Edit("join", "uneven inputs without Join: the rank out of batches first leaves the others in an all-reduce",
         "        with Join([model]):\n", "        if True:\n"),
    Edit("join_momentum", "Join syncs the weights, not the momentum of the ranks that sat steps out",
         "dist.broadcast(momentum, src=longest)", "pass"),
    Edit("join_buffer_sync", "Join with DDP's buffer broadcast: a blocking all-reduce and a host read every forward",
         "find_unused_parameters=args.find_unused_parameters, **{no_buffer_sync: False},",
         "find_unused_parameters=args.find_unused_parameters,"),
    Edit("zero_bucket_view", "ZeRO broadcasting the stepped parameters one tensor at a time (62 for resnet18)",
         "parameters_as_bucket_view=True", "parameters_as_bucket_view=False"),
    Edit("comm_hook", "a communication hook chosen but not registered: DDP all-reduces every gradient in fp32",
         'model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))', "pass"),
    Edit("powersgd_state", "PowerSGD resumed without its state: no error feedback, a cold random Q",
         'powersgd.load_state_dict(ckpt["comm_hook"])', "pass"),
    Edit("powersgd_mean_error", "PowerSGD's error feedback saved from rank 0 alone, not the ranks' mean",
         "dist.all_reduce(error)", "error.mul_(world_size)"),
    Edit("full_state_dict", "FSDP: model.pt saved from the sharded state_dict (rank 0's DTensor shards)",
         "StateDictOptions(full_state_dict=True, cpu_offload=True)", "StateDictOptions(cpu_offload=True)"),
    # The language models (recipes/lm_*.py), guarded by tests/test_lm*.py.
    Edit("lm_eval_sum", "validation summed on each rank alone: every rank reports its own windows' loss",
         "    dist.all_reduce(total)\n", "\n"),
    Edit("lm_clip", "no gradient clipping: the early steps' large gradients move the weights too far",
         "torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)", "None"),
    Edit("lm_decay_groups", "AdamW's weight decay on biases, norms and embeddings too",
         '{"params": others, "weight_decay": 0.0}', '{"params": others, "weight_decay": args.weight_decay}'),
    Edit("lm_checkpoint_wrapper", "--activation-checkpointing that wraps nothing: every activation is kept",
         "model.blocks[name] = checkpoint_wrapper(block)", "pass"),
    Edit("lm_resume_moments", "a resume without AdamW's moments: the first steps after it take other sizes",
         'optimizer.load_state_dict(ckpt["optimizer"])', "pass"),
    Edit("lm_resume_data", "a resume that draws the first steps' batches again (the data counted from the resume)",
         "train_batch(train_text, step, args.seed", "train_batch(train_text, step - start_step, args.seed"),
    Edit("lm_sp_plan", "--sequence-parallel without SequenceParallel on the norms: they meet sequence-cut activations",
         'plan.update({name: SequenceParallel() for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f")})', "pass"),
    Edit("lm_loss_parallel", "the cross-entropy outside loss_parallel() on logits cut by bytes",
         "with loss_parallel():  # New: around the loss and its backward: the softmax's max and sum all-reduced",
         "if True:"),
    Edit("lm_col_row_swap", "the MLP's first layer cut by input (rowwise) instead of by output",
         '"blocks.*.mlp.fc": ColwiseParallel(),', '"blocks.*.mlp.fc": RowwiseParallel(),'),
    Edit("lm_heads_per_rank", "attention viewed with the global head count: each rank's heads come out the wrong size",
         "w(x).view(B, T, -1, self.head_dim)", "w(x).view(B, T, self.n_head, -1)", file="common/lm.py"),
    Edit("lm_pp_stage_boundary", "a pipeline stage boundary that drops a block: each later stage starts one late",
         "return [(s * n_layer // pp, (s + 1) * n_layer // pp) for s in range(pp)]",
         "return [(s * n_layer // pp + (s > 0), (s + 1) * n_layer // pp) for s in range(pp)]"),
    Edit("lm_pp_scale_grads", "the schedule's gradients not divided by the micro-batches: m times the gradient",
         "loss_fn=loss_fn, scale_grads=True)", "loss_fn=loss_fn, scale_grads=False)"),
    Edit("lm_pp_local_clip", "each pipeline stage clipped by its own gradient norm, not the whole model's",
         "    dist.all_reduce(squared)\n", "\n"),
    Edit("lm_grad_sync_never_off", "FSDP2 accumulation without the switch: a reduce-scatter every micro-step",
         "model.set_requires_gradient_sync(micro == args.accum_steps - 1)", "model.set_requires_gradient_sync(True)"),
    Edit("lm_grad_sync_never_on", "the gradient-sync switch never turned back on: the shards get no gradient",
         "model.set_requires_gradient_sync(micro == args.accum_steps - 1)", "model.set_requires_gradient_sync(False)"),
    Edit("lm_mesh_shape_swapped", "the 2-D mesh built (tp, dp) under the names (dp, tp)",
         "init_device_mesh(device.type, (args.dp, args.tp),", "init_device_mesh(device.type, (args.tp, args.dp),"),
    Edit("lm_dp_rank_from_tp", "the batch share taken by the tp rank: a tp group's ranks see other data",
         'dp_rank = mesh["dp"].get_local_rank()', 'dp_rank = mesh["tp"].get_local_rank()'),
    Edit("lm_eval_sum_dp", "validation sums not all-reduced across dp: each dp rank reports its own windows",
         "    dist.all_reduce(total, group=dp_group)", "    pass"),
    Edit("lm_clip_2d", "no gradient clipping (2-D)", "clip_grad_norm_across_meshes(model, args.clip_grad)", "None"),
    Edit("lm_meta_init_naive", "meta init, then the model's own init on the shards instead of rank 0's weights",
         "    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, "
         "broadcast_from_rank0=True))", "    model.init_weights(args.n_layer)"),
    # Issue 42: where each rank is, and which collective each called.
    Edit("hang_stacks", "a hang ends in its error line alone: no rank answers the launcher's signal with its stack",
         "    _stack_on_signal()  # under tools/torchrun.py", "    pass  # under tools/torchrun.py",
         file="common/utils.py"),
    Edit("debug_level", "--debug-collectives that sets no debug level: mismatched collectives go unchecked",
         "dist.set_debug_level(dist.DebugLevel.DETAIL)  # before init", "pass  # before init"),
    Edit("ddp_checked_group", "DDP on gloo's checked group under --debug-collectives: torch 2.14's DDP dies (SIGSEGV)",
         'return dist.new_group(backend="gloo", timeout=timeout)', "return None", file="common/harness.py"),
    # Issue 42: where the time goes (--profile's table, the epoch line's own_ms).
    Edit("profile_gloo_comm", "--profile blind to gloo: collectives run on gloo's own threads, not the training one",
         'comm = [span(e) for e in events if e["name"].startswith("gloo:")]', "comm = []",
         file="common/profiling.py"),
    Edit("profile_waits_compute", "an operator blocked on a collective (DTensor's wait_tensor) counted as compute",
         '            active.discard("compute")', "            pass", file="common/profiling.py"),
    Edit("profile_zero_wait", "a collective waited on inside optimizer.step (ZeRO's broadcast) counted as optimizer",
         '            active.add("wait")', "            pass", file="common/profiling.py"),
    Edit("own_ms_forward", "own_ms that counts DDP's wait for other ranks: timed from the call, not the inner forward",
         "            forward.register_forward_pre_hook(self._forward_starts)",
         "            model.register_forward_pre_hook(self._forward_starts, prepend=True)", file="common/utils.py"),
    # Issue 43: the preemption save (tests/test_preempt.py).
    Edit("preempt_vote", "each rank stops when SIGUSR1 reaches it, no vote: one saves while the others train",
         "stop = vote is not None and vote.wait() and ballot.item() > 0", "stop = bool(preempt)"),
    Edit("lm_preempt_vote", "each rank stops when SIGUSR1 reaches it, no vote: one saves while the others train",
         "agreed = self.work is not None and self.work.wait() and self.ballot.item() > 0",
         "agreed = bool(self.flag)", file="common/harness.py"),
    Edit("resume_bucket_layout", "no backward before a resumed DDP run's first step: other buckets, other roundings",
         "model(torch.zeros(1, 3, args.image_size, args.image_size, device=device)).sum().backward()",
         "pass"),
    Edit("lm_resume_bucket_layout", "no backward before a resumed DDP run's first step: other buckets, other roundings",
         "logits.float().sum().backward()  # the bucket order", "pass"),
    Edit("seeded_samples", "augmentation from the workers' streams: a run resumed mid-epoch crops other samples' way",
         "                torch.default_generator.manual_seed(seed)  # the CPU's alone (torch.manual_seed seeds the "
         "GPUs' too)\n", "",
         file="common/data.py"),
    Edit("skip_first", "a run resumed mid-epoch trains the epoch's first batches again",
         "return itertools.islice(iter(self.sampler), skip, None)", "return iter(self.sampler)",
         file="common/data.py"),
    Edit("restart_after_save", "MAX_RESTARTS restarts ranks that saved and exited 75 for a requeue",
         "self._remaining_restarts = 0  # as torch does", "pass  # as torch does", file="tools/torchrun.py"),
    Edit("torchelastic_left", "torchrun's log folder left to torchrun: a /tmp/torchelastic_* behind every launch",
         'args.log_dir = os.path.join(folder, "torchelastic")', "pass", file="tools/torchrun.py"),
    # Issue 43: --async-save (the crash while the thread writes: tests/test_fsdp.py, test_lm.py, test_lm_tp.py).
    Edit("async_named_early", "--async-save naming the shards in latest.pt as their write starts, not once written",
         *NAMED_EARLY, file="common/checkpoint.py"),
    Edit("lm_async_named_early", "--async-save naming the shards in latest.pt as their write starts, not once written",
         *NAMED_EARLY, file="common/checkpoint.py"),
    Edit("lm_async_cpu_copy", "--async-save without the copy in CPU memory: the thread writes what later steps changed",
         "saver.submit(write_checkpoint, cpu_copy(state),", "saver.submit(write_checkpoint, state,"),
    # Issue 58: what the language models teach (tests/test_lm*.py measure it in the recipes' own processes).
    Edit("lm_model_pt_atomic", "same numbers, model.pt written in place: a kill mid-write leaves it truncated",
         'save_atomic(state["model"], os.path.join(out_dir, "model.pt"))',
         'torch.save(state["model"], os.path.join(out_dir, "model.pt"))'),
    Edit("lm_model_pt_atomic_sharded", "same numbers, model.pt written in place: a kill mid-write leaves it truncated",
         'save_atomic(full, os.path.join(args.out_dir, "model.pt"))',
         'torch.save(full, os.path.join(args.out_dir, "model.pt"))'),
    Edit("lm_fsdp_block_kept", "same numbers, FSDP2's blocks kept gathered from forward to backward: one all-gather a "
         "block, a whole tp slice of every block held", '        fully_shard(block, mesh=mesh["dp"])',
         '        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)'),
    Edit("lm_fsdp_root_resharded", "same numbers, the root resharded after forward: gathered again for backward",
         '    fully_shard(model, mesh=mesh["dp"])',
         '    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)'),
    Edit("lm_pp_1f1b_is_gpipe", "same numbers, --schedule 1f1b running GPipe: every microbatch's activations held",
         'SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}',
         'SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": ScheduleGPipe}'),
    Edit("lm_tp_refuses_3", "lm_tp refusing --tp 3, which its docstring runs (256 bytes cut 86/86/84)",
         "    if args.sequence_parallel and args.seq_len % args.tp:  # New",
         "    if 256 % args.tp or args.sequence_parallel and args.seq_len % args.tp:  # New"),
    # Issue 57: what each image recipe's rank computes, holds and sends (docs/recipes.md's table), measured in the
    # recipes' own processes by tests/instrument.
    Edit("eval_rank0_alone", "same numbers, evaluation on rank 0 alone: it scores every sample while the others idle",
         "Subset(val_set, range(rank, len(val_set), world_size))",
         "Subset(val_set, range(len(val_set)) if rank == 0 else [])"),
    Edit("channels_last_inputs", "same numbers, --channels-last on the model alone: the first convolution gets NCHW",
         "images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))",
         "images = normalize(images.to(device, non_blocking=True))"),
    Edit("channels_last_model", "same numbers, --channels-last on the inputs alone: every weight stays NCHW",
         "build_model(args.arch, num_classes, args.image_size).to(device, memory_format=memory_format)",
         "build_model(args.arch, num_classes, args.image_size).to(device)"),
    Edit("fsdp_root_only", "same numbers, fully_shard on the root alone: one group, the whole model gathered at once",
         "    for block in blocks(model):\n        if not isinstance(block, FSDPModule):",
         "    for block in []:\n        if not isinstance(block, FSDPModule):"),
    Edit("fsdp_reshard_ignored", "same numbers, --no-reshard-after-forward ignored: each block gathered twice a step",
         "args.amp_dtype, args.reshard_after_forward)", "args.amp_dtype, True)"),
    Edit("fsdp_root_resharded", "same numbers, the root resharded after its forward: gathered again for backward",
         "                reshard_after_forward=False)",
         "                reshard_after_forward=reshard_after_forward)"),
    # Issue 57, the language models: what each rank computes and sends, measured in their own runs (lm_claims.py).
    Edit("lm_ddp_whole_batch", "same numbers, every DDP rank computes the whole batch: N times the compute",
         "lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, rank, world_size))",
         "lm.train_batch(train_text, step, args.seed, args.batch_size, args.seq_len, 0, 1))"),
    Edit("lm_loss_host_read", "same numbers, the loss read on the host every step: the CPU waits for the device",
         "meter.step(step, loss, args.batch_size * args.seq_len)",
         "meter.step(step, torch.tensor(loss.item()), args.batch_size * args.seq_len)"),
    Edit("lm_pp_loss_host_read", "same numbers, the last stage reads the loss on the host every step",
         "loss = torch.stack(losses).mean() if stage.is_last else None",
         "loss = torch.tensor(torch.stack(losses).mean().item()) if stage.is_last else None"),
    Edit("lm_ddp_find_unused", "same numbers, DDP searching for unused parameters: an extra all-reduce and host reads",
         "process_group=harness.ddp_process_group(timeout))",
         "process_group=harness.ddp_process_group(timeout), find_unused_parameters=True)"),
    Edit("lm_sp_ignored", "same numbers, --sequence-parallel that changes nothing: all-reduces and whole activations",
         "model = parallelize_module(model, mesh, tp_plan(args.sequence_parallel), src_data_rank=0)",
         "model = parallelize_module(model, mesh, tp_plan(False), src_data_rank=0)"),
    Edit("lm_eval_whole_dp_batch", "same numbers, lm_fsdp_tp evaluating a dp rank's whole batch at once: --accum-steps "
         "times training's micro-batch (out of memory at the first evaluation)",
         "per_dp // args.accum_steps,", "per_dp,"),
    Edit("lm_divergence_names_nothing", "a divergence's stop says no checkpoint was written beside a latest.pt",
         "last_good=latest)", "last_good=None)"),
    Edit("lm_dp_whole_batch", "same numbers, every dp rank computes the whole batch: dp times the compute",
         "args.seq_len, dp_rank, args.dp))", "args.seq_len, 0, 1))"),
    Edit("lm_checkpoint_recomputes_nothing", "same numbers, --activation-checkpointing that recomputes nothing: "
         "every activation kept", "model.blocks[name] = checkpoint_wrapper(block)",
         "model.blocks[name] = checkpoint_wrapper(block, checkpoint_fn=lambda block, *args, **kwargs: block(*args))"),
    # Issue 66: --compile in the language models, each block in place: torch.compile(block)'s result dropped leaves
    # the blocks eager, with no error (the test's run stops at its first step: no graph compiled).
    Edit("compile_dropped", "torch.compile(model) with its result dropped: --compile trains the model eager",
         "model.compile(dynamic=False)  # evaluation's", "torch.compile(model, dynamic=False)  # evaluation's"),
    Edit("lm_compile_dropped", "torch.compile(block) with its result dropped: --compile trains every block eager",
         "block.compile(dynamic=False)", "torch.compile(block, dynamic=False)"),
    # Resumes and heads (2026-11-30's reviews): model.pt through save_atomic where a recipe resumes; the flags a resume
    # must keep; ArcFace's fall past pi - m; PowerSGD's default start after the LR warm-up.
    Edit("save_module_atomic", "saving the wrapper's state_dict (keys with 'module.'), atomically",
         "save_atomic(model.module.state_dict(), path)", "save_atomic(model.state_dict(), path)"),
    Edit("resume_any_flags", "a resume with another --lr, --seed or --epochs goes on silently (the optimizer's saved "
         "learning rate overrules a new --lr)", '        check_same_run(path, ckpt.get("args", {}), same_run_as)\n',
         "        pass\n", file="common/checkpoint.py"),
    Edit("arcface_past_pi", "ArcFace's cos(t + m) past t = pi - m: the hardest samples pushed away from their class",
         "arc = torch.where(target > -np.cos(m), torch.cos(torch.acos(target) + m), target - m * np.sin(m))",
         "arc = torch.cos(torch.acos(target) + m)"),
    Edit("powersgd_start_uncapped", "PowerSGD's default start an epoch of warm-up, uncapped: a default one-epoch run "
         "never compresses", "max(2, warmup_steps(args.epochs, len(train_loader), args.warmup_epochs))",
         "max(2, round(args.warmup_epochs * len(train_loader)))"),
    # Issue 65: gpu_decode's workers hand over the files' bytes; the main process decodes.
    Edit("gpu_decode_pixels", "same numbers, the workers decode every file and hand over pixels: the GPU's work done "
         "by the CPU", 'if image.format == "JPEG" and image.mode in ("RGB", "L") and data.endswith(b"\\xff\\xd9"):',
         "if False:"),
    Edit("gpu_decode_global_generator", "each sample's box and flip drawn from torch's generator seeded for it: with "
         "--workers 0 DataLoaderX's thread and the step's dropout draw from it at once",
         "generator = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))",
         "generator = torch.default_generator.manual_seed(sample_seed(self.seed, self.epoch, index))"),
    Edit("gpu_decode_resume_reseed", "a resume reseeds with seed + rank: epoch 0's dropout draws again",
         "torch.manual_seed(args.seed + rank + 10_000 * step)", "torch.manual_seed(args.seed + rank)"),
    Edit("gpu_decode_resume_saved_step", "a resume mid-epoch takes the saved step less this run's epochs as its steps "
         "into the epoch: on another process count DistributedSampler's padding counts other epochs, and it skips "
         "samples or fails",
         'in_epoch_at_start = ckpt.get("in_epoch", ckpt["step"] - start_epoch * steps_per_epoch)',
         'in_epoch_at_start = ckpt["step"] - start_epoch * steps_per_epoch'),
    Edit("gpu_decode_val_workers_late", "gpu_decode's validation workers first forked at the first evaluation, just "
         "after the training workers shut down in DataLoaderX's thread: a fork that can deadlock (CPython gh-112275)",
         "        torch.utils.data.DataLoader.__iter__(val_loader)", "        pass"),
    Edit("fsdp_unused_state", "fsdp's resume asks the shards for a momentum buffer of every parameter, as "
         "get_state_dict's first step makes them: a model with a parameter that gets no gradient cannot resume",
         'del optim_state["state"][name]', "pass"),
    Edit("resume_saved_step", "a resume counts steps as the checkpoint did: with another batch its epochs end off "
         "their boundaries and it stops early, unsaved",
         "        step = start_epoch * len(train_loader)\n", '        step = ckpt["step"]\n'),
    Edit("o2_masters_before_wrap", "apex_amp's torch O2 keeps the fp32 masters made before the DDP wrap: each rank "
         "trains from its own initial weights, not rank 0's",
         "        masters.copy_from_model()  # O2: the wrap gave", "        pass  # O2: the wrap gave"),
    Edit("resume_mid_epoch_anywhere", "a recipe that resumes at an epoch's end takes ddp_checkpoint.py's mid-epoch "
         "save: the epoch's first steps train twice",
         '        if ckpt.get("step_in_epoch"):', "        if False:"),
    Edit("lm_eval_stand_in", "an evaluation out of windows runs an empty batch: that rank raises in the attention's "
         "view, the others wait in its collectives",
         "        x, y = (x, y) if scored else (inputs[:1].to(device), targets[:1].to(device))", "        pass"),
    # Issue 67: mixture of experts, expert parallelism (recipes/lm_moe.py).
    Edit("lm_moe_model_pt_dense_sent", "same numbers, model.pt's ranks 1 .. ep - 1 send rank 0 their dense weights "
         "too, which it holds", '(rank < ep and ".experts." in k)', "(rank < ep)"),
    Edit("lm_moe_expert_grads_everywhere", "each expert's gradient all-reduced over every rank: other ranks' experts "
         "summed into it", "all_reduce_gradients(experts, dp_group, world_size)",
         "all_reduce_gradients(experts, None, world_size)"),
    Edit("lm_moe_expert_grads_by_dp", "the experts' gradients divided by their dp group's size, not the world's: "
         "ep times too large", "all_reduce_gradients(experts, dp_group, world_size)",
         "all_reduce_gradients(experts, dp_group, args.dp)"),
    Edit("lm_moe_local_clip", "the clip's norm from this rank's experts alone, not every expert's",
         "    dist.all_reduce(expert_sq, group=ep_group)\n", "\n"),
    Edit("lm_moe_balance_local", "the balance loss from this rank's rows per expert, not the global batch's",
         "    dist.all_reduce(load)  # every rank's rows per expert: the global batch's balance\n", "\n"),
    Edit("lm_moe_same_experts_everywhere", "every rank of an ep group keeps the first E / ep experts",
         "self.first, self.ep, self.group = ep_rank * share, ep, group",
         "self.first, self.ep, self.group = 0, ep, group"),
    Edit("lm_moe_gates_not_renormalised", "the top-k gates left as the softmax gave them, not renormalised over k",
         "gates = gates / gates.sum(-1, keepdim=True)", "gates = gates"),
    Edit("lm_moe_unsorted_dispatch", "rows sent in token order, not grouped by destination: tokens reach other "
         "experts", "order = chosen.flatten().argsort(stable=True)",
         "order = torch.arange(chosen.numel(), device=x.device)"),
    Edit("lm_moe_rows_fp32", "same numbers, the rows cross the all-to-alls in fp32 under bf16 autocast: twice the "
         "bytes",
         "rows = rows.to(torch.get_autocast_dtype(x.device.type))", "rows = rows"),
    # Issue 67's four claims (docs/lm.md's table: holds, sends, runs, reduces), each broken with the losses kept.
    Edit("lm_moe_dropped_experts_kept", "same numbers, the cut keeps the other ranks' experts alive (a list holds "
         "them): every rank holds every expert's weights, the model's own state bytes unchanged",
         "                del self.experts[str(e)]",
         '                self.dropped = [*getattr(self, "dropped", []), self.experts.pop(str(e))]'),
    Edit("lm_moe_rows_to_every_rank", "same numbers, each rank's rows all sent to every ep rank, each receiver "
         "keeping those for its experts: ep times the dispatch's rows",
         "            rows = AllToAll.apply(rows, send, receive, self.group)",
         "            if torch.is_grad_enabled():  # training: as many rows from each rank (each its B / world)\n"
         "                rows = AllToAll.apply(torch.cat([rows.roll(-sum(send[:i]), 0) for i in range(self.ep)]),\n"
         "                                      [len(rows)] * self.ep, [len(rows)] * self.ep, self.group)\n"
         "                rows = torch.cat([c[:n] for c, n in zip(rows.split(len(rows) // self.ep), receive)])\n"
         "            else:\n"
         "                rows = AllToAll.apply(rows, send, receive, self.group)"),
    Edit("lm_moe_experts_on_every_row", "same numbers, each expert run on every row that arrived, its own rows kept: "
         "E / ep times the experts' compute",
         "        out = torch.cat([self.experts[str(self.first + e)](piece) for e, piece in enumerate(pieces)])",
         "        out = torch.cat([self.experts[str(self.first + e)](rows[by_expert]).split(per_expert)[e]\n"
         "                         for e in range(len(pieces))])"),
    Edit("lm_moe_expert_grads_world_zeroed", "same numbers, the experts' gradients all-reduced over every rank, each "
         "ep rank's in its own slot and zeros in the others': ep times the bytes, over the world group",
         "        all_reduce_gradients(experts, dp_group, world_size)",
         "        slots = torch.zeros(args.ep, sum(p.numel() for p in experts), device=device)\n"
         "        slots[ep_rank] = torch.cat([p.grad.flatten() for p in experts])  # the others' experts: zeros\n"
         "        dist.all_reduce(slots)\n"
         "        for p, piece in zip(experts, (slots[ep_rank] / world_size).split([p.numel() for p in experts])):\n"
         "            p.grad.copy_(piece.view_as(p))"),
    Edit("channels_last_eval", "same numbers, --channels-last in training alone: evaluation's convolutions get NCHW",
         "images = normalize(images.to(device, non_blocking=True, memory_format=memory_format))  # New: as in training",
         "images = normalize(images.to(device, non_blocking=True))  # New: as in training"),
    Edit("spawn_loader_fork", "same numbers, ddp_spawn's DataLoader workers started by spawn (mp.spawn's own start "
         "method, which its workers inherit): each a fresh interpreter that imports torch again",
         'loader_args["multiprocessing_context"] = "fork"', "pass"),
]
# The tests that guard a recipe by default: its conformance cases (a -k expression); ddp_uneven's own reference loop
# (every rank's batches); a language model's own file (test_lm.py guards the base, test_lm_tp.py its sibling).
CONFORMANCE = "tests/test_conformance.py"
PREEMPT = "tests/test_preempt.py"


def own_tests(recipe):
    if recipe.startswith("lm_"):
        return [f"tests/test_{recipe.replace('_ddp', '')}.py"]
    if recipe == "ddp_uneven":
        return ["tests/test_uneven.py", "-k", "equals_the_reference"]
    if recipe == "gpu_decode":  # its own reference loop, fed its samples one at a time (issue 65)
        return ["tests/test_gpu_decode.py"]
    # "[dp]" but not "[apex_ddp]", "[apex_amp:O0]" to "[apex_amp:O3]".
    return [CONFORMANCE, "-k", f"[{recipe}] or [{recipe}:"]


def cases(recipe, test):
    """One test of a recipe's conformance cases (a -k expression)."""
    return [CONFORMANCE, "-k", f"{test} and ([{recipe}] or [{recipe}:)"]


# Which recipes each edit is tried on, and the tests that guard it there: one mapping. An edit named here is tried on
# the recipes it names (each guarded by the tests given: a list, or a function of the recipe) and, under ANY, on
# every other recipe of its family whose file holds its text; an edit not named here is tried on every such recipe,
# guarded by own_tests(). The family: lm_* edits on the language models, the others on the image recipes. An edit of
# a file of common/ or tools/ (Edit.file) is tried on the recipes it names only.
ANY = "*"
ASYNC_CRASH = ["-k", "crash_while_an_async_save"]
DIVERGENCE = "tests/test_divergence.py"
ZERO_THIRD = "tests/test_recipe_variants.py::test_zero_gives_each_of_three_ranks_about_a_third_of_the_optimizer_state"
ZERO_RESUME = ("tests/test_recipe_variants.py::"
               "test_zero_checkpoint_from_two_ranks_resumes_on_three_as_plain_ddp_resumes_it")
POWERSGD_RESUME = "tests/test_comm_hooks.py::test_powersgd_resumes_on_another_world_size"
MOE_CLAIMS = ("tests/test_lm_moe.py::"
              "test_each_rank_sends_what_its_router_chose_runs_its_own_experts_and_reduces_them_over_its_dp_group[ep2]")
GUARDS = {
    # Edits that one recipe's test guards for all (the drills run ddp_torchrun; the conformance case with
    # --debug-collectives is ddp_launch's on 3 processes), and that test.
    "async_named_early": {"fsdp": ["tests/test_fsdp.py", *ASYNC_CRASH]},
    "lm_async_named_early": {"lm_tp": ["tests/test_lm_tp.py", *ASYNC_CRASH]},
    "lm_async_cpu_copy": {"lm_ddp": ["tests/test_lm.py", *ASYNC_CRASH]},
    "hang_stacks": {"ddp_torchrun": ["tests/test_failures.py", "-k", "diverging_ranks"]},
    "debug_level": {"ddp_torchrun": ["tests/test_failures.py", "-k", "debug_collectives"]},
    "ddp_checked_group": {"ddp_launch": [CONFORMANCE, "-k", "[ddp_launch:3]"]},
    "profile_gloo_comm": {"ddp_torchrun": ["tests/test_profile.py", "-k", "cpu_step"]},
    "profile_waits_compute": {"ddp_torchrun": ["tests/test_profile.py", "-k", "cpu_step"]},
    "profile_zero_wait": {"ddp_torchrun": ["tests/test_profile.py", "-k", "cpu_step"]},
    "own_ms_forward": {"ddp_torchrun": ["tests/test_common.py", "-k", "own_ms"]},
    "preempt_vote": {"ddp_checkpoint": [PREEMPT, "-k", "3-self"]},
    "lm_preempt_vote": {"lm_ddp": ["tests/test_lm.py", "-k", "sigusr1"]},
    "resume_bucket_layout": {"ddp_checkpoint": [PREEMPT, "-k", "3-self"]},
    "lm_resume_bucket_layout": {"lm_ddp": ["tests/test_lm.py", "-k", "sigusr1"]},
    "lm_model_pt_atomic": {"lm_ddp": ["tests/test_lm.py", "-k", "model_pt"]},
    "lm_model_pt_atomic_sharded": {"lm_tp": ["tests/test_lm_tp.py", "-k", "model_pt"]},
    "lm_fsdp_block_kept": {"lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "all_gathers"]},
    "lm_fsdp_root_resharded": {"lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "all_gathers"]},
    "lm_eval_whole_dp_batch": {"lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k",
                                              "all_gathers or mesh_with_accumulation"]},
    # lm_ddp's and lm_moe's drills stop before any save: the three that save step 1 first tell
    "lm_divergence_names_nothing": {r: [f"tests/test_{r}.py", "-k", "diverged"]
                                    for r in ("lm_tp", "lm_pp", "lm_fsdp_tp")},
    "lm_pp_1f1b_is_gpipe": {"lm_pp": ["tests/test_lm_pp.py", "-k", "order"]},
    "lm_tp_refuses_3": {"lm_tp": ["tests/test_lm_tp.py", "-k", "3_ranks"]},
    "spawn_loader_fork": {"ddp_spawn": ["tests/test_failures.py", "-k", "ctrl_c and ddp_spawn"]},
    # In epoch 1 a fresh run's workers draw the same streams again: the stop in epoch 2 tells.
    "seeded_samples": {"ddp_checkpoint": [PREEMPT, "-k", "3-self"]},
    "skip_first": {"ddp_checkpoint": [PREEMPT, "-k", "2-launcher"]},
    "restart_after_save": {"ddp_checkpoint": [PREEMPT, "-k", "2-launcher"]},
    "torchelastic_left": {"ddp_torchrun": ["tests/test_warm_path.py", "-k", "two_paths and ddp_torchrun"]},
    # The heads per rank matter only where heads are cut (common/lm.py).
    "lm_heads_per_rank": {"lm_tp": own_tests, "lm_fsdp_tp": own_tests},
    # What the CPU cannot see in a conformance run: a checkpoint tagged as saved on cuda:1 must be loaded with
    # map_location, by each recipe's resume test.
    "map_location": {
        "ddp_checkpoint": ["tests/test_recipe_variants.py::test_resume_reproduces_the_uninterrupted_run_bitwise"],
        "torch_amp": ["tests/test_recipe_variants.py::test_fp16_trains_and_the_scaler_state_survives_resume"],
        "apex_amp": ["tests/test_apex.py::test_torch_mode_checkpoint_restores_the_scaler_and_refuses_another_impl"],
        "ddp_zero": [ZERO_RESUME],
        "ddp_comm_hooks": [POWERSGD_RESUME]},
    # ddp_checkpoint and fsdp restore the RNG state on the same world size (the conformance resume): only a resume on
    # another world size reaches the reseed.
    "resume_reseed": {
        "ddp_checkpoint": ["tests/test_recipe_variants.py::"
                           "test_resumed_random_streams_continue_on_the_same_world_size_and_replay_no_epoch_on_another"],
        "fsdp": ["tests/test_fsdp.py::test_a_checkpoint_from_two_ranks_resumes_on_another_world_size"],
        "ddp_zero": [ZERO_RESUME], "ddp_comm_hooks": [POWERSGD_RESUME], ANY: own_tests},
    "divergence_check": {ANY: lambda recipe: [DIVERGENCE, "-k", f"[{recipe}] or [{recipe}:"]},
    # The broadcasts ZeRO's step makes are counted (tests/instrument) by its test on resnet18's 62 parameter tensors.
    "zero_bucket_view": {ANY: [ZERO_THIRD]},
    # In the conformance run every rank has as many validation batches as the others; tests/test_fsdp.py's runs do not.
    "eval_lockstep": {ANY: ["tests/test_fsdp.py"]},
    # ddp_comm_hooks' conformance runs --comm-hook none (DDP's own all-reduce): tests/test_comm_hooks.py the hooks.
    "comm_hook": {ANY: ["tests/test_comm_hooks.py"]},
    "powersgd_state": {ANY: ["tests/test_comm_hooks.py"]},
    "powersgd_mean_error": {ANY: ["tests/test_comm_hooks.py"]},
    # Issue 57: the measurements in the recipes' own processes (tests/instrument).
    "gpu_decode_pixels": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "handed"]},
    "gpu_decode_global_generator": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "thread"]},
    "gpu_decode_resume_reseed": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "resumed_mid_epoch_ends"]},
    "gpu_decode_resume_saved_step": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "more_processes"]},
    "gpu_decode_val_workers_late": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "nothing_decodes"]},
    "fsdp_unused_state": {"fsdp": ["tests/test_fsdp.py", "-k", "no_gradient"]},
    "eval_rank0_alone": {"gpu_decode": ["tests/test_gpu_decode.py", "-k", "handed"],
                         "ddp_uneven": ["tests/test_uneven.py", "-k", "equals_the_reference and cpu:2"],
                         ANY: lambda recipe: cases(recipe, "disjoint_share")},
    "channels_last_inputs": {"torch_amp": cases("torch_amp", "layout")},
    "channels_last_model": {"torch_amp": cases("torch_amp", "layout")},
    "fsdp_root_only": {"fsdp": cases("fsdp", "gathers_each_block")},
    "fsdp_reshard_ignored": {"fsdp": ["tests/test_fsdp.py", "-k", "no_reshard_after_forward"]},
    "fsdp_root_resharded": {"fsdp": cases("fsdp", "gathers_each_block")},
    "lm_ddp_whole_batch": {"lm_ddp": ["tests/test_lm.py", "-k", "slice_and_sends"]},
    "lm_loss_host_read": {"lm_ddp": ["tests/test_lm.py", "-k", "slice_and_sends"],
                          "lm_tp": ["tests/test_lm_tp.py", "-k", "whole_batch"],
                          "lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "tp_group_shares"]},
    "lm_pp_loss_host_read": {"lm_pp": ["tests/test_lm_pp.py", "-k", "neighbours"]},
    "lm_ddp_find_unused": {"lm_ddp": ["tests/test_lm.py", "-k", "slice_and_sends"]},
    "lm_sp_ignored": {"lm_tp": ["tests/test_lm_tp.py", "-k", "whole_batch"]},
    "lm_dp_whole_batch": {"lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "tp_group_shares"]},
    "lm_checkpoint_recomputes_nothing": {"lm_ddp": ["tests/test_lm.py", "-k", "again_in_backward"],
                                         "lm_pp": ["tests/test_lm_pp.py", "-k", "another_number_of_stages"],
                                         "lm_tp": ["tests/test_lm_tp.py", "-k", "reshards_onto"],
                                         "lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "goes_on_at"]},
    "channels_last_eval": {"torch_amp": cases("torch_amp", "layout")},
    # ddp_compile's; on torch_amp and gpu_decode its text makes compile_dropped's mutant, which the test that compiles
    # them guards (test_recipe_variants: no two edits make one mutant).
    "compile_result": {"ddp_compile": own_tests},
    "compile_dropped": {"torch_amp": ["tests/test_gpu_bench.py", "-k", "data_section"],
                        "gpu_decode": ["tests/test_gpu_bench.py", "-k", "data_section"]},
    # lm_moe's four claims: its --ep 2 run's records (the cheapest of the claims test's layouts notices each).
    **{name: {"lm_moe": [MOE_CLAIMS]} for name in ("lm_moe_dropped_experts_kept", "lm_moe_rows_to_every_rank",
                                                   "lm_moe_experts_on_every_row", "lm_moe_expert_grads_world_zeroed",
                                                   "lm_moe_model_pt_dense_sent")},
    "resume_saved_step": {"fsdp": ["tests/test_fsdp.py", "-k", "other_steps_per_epoch"]},
    **{"resume_mid_epoch_anywhere": {recipe: ["tests/test_preempt.py", "-k", "2-launcher"]
                                     for recipe in ("ddp_zero", "ddp_comm_hooks")}},
    "lm_eval_stand_in": {"lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "2x2_mesh_with"],
                         "lm_moe": ["tests/test_lm_moe.py", "-k", "trains_the_one_process_model and ep2"]},
    "resume_any_flags": {
        "ddp_checkpoint": ["tests/test_failures.py", "-k", "wrong_or_truncated and ddp_checkpoint"],
        "ddp_zero": ["tests/test_recipe_variants.py", "-k", "resume_with_other_epochs and ddp_zero"],
        "ddp_comm_hooks": ["tests/test_recipe_variants.py", "-k", "resume_with_other_epochs and ddp_comm_hooks"],
        "fsdp": ["tests/test_fsdp.py", "-k", "another_arch"]},
    "arcface_past_pi": {"mx_face_prefetch": ["tests/test_mx_face.py", "-k", "arcface_target"]},
    "powersgd_start_uncapped": {"ddp_comm_hooks": ["tests/test_comm_hooks.py", "-k", "by_default"]},
    "lm_compile_dropped": {"lm_ddp": ["tests/test_lm.py", "-k", "compiled"],
                           "lm_tp": ["tests/test_lm_tp.py", "-k", "compiled"],
                           "lm_pp": ["tests/test_lm_pp.py", "-k", "compiled"],
                           "lm_fsdp_tp": ["tests/test_lm_fsdp_tp.py", "-k", "compiled"]},
}


def plan(recipes, edits):
    """[(recipe, edit, the tests that guard it there)]: each edit on each recipe GUARDS gives it, in that order."""
    mutants = []
    for recipe in recipes:
        for edit in edits:
            guards = GUARDS.get(edit.name, {ANY: own_tests})
            family = recipe.startswith("lm_") == edit.name.startswith("lm_")
            tests = guards.get(recipe, guards.get(ANY) if family and not edit.file else None)
            if tests is not None and edit.old in (REPO / (edit.file or f"recipes/{recipe}.py")).read_text():
                mutants.append((recipe, edit, tests(recipe) if callable(tests) else tests))
    return mutants


def scratch_copy(into):
    """The working tree as git sees it (tracked and untracked, not ignored): no .venv, no runs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def check(recipe, edit, tests, timeout):
    with tempfile.TemporaryDirectory(prefix=f"mutant_{recipe}_{edit.name}_") as tmp:
        tree = Path(tmp)
        scratch_copy(tree)
        path = tree / (edit.file or f"recipes/{recipe}.py")
        text = path.read_text()
        mutated = text.replace(edit.old, edit.new)
        try:  # an edit that breaks the syntax would be "noticed" by any test: say so instead
            compile(mutated, str(path), "exec")
        except SyntaxError as exc:
            return {"recipe": recipe, "edit": edit.name, "pitfall": edit.pitfall, "outcome": "INVALID edit",
                    "seconds": 0.0, "tests": f"the edited file does not compile: {exc}"}
        path.write_text(mutated)
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                   *tests], cwd=tree, capture_output=True, text=True,
                                  timeout=timeout)
            outcome = "noticed" if proc.returncode == 1 else "MISSED" if proc.returncode == 0 else (
                f"error (pytest exit {proc.returncode})")
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        except subprocess.TimeoutExpired:
            outcome, summary = "noticed", f"the tests did not finish within {timeout} s (a hang)"
        return {"recipe": recipe, "edit": edit.name, "pitfall": edit.pitfall, "outcome": outcome,
                "seconds": round(time.monotonic() - start, 1), "tests": summary}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", help="comma-separated recipe names (default: every recipe in recipes/)")
    p.add_argument("--edits", help=f"comma-separated edits (default: all: {', '.join(e.name for e in EDITS)})")
    p.add_argument("--timeout", type=float, default=600, help="seconds one mutant's tests may take")
    p.add_argument("--out", help="also write the results here as JSON")
    p.add_argument("--jobs", type=int, default=1,
                   help="mutants whose tests run at once, each in its own scratch tree (default 1)")
    args = p.parse_args(argv)
    recipes = args.recipes.split(",") if args.recipes else sorted(f.stem for f in (REPO / "recipes").glob("*.py"))
    edits = EDITS if not args.edits else [e for e in EDITS if e.name in args.edits.split(",")]
    unknown = [r for r in recipes if not (REPO / "recipes" / f"{r}.py").is_file()] + [
        e for e in (args.edits.split(",") if args.edits else []) if e not in {x.name for x in EDITS}]
    if unknown:
        p.error(f"unknown recipe or edit: {', '.join(unknown)}")
    mutants = plan(recipes, edits)
    print(f"{len(mutants)} mutants: each edit on each recipe that contains its text", flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        running = [pool.submit(check, recipe, edit, tests, args.timeout) for recipe, edit, tests in mutants]
        for i, future in enumerate(concurrent.futures.as_completed(running), 1):
            results.append(r := future.result())
            print(f"[{i}/{len(mutants)}] {r['outcome']:8} {r['recipe']:17} {r['edit']:14} {r['seconds']:6.1f} s  "
                  f"{r['tests']}", flush=True)
    missed = [r for r in results if r["outcome"] != "noticed"]
    print(f"\n{len(results) - len(missed)} of {len(results)} edits noticed"
          + (f"; missed: {', '.join(r['recipe'] + ':' + r['edit'] for r in missed)}" if missed else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}, indent=1) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
