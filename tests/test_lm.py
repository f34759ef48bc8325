"""The language-model base recipe (recipes/lm_ddp.py) against a single-process reference loop, on real text.

The reference below is the plainest loop that trains common/lm.py's Transformer: one process, no DDP, the batches
common.lm.train_batch draws for (seed, step), AdamW with the recipe's groups, the warm-up + cosine schedule, global
norm clipping. lm_ddp.py on 1, 2 and 3 processes must end where it ends: DDP averages the ranks' mean gradients, which
equals the whole batch's mean gradient up to the order of float additions (1e-6 after 8 steps; a wrong shard, a
missing all-reduce or a rank that drew other windows moves weights by 1e-3 and more).
"""

import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import LM_RECIPES, launch, load_recipe, max_diff, params, result_of, run_direct
from jobs import error_lines
from lm_checks import (
    blocks_per_step,
    claims_env,
    comms_per_step,
    compiled_matches_eager,
    kept_at_the_defaults,
    killed_while_saving_resumes_bitwise,
    killed_while_writing_model_pt_leaves_the_last_one,
    only,
    plain_steps,
    saved_per_step,
    stops_and_resumes_bitwise,
    tokens_seen,
)

from common.lm import Transformer, read_text, split, train_batch, val_windows
from common.schedule import warmup_cosine

TINY = dict(n_layer=2, n_head=4, d_model=32, block_size=32, seq_len=16, batch_size=12, steps=8, warmup_steps=2,
            lr=3e-3, weight_decay=0.1, clip_grad=1.0, seed=0, val_windows=12)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()] + ["--eval-every", "4"]
TINY_MODEL = {k: TINY[k] for k in ("n_layer", "n_head", "d_model", "block_size")}  # Transformer(**TINY_MODEL)
TOLERANCE = 1e-5  # fp32 weights after 8 AdamW steps; measured 1e-7 to 1e-6 (the order of the gradient sums)


def reference(steps=TINY["steps"], **over):
    """(state_dict, val_loss, per-step losses) of the single-process loop."""
    c = {**TINY, **over}
    train, val = split(read_text(None)[0])
    torch.manual_seed(c["seed"])
    model = Transformer(c["n_layer"], c["n_head"], c["d_model"], c["block_size"])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=c["lr"], betas=(0.9, 0.95))
    sched = warmup_cosine(opt, 1, c["steps"], c["warmup_steps"] / c["steps"])
    losses = []
    for step in range(steps):
        x, y = train_batch(train, step, c["seed"], c["batch_size"], c["seq_len"], 0, 1)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip_grad"])
        opt.step()
        sched.step()
        losses.append(loss.item())
    with torch.no_grad():
        vx, vy = val_windows(val, c["seq_len"], c["val_windows"])
        val_loss = F.cross_entropy(model(vx).flatten(0, 1), vy.flatten()).item()
    return model.state_dict(), val_loss, losses


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """lm_ddp.py with FLAGS (and `flags`) on `world` processes, once per (world, flags) in this module: (the
    CompletedProcess, its --out-dir)."""
    done = {}

    def run(world, *flags):
        key = (world, *map(str, flags))
        if key not in done:
            out = tmp_path_factory.mktemp(f"straight{world}{''.join(key[1:])}")
            # What each rank computes and sends, logged by tests/instrument/lm_claims.py into claims(out).
            env = claims_env(claims(out), comms=key == (2,))
            done[key] = (launch("recipes/lm_ddp.py", f"cpu:{world}", *FLAGS, *flags, "--out-dir", out, env=env), out)
        return done[key]
    return run


