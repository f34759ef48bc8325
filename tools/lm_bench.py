"""Benchmark the language-model recipes: tokens/s, the bytes each rank holds, and lm_ddp against a bare loop.

    python tools/lm_bench.py                          # cpu:1 and cpu:2 entries, 40 steps each, 3 rounds: ~6 min
    python tools/lm_bench.py --devices 0,1 --steps 200
    python tools/lm_bench.py --activations            # activation bytes per rank: DDP, TP, TP + SP, + checkpointing

Each entry is launched through launch.sh with the recipe's defaults (the default model, batch and corpus) and
`--steps STEPS --eval-every STEPS`, and its RESULT line read (tokens/s leaves the first step out). The bare loop is
the plainest loop over the same model and batch in one process, with launch.sh's thread count for one process:
random bytes, forward, cross-entropy, backward, clipping, AdamW; its first step left out too. Rounds interleave the
entries (A B ... bare A B ... bare) so a drift in the machine's load hits all alike; each cell is the median.
Prints a Markdown table and `RESULT {json}` with every run.
"""

import argparse
import contextlib
import json
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
from common.lm import Transformer  # noqa: E402

ENTRIES = {  # name: (recipe, extra flags); a DEVICES of one process runs only the entries that fit it
    "lm_ddp": ("recipes/lm_ddp.py", []),
    "lm_ddp+ac": ("recipes/lm_ddp.py", ["--activation-checkpointing"]),
    "lm_tp": ("recipes/lm_tp.py", []),
    "lm_tp+sp": ("recipes/lm_tp.py", ["--sequence-parallel"]),
}


def bare_tokens_per_sec(steps, threads, batch=32, seq_len=128):
    """The bare loop: lm_ddp's model, batch and optimizer at world size 1, nothing else."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(4, 4, 128, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
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
    import importlib.util

    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    spec = importlib.util.spec_from_file_location("lm_tp", REPO / "recipes" / "lm_tp.py")
    lm_tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm_tp)
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="cpu:1,cpu:2", help="comma-separated launch.sh DEVICES, each run in turn: "
                                                            "cpu:1,cpu:2 or 0 or 0,1 (a list of GPUs: one DEVICES)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", action="store_true", help="only the activation bytes per rank (2 processes)")
    args = p.parse_args(argv)
    if args.activations:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(activations_per_rank, args=(port, results), nprocs=2)
        print("| layout (global batch 32 x 128 bytes, the default model) | activation MiB per rank |")
        print("| --- | --- |")
        for name, size in results[0].items():
            print(f"| {name} | {size / 2**20:.2f} |")
        print("RESULT " + json.dumps(dict(results)))
        return 0
    device_sets = args.devices.split(",") if args.devices.startswith("cpu") else [args.devices]
    cores = os.cpu_count() or 1
    runs = []
    for round_ in range(args.rounds):
        for devices in device_sets:
            world = int(devices.split(":")[1]) if ":" in devices else len(devices.split(","))
            for name, (recipe, flags) in ENTRIES.items():
                if not (REPO / recipe).is_file() or (name.startswith("lm_tp") and world < 2):
                    continue
                result = launch(recipe, devices, flags, args.steps)
                runs.append({"round": round_, "entry": name, "devices": devices, "result": result})
                print(f"round {round_ + 1} {name} {devices}: {result.get('tokens_per_sec', result.get('error'))}",
                      flush=True)
        if args.devices.startswith("cpu"):
            bare = bare_tokens_per_sec(args.steps, max(1, cores))
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
