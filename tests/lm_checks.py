"""What tests/test_lm_tp.py, test_lm_pp.py and test_lm_fsdp_tp.py each read or check the same way: the printed
evaluation lines, a model.pt scored in one process, a recipe's flag check failing with one line, and (test_lm.py too)
the preemption drill, the crash during an --async-save, and the kill while model.pt is written."""

import json
import os
import random
import re
import signal
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, launch, load_recipe, max_diff, params, result_of
from jobs import error_lines

from common.checkpoint import EX_TEMPFAIL
from common.lm import Transformer, read_text, split, val_windows
from common.utils import first_line


def step_lines(stdout):
    """{step: {train_loss, val_loss, val_bpb, lr}} of the printed eval lines."""
    return {int(m[1]): {k: float(v) for k, v in re.findall(r"(train_loss|val_loss|val_bpb|lr)=(\S+)", m[0])}
            for m in re.finditer(r"^step=(\d+)/\d+ .*$", stdout, re.M)}


def one_process_val_loss(path, model, seq_len, windows, mlp=None):
    """model.pt loaded strictly into a plain Transformer(**model) (each block's MLP made by `mlp`, lm_moe.py's
    experts, where given) and scored on the validation windows in one process."""
    net = Transformer(**model, mlp=mlp)
    net.load_state_dict(params(path), strict=True)
    net.eval()
    x, y = val_windows(split(read_text()[0])[1], seq_len, windows)
    with torch.no_grad():
        return F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum").item() / y.numel()