def claims(out):
    """Where straight() logs a run's tokens, block forwards, collectives (tests/lm_checks.py's claims_env) and what
    autograd saves (COUNT_SAVED_DIR: lm_checks' saved_per_step)."""
    return out.with_name(f"{out.name}_claims")


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2,  # 2 in the quick tier: 12 s
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_lm_ddp_equals_the_single_process_reference(straight, ref, world):
    weights, val_loss, _ = ref
    proc, out = straight(world)
    result = result_of(proc)
    assert (result["world_size"], result["steps"], result["start_step"], result["val_windows"]) == (world, 8, 0, 12)
    assert result["val_loss"] == pytest.approx(val_loss, rel=1e-5)
    assert result["val_bpb"] == pytest.approx(val_loss / math.log(2), rel=1e-5)
    saved = params(out / "model.pt")
    assert max_diff(saved, weights) < TOLERANCE
    # The control: the reference moved the weights well beyond the tolerance.
    torch.manual_seed(0)
    initial = Transformer(2, 4, 32, 32).state_dict()
    assert max_diff(weights, initial) > 1e-3
    assert "steps=" not in proc.stdout  # the log says step=k/steps
    assert [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("step=")] == ["step=4/8",
                                                                                                 "step=8/8"]


def test_each_ddp_rank_computes_its_slice_and_sends_each_gradient_once_a_step(straight):
    # docs/lm.md's table for lm_ddp (issue 57), measured in the quick tier's 2-process run above by
    # tests/instrument/lm_claims.py, in the recipe's own processes: the token windows each rank's model received, the
    # collectives and host reads of each step, by kind, group and bytes.
    proc, out = straight(2)
    train, val = split(read_text(None)[0])
    seen = [tokens_seen(claims(out), rank) for rank in (0, 1)]
    for step in range(TINY["steps"]):  # computes: rank r the r-th half of step k's batch: disjoint, all of it
        whole = train_batch(train, step, TINY["seed"], TINY["batch_size"], TINY["seq_len"], 0, 1)[0].tolist()
        mine = [[line["rows"] for line in lines if line["train"] and line["step"] == step] for lines in seen]
        assert [len(forwards) for forwards in mine] == [1, 1], (step, mine)  # one forward a step
        assert mine[0][0] + mine[1][0] == whole, step
    windows = val_windows(val, TINY["seq_len"], TINY["val_windows"])[0]
    for rank, lines in enumerate(seen):  # validation: rank r windows r, r + 2, ..., each scored once
        assert [row for line in lines if not line["train"] and line["step"] == 4 for row in line["rows"]] == \
            windows[rank::2].tolist()
        assert {line["dtype"] for line in lines} == {"float32"}  # --amp-dtype fp32: fp32 logits
    # holds: the whole model on every rank (parameters, gradients, AdamW's two moments, its step counters)
    model = Transformer(**TINY_MODEL)
    numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert result_of(proc)["state_bytes_per_rank"] == [16 * numel + 4 * tensors] * 2
    sends_every_gradient_once_a_step(claims(out), TINY["steps"])
    for rank in (0, 1):
        assert blocks_per_step(claims(out), rank) == [{"forward": TINY["n_layer"], "recomputed": 0}] * 8


def sends_every_gradient_once_a_step(folder, steps):
    """lm_ddp's sends, counted on 2 ranks into `folder` (claims_env) over `steps` steps: in each step of
    plain_steps, one all-reduce of every gradient in backward and the stop vote, nothing else."""
    numel = sum(p.numel() for p in Transformer(**TINY_MODEL).parameters())
    for rank in (0, 1):
        counted = comms_per_step(folder, rank)
        assert len(counted) == steps
        for k in plain_steps(steps, 4):
            # sends: DDP's all-reduce(s) of the gradients in backward, every gradient once (fp32), over both ranks
            backward = only(counted[k - 1], "backward")
            # one bucket at this size (DDP's first holds 1 MB): one all-reduce of every gradient, in fp32
            assert backward == [(("allreduce_", "backward", (0, 1), 4 * numel), 1)], (k, backward)
            assert only(counted[k - 1], "forward") == [], k  # no buffers to broadcast
            # and nothing else but the stop vote (an all-reduce on its own group, its CPU ballot read a step later):
            # the loss is summed on the device, no all-reduce and no host read of it per step
            assert only(counted[k - 1], "step") == [(("allreduce_", "step", (0, 1), 4), 1),
                                                    (("item", "step", "common/harness.py:all_reduce_max", 4), 1)], k


