"""recipes/lm_moe.py (mixture of experts, expert parallelism) trains the one-process model: the same recipe on 1
process (--ep 1: every expert local, no exchange) is the reference, launched once. Its layouts, each against it
(12 experts, so that --ep 2, 3 and 4 each divide them; 8 steps of a 2-layer model, 12 sequences a step):
- --ep 2 on 2 processes, --ep 3 on 3, --ep 4 on 4, --dp 2 --ep 2 on 4, --ep 1 on 3 (every expert on every rank,
  data parallel alone): the printed losses, train_loss and val_loss (the RESULT line's 6 decimals) equal the
  reference's, model.pt (every expert, gathered) within WEIGHTS_ATOL;
- a run stopped at step 4 on --ep 2 goes on with --resume auto on --ep 4 (DCP, the experts by their global names)
  to the uninterrupted run's val_loss and weights, with --activation-checkpointing on the way;
- at --top-k 1, against its own one-process run: --ep 2 the same; a run stopped at step 4 on --dp 2 --ep 2 goes on
  on --dp 1 --ep 2 to the same numbers;
- the rows per expert are counted in int64: exact past float32's 2^24.
What each rank holds, computes and sends (docs/lm.md's table), measured inside the recipe's processes
(tests/instrument/lm_claims.py: every collective with its group and bytes, each all-to-all's rows per destination,
the router's choices recomputed from each MoE layer's input, each expert's forward):
- the state bytes: the dense parameters whole and its E / ep experts (parameters, gradients, AdamW's two moments);
  and every nn.Parameter alive in the process after its first step (the garbage collector's): those weights alone,
  no other rank's expert kept alive beside the model;
- the dispatch all-to-all sends each ep rank exactly the rows its router chose for that rank's experts, the combine
  brings them back, and what a rank receives is what the others' routers chose for its experts;
- every rank takes its own slice of each step's batch (B / world), ep ranks too: data parallel over all ranks;
- it runs its own experts only, each on the rows the ep group routed to it;
- the dense gradients are all-reduced over every rank, the experts' over their dp group only (the ranks holding the
  same experts), the clip's one float over the ep group.
"""

import re
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import launch, load_recipe, max_diff, params, result_of, run_direct
from lm_checks import (
    check_args_refuses,
    claims_env,
    comm_records,
    compiled_matches_eager,
    diverged_run_stops_with_one_line,
    one_process_val_loss,
    step_lines,
    stops_and_resumes_bitwise,
    tokens_seen,
)

from common.lm import Transformer, read_text, split, train_batch, val_windows
from common.schedule import warmup_cosine

MODEL = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 32}
MOE = {"experts": 12, "top_k": 2, "hidden": 64}  # the recipe's default width: 4 x 32 / 2
ARGS = ["--n-layer", 2, "--n-head", 4, "--d-model", 32, "--block-size", 32, "--seq-len", 16, "--batch-size", 12,
        "--steps", 8, "--eval-every", 4, "--val-windows", 13, "--experts", 12]
# 13 windows: on 2, 3 and 4 ranks some rank's windows run out a batch before another's (7 and 6 in batches of 6;
# 5, 4, 4 in batches of 4; 4, 3, 3, 3 in batches of 3): its last evaluation forward has none of its own to score.
LOSS_ATOL = 1.5e-6  # the RESULT line's 6 decimals, one unit either way
WEIGHTS_ATOL = 1e-5
PRINTED_ATOL = 1.01e-4  # one unit of the printed 4th decimal
# After each eval line: the rows of the busiest and idlest expert of the worst layer (the largest max / min) since the
# last line, that layer, the balance loss and the bytes rank 0 sent a step.
EXPERTS_LINE = re.compile(r"^experts: rows max (\d+) / min (\d+) \(layer (\d+), the worst\), balance loss ([\d.]+) "
                          r"\(1: even\), all-to-all ([\d.]+) MB a step sent by rank 0 \(forward and backward\)$", re.M)
LOAD_KEYS = ("load_max", "load_min", "load_layer", "load_max_over_min")
COUNTED = {("cpu:2",), ("cpu:4", "--dp", "2", "--ep", "2"), ("cpu:2", "--amp-dtype", "bf16", "--max-steps", "2"),
           ("cpu:2", "--compile")}
