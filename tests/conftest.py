"""Helpers for running launch.sh and recipes as a user would, and for making real on-disk data."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import warm
from PIL import Image

from tools.procs import run_group
from tools.recipes import load_recipe  # noqa: F401 (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]
# The suite runs two test processes on two cores (-n 2), and their jobs more processes than that. libgomp's threads
# (torch's intra-op pool: a job of one process computes on every core) spin a while before they sleep when they wait
# for each other (GOMP_SPINCOUNT), and here they spin through the time slices of the threads they wait for: the
# sbatch requeue drill took 60 core-seconds so, 32 asleep. Every process the suite starts waits asleep
# (OMP_WAIT_POLICY=PASSIVE, which libgomp reads when it loads: so here, before anything imports torch; tests/warm.py's
# server and ranks inherit it). It changes how a thread waits, not what it computes: the same threads sum in the same
# order.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
LAUNCH = REPO / "launch.sh"
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.py"))  # every recipe, by name
LM_RECIPES = [r for r in RECIPES if r.startswith("lm_")]  # the language-model family (tests/test_lm*.py)
IMAGE_RECIPES = [r for r in RECIPES if r not in LM_RECIPES]  # the image classifiers: --arch, --dataset, epochs


def cuda_unusable():
    """Why CUDA cannot run here (torch's and the driver's CUDA versions), or None when it can."""
    import subprocess

    import torch

    if torch.cuda.is_available():
        return None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split()
        driver = f"NVIDIA driver {driver[0]}" if driver else "nvidia-smi lists no GPU"
    except (OSError, subprocess.TimeoutExpired):
        driver = "no NVIDIA driver (nvidia-smi not found)"
    return (f"the GPU tier needs CUDA, and torch.cuda.is_available() is False here: torch {torch.__version__} "
            f"is built for CUDA {torch.version.cuda}, {driver}")


TIER_FIRST = "test_every_language_model_learns_on_one_gpu"  # tools/gpu_bench.py's TIER_TEST


def pytest_collection_modifyitems(config, items):
    """The GPU tier runs only when asked for (-m gpu, or any -m naming it): a plain run, or the quick tier's
    -m "not slow", stays on the CPU even on a machine with a GPU. Asked for where CUDA cannot run, it fails with one
    line instead of skipping every test and passing; --collect-only runs nothing, so it lists the tier anywhere
    (tests/test_gpu_tier.py checks both)."""
    markexpr = config.getoption("markexpr") or ""
    if "gpu" in markexpr:
        asked = "not gpu" not in markexpr and not config.getoption("collectonly")
        why = cuda_unusable() if asked else None
        if why and any(item.get_closest_marker("gpu") for item in items):
            pytest.exit(why, returncode=1)
        # The language models' one-GPU runs first: a tier stopped at its time limit (tools/gpu_session.sh, SIGINT)
        # keeps them, and tools/gpu_bench.py --render --tier reads their tokens/s (lm_moe's: issue 67) from it.
        items.sort(key=lambda item: getattr(item, "originalname", None) != TIER_FIRST)
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


# What multiprocessing's fork server imports once, before it forks each process of warm_spawn.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torchvision", "numpy"]


def warm_spawn(fn, args=(), nprocs=2):
    """torch.multiprocessing.spawn(fn, args, nprocs) whose processes are forked from this test process's warm server
    (tests/warm.py's spawn(): the server that forks the jobs' ranks), or, where the warm path is off
    (COOKBOOK_WARM=0, a variable read at start-up set differently), from multiprocessing's fork server, which imports
    torch once for this test process (FORKSERVER_PRELOAD): the same fn(rank, *args) in a process of its own, its
    exceptions raised here as spawn's, instead of each process importing torch anew. The warm server's processes
    import a sitecustomize on PYTHONPATH first, as a new interpreter does; the fork server's do not."""
    import multiprocessing

    import torch.multiprocessing as mp

    if warm.reason_for_real_path(dict(os.environ)) is None:
        return warm.spawn(fn, args, nprocs)

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the fork server starts: the first call
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def spawn_gloo(worker, nprocs=2, results=None, inherit_output=False):
    """Run worker(rank, port, results) in `nprocs` processes (warm_spawn) that meet on a free local port; each puts
    what it saw in results[rank] (results: a Manager dict, a new one if None). Returns that dict. inherit_output:
    new interpreters (mp.spawn), whose stdout and stderr are this process's as they print (capfd reads them); the
    warm server's processes print into files, copied here when they end (multiprocessing's fork server's print where
    the fork server does)."""
    import torch.multiprocessing as mp

    from tools.free_port import free_port

    # Not bind(0): that port comes from the ephemeral range, where the other worker's gloo connections draw their
    # local ports, and one could take it before rank 0's store listens (tools/free_port.py says why).
    port = free_port()
    results = mp.Manager().dict() if results is None else results
    if inherit_output:
        mp.spawn(worker, args=(port, results), nprocs=nprocs)
    else:
        warm_spawn(worker, args=(port, results), nprocs=nprocs)
    return results