@pytest.mark.slow  # a 2-step run on one process: 5-10 s
def test_bf16_autocast_gives_bf16_logits_and_a_fp32_loss(straight):
    # --amp-dtype bf16, in the recipe's process (tests/instrument/lm_claims.py: the dtype of each forward's output):
    # the matrix products under autocast, so the head's logits come out bf16, in training and in evaluation; the
    # loss is the recipe's, in fp32 (.float() before the cross-entropy): the RESULT line's train_loss is a number.
    proc, out = straight(1, "--amp-dtype", "bf16", "--max-steps", "2")
    assert result_of(proc)["steps"] == 2
    lines = tokens_seen(claims(out), 0)
    assert [(line["train"], line["dtype"]) for line in lines] == [(True, "bfloat16")] * 2 + [(False, "bfloat16")]


@pytest.mark.slow  # the resume test's run with --activation-checkpointing (alone: 10-15 s)
def test_activation_checkpointing_runs_each_block_forward_again_in_backward(straight):
    # --activation-checkpointing, counted in the recipe's processes (tests/instrument/lm_claims.py: common.lm.Block's
    # forwards, those inside autograd's backward apart): each step every block's forward once, then once more in
    # backward, rebuilding what its backward needs. The weights are bitwise those of the run without it (the resume
    # test above).
    _, out = straight(2, "--activation-checkpointing")
    for rank in (0, 1):
        assert blocks_per_step(claims(out), rank) == [{"forward": TINY["n_layer"],
                                                       "recomputed": TINY["n_layer"]}] * TINY["steps"]


@pytest.mark.slow  # the runs above, shared
def test_activation_checkpointing_keeps_each_block_s_input_alone_for_backward(straight):
    # docs/lm.md's table (issue 57), counted in the recipe's own processes (tests/instrument/lm_claims.py's
    # COUNT_SAVED_DIR: what autograd saves between each training forward's start and its backward, each storage
    # once, parameters left out), on the 2-process runs with and without --activation-checkpointing: the same model
    # and batches. Without it each block keeps what its backward needs; with it nothing inside a block's forward is
    # kept, and the bytes kept are those outside the blocks (the embeddings' indices, the final norm, the head, the
    # loss) plus each block's input: one (B / N, T, D) fp32 tensor a block.
    _, plain_out = straight(2)
    _, ac_out = straight(2, "--activation-checkpointing")
    block_input = 4 * TINY["batch_size"] // 2 * TINY["seq_len"] * TINY["d_model"]
    numel = sum(p.numel() for p in Transformer(**TINY_MODEL).parameters())
    for rank in (0, 1):
        plain, ac = saved_per_step(claims(plain_out), rank), saved_per_step(claims(ac_out), rank)
        assert len(plain) == len(ac) == TINY["steps"]
        for k, ([p], [a]) in enumerate(zip(plain, ac, strict=True), 1):  # one backward a step
            assert p["saved_in_blocks"] > 0 and a["saved_in_blocks"] == 0, (rank, k, p, a)
            assert a["saved"] == p["saved"] - p["saved_in_blocks"] + TINY["n_layer"] * block_input, (rank, k, p, a)
            assert a["saved"] < p["saved"] / 2, (rank, k, p, a)
            assert a["grads"] == p["grads"] == 4 * numel, (rank, k, p, a)  # the whole model's gradients, either way
    print(f"lm_ddp on 2 ranks: {p['saved']} bytes saved for backward a rank, {a['saved']} with "
          "--activation-checkpointing")