# the runs whose collectives a test reads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """launch(devices, *flags) once per (devices, flags) in this module: (the CompletedProcess, its --out-dir)."""
    done = {}

    def run(devices, *flags, out=None):
        key = (devices, *map(str, flags))
        if key not in done:
            out = out or tmp_path_factory.mktemp(re.sub(r"\W+", "_", "-".join(key)))
            env = claims_env(claims(out), comms=key in COUNTED, saved=False)
            done[key] = (launch("recipes/lm_moe.py", devices, *ARGS, *flags, "--out-dir", out, env=env), out)
        return done[key]

    return run


def claims(out):
    return out.with_name(f"{out.name}_claims")


def moe_mlp():
    """What makes each block's MLP in lm_moe.py's one-process model: its MoE layer, every expert."""
    recipe = load_recipe("lm_moe")
    return lambda: recipe.MoE(MODEL["d_model"], MOE["experts"], MOE["top_k"], MOE["hidden"])


def moe_model():
    """The one-process model lm_moe.py builds (every expert), to load a model.pt into."""
    return Transformer(**MODEL, mlp=moe_mlp())


def expected_state_bytes(ep):
    """Per rank: 16 bytes (the parameter, its gradient, AdamW's two moments) of every dense parameter and of this
    rank's E / ep experts, and AdamW's 4-byte step counter per parameter tensor it holds."""
    net = moe_model()
    dense = [p for n, p in net.named_parameters() if ".experts." not in n]
    expert = [p for n, p in net.named_parameters() if ".experts." in n]
    held = sum(p.numel() for p in dense) + sum(p.numel() for p in expert) // ep
    return 16 * held + 4 * (len(dense) + len(expert) // ep)


def plain_moe_forward(self, x):
    """The plainest MoE layer, written here apart from the recipe's: every expert on every token, each output
    weighted by its gate where the expert is among the token's top k (renormalised over the k), else 0. Keeps what
    the balance loss needs: (rows per expert, mean gate probability, z-loss)."""
    B, T, D = x.shape
    x = x.reshape(B * T, D)
    logits = self.router(x).float()
    probs = logits.softmax(-1)
    top = probs.topk(self.top_k, dim=-1)
    weights = torch.zeros_like(probs).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    out = sum(weights[:, e:e + 1] * self.experts[str(e)](x) for e in range(self.n_experts))
    counts = torch.zeros(self.n_experts).scatter_add(0, top.indices.flatten(), torch.ones(top.indices.numel()))
    self.plain = (counts, probs.mean(0), torch.logsumexp(logits, -1).square().mean())
    return out.view(B, T, D)


def reference(steps=8, aux_weight=0.01):
    """(state_dict, val_loss) of a single-process loop written here: the recipe's model with the plain layer above,
    lm_ddp's loop (test_lm.py's reference: AdamW's groups, the schedule, the clip) and the balance loss of the whole
    batch, E sum_e f_e P_e averaged over the layers."""
    train, val = split(read_text(None)[0])
    torch.manual_seed(0)
    model = moe_model()
    for block in model.blocks.values():
        block.mlp.forward = types.MethodType(plain_moe_forward, block.mlp)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, 1, steps, (steps // 20) / steps)
    for step in range(steps):
        x, y = train_batch(train, step, 0, 12, 16, 0, 1)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        plain = [block.mlp.plain for block in model.blocks.values()]
        aux = sum(MOE["experts"] * (c / c.sum() * p).sum() for c, p, _ in plain) / len(plain)
        opt.zero_grad()
        (loss + aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    x, y = val_windows(val, 16, 13)
    with torch.no_grad():
        val_loss = F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten()).item()
    return model.state_dict(), val_loss


def test_one_process_equals_a_plain_moe_loop_written_here(runs):
    # The reference every layout below is held to is the recipe on one process: here it is held to a loop that
    # shares nothing with the recipe's MoE layer but its parameters (every expert on every token, no sort, no
    # grouping), its balance loss from the whole batch's counts. Measured: val_loss 4e-7 apart, weights 2e-6.
    proc, out = runs("cpu:1")
    state, val_loss = reference()
    assert abs(result_of(proc)["val_loss"] - val_loss) <= 1e-5 * val_loss, (result_of(proc)["val_loss"], val_loss)
    weights = max_diff(params(out / "model.pt"), state)
    assert weights <= WEIGHTS_ATOL, weights
    print(f"the recipe on one process against the plain loop: val_loss {result_of(proc)['val_loss']:.6f} and "
          f"{val_loss:.6f}, weights {weights:.1e} apart")


LAYOUTS = [("cpu:2", (), 2, 1), ("cpu:3", ("--ep", 3), 3, 1), ("cpu:4", (), 4, 1),
           ("cpu:4", ("--dp", 2, "--ep", 2), 2, 2), ("cpu:3", ("--ep", 1), 1, 3)]


@pytest.mark.parametrize(("devices", "flags", "ep", "dp"), LAYOUTS, ids=["ep2", "ep3", "ep4", "dp2xep2", "dp3"])
def test_expert_parallel_trains_the_one_process_model(runs, devices, flags, ep, dp):
    ref_proc, ref_out = runs("cpu:1")
    ref = result_of(ref_proc)
    proc, out = runs(devices, *flags)
    result = result_of(proc)
    assert (ref["ep"], ref["dp"]) == (1, 1) and (result["ep"], result["dp"]) == (ep, dp), result
    assert f"dp={dp} x ep={ep}: {12 // ep} of 12 experts a rank, top-2" in proc.stdout
    assert result["steps"] == ref["steps"] == 8
    for key in ("train_loss", "val_loss"):  # the 6 decimals of the RESULT line
        assert abs(result[key] - ref[key]) <= LOSS_ATOL, (key, result[key], ref[key])
    lines, ref_lines = step_lines(proc.stdout), step_lines(ref_proc.stdout)
    assert sorted(lines) == sorted(ref_lines) == [4, 8]
    for step, values in lines.items():
        for key, value in values.items():
            assert abs(value - ref_lines[step][key]) <= PRINTED_ATOL, (step, key, value, ref_lines[step][key])
    weights = max_diff(params(out / "model.pt"), params(ref_out / "model.pt"))
    assert weights <= WEIGHTS_ATOL, weights
    print(f"{devices} {flags}: model.pt {weights:.1e} from the one-process run's")
    # Each rank holds the dense part whole and its share of the experts.
    assert ref["state_bytes_per_rank"] == [expected_state_bytes(1)]
    assert result["state_bytes_per_rank"] == [expected_state_bytes(ep)] * (ep * dp)
    # model.pt is every expert: one process scores it as the run did.
    scored = one_process_val_loss(out / "model.pt", MODEL, 16, 13, mlp=moe_mlp())
    assert abs(scored - result["val_loss"]) <= LOSS_ATOL


def test_a_resume_on_another_ep_goes_on_to_the_uninterrupted_run(runs, tmp_path):
    # Stopped at step 4 on --ep 2, resumed on --ep 4 with --activation-checkpointing: DCP finds each expert by its
    # global name (blocks.L.mlp.experts.E.*), and AdamW's moments with it.
    ref_proc, ref_out = runs("cpu:1")
    out = tmp_path / "run"
    first = launch("recipes/lm_moe.py", "cpu:2", *ARGS, "--max-steps", 4, "--out-dir", out)
    assert result_of(first)["steps"] == 4
    second = launch("recipes/lm_moe.py", "cpu:4", *ARGS, "--resume", "auto", "--activation-checkpointing",
                    "--out-dir", out)
    result = result_of(second)
    assert "resume: " in second.stdout and (result["start_step"], result["steps"], result["ep"]) == (4, 8, 4)
    assert "activation checkpointing: 2 of 2 blocks" in second.stdout
    assert abs(result["val_loss"] - result_of(ref_proc)["val_loss"]) <= LOSS_ATOL
    assert step_lines(second.stdout)[8] == pytest.approx(step_lines(ref_proc.stdout)[8], abs=PRINTED_ATOL)
    weights = max_diff(params(out / "model.pt"), params(ref_out / "model.pt"))
    assert weights <= WEIGHTS_ATOL, weights
    print(f"resumed on --ep 4: model.pt {weights:.1e} from the one-process run's")


def test_top_1_on_ep_2_trains_the_one_process_model(runs):
    # The layouts above route top-2. --top-k 1 (Switch's: one row a token, its gate the probability itself) on --ep 2
    # against its own one-process run: the same 6 decimals, printed lines and weights. (--dp 2 --ep 2 at top-1: the
    # resume across --dp below trains its first 4 steps there.)
    ref_proc, ref_out = runs("cpu:1", "--top-k", 1)
    proc, out = runs("cpu:2", "--top-k", 1)
    ref, result = result_of(ref_proc), result_of(proc)
    assert "dp=1 x ep=2: 6 of 12 experts a rank, top-1" in proc.stdout and (ref["ep"], ref["top_k"]) == (1, 1)
    for key in ("train_loss", "val_loss"):  # the 6 decimals of the RESULT line
        assert abs(result[key] - ref[key]) <= LOSS_ATOL, (key, result[key], ref[key])
    lines, ref_lines = step_lines(proc.stdout), step_lines(ref_proc.stdout)
    assert sorted(lines) == sorted(ref_lines) == [4, 8]
    for step, values in lines.items():
        assert values == pytest.approx(ref_lines[step], abs=PRINTED_ATOL), (step, values, ref_lines[step])
    weights = max_diff(params(out / "model.pt"), params(ref_out / "model.pt"))
    assert weights <= WEIGHTS_ATOL, weights
    print(f"top-1 on --ep 2: val_loss {result['val_loss']:.6f} ({ref['val_loss']:.6f} on one process), model.pt "
          f"{weights:.1e} from the one-process run's")


def test_a_resume_on_another_dp_goes_on_to_the_uninterrupted_run(runs, tmp_path):
    # Stopped at step 4 on --dp 2 --ep 2 (4 processes: each expert on 2 ranks, DCP writes it once), resumed on --dp 1
    # --ep 2 (2 processes), at top-1: the one-process run's numbers, as the resume on another --ep above.
    ref_proc, ref_out = runs("cpu:1", "--top-k", 1)
    out, top1 = tmp_path / "run", [*ARGS, "--top-k", 1]
    first = launch("recipes/lm_moe.py", "cpu:4", *top1, "--dp", 2, "--ep", 2, "--max-steps", 4, "--out-dir", out)
    assert (result_of(first)["steps"], result_of(first)["dp"], result_of(first)["ep"]) == (4, 2, 2)
    assert step_lines(first.stdout)[4] == pytest.approx(step_lines(ref_proc.stdout)[4], abs=PRINTED_ATOL)
    second = launch("recipes/lm_moe.py", "cpu:2", *top1, "--dp", 1, "--resume", "auto", "--out-dir", out)
    result = result_of(second)
    assert "resume: " in second.stdout and (result["start_step"], result["steps"]) == (4, 8), result
    assert (result["dp"], result["ep"], result["top_k"]) == (1, 2, 1), result
    assert abs(result["val_loss"] - result_of(ref_proc)["val_loss"]) <= LOSS_ATOL
    assert step_lines(second.stdout)[8] == pytest.approx(step_lines(ref_proc.stdout)[8], abs=PRINTED_ATOL)
    weights = max_diff(params(out / "model.pt"), params(ref_out / "model.pt"))
    assert weights <= WEIGHTS_ATOL, weights
    print(f"resumed on --dp 1: val_loss {result['val_loss']:.6f} ({result_of(ref_proc)['val_loss']:.6f} on one "
          f"process), model.pt {weights:.1e} from the one-process run's")


def test_the_rows_per_expert_are_counted_exactly_past_float32s_integers(monkeypatch):
    # A logging interval's rows per expert, summed over ranks and steps: int64 (float32 holds integers exactly only
    # up to 2^24, which a long interval at a large batch passes: 2^24 + 1 would read 2^24).
    recipe = load_recipe("lm_moe")
    monkeypatch.setattr(recipe.dist, "all_reduce", lambda tensor, *args, **kwargs: None)  # one process's sum
    counts, gate = [2**24 + 1, 1, 2**30 + 3], [0.5, 0.3, 0.2]
    block = types.SimpleNamespace(mlp=types.SimpleNamespace(routed=(torch.tensor(counts), torch.tensor(gate),
                                                                    torch.ones(()))))
    aux, _, load = recipe.balance_loss(types.SimpleNamespace(blocks={"0": block}), 3)
    interval = 0 + load + load  # as the loop sums the steps' counts, from its 0
    assert interval.tolist() == [[2 * (2**24 + 1), 2, 2 * (2**30 + 3)]], interval
    # E sum_e f_e P_e, worked out here in float64: a float32 dtype of its own, the shares still right
    expected = 3 * sum(c * p for c, p in zip(counts, gate, strict=True)) / sum(counts)
    assert aux.dtype == torch.float32 and aux.item() == pytest.approx(expected, rel=1e-6), (aux, expected)


def test_a_stop_on_sigusr1_with_async_saves_resumes_bitwise(runs, tmp_path):
    # The preemption drill on --ep 2 with --async-save: SIGUSR1 to rank 0 at a random step; the vote stops every rank
    # after the same step, each writes its experts' shards (dcp.async_save, then model.pt) and exits 75; --resume
    # auto ends bitwise on the run never stopped.
    _, out = runs("cpu:2")
    stops_and_resumes_bitwise("lm_moe", "cpu:2", [*ARGS, "--async-save"], tmp_path, out, 8)


@pytest.mark.slow  # a 2-process launch with --compile: 15-40 s (inductor's cache cold: its C++ builds)
def test_compiled_attention_trains_as_eager(runs):
    # --compile compiles each block's attention (the MoE layer stays eager: its row counts are data, read on the
    # host); on --ep 2 the eager run's numbers, 0 recompiles, 0 graph breaks.
    eager, eager_out = runs("cpu:2")
    proc, out = runs("cpu:2", "--compile")
    compiled_matches_eager(proc, eager, 2, out, eager_out)


@pytest.mark.parametrize(("devices", "flags", "ep", "dp"),
                         [LAYOUTS[0], LAYOUTS[3], pytest.param("cpu:2", ("--compile",), 2, 1, marks=pytest.mark.slow)],
                         ids=["ep2", "dp2xep2", "ep2_compiled"])
def test_each_rank_sends_what_its_router_chose_runs_its_own_experts_and_reduces_them_over_its_dp_group(
        runs, devices, flags, ep, dp):
    # ep2_compiled: the run test_compiled_attention_trains_as_eager holds to the eager one (issue 66: the claims hold
    # with --compile; the MoE layer and its all-to-alls run eager between the compiled attentions).
    proc, out = runs(devices, *flags)
    result_of(proc)
    world, share = ep * dp, 12 // ep
    net = moe_model()
    dense = sum(p.numel() for n, p in net.named_parameters() if ".experts." not in n)
    expert = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    steps = [comm_records(claims(out), rank) for rank in range(world)]
    train = split(read_text()[0])[0]
    load = torch.zeros(2, 2, 12, dtype=torch.long)  # (steps 1-4 and 5-8, layer, expert): the rows the routers chose
    for rank in range(world):  # every rank its own slice of each step's batch: data parallel over all ranks
        seen = [t["rows"] for t in tokens_seen(claims(out), rank) if t["train"]]
        assert seen == [train_batch(train, k, 0, 12, 16, rank, world)[0].tolist() for k in range(8)]
    for k in range(8):  # step k + 1's training forward and backward (the records after optimizer step k)
        routes = {}  # (rank, layer) -> the rows its router chose for each expert
        for rank in range(world):
            d, j = divmod(rank, ep)  # the mesh (dp, ep): ep groups are consecutive ranks
            group, dp_group = [d * ep + i for i in range(ep)], [i * ep + j for i in range(dp)]
            records = steps[rank][k]
            chosen = [r[4] for r in records if r[0] == "route"]
            ran = [(r[4], r[3]) for r in records if r[0] == "expert"]
            a2a = [r for r in records if r[0] == "alltoall_base_" and r[1] != "step"]  # evaluation's: "step"
            assert len(chosen) == 2 and len(ran) == 2 * share, (k, rank, chosen, ran)  # 2 layers
            load[k // 4] += torch.tensor(chosen)
            if k == 0:  # the weights alive in the process: the dense ones and its experts, nothing freed kept alive
                held = [r[3] for r in records if r[0] == "parameters"]
                assert held == [4 * (dense + expert // ep)], (rank, held, 4 * (dense + expert // ep))
            # A layer: the counts' exchange, the dispatch and the combine forward; backward the two again, reversed.
            assert [(r[1], r[2]) for r in a2a] == [("forward", group)] * 6 + [("backward", group)] * 4, a2a
            for layer in range(2):
                counts, dispatch, combine = a2a[3 * layer:3 * layer + 3]
                per_rank = [sum(chosen[layer][i * share:(i + 1) * share]) for i in range(ep)]
                assert counts[3] == 8 * 12 and dispatch[4] == per_rank and combine[5] == per_rank, (k, rank, layer)
                assert dispatch[3] == sum(per_rank) * 32 * 4  # fp32 rows of d_model
                routes[rank, layer] = (chosen[layer], dispatch[5])
            # Its own experts, each once a layer, on the rows its ep group routed to it.
            assert sorted(e for e, _ in ran) == sorted([*range(j * share, (j + 1) * share)] * 2), ran
            # The gradients: dense over every rank, experts over the dp group, both in one buffer each; the clip's
            # squared expert norm over the ep group; the balance loss's rows per expert over every rank.
            step_ops = sorted((r[2], r[3]) for r in records if r[0] == "allreduce_" and r[1] == "step")
            assert (list(range(world)), 4 * dense) in step_ops and (dp_group, 4 * expert // ep) in step_ops
            assert (group, 4) in step_ops and (list(range(world)), 8 * 2 * 12) in step_ops, step_ops  # int64
            assert not any(r[2] == list(range(world)) and r[3] == 4 * expert // ep for r in records if
                           r[0] == "allreduce_" and dp < world), "the experts' gradients reduced over every rank"
        for rank in range(world):  # what arrived from each rank is what that rank's router chose for mine
            d, j = divmod(rank, ep)
            for layer in range(2):
                received = routes[rank, layer][1]
                assert received == [sum(routes[d * ep + i, layer][0][j * share:(j + 1) * share]) for i in range(ep)]
        # And each expert ran on what the group's routers chose for it.
        for rank in range(world):
            d, j = divmod(rank, ep)
            ran = [(r[4], r[3]) for r in steps[rank][k] if r[0] == "expert"]
            for layer in range(2):
                for e, rows in ran[layer * share:(layer + 1) * share]:
                    assert rows == sum(routes[d * ep + i, layer][0][e] for i in range(ep)), (k, rank, layer, e)
    # The experts' lines at steps 4 and 8, and RESULT's load fields (steps 5-8): the worst layer's (the largest max /
    # min) busiest and idlest expert's rows, as every rank's router chose them since the last line.
    lines, result = EXPERTS_LINE.findall(proc.stdout), result_of(proc)
    assert len(lines) == 2 and (load.sum(-1) == 4 * 12 * 16 * 2).all(), (lines, load)  # 4 steps' rows, top-2
    for line, interval in zip(lines, load, strict=True):
        ratio, layer = interval.amax(-1) / interval.amin(-1), int(line[2])
        assert ratio[layer] == ratio.max(), (line, interval)
        assert [int(line[0]), int(line[1])] == [int(interval[layer].max()), int(interval[layer].min())], line
    assert [result[key] for key in LOAD_KEYS[:3]] == [int(field) for field in lines[-1][:3]], result
    assert result["load_max_over_min"] == pytest.approx(int(lines[-1][0]) / int(lines[-1][1]), abs=1e-4), result
    # model.pt at step 4's save (--eval-every 4): rank 0 receives the experts of ranks 1 .. ep - 1 from each of them,
    # point to point (a size, then the pickled experts, which hold this rank's share alone); every other rank, which
    # holds copies of those, sends nothing (a gather_object padded every rank's part to rank 0's whole state: the
    # gathers at a save are DCP's own, of its plans).
    share_bytes = 4 * expert // ep
    for rank in range(world):
        p2p = [(r[0], r[2][1], r[3]) for r in steps[rank][4] if r[0] in ("send", "recv_")]
        if rank == 0:
            assert [(op, peer) for op, peer, _ in p2p] == [("recv_", i) for i in range(1, ep) for _ in range(2)], p2p
        elif rank < ep:
            assert [(op, peer) for op, peer, _ in p2p] == [("send", 0)] * 2, (rank, p2p)
            # its experts, pickled (15.7 kB over their bytes here); not the dense weights, which rank 0 has
            assert share_bytes < p2p[1][2] < share_bytes + 2**15 < share_bytes + 4 * dense, (rank, p2p)
        else:
            assert p2p == [], (rank, p2p)


def test_under_bf16_autocast_the_rows_travel_in_bf16(runs):
    # The expert's first layer would cast its rows to bf16 anyway: cast before the dispatch, they cross the
    # all-to-alls at half fp32's bytes (the combine's expert outputs are bf16 already), forward and backward.
    proc, out = runs("cpu:2", "--amp-dtype", "bf16", "--max-steps", 2)
    assert result_of(proc)["steps"] == 2
    for rank in range(2):
        for k in range(2):  # each training step: of each layer the dispatch and the combine, forward and backward
            rows = [r for r in comm_records(claims(out), rank)[k] if r[0] == "alltoall_base_" and r[1] != "step"
                    and r[4]]  # with splits: the rows (the counts' exchange has none)
            assert len(rows) == 8 and all(r[3] == sum(r[4]) * 32 * 2 for r in rows), rows


@pytest.mark.parametrize(("world", "flags", "line"), [
    (2, ["--experts", 3, "--ep", 2], "--ep 2 must divide --experts 3: each rank holds --experts / --ep whole experts; "
     "try --ep 1"),
    (4, ["--experts", 6, "--ep", 4], "--ep 4 must divide --experts 6: each rank holds --experts / --ep whole experts; "
     "try --ep 2"),
    # --ep from --dp: the hint names a --dp that goes with its --ep (--dp 2 --ep 1 would be refused on 4)
    (4, ["--dp", 2, "--experts", 3], "--ep 2 (processes / --dp) must divide --experts 3: each rank holds --experts / "
     "--ep whole experts; try --dp 4 --ep 1"),
    (4, ["--dp", 2, "--ep", 2, "--experts", 3], "--ep 2 must divide --experts 3: each rank holds --experts / --ep "
     "whole experts; try --dp 4 --ep 1"),
    (1, ["--top-k", 9], "--top-k 9 must be between 1 and --experts 8"),
    (1, ["--top-k", 0], "--top-k 0 must be between 1 and --experts 8"),
    (1, ["--experts", 0], "--experts 0 must be >= 1"),  # not a complaint about --top-k
    (2, ["--ep", 0], "--ep 0 must divide the number of processes, 2: try 1 or 2"),  # not a division by zero
    # --dp left out: the --ep that does not divide the processes is named, not a --dp 1 (or 0) nobody gave
    (4, ["--ep", 3], "--ep 3 must divide the number of processes, 4: try 1, 2 or 4"),
    (2, ["--ep", 4], "--ep 4 must divide the number of processes, 2: try 1 or 2"),
    (1, ["--expert-width", 0], "--expert-width 0 must be >= 1"),  # not the default in its place
    (1, ["--aux-loss-weight", -0.01], "--aux-loss-weight -0.01 must be >= 0"),  # it would train toward imbalance
    (1, ["--z-loss-weight", -1e-3], "--z-loss-weight -0.001 must be >= 0"),
    (1, ["--expert-width", -3], "--expert-width -3 must be >= 1"),  # not a traceback from nn.Linear on every rank
    (4, ["--dp", 3], "--dp 3 must divide the number of processes, 4: try 1, 2 or 4"),
    (4, ["--dp", 0], "--dp 0 must divide the number of processes, 4: try 1, 2 or 4"),  # not taken as left out
    (4, ["--dp", 2, "--ep", 4], "--dp 2 x --ep 4 is 8 processes, not 4: give --ep alone (--dp is then processes / "
     "--ep)"),
    (1, ["--n-head", 3], "--n-head 3 must divide --d-model 128")])  # the family's model checks
def test_bad_expert_flags_fail_with_one_line_before_training(world, flags, line, capsys, monkeypatch):
    check_args_refuses("lm_moe", flags, world, f"error: {line}", capsys, monkeypatch)


def test_the_default_ep_is_the_most_the_experts_and_one_nodes_processes_allow(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    recipe = load_recipe("lm_moe")
    # (world, processes a node: torchrun's LOCAL_WORLD_SIZE, flags, ep, dp): on 2 nodes of 4 the 8 experts split over
    # one node's 4 ranks (the all-to-alls within it), each node a replica; --ep 8 would send every layer's rows across
    for world, node, flags, ep, dp in [
            (1, 1, [], 1, 1), (2, 2, [], 2, 1), (3, 3, [], 1, 3), (4, 4, [], 4, 1), (8, 8, [], 8, 1), (6, 6, [], 2, 3),
            (3, 3, ["--experts", 6], 3, 1), (4, 4, ["--dp", 2], 2, 2), (8, 4, [], 4, 2), (16, 8, [], 8, 2),
            (6, 3, ["--experts", 6], 3, 2), (4, 2, ["--ep", 4], 4, 1)]:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(node))
        args = recipe.parse_args([*map(str, flags)])
        recipe.check_args(args, world)
        assert (args.ep, args.dp, args.expert_width) == (ep, dp, 256), (world, node, flags)


@pytest.mark.slow  # 40 steps of the default model on 2 processes: 25-50 s
def test_at_the_defaults_the_balance_loss_keeps_every_expert_fed(tmp_path):
    # The first 40 steps of the default run (8 experts of 256 units, top-2, --ep 2; 1000 steps' schedule, in its
    # warm-up): no expert of any layer gets fewer than a quarter of the rows the busiest one gets. Measured: max/min
    # 3.03 (the worst of the 4 layers); with --aux-loss-weight 0 the same steps measured 139. The whole default run
    # (docs/lm.md): 1.9-2.5 in every interval of 250 steps (seed 1: up to 3.6).
    proc = launch("recipes/lm_moe.py", "cpu:2", "--max-steps", 40, "--val-windows", 16, "--out-dir", tmp_path)
    result = result_of(proc)
    assert (result["steps"], result["ep"], result["experts"]) == (40, 2, 8)
    assert 1 <= result["load_max_over_min"] <= 4, result
    line = EXPERTS_LINE.search(proc.stdout)  # the one experts' line, at step 40
    most, least, layer = map(int, line.groups()[:3])
    assert [result[key] for key in LOAD_KEYS[:3]] == [most, least, layer] and 0 <= layer < 4, (line[0], result)
    assert result["load_max_over_min"] == pytest.approx(most / least, abs=1e-4), (line[0], result)
    assert 1 <= float(line[4]) < 1.2, line[0]  # E sum f P: 1 when even
    # Rank 0's rows sent to rank 1 and back, 128 fp32 numbers each, forward and backward: about half of its
    # 16 x 128 x 2 = 4096 rows a layer, 4 layers.
    assert 0.3 * 16.8 < float(line[5]) < 1.7 * 16.8, line[0]


def test_a_starved_expert_and_a_run_with_nothing_to_train_differ_in_result(tmp_path):
    # 48 experts and one sequence of 16 bytes a step, top-2: 32 rows a layer, so at least 16 experts of each layer
    # get none. The experts' line says min 0 and in which layer; RESULT's load_min is 0 and load_max_over_min null
    # (inf is not JSON). Resumed at its last step, the run trains nothing: no experts' line, every load field null.
    flags = [*ARGS, "--experts", 48, "--batch-size", 1, "--steps", 1, "--out-dir", tmp_path]
    proc = run_direct("lm_moe", *flags)
    first, line = result_of(proc), EXPERTS_LINE.search(proc.stdout)
    assert first["steps"] == 1 and line, proc.stdout
    most, least, layer = map(int, line.groups()[:3])
    assert least == 0 and 0 < most <= 16, line[0]  # an expert takes one of a token's 2 rows at most: 16
    assert [first[key] for key in LOAD_KEYS] == [most, least, layer, None], (line[0], first)
    resumed = run_direct("lm_moe", *flags, "--resume", "auto")
    result = result_of(resumed)
    assert (result["start_step"], result["steps"]) == (1, 1) and not EXPERTS_LINE.search(resumed.stdout), result
    assert [result[key] for key in LOAD_KEYS] == [None] * 4 and result["val_loss"] == first["val_loss"], result


def test_a_diverged_run_stops_with_one_line_and_saves_nothing(tmp_path):
    # An expert's NaN travels back through the combine to every rank of its ep group; the check's all-reduce stops
    # them all before any save.
    diverged_run_stops_with_one_line("lm_moe", "cpu:2", ARGS, tmp_path / "out")
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_with_top_1_the_router_learns_from_the_loss():
    # Switch's top-1: the token's output is its expert's, weighted by the gate probability itself. Renormalised over
    # one expert that weight would be 1.0, constant: the router would get no gradient from the language model's loss.
    recipe = load_recipe("lm_moe")
    torch.manual_seed(0)
    for k in (1, 2):
        layer = recipe.MoE(8, 4, k, 16)
        layer(torch.randn(2, 5, 8)).square().sum().backward()
        assert layer.router.weight.grad.abs().sum() > 0, k