def scaler_resumed_from(saved):
    """What torch_amp.py's `resumed:` line shows of a restored GradScaler state (its state_dict's repr: the keys are
    scale, growth_factor, backoff_factor, growth_interval, _growth_tracker)."""
    return f"scaler={{'scale': {saved['scale']}, 'growth_factor': {saved['growth_factor']}"


def launch_env(env=None):
    """os.environ with this interpreter as PYTHON, less the variables launch.sh reads, plus `env`."""
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    for name in ("CUDA_VISIBLE_DEVICES", "MASTER_PORT", "MASTER_ADDR", "NNODES", "NODE_RANK", "LAUNCH_DRY_RUN",
                 "MAX_RESTARTS", "RANKS_PER_GPU", "DEVICES"):
        if env is None or name not in env:
            full_env.pop(name, None)
    return full_env


def launch(*args, env=None, cwd=REPO, timeout=300):
    """Run ./launch.sh with this interpreter as PYTHON. Returns the CompletedProcess. The job's ranks are forked from
    this test process's warm server where they can be (tests/warm.py: launch.sh still parses the arguments); a test
    marked real_path, and the jobs warm.py names, go through launch.sh, torchrun and new interpreters."""
    job = warm.launch_job(args, launch_env(env), cwd)
    if job is None:
        return run_group([str(LAUNCH), *map(str, args)], env=launch_env(env), cwd=cwd, timeout=timeout)
    return job if isinstance(job, subprocess.CompletedProcess) else job.wait(timeout)


def run_direct(recipe, *args, env=None, timeout=300):
    """`python recipes/RECIPE.py ...` without a launcher (a world of one process), on the CPU, plus `env`: forked
    from the warm server where it can be (tests/warm.py), else a new interpreter."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [f"recipes/{recipe}.py", *map(str, args)]
    job = warm.direct_job(argv, env, REPO)
    if job is None:
        return run_group([sys.executable, *argv], env=env, cwd=REPO, timeout=timeout)
    return job.wait(timeout)


def run_script(argv, env=None, cwd=REPO, timeout=120):
    """`python ARGV` (a script and its arguments) in environment `env` (os.environ if None): forked from the warm
    server where it can be (tests/warm.py: torch and torchvision already imported, one thread unless OMP_NUM_THREADS
    says more), else a new interpreter. Either is killed at the timeout (subprocess.TimeoutExpired)."""
    env = dict(os.environ) if env is None else env
    argv = list(map(str, argv))
    job = warm.direct_job(argv, env, cwd)
    if job is None:
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return job.wait(timeout)


@pytest.fixture(autouse=True)
def _real_path_when_marked(request):
    """A test marked real_path runs every job of its own through launch.sh, torchrun and new interpreters: its
    subject is the launcher or the processes (docs/testing.md lists them). Module fixtures run their jobs warm."""
    marker = request.node.get_closest_marker("real_path")
    warm.forbidden.why = f"marked real_path: {marker.args[0] if marker.args else 'the launcher is its subject'}" \
        if marker else None
    yield
    warm.forbidden.why = None


def result_of(proc):
    """The recipe's single RESULT line as a dict; fails with the output if the run failed."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (rank 0 only), got {len(lines)}:\n{proc.stdout}"
    return json.loads(lines[0][len("RESULT "):])


def ddp_counts(folder):
    """What tests/instrument counted in each rank of a run with COUNT_DDP_DIR=folder, in rank order."""
    return [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank*.json"))]


def recipe_with_one_line_edited(tmp_path, recipe, line, instead):
    """A copy of recipes/RECIPE.py in tmp_path/recipes (common/ linked beside it, as the recipe imports it) with
    `line`, found there once, replaced by `instead`: a test's way to run a mistake. Line for line (the same count):
    tools/gpu_only_lines.py credits the copy's other lines to the recipe. Returns the copy's path."""
    text = (REPO / "recipes" / f"{recipe}.py").read_text()
    assert text.count(line) == 1 and line.count("\n") == instead.count("\n"), (recipe, line)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "common").symlink_to(REPO / "common")
    copy = tmp_path / "recipes" / f"{recipe}.py"
    copy.write_text(text.replace(line, instead))
    return copy