def check_args_refuses(name, argv, world, line, capsys, monkeypatch):
    """recipes/NAME.py's check_args on `world` processes exits 2 with one error line starting with `line`."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    recipe = load_recipe(name)
    args = recipe.parse_args([*map(str, argv)])
    with pytest.raises(SystemExit) as exc:
        recipe.check_args(args, world)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().splitlines() == error_lines(err), err
    assert len(error_lines(err)) == 1 and error_lines(err)[0].startswith(line), err


def diverged_run_stops_with_one_line(recipe, devices, args, out, saved_first=False):
    """`recipe` on `devices` with `args` and --lr 1e30: exit 3, one error line (the divergence check's, the loss not
    finite from step 2 of the first 4), and no model.pt in `out`. saved_first: with --save-every 1, step 1's
    checkpoint written before the check at step 2 stops the run; the line names its latest.pt, which still names step
    1. Returns the CompletedProcess."""
    save = ["--save-every", 1] if saved_first else []
    proc = launch(f"recipes/{recipe}.py", devices, *args, *save, "--lr", "1e30", "--out-dir", out)
    assert proc.returncode == 3, proc.stderr[-2000:]
    said = error_lines(proc.stderr)
    latest = out / "checkpoint" / "latest.pt"
    steps, kept = ("2-2", f"the last good checkpoint is {latest}") if saved_first else \
        ("1-4", "this run wrote no checkpoint")
    assert len(said) == 1 and said[0].startswith(f"error: training diverged steps {steps}: the training loss stopped "
                                                 f"being finite at step 2. Nothing was saved from these weights; "
                                                 f"{kept}. "), proc.stderr[-2000:]
    if saved_first:
        assert torch.load(latest, weights_only=True)["step"] == 1
    else:
        assert not (out / "model.pt").exists()
    return proc


def stops_and_resumes_bitwise(recipe, devices, args, out, straight_out, steps):
    """The preemption drill (issue 43): SIGUSR1 to rank 0 alone (tests/faults' FAULT_SIGNAL, a test double of the
    scheduler's warning) after a step drawn at random; the others learn of it from the stop vote. The batches follow
    from (seed, step), so any step is a resume point: every rank saves there (lm_tp: the DCP shards, then latest.pt
    naming them), between two evaluations, and exits 75. --resume auto then ends bitwise at `straight_out`'s weights
    (the same command never stopped)."""
    seed = random.randrange(10**6)
    step = random.Random(seed).randint(1, steps // 2)
    run = [f"recipes/{recipe}.py", devices, *args, "--out-dir", out]
    first = launch(*run, env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_SIGNAL": f"0:step={step}:self"})
    said = f"seed {seed}, step {step}\nstdout:\n{first.stdout}\nstderr:\n{first.stderr[-3000:]}"
    assert first.returncode == EX_TEMPFAIL and "RESULT" not in first.stdout, said
    saved = re.search(r"^preempt: SIGUSR1: saved \S+ at step (\d+); exit 75", first.stdout, re.M)
    assert saved and step < int(saved[1]) <= step + 3 < steps, said
    assert (out / "model.pt").exists(), said  # the stop's weights too (--async-save: gathered at the stop)
    resumed = result_of(launch(*run, "--resume", "auto"))
    assert (resumed["start_step"], resumed["steps"]) == (int(saved[1]), steps), said
    assert max_diff(params(out / "model.pt"), params(straight_out / "model.pt")) == 0, said


def killed_while_saving_resumes_bitwise(recipe, devices, args, out, straight_out, written, latest):
    """Issue 43's --async-save crash, on a run that saves at steps 4 and 8 (`args`). Rank 0's writer thread opens
    `written` (the file it writes) slowly (tests/faults' FAULT_SLOW_WRITE, 1 s: a shared file system), so training
    goes on while step 4's checkpoint is written; the whole job is SIGKILLed as the thread opens step 8's
    (FAULT_KILL_ON_WRITE: a node lost mid-write). `latest` (under `out`) still names step 4's checkpoint, and
    --resume auto goes on from it to `straight_out`'s weights (the same command, saving synchronously), bitwise."""
    run = [f"recipes/{recipe}.py", devices, *args, "--async-save", "--out-dir", out]
    killed = launch(*run, env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_SLOW_WRITE": f"{written}:1",
                               "FAULT_KILL_ON_WRITE": f"{written}:2"})
    said = f"stdout:\n{killed.stdout}\nstderr:\n{killed.stderr[-3000:]}"
    assert killed.returncode == -signal.SIGKILL and "FAULT: killing the job as" in killed.stdout, said
    assert killed.stdout.count(" in the background; training waited ") == 2, said  # steps 4 and 8
    lines = killed.stdout.splitlines()
    written_at = [i for i, line in enumerate(lines) if re.fullmatch(r"saved: .+ at step 4 \(written in the "
                                                                     r"background\)", line)]
    trained_at = [i for i, line in enumerate(lines) if line.startswith("step=8/")]
    assert written_at and trained_at and trained_at[0] < written_at[0], said  # steps 5-8 trained during the write
    assert torch.load(out / latest, weights_only=True)["step"] == 4, said
    resumed = result_of(launch(*run, "--resume", "auto"))
    assert (resumed["start_step"], resumed["steps"]) == (4, 8), said
    assert max_diff(params(out / "model.pt"), params(straight_out / "model.pt")) == 0, said


def killed_while_writing_model_pt_leaves_the_last_one(recipe, devices, args, out, model, step4_out):
    """Issue 58: a run that saves synchronously at steps 4 and 8 (`args`; model.pt at each save) is SIGKILLed, the
    whole job, partway through writing step 8's model.pt: tests/faults' FAULT_KILL_MID_WRITE kills it after the first
    write() to the second file opened as model.pt or model.pt.tmp (common.checkpoint.save_atomic's temp), so that
    file holds some bytes. OUT_DIR/model.pt is then step 4's, whole: it loads (weights_only), strictly into
    Transformer(**model), and equals `step4_out`'s (the same command with --max-steps 4) bitwise. A torch.save straight
    to model.pt fails here: it truncates the file it overwrites, and the kill leaves a few bytes of a zip archive."""
    run = [f"recipes/{recipe}.py", devices, *args, "--out-dir", out]
    killed = launch(*run, env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_KILL_MID_WRITE": "model.pt:2"})
    said = f"stdout:\n{killed.stdout}\nstderr:\n{killed.stderr[-3000:]}"
    assert killed.returncode == -signal.SIGKILL, said
    cut = re.search(r"^FAULT: killing the job after the first write to (\S+) \((\d+) bytes\)$", killed.stdout, re.M)
    assert cut and int(cut[2]) > 0, said
    assert sorted(step_lines(killed.stdout)) == [4, 8] and "RESULT" not in killed.stdout, said  # killed at 8's save
    assert re.search(r"^saved: \S+ and model\.pt at step 4;", killed.stdout, re.M), said
    assert not re.search(r"^saved: .* at step 8", killed.stdout, re.M), said
    assert os.path.getsize(cut[1]) > 0, said  # the file it was writing holds bytes: killed mid-write, not at the open
    try:
        state = torch.load(out / "model.pt", weights_only=True)
    except Exception as exc:  # any failure to read it: what the test is about
        pytest.fail(f"{out / 'model.pt'} does not load after a kill mid-write: {first_line(exc)}\n{said}")
    Transformer(**model).load_state_dict(state, strict=True)
    step4 = params(step4_out / "model.pt")
    assert max_diff(state, step4) == 0, said


# ------------------------------------------------------------------ what each rank computes and sends (issue 57)
CLAIMS = ("LOG_TOKENS_DIR", "COUNT_BLOCKS_DIR", "COUNT_COMMS_DIR", "COUNT_SAVED_DIR")  # lm_claims.py's variables


def claims_env(folder, env=None, comms=True, saved=True, blocks=True):
    """env for launch(): tests/instrument on PYTHONPATH and lm_claims.py's logs in (if `blocks`) folder/tokens and
    folder/blocks, (if `comms`) folder/comms and (if `saved`) folder/saved, made here. The collectives' count costs the
    most (every operator of the run passes through its dispatch mode: 10-30% more CPU on lm_fsdp_tp's runs): only the
    runs a test reads it from take it. blocks=False for a --compile run: the tokens' and forwards' hooks on each block
    would run inside its compiled graph and break it. `env`: more variables (its PYTHONPATH goes after
    tests/instrument)."""
    env = dict(env or {})
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "instrument"), env.pop("PYTHONPATH", None)]))
    left_out = {"COUNT_COMMS_DIR": not comms, "COUNT_SAVED_DIR": not saved, "LOG_TOKENS_DIR": not blocks,
                "COUNT_BLOCKS_DIR": not blocks}
    logs = {name: folder / name.split("_")[1].lower() for name in CLAIMS if not left_out.get(name)}
    for log in logs.values():
        log.mkdir(parents=True, exist_ok=True)
    return {**env, "PYTHONPATH": path, **{name: str(log) for name, log in logs.items()}}