@pytest.mark.slow  # real multi-process launches: 10-60 s
def test_lm_ddp_resumes_exactly_and_activation_checkpointing_changes_nothing(straight, tmp_path):
    # 2 processes: 4 steps, stop, --resume auto to 8, equal to the straight run bitwise (the data follow from the
    # step; AdamW's moments and the schedule are in latest.pt). Then the straight run again with every block
    # recomputed in backward: the same floating-point operations, so the same weights bitwise.
    unstopped, unstopped_out = straight(2)  # the quick tier's run above
    first, first_out = straight(2, "--max-steps", "4")  # shared with the kill mid-write below
    shutil.copytree(first_out, tmp_path / "pieced")
    # --max-steps counts this run's steps: the same short command again goes on from 4 to 6, then to the end.
    middle = launch("recipes/lm_ddp.py", "cpu:2", *FLAGS, "--max-steps", "2", "--resume", "auto",
                    "--out-dir", tmp_path / "pieced")
    assert (result_of(middle)["start_step"], result_of(middle)["steps"]) == (4, 6)
    resumed = launch("recipes/lm_ddp.py", "cpu:2", *FLAGS, "--resume", "auto", "--out-dir", tmp_path / "pieced")
    ac, ac_out = straight(2, "--activation-checkpointing")  # shared with the recomputation's count below
    assert (result_of(first)["steps"], result_of(resumed)["start_step"], result_of(resumed)["steps"]) == (4, 6, 8)
    assert f"resume: {tmp_path / 'pieced/latest.pt'} at step 6" in resumed.stdout
    want = params(unstopped_out / "model.pt")
    assert max_diff(params(tmp_path / "pieced/model.pt"), want) == 0
    assert max_diff(params(ac_out / "model.pt"), want) == 0
    assert "activation checkpointing: 2 of 2 blocks recompute their forward in backward" in ac.stdout
    assert result_of(ac)["val_loss"] == result_of(unstopped)["val_loss"]
    # A resume with another schedule is refused: the steps it saved would mean another rate.
    other = launch("recipes/lm_ddp.py", "cpu:2", *FLAGS, "--steps", "9", "--resume", "auto",
                   "--out-dir", tmp_path / "pieced")
    assert other.returncode == 2
    assert error_lines(other.stderr) == [
        f"error: {tmp_path / 'pieced/latest.pt'} was written with --steps 8 (this run: 9); resume with the same flags"]


@pytest.mark.slow  # two 2-process launches with --compile: 25-70 s (inductor's cache cold: its C++ builds)
def test_compiled_blocks_train_as_the_eager_run_and_resume_compiled(straight, tmp_path):
    # issue 66: --compile (each block compiled before the DDP wrap) stops at step 4 (--max-steps) and goes on to step
    # 8 with --resume auto; each run against the eager 2-process run above: the same losses and weights (measured
    # equal to 6 decimals, model.pt 3.8e-6 apart), one graph the blocks share, one more for evaluation, no recompile,
    # no graph break; and the first run's sends are the eager run's claim (docs/lm.md's table). The resumed run's
    # first backward (DDP's bucket order) runs at the training batch's shape: the first step's graph, not one of its
    # own.
    eager, eager_out = straight(2)
    run = ["recipes/lm_ddp.py", "cpu:2", *FLAGS, "--compile", "--out-dir", tmp_path / "out"]
    # The collectives counted (tests/instrument/lm_claims.py) and nothing else (claims_env's blocks=False).
    counting = claims_env(tmp_path / "claims", saved=False, blocks=False)
    first = launch(*run, "--max-steps", "4", env=counting)
    assert result_of(first)["steps"] == 4
    # Under the counting mode each block compiles a graph of its own (measured: 2 for training, 2 for evaluation);
    # without it (the resumed run below) the blocks share one.
    assert compiled_matches_eager(first, eager, 2)["compiled_graphs"] == [4, 4]
    sends_every_gradient_once_a_step(tmp_path / "claims", 4)  # the claim holds compiled: DDP's hooks stay eager
    resumed = launch(*run, "--resume", "auto")
    assert result_of(resumed)["start_step"] == 4
    # the blocks' one graph; evaluation's
    assert compiled_matches_eager(resumed, eager, 2, tmp_path / "out", eager_out)["compiled_graphs"] == [2, 2]


@pytest.mark.slow
def test_a_stop_on_sigusr1_resumes_bitwise(straight, tmp_path):
    # Issue 43's drill (tests/lm_checks.py): rank 0 of 3 alone gets SIGUSR1, every rank saves at the agreed step and
    # exits 75; resumed, the weights equal the straight run's above, bitwise. 3 ranks: DDP's bucket layout after its
    # first backward shows there (without the recipe's backward before a resumed run: 5.9e-7 off).
    stops_and_resumes_bitwise("lm_ddp", "cpu:3", FLAGS, tmp_path, straight(3)[1], TINY["steps"])


