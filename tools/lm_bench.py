"""Benchmark the language-model recipes: tokens/s, the bytes each rank holds, and lm_ddp against a bare loop.

    python tools/lm_bench.py                          # cpu:1 and cpu:2 entries, 40 steps each, 3 rounds: ~6 min
    python tools/lm_bench.py --devices 0,1 --steps 200
    python tools/lm_bench.py --activations            # activation bytes per rank: DDP, TP, TP + SP, + checkpointing
    python tools/lm_bench.py --comm                   # each layout's state, collectives and bytes a step (DDP to 2-D)

Each entry is launched through launch.sh with the recipe's defaults (the default model, batch and corpus) and
`--steps STEPS --eval-every STEPS`, and its RESULT line read (tokens/s leaves the first step out). The bare loop is
the plainest loop over the same model and batch in one process, with launch.sh's thread count for one process:
random bytes, forward, cross-entropy, backward, clipping, AdamW; its first step left out too. Rounds interleave the
entries (A B ... bare A B ... bare) so a drift in the machine's load hits all alike; each cell is the median.
Prints a Markdown table and `RESULT {json}` with every run.
"""

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.lm import Transformer, adamw_implementation  # noqa: E402
from tools.bench import cpu_threads, is_cpu, process_count, valid_devices  # noqa: E402
from tools.cli import OneLineParser  # noqa: E402
from tools.recipes import load_recipe  # noqa: E402

ENTRIES = {  # name: (recipe, extra flags); a DEVICES of one process runs only the entries that fit it
    "lm_ddp": ("recipes/lm_ddp.py", []),
    "lm_ddp+ac": ("recipes/lm_ddp.py", ["--activation-checkpointing"]),
    "lm_tp": ("recipes/lm_tp.py", []),
    "lm_tp+sp": ("recipes/lm_tp.py", ["--sequence-parallel"]),
}