# --profile's table: a row per rank (tests/test_profile.py reads it as `table`).
PROFILE_ROW = re.compile(r"^ +(\d+) +([\d.]+) +([\d.]+)% +([\d.]+)% +\(([\d.]+)%\) +([\d.]+)% +([\d.]+)% +([\d.]+)%$",
                         re.M)


def profile_table(stdout):
    """The profile table's rows: {rank: {step_ms, compute, communication, overlapped, data, optimizer, idle}}."""
    names = ("step_ms", "compute", "communication", "overlapped", "data", "optimizer", "idle")
    return {int(m[0]): dict(zip(names, map(float, m[1:]), strict=True)) for m in PROFILE_ROW.findall(stdout)}


# The debugging flags, given to one multi-process test run of each image recipe (test_conformance.py's cases,
# test_gpu_decode.py's and test_uneven.py's 3-process runs), which then checks both the lesson's numbers and each
# flag's own effect (debugging_took_effect).
DEBUGGING = ("--debug-collectives", "--profile")


def debugging_took_effect(proc, out, counts, world, flags):
    """--debug-collectives: torch's DETAIL level in every rank as its process group ends (tests/instrument's
    COUNT_DDP_DIR=counts; None: a recipe without one); --profile: the table with a row of every rank whose shares add
    up to 100%, and a trace file of each rank in out/profile. Without a flag: no trace of it."""
    if counts is not None:
        levels = [count["debug_level"] for count in ddp_counts(counts)]
        assert levels == ["DETAIL" if "--debug-collectives" in flags else "OFF"] * world, levels
    rows = profile_table(proc.stdout)
    if "--profile" not in flags:
        assert rows == {} and not (Path(out) / "profile").exists(), proc.stdout
        return
    assert "profile: this run's steps 3-6, traces in " in proc.stdout, proc.stdout
    assert sorted(rows) == list(range(world)), proc.stdout
    for row in rows.values():
        shares = row["compute"] + row["communication"] + row["data"] + row["optimizer"] + row["idle"]
        assert row["step_ms"] > 0 and shares == pytest.approx(100, abs=0.3), row
    assert sorted(p.name for p in (Path(out) / "profile").glob("trace_rank*.json")) == [
        f"trace_rank{rank}.json" for rank in range(world)]


def epoch_lines(stdout):
    """A recipe's per-epoch lines without the timing fields and the planned step total, which differ between runs
    (a --max-steps run plans fewer steps)."""
    return [re.sub(r" img/s=\S+ eta=\S+( own_ms=[^)]*\))?", "", re.sub(r"step=(\d+)/\d+", r"step=\1", line))
            for line in stdout.splitlines() if line.startswith("epoch=")]


def epoch_losses(stdout):
    """The train_loss of each printed epoch line."""
    return [float(x) for x in re.findall(r"^epoch=\d+/\d+ .*?train_loss=([\d.]+)", stdout, re.M)]


def params(path):
    """A saved state_dict (or checkpoint), onto the CPU."""
    import torch  # here: launch.sh tests need no torch

    return torch.load(path, map_location="cpu", weights_only=True)


def max_diff(a, b):
    """The largest absolute difference between two state_dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def rng_env(folder, env=None):
    """`env` for launch()/run_direct() plus tests/instrument's RNG log into `folder`: each training epoch's RNG
    state, per rank."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "instrument"), (env or {}).get("PYTHONPATH")]))
    return {**(env or {}), "PYTHONPATH": path, "LOG_RNG_DIR": str(folder)}


def rng_streams(*folders):
    """{(world, rank, epoch): {digest of the RNG state the epoch started from, ...}} from rng_env's logs."""
    streams = {}
    for folder in folders:
        for log in Path(folder).glob("*.jsonl"):
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                streams.setdefault((entry["world"], entry["rank"], entry["epoch"]), set()).add(entry["rng"])
    return streams


def instrument_env(env=None, **folders):
    """`env` for launch()/run_direct() with tests/instrument on PYTHONPATH and each of `folders` (a variable of
    tests/instrument/sitecustomize.py: COUNT_DDP_DIR, LOG_SAMPLES_DIR, LOG_LAYERS_DIR, COUNT_FSDP_DIR, ...) made
    and set."""
    for folder in folders.values():
        Path(folder).mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "instrument"), (env or {}).get("PYTHONPATH")]))
    return {**(env or {}), "PYTHONPATH": path, **{name: str(folder) for name, folder in folders.items()}}