@pytest.mark.slow
def test_a_crash_while_an_async_save_writes_leaves_the_last_checkpoint_to_resume_from(straight, tmp_path):
    # Issue 43, --async-save (tests/lm_checks.py): rank 0's thread writes latest.pt from a copy in CPU memory while
    # training goes on (without the copy it would write weights that later steps changed in place); killed while it
    # writes step 8's, latest.pt is step 4's, whole (written to latest.pt.tmp, then renamed), and the run goes on.
    killed_while_saving_resumes_bitwise("lm_ddp", "cpu:2", FLAGS, tmp_path, straight(2)[1], "latest.pt.tmp",
                                        "latest.pt")


@pytest.mark.slow  # the drill takes the real path (torchrun, new interpreters): 20-30 s; and the 4-step run
def test_a_kill_while_model_pt_is_written_leaves_the_last_model_pt_whole(straight, tmp_path):
    # Issue 58 (tests/lm_checks.py): rank 0 writes model.pt at steps 4 and 8; the job is SIGKILLed after the first
    # write() to step 8's (save_atomic's model.pt.tmp). model.pt is step 4's, bitwise the 4-step run's: measured
    # 0 apart; with a plain torch.save(state["model"], model.pt) it does not load (a truncated zip archive).
    killed_while_writing_model_pt_leaves_the_last_one("lm_ddp", "cpu:2", FLAGS, tmp_path, TINY_MODEL,
                                                      straight(2, "--max-steps", "4")[1])


@pytest.mark.slow  # two 1-step runs of the default model on 2 processes: 6-12 s
def test_activation_checkpointing_at_the_defaults_keeps_8_mib_where_68_were(tmp_path):
    # docs/lm.md's figures, in the recipe's own processes at its defaults (16 sequences of 128 bytes a rank): 68.3 MiB
    # kept for backward without it; with it each block keeps its input (1 MiB), plus what lies outside the blocks
    # (embeddings, final norm, head and its logits): 8.0 MiB.
    plain, checkpointed = kept_at_the_defaults("lm_ddp", tmp_path, "--activation-checkpointing")
    assert round(plain[0] / 2**20, 1) == 68.3 and round(checkpointed[0] / 2**20, 1) == 8.0
    assert checkpointed[1] == 0  # nothing saved inside a block
    block_inputs = 4 * 16 * 128 * 128 * 4  # 4 blocks' (16, 128, 128) fp32 inputs: 1 MiB each
    outside = plain[0] - plain[1]  # what the blocks do not save: the same with it
    assert checkpointed[0] == outside + block_inputs, (plain, checkpointed)


def test_reentrant_checkpoint_under_ddp_fails_where_the_non_reentrant_one_works():
    # The DDP pitfall docs/lm.md teaches (pytorch/pytorch#84589): a model with a parameter some steps do not use needs
    # find_unused_parameters=True, and then a block checkpointed with the reentrant implementation makes DDP's
    # reducer see its parameters ready twice (once in the forward's graph search, once in the recomputation).
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.block = torch.nn.Linear(8, 8)
            self.unused = torch.nn.Linear(8, 8)  # e.g. an auxiliary head this step skips
            self.reentrant = reentrant

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=self.reentrant)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outcomes = {}
        for reentrant in (True, False):
            model = DDP(Net(reentrant), find_unused_parameters=True)
            try:
                for _ in range(2):
                    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
                outcomes[reentrant] = "ok"
            except RuntimeError as exc:
                outcomes[reentrant] = str(exc).splitlines()[0]
    finally:
        dist.destroy_process_group()
    assert outcomes[False] == "ok"
    assert outcomes[True].startswith("Expected to mark a variable ready only once"), outcomes[True]