def bare_tokens_per_sec(steps, threads, batch=32, seq_len=128):
    """The bare loop: lm_ddp's model, batch and optimizer at world size 1 (its AdamW: decay on the matrices only,
    fused), nothing else."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(4, 4, 128, 256)
    matrices = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    others = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), **adamw_implementation(dtensor=False))
    x = torch.randint(0, 256, (batch, seq_len))
    y = torch.randint(0, 256, (batch, seq_len))
    for step in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()
        if step == 0:
            start = time.perf_counter()
    return batch * seq_len * (steps - 1) / (time.perf_counter() - start)


def activation_bytes(model, x, y, parallel_loss=False):
    """Bytes of the activations autograd keeps for backward in one training step of `model` on (x, y), counted with
    saved_tensors_hooks: each storage once (a DTensor's local shard), parameters (saved by reference) left out."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    context = loss_parallel() if parallel_loss else contextlib.nullcontext()
    with context:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    return sum(storages.values())


def activations_per_rank(rank, port, results, n_layer=4, n_head=4, d_model=128, seq_len=128, batch=32):
    """(a spawned process of 2, gloo) Activation bytes per rank at a global batch of `batch` sequences: lm_ddp's rank
    (half the batch), with --activation-checkpointing, and lm_tp's (the whole batch, each layer cut in 2), with
    --sequence-parallel and both. results[rank] = {layout: bytes}."""

    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    lm_tp = load_recipe("lm_tp")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (batch, seq_len), generator=g) for _ in range(2))
    seen = {}
    for name, tp, sp, ac in (("lm_ddp", False, False, False), ("lm_ddp --activation-checkpointing", False, False, True),
                             ("lm_tp", True, False, False), ("lm_tp --sequence-parallel", True, True, False),
                             ("lm_tp --sequence-parallel --activation-checkpointing", True, True, True)):
        torch.manual_seed(0)
        model = Transformer(n_layer, n_head, d_model, 2 * seq_len)
        if tp:
            model = parallelize_module(model, mesh, lm_tp.tp_plan(sp), src_data_rank=0)
        if ac:
            for key, block in model.blocks.items():
                model.blocks[key] = checkpoint_wrapper(block)
        mine = slice(None) if tp else slice(rank * batch // 2, (rank + 1) * batch // 2)  # DDP: this rank's half
        seen[name] = activation_bytes(model, x[mine], y[mine], parallel_loss=tp)
    results[rank] = seen
    dist.destroy_process_group()


def canonical(name):
    """all-reduce, reduce-scatter, all-gather, broadcast, send, recv: c10d's, the functional and gloo's names."""
    flat = name.strip("_").replace("_", "")
    for prefix, kind in (("allreduce", "all-reduce"), ("reducescatter", "reduce-scatter"), ("allgather", "all-gather"),
                         ("broadcast", "broadcast"), ("send", "send"), ("recv", "recv")):
        if flat.startswith(prefix):
            return kind
    return flat


def collectives(prof):
    """[(op, bytes in)] of every collective a rank ran under torch.profiler (record_shapes=True), in order: each
    collective op the rank called (c10d's, which torch.distributed's calls and DDP's reducer go through, or the
    functional ones DTensor calls; the outermost of a nest) with the bytes this rank put in, from the transfer the
    process group made for it (gloo's `gloo:*` events, on gloo's own threads, in the same order): an all-reduce's
    tensor, a reduce-scatter's whole input, an all-gather's own piece, a send's tensor."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}

    def collective(event):
        return event.name.startswith(("c10d::", "_c10d_functional::")) and "wait" not in event.name

    def outermost(event):
        parent = event.cpu_parent
        while parent is not None and not collective(parent):
            parent = parent.cpu_parent
        return parent is None

    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    ops = [canonical(e.name.split("::")[1]) for e in events if collective(e) and outermost(e)]
    transfers = {}  # gloo's, by kind, each kind in the order the process group ran them
    for event in events:
        if event.name.startswith("gloo:"):
            numel = sum(math.prod(shape) for shape in event.input_shapes if shape)
            transfers.setdefault(canonical(event.name[len("gloo:"):]), []).append(numel * sizes[event.input_dtypes[0]])

    def kind(op):  # gloo runs a reduce-scatter as an all-reduce of the whole input
        return "all-reduce" if op == "reduce-scatter" else op

    assert sorted(map(kind, ops)) == sorted(k for k, sizes_ in transfers.items() for _ in sizes_), (ops, transfers)
    taken = {k: iter(v) for k, v in transfers.items()}  # the i-th op of a kind made the i-th transfer of that kind
    return [(op, next(taken[kind(op)])) for op in ops]


def ring_bytes_sent(name, size, world):
    """Bytes a rank sends for a collective that takes `size` bytes in from it, in ring algorithms (what NCCL runs for
    large messages): an all-reduce is a reduce-scatter then an all-gather, 2 (n-1)/n of the tensor."""
    return {"all-reduce": 2 * (world - 1) * size // world, "reduce-scatter": (world - 1) * size // world,
            "all-gather": (world - 1) * size, "recv": 0}.get(name, size)  # a send, a broadcast's source: size


def comm_per_rank(rank, port, results, world=2):
    """(a spawned process of `world`, gloo) results[rank] = step_collectives(rank, world) at the defaults."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results[rank] = step_collectives(rank, world)
    dist.destroy_process_group()


def comm_per_rank_of_4(rank, port, results):
    comm_per_rank(rank, port, results, world=4)


def step_collectives(rank, world=2, n_layer=4, n_head=4, d_model=128, seq_len=128, batch=32, layouts=None):
    """(rank of a `world`-process gloo group) The collectives of one training step (the third: DDP lays its buckets
    out again in the second) at the default model and a global batch of `batch` sequences, as the recipes run it:
    lm_ddp, lm_tp (+ --sequence-parallel: forward, loss_parallel, backward, grads_as_params, clipping, AdamW), lm_pp
    (2 stages, gpipe, 2 x world microbatches, the recipe's clip across stages), lm_fsdp_tp (--tp 1: FSDP2 alone, and
    on 4 ranks 2 x 2). The recipes' once-per-eval collectives (the loss meter, the divergence check, validation) are
    left out. ({layout: [(op, bytes in), ...]}, {layout: bytes of parameters, gradients and AdamW state held})."""

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    lm_tp, lm_pp, lm_fsdp_tp = load_recipe("lm_tp"), load_recipe("lm_pp"), load_recipe("lm_fsdp_tp")
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (batch, seq_len), generator=g) for _ in range(2))

    def one_process_model():
        torch.manual_seed(0)
        return Transformer(n_layer, n_head, d_model, 2 * seq_len)

    def fsdp_tp(dp, tp):  # lm_fsdp_tp.py's model: the plan on the meta model, FSDP2 across dp, rank 0's weights
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        full = one_process_model().state_dict() if rank == 0 else {}
        with torch.device("meta"):
            model = Transformer(n_layer, n_head, d_model, 2 * seq_len)
        model = parallelize_module(model, mesh["tp"], lm_fsdp_tp.tp_plan(False), src_data_rank=None)
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        share = batch // dp
        return model, slice(mesh["dp"].get_local_rank() * share, (mesh["dp"].get_local_rank() + 1) * share)

    from common.outputs import held_state_bytes

    everything = {"lm_ddp": 2, "lm_tp": 2, "lm_tp --sequence-parallel": 2, "lm_pp": 2, "lm_fsdp_tp --tp 1": 2,
                  "lm_fsdp_tp (2 x 2)": 4}
    seen, state = {}, {}
    for name in layouts or [n for n, w in everything.items() if w == world]:
        tp = name.startswith("lm_tp")
        mine = slice(rank * batch // world, (rank + 1) * batch // world)  # data parallel: this rank's share
        if name == "lm_ddp":
            model = DDP(one_process_model())
        elif tp:
            model = parallelize_module(one_process_model(), init_device_mesh("cpu", (world,)),
                                       lm_tp.tp_plan("sequence" in name), src_data_rank=0)
            mine = slice(None)
        elif name == "lm_pp":
            model = lm_pp.Stage(one_process_model(), rank, world)
            stage, schedule = lm_pp.pipeline(model, rank, world, torch.device("cpu"), "gpipe", 2 * world)
        else:
            model, mine = fsdp_tp(world, 1) if "--tp 1" in name else fsdp_tp(2, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(3):  # the third step's: DDP lays its buckets out again in the second
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                optimizer.zero_grad(set_to_none=True)  # at the start: the gradients held at the end are counted
                if name == "lm_pp":
                    schedule.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
                    lm_pp.clip_grad_norm_across_stages(model.parameters(), 1.0)
                    optimizer.step()
                else:
                    with loss_parallel() if tp or name.startswith("lm_fsdp_tp") else contextlib.nullcontext():
                        F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
                    if tp:
                        lm_tp.grads_as_params(model)
                    if name.startswith("lm_fsdp_tp"):
                        lm_fsdp_tp.clip_grad_norm_across_meshes(model, 1.0)
                        optimizer.step()
                    else:
                        with implicit_replication():
                            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                            optimizer.step()
        seen[name] = collectives(prof)
        state[name] = held_state_bytes(model, optimizer)  # the RESULT line's state_bytes_per_rank, this rank's
    return seen, state


def spawn(worker, nprocs=2):
    """results of worker(rank, port, results) in `nprocs` spawned processes on a free local port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(port, results), nprocs=nprocs)
    return dict(results)


def comm_table(calls, world=2):
    """{layout: (count by op, bytes in, ring bytes sent)} of comm_per_rank's calls on one rank, every collective in a
    group of `world` ranks."""
    table = {}
    for name, seen in calls.items():
        counts = {}
        for op, _ in seen:
            counts[op] = counts.get(op, 0) + 1
        sent = sum(ring_bytes_sent(op, size, world) for op, size in seen)
        table[name] = (counts, sum(size for op, size in seen if op != "recv"), sent)  # a recv puts nothing in
    return table


def launch(recipe, devices, flags, steps):
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([str(REPO / "launch.sh"), recipe, devices, *flags, "--steps", str(steps),
                               "--eval-every", str(steps), "--out-dir", out], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "PYTHON": sys.executable})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-1500:]}
    return json.loads(lines[0][len("RESULT "):])


def main(argv=None):
    p = OneLineParser("lm_bench", description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cpu:1,cpu:2", help="comma-separated launch.sh DEVICES, each run in turn: "
                                                            "cpu:1,cpu:2 or 0 or 0,1 (a list of GPUs: one DEVICES)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", action="store_true", help="only the activation bytes per rank (2 processes)")
    p.add_argument("--comm", action="store_true", help="only the collectives and bytes of one step (2 processes)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:  # the first step is left out of tokens/s: one would leave none
        p.error(f"--steps {args.steps} must be at least 2 and --rounds {args.rounds} at least 1")
    device_sets = args.devices.split(",") if args.devices.startswith("cpu") else [args.devices]
    if not all(valid_devices(d) and is_cpu(d) == is_cpu(device_sets[0]) for d in device_sets):  # before any launch
        p.error(f"--devices {args.devices!r}: expected cpu:N entries (cpu:1,cpu:2, N >= 1) or one GPU list like 0,1")
    if args.activations:
        results = spawn(activations_per_rank)
        print("| layout (global batch 32 x 128 bytes, the default model) | activation MiB per rank |")
        print("| --- | --- |")
        for name, size in results[0].items():
            print(f"| {name} | {size / 2**20:.2f} |")
        print("RESULT " + json.dumps(results))
        return 0
    if args.comm:
        results = {2: spawn(comm_per_rank), 4: spawn(comm_per_rank_of_4, nprocs=4)}
        print("| layout (global batch 32 x 128 bytes, the default model) | ranks | state kB per rank | "
              "collectives a step (rank 0) | MB in, rank 0 | MB sent, rank 0 (ring) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for world, ranks in results.items():
            # world 4 is a 2 x 2 mesh: each collective runs in a group of 2 (a dp or a tp group), as on 2 ranks
            for name, (counts, size, sent) in comm_table(ranks[0][0], 2).items():
                ops = ", ".join(f"{n} {op}" for op, n in sorted(counts.items()))
                held = ", ".join(f"{ranks[r][1][name] / 1000:,.0f}" for r in sorted(ranks))
                print(f"| {name} | {world} | {held} | {ops} | {size / 1e6:.2f} | {sent / 1e6:.2f} |")
        print("RESULT " + json.dumps(results))
        return 0
    runs = []
    for round_ in range(args.rounds):
        for devices in device_sets:
            world = process_count(devices)  # as launch.sh: cpu is cpu:2
            for name, (recipe, flags) in ENTRIES.items():
                if not (REPO / recipe).is_file() or (name.startswith("lm_tp") and world < 2):
                    continue
                result = launch(recipe, devices, flags, args.steps)
                runs.append({"round": round_, "entry": name, "devices": devices, "result": result})
                print(f"round {round_ + 1} {name} {devices}: {result.get('tokens_per_sec', result.get('error'))}",
                      flush=True)
        if args.devices.startswith("cpu"):
            bare = bare_tokens_per_sec(args.steps, cpu_threads(1))  # launch.sh's threads for one process
            runs.append({"round": round_, "entry": "bare loop", "devices": "cpu:1", "result": {"tokens_per_sec": bare}})
            print(f"round {round_ + 1} bare loop: {bare:.0f}", flush=True)
    rows = {}
    for run in runs:
        if "error" not in run["result"]:
            rows.setdefault((run["entry"], run["devices"]), []).append(run["result"])
    print("\n| entry | devices | tokens/s (median, runs) | state kB per rank | peak MB per rank |")
    print("| --- | --- | --- | --- | --- |")
    for (entry, devices), results in rows.items():
        tps = statistics.median(r["tokens_per_sec"] for r in results)
        state = results[0].get("state_bytes_per_rank")
        peak = results[0].get("peak_mem_mb_per_rank")
        print(f"| {entry} | {devices} | {tps:,.0f} ({len(results)}) | "
              f"{', '.join(f'{b / 1000:,.0f}' for b in state) if state else '-'} | "
              f"{', '.join(f'{m:,.0f}' for m in peak) if peak else '-'} |")
    if ("bare loop", "cpu:1") in rows and ("lm_ddp", "cpu:1") in rows:
        bare = statistics.median(r["tokens_per_sec"] for r in rows["bare loop", "cpu:1"])
        recipe = statistics.median(r["tokens_per_sec"] for r in rows["lm_ddp", "cpu:1"])
        print(f"\nlm_ddp on cpu:1 against the bare loop: {bare / recipe:.3f}x the bare loop's time per token")
    print("RESULT " + json.dumps({"steps": args.steps, "rounds": args.rounds, "runs": runs}))
    return 1 if any("error" in run["result"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