def samples_seen(folder):
    """{(kind, world, rank, pass): [the sample ids of each batch, in order]} from tests/instrument's LOG_SAMPLES_DIR
    (kind "train" or "eval"; pass: the process's nth iteration of such a loader, from 0)."""
    seen = {}
    for log in sorted(Path(folder).glob("*.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault((entry["kind"], entry["world"], entry["rank"], entry["pass"]), []).append(entry["indices"])
    return seen


def layers_seen(folder):
    """{rank: {(mode, layer, input format, weight format, output dtype), ...}} from tests/instrument's
    LOG_LAYERS_DIR: what each rank's eager nn.Conv2d and nn.Linear modules met."""
    seen = {}
    for log in Path(folder).glob("*.json"):
        entry = json.loads(log.read_text())
        seen.setdefault(entry["rank"], set()).update(map(tuple, entry["seen"]))
    return seen


def fsdp_blocks(model):
    """The modules recipes/fsdp.py's docstring says get a fully_shard each, by name: the members with parameters of
    the model's Sequentials (for models without nested ones: the tiny models' layers)."""
    import torch  # here: launch.sh tests need no torch

    return [f"{name}.{child}" for name, module in model.named_modules() if isinstance(module, torch.nn.Sequential)
            for child, block in module.named_children() if any(True for _ in block.parameters())]


def fsdp_counts(folder, rank):
    """Rank `rank`'s FSDP2 collectives from tests/instrument's COUNT_FSDP_DIR=folder: {"steps": [{group:
    {"all_gather": n, "reduce_scatter": n}}, one per optimizer step], "eval_all_gathers": {group: n}, ...}."""
    return json.loads((Path(folder) / f"rank{rank}.json").read_text())


def replayed(streams):
    """The digests that started more than one (rank, epoch): an epoch replaying another's random stream (the same
    augmentation and dropout draws, the same worker seeds). It sees exact replays only (not one shifted by a draw),
    and needs every epoch to draw from the stream (non-persistent workers, or augmentation in the main process)."""
    owners = {}
    for (_, rank, epoch), digests in streams.items():
        for digest in digests:
            owners.setdefault(digest, set()).add((rank, epoch))
    return {digest: sorted(who) for digest, who in owners.items() if len(who) > 1}


def as_if_saved_on_gpu(path, gpu=1):
    """Rewrite a CPU checkpoint in place so that its tensors say they were saved from cuda:GPU, as a GPU job's
    are: torch.load without map_location then fails here (no such GPU), and with it loads onto the CPU."""
    import torch  # here: launch.sh tests need no torch

    obj = torch.load(path, weights_only=True)

    def tagger(storage):
        return f"cuda:{gpu}" if storage.device.type == "cpu" else None

    torch.serialization.register_package(0, tagger, lambda storage, location: None)
    try:
        torch.save(obj, path)
    finally:
        torch.serialization._package_registry[:] = [e for e in torch.serialization._package_registry
                                                     if e[1] is not tagger]
    with pytest.raises(RuntimeError, match="on a CUDA device|CUDA device 1"):
        torch.load(path, weights_only=True)  # it really does need map_location now


def import_mxnet():
    """(mxnet, None), or (None, why) where it does not import: mxnet 1.9.1 needs numpy<1.24 and python<3.12,
    and with a newer numpy it fails with AttributeError, not ImportError."""
    try:
        with warnings.catch_warnings():  # mxnet 1.9.1's import warns about distutils, not about us
            warnings.simplefilter("ignore", DeprecationWarning)
            import mxnet
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return mxnet, None


def make_imagefolder(root, classes=3, train_per_class=20, val_per_class=7, size=24, seed=0):
    """root/{train,val}/class_k/*.png: each class a distinct colour plus noise, so it is learnable."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(classes, 3))
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for k in range(classes):
            folder = Path(root) / split / f"class_{k}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                noise = rng.normal(0, 40, size=(size, size, 3))
                pixels = np.clip(colours[k] + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return Path(root)


@pytest.fixture(scope="session")
def imagefolder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("imagefolder"))


def stand_in_command(folder, name, body):
    """An executable shell script folder/name running `body` (a test double of a command: nvidia-smi, nproc, the
    PYTHON launch.sh starts); returns {"PATH": folder first}, for a command looked up on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def fake_gpus(tmp_path):
    """A stand-in nvidia-smi (the real one cannot run without a GPU) listing n GPUs; returns env with PATH."""

    def make(n):
        lines = "".join(f'echo "GPU {i}: Fake GPU (UUID: GPU-{i:08d})"\n' for i in range(n))
        body = lines if n else 'echo "No devices were found"\nexit 6\n'
        return stand_in_command(tmp_path / f"fake_nvidia_smi_{n}", "nvidia-smi", body)

    return make