def tokens_seen(folder, rank):
    """Rank `rank`'s LOG_TOKENS_DIR lines (claims_env's folder): [{"where", "train", "step", "rows", "shape",
    "dtype"}, ...] in the order it ran them."""
    text = (folder / "tokens" / f"rank{rank}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def blocks_per_step(folder, rank):
    """Rank `rank`'s COUNT_BLOCKS_DIR steps: [{"forward": n, "recomputed": n}, one per optimizer step]."""
    return json.loads((folder / "blocks" / f"rank{rank}.json").read_text())["steps"]


def saved_per_step(folder, rank):
    """Rank `rank`'s COUNT_SAVED_DIR steps: [[{"saved", "saved_in_blocks", "grads"}, one per backward (a stage's
    microbatch in lm_pp, a micro-step's under --accum-steps)], one per optimizer step]: the bytes autograd saved for
    that backward since the training forward began (those first saved inside common.lm.Block's forwards apart), and
    the bytes of gradients the rank holds just after it (FSDP2's post-backward included), a DTensor's local shard."""
    return json.loads((folder / "saved" / f"rank{rank}.json").read_text())["steps"]


def comm_records(folder, rank):
    """Rank `rank`'s COUNT_COMMS_DIR steps as recorded: [[op, phase, ranks, bytes, ...] per operation] per step (an
    all-to-all's rows sent to and received from each rank after its bytes; lm_moe.py's "route" and "expert" records).
    Step k (from 1) holds what ran after optimizer step k - 1 until step k's."""
    return json.loads((folder / "comms" / f"rank{rank}.json").read_text())["steps"]


def comms_per_step(folder, rank):
    """Rank `rank`'s COUNT_COMMS_DIR steps, each a Counter {(op, phase, ranks, bytes): n}; host reads as ("item",
    phase, caller, bytes). Step k (from 1) holds what ran after optimizer step k - 1 until step k's."""
    return [Counter((e[0], e[1], e[4] if e[0] == "item" else tuple(e[2]), e[3]) for e in step)
            for step in comm_records(folder, rank)]


def plain_steps(steps, eval_every, start=0):
    """The steps (from 1) whose interval holds the training step alone: not the first two (setup before step 1; DDP
    rebuilds its buckets at step 2, broadcasting rank 0's order, and the stop vote's first read), none right after an
    evaluation or a save (which run between two steps)."""
    return [k for k in range(start + 3, steps + 1) if (k - 1) % eval_every]


def only(counter, phase=None, ops=None):
    """The entries of a comms_per_step Counter in `phase` (and of `ops`), sorted: [((op, phase, ranks, bytes), n)]."""
    return sorted((key, n) for key, n in counter.items()
                  if (phase is None or key[1] == phase) and (ops is None or key[0] in ops))


COMPILED_RTOL = 1e-4  # --compile against eager: measured equal to the RESULT line's 6 decimals (< 2e-7) on every recipe
COMPILED_ATOL = 1e-4  # model.pt: measured 3.8e-6 at most (lm_ddp on 2 processes); inductor's CPU kernels sum in
#                      another order than eager's, and AdamW turns a gradient that is rounding noise into a step


def compiled_matches_eager(proc, eager_proc, world, out=None, eager_out=None):
    """issue 66: `proc`, a run with --compile, against `eager_proc`, the same command without (or the run it goes on
    from, resumed): exit 0; every rank compiled at least one graph for training and one for evaluation, none again
    during training, with 0 graph breaks; the first step's 'compile:' line; the printed steps of `proc` equal to the
    eager run's (COMPILED_RTOL, or the printed 4th decimal); the same state bytes per rank. With `out`: val_loss
    (COMPILED_RTOL) and model.pt (COMPILED_ATOL) too, `proc` having run to the same step. Returns the RESULT."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    result, eager = result_of(proc), result_of(eager_proc)
    assert len(result["compiled_graphs"]) == world, result
    assert min(result["compiled_graphs"]) >= 2 and min(result["eval_graphs"]) >= 1, result
    assert result["recompiles"] == [0] * world and result["graph_breaks"] == [0] * world, result
    assert "compiled_graphs" not in eager  # RESULT's compile fields: --compile's alone
    assert len(re.findall(r"^compile: \d+ graph\(s\) in [\d.]+ s \(the first step; the rate leaves it out\), 0 graph "
                          r"break\(s\)$", proc.stdout, re.M)) == 1, proc.stdout
    assert re.search(r"^compile: \d+(-\d+)? graph\(s\) a rank, \d+(-\d+)? of them for evaluation; 0 compiled "
                     r"again during training; 0 graph break\(s\)$", proc.stdout, re.M), proc.stdout
    lines, eager_lines = step_lines(proc.stdout), step_lines(eager_proc.stdout)
    assert lines and set(lines) <= set(eager_lines), (lines, eager_lines)
    for step, values in lines.items():
        for key, value in values.items():
            assert value == pytest.approx(eager_lines[step][key], rel=COMPILED_RTOL, abs=1.01e-4), (step, key)
    assert result["state_bytes_per_rank"] == eager["state_bytes_per_rank"]
    if out is not None:
        assert result["steps"] == eager["steps"]
        assert result["val_loss"] == pytest.approx(eager["val_loss"], rel=COMPILED_RTOL)
        assert max_diff(params(out / "model.pt"), params(eager_out / "model.pt")) <= COMPILED_ATOL
    return result


def kept_at_the_defaults(recipe, tmp_path, flag):
    """The bytes autograd saved for backward (tests/instrument's COUNT_SAVED_DIR) in one step of `recipe` on 2
    processes at its defaults (4 blocks of width 128, 32 sequences of 128 bytes), without `flag` and with it: two
    (saved, saved inside blocks), each the same on both ranks (asserted), printed in MiB."""
    kept = []
    for flags in ((), (flag,)):
        out = tmp_path / "_".join(["run", *flags])
        folder = out.with_name(f"{out.name}_claims")
        proc = launch(f"recipes/{recipe}.py", "cpu:2", "--max-steps", "1", *flags, "--out-dir", out,
                      env=claims_env(folder, comms=False))
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = [saved_per_step(folder, rank) for rank in (0, 1)]
        assert all(len(s) == 1 and len(s[0]) == 1 for s in steps), steps  # one step, one backward
        ranks = [(s[0][0]["saved"], s[0][0]["saved_in_blocks"]) for s in steps]
        assert ranks[0] == ranks[1], (flags, ranks)  # every rank the same
        kept.append(ranks[0])
    print(f"{recipe}: activation bytes a rank {kept[0][0] / 2**20:.2f} MiB, {flag} {kept[1][0] / 2**20:.2f} MiB")
    return kept