@pytest.mark.parametrize(("flags", "says"), [
    (["--text", "/nonexistent/corpus"], "error: --text /nonexistent/corpus: no such file or folder"),
    (["--seq-len", "300"], "error: --seq-len 300 is above --block-size 256, the positions the model has"),
    (["--n-head", "5"], "error: --n-head 5 must divide --d-model 128 (each head takes d_model / n_head)"),
    (["--steps", "0"], "error: --steps 0 must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(flags, says):
    proc = run_direct("lm_ddp", *flags, "--out-dir", "/tmp/unused")
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == [says]
    assert "Traceback" not in proc.stderr


def test_a_text_too_short_or_empty_or_not_utf8_is_one_line(tmp_path):
    short, empty, binary = tmp_path / "short.txt", tmp_path / "empty", tmp_path / "binary.txt"
    short.write_text("print('hello')\n" * 20)
    empty.mkdir()
    binary.write_bytes(b"caf\xe9 " * 1000)
    said = {}
    for path in (short, empty, binary):
        proc = run_direct("lm_ddp", "--text", path, "--out-dir", tmp_path / "out")
        assert proc.returncode == 2, proc.stderr
        said[path.name] = error_lines(proc.stderr)
    assert said["short.txt"] == [
        "error: the text is too short for --seq-len 128: 287 training and 15 validation bytes, where at least 516 and "
        "129 are needed (validation is the last 5%); use a longer text or a smaller --seq-len"]
    assert said["empty"] == [f"error: --text {empty}: the folder has no UTF-8 text files"]
    assert said["binary.txt"] == [f"error: --text {binary}: not UTF-8 text (invalid continuation byte at byte 3)"]


def test_a_text_folder_takes_its_utf8_files_and_says_what_it_left_out(tmp_path):
    from common.lm import read_text

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("héllo\n")
    (tmp_path / "sub" / "b.pyc").write_bytes(b"\xa7\r\r\n" + bytes(range(256)))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    data, where = read_text(tmp_path)
    assert bytes(data.tolist()) == "x = 1\n\n\nhéllo\n\n\n".encode()  # sorted paths, each and a blank line
    assert where == f"{tmp_path} (2 files; 1 not UTF-8 left out, e.g. b.pyc)"


@pytest.mark.parametrize("recipe", LM_RECIPES)
def test_every_language_model_checks_its_out_dir_before_the_first_step(tmp_path, recipe):
    in_the_way = tmp_path / "runs_x"
    in_the_way.write_text("a file where the out-dir should go\n")
    proc = run_direct(recipe, *FLAGS, "--out-dir", in_the_way, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc.stderr) == [f"error: --out-dir {in_the_way} is a file, not a folder; pass a folder to "
                                        "write to"]
    assert "step=" not in proc.stdout


def test_the_default_batch_divides_on_any_process_count():
    module = load_recipe("lm_ddp")
    for world, batch in {1: 32, 2: 32, 3: 30, 5: 30, 7: 28, 8: 32, 48: 48}.items():  # 48 ranks: one sequence each
        args = module.parse_args([])
        module.check_args(args, world)
        assert (args.batch_size, args.warmup_steps) == (batch, 50), (world, args.batch_size)


def test_the_ngram_bar_equals_a_plain_count_of_the_same_model():
    # tools/ngram_bpb.py's vectorised counts against the model written out with dicts, on real text (a stdlib file).
    import collections
    import sysconfig
    from pathlib import Path

    import numpy as np

    from tools.ngram_bpb import ngram_bpb

    raw = np.frombuffer((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes(), dtype=np.uint8)
    train, val = raw[:15000], raw[15000:17000]
    for context, k in ((0, 1.0), (1, 0.5), (3, 0.1)):
        pairs, contexts = collections.Counter(), collections.Counter()
        for i in range(context, len(train)):
            c = bytes(train[i - context:i])
            pairs[c, train[i]] += 1
            contexts[c] += 1
        text = np.concatenate([train[len(train) - context:], val])
        bits = [-math.log2((pairs[bytes(text[i - context:i]), text[i]] + k) / (contexts[bytes(text[i - context:i])]
                                                                             + 256 * k))
                for i in range(context + 1, context + 1 + 1000)]
        assert ngram_bpb(train, val, context, k, 1, 1000) == pytest.approx(sum(bits) / len(bits), rel=1e-9)


@pytest.mark.slow  # real multi-process launches: 10-60 s
def test_a_diverged_run_stops_with_one_line_and_saves_nothing(tmp_path):
    proc = launch("recipes/lm_ddp.py", "cpu:2", *FLAGS, "--lr", "1e30", "--out-dir", tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert [line.split(":")[0] for line in error_lines(proc.stderr)] == ["error"]
    assert "error: training diverged steps 1-4: the training loss stopped being finite at step 2. Nothing was saved " \
        "from these weights; this run wrote no checkpoint. " in proc.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
