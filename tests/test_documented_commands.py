"""Every command that README.md, docs/ and the recipes' docstrings print runs, as a user would type it.

The list is read from the files, not typed here: fenced code blocks and `inline code` in the Markdown, and each
recipe's opening docstring; a line that starts with ./launch.sh, python recipes/ or tools/, torchrun, sbatch, or
environment assignments before one of those is a command (a trailing backslash continues it). Each runs on a
CPU stand-in with the same process count (0,1,3 -> cpu:3, 0 -> cpu:1, G:N -> cpu:N, CUDA_VISIBLE_DEVICES=0,1,3 ->
3 processes), changing only what a CPU box cannot have:
- data that needs a download or the user's folder: CIFAR-100 becomes 128 + 48 synthetic images of 8 px (one step an
  epoch at the default batch; 48 validation images split evenly over 1, 2, 3, 4 or 8 processes, so that a compiled
  evaluation is one shape on every rank), a user's ImageFolder or .rec becomes 250 of scikit-learn's real digits in
  that format (also one step an epoch);
- the length: --max-steps 1, one whole epoch (a checkpoint to --resume from); with --profile, 512 synthetic images
  and --max-steps 4 (its table then holds 2 profiled steps, checked); tools/tune_loader.py: --batches 2,
  --rounds 1; the output: a fresh folder as the working directory (runs/... lands there);
- two nodes (NNODES=2, MASTER_ADDR of node 0): both nodes on this machine, over 127.0.0.1.
A recipe must exit 0 with its RESULT line; a documented failure (--impl apex without a GPU) its documented line.
A command that --resume's or --init-from's an earlier one runs in a copy of that one's folder, after it (and
tools/plot_profile.py after the --profile command printed before it). What
cannot run here is in NOT_RUN with the reason, and the test fails on a command that is in neither: a new command
is never skipped silently.
"""

import ast
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import warm
from conftest import REPO, launch_env, profile_table
from test_defaults import THREE_HERE

from common.harness import cpu_amp_default
from common.models import SMALL_IMAGES
from tools.free_port import free_port
from tools.procs import run_group
from tools.real_data import export

PROGRAMS = ("./launch.sh", "python", "python3", "torchrun", "sbatch")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
# Not commands: a usage line and placeholders for the reader to fill in.
TEMPLATES = {"./launch.sh [--dry-run] RECIPE [DEVICES] [recipe args...]", "python recipes/R.py",
             "python -m torch.distributed.launch"}
SUITE = "the test suite itself (.ci/run runs it)"
LM_SAVE_STALL = ("docs/benchmarks.md's save stall for the language models: 60 steps of the default model, 30-60 s; "
                 "tests/test_lm.py and test_lm_tp.py run --async-save (a crash mid-write)")
FP16 = "fp16 (apex_amp O2 is fp16 weights) on the CPU: minutes for a step of resnet18; its flags run small elsewhere"
MUTANTS = "a mutant per edit, each running the recipe's tests: run by hand for the counts docs/testing.md gives"
SLURM = "SLURM is not installed; tests/test_cluster.py runs the script's node part with SLURM's variables"
NOT_RUN = {  # command: why it cannot run on this CPU box (each is checked elsewhere, as said)
    "DEVICES=cpu:4 sbatch --nodes 2 --gpus-per-node 0 slurm/train.sbatch recipes/ddp_torchrun.py --arch tiny": SLURM,
    "sbatch --nodes 2 slurm/train.sbatch recipes/ddp_checkpoint.py --dataset cifar100 --epochs 30 --resume auto":
        SLURM,
    "sbatch --nodes 2 slurm/train.sbatch recipes/ddp_checkpoint.py --epochs 30 --resume auto": SLURM,
    "MAX_RESTARTS=3 sbatch --nodes 4 --gpus-per-node 8 slurm/train.sbatch recipes/torch_amp.py --resume auto": SLURM,
    "python tools/bench.py --devices 0,1,3 --arch resnet101 --batch-size 384 --image-size 32 --recipes "
    "dp,ddp_torchrun,apex_ddp,apex_amp,torch_amp:fp16":
        "resnet101 at a global batch of 384: minutes per step on 2 CPU cores; tests/test_bench.py runs the tool",
    "python tools/bench.py --devices cpu:2 --recipes dp,ddp_torchrun,ddp_launch,ddp_spawn,ddp_checkpoint,torch_amp,"
    "apex_ddp,fsdp,apex_amp":
        "14 entries, 5 rounds: about 8 minutes; tests/test_bench.py runs two real rounds of the tool",
    "python tools/bench.py --devices cpu:2 --arch resnet18 --batch-size 32 --steps 20 --repeats 3 --recipes "
    "ddp_torchrun,ddp_compile": "docs/benchmarks.md's compile numbers: 3.5 minutes; tests/test_bench.py runs the tool",
    "python tools/bench.py --devices cpu:2 --arch tiny_bn --steps 50 --repeats 3 --recipes ddp_torchrun,ddp_compile":
        "docs/benchmarks.md's compile numbers: a minute; tests/test_bench.py runs the tool",
    "python tools/bench.py --devices cpu:2 --arch resnet18 --batch-size 32 --steps 10 --repeats 2 --recipes "
    "ddp_torchrun,ddp_zero,fsdp,ddp_comm_hooks:none,ddp_comm_hooks:bf16,ddp_comm_hooks:fp16,ddp_comm_hooks:powersgd":
        "docs/benchmarks.md's state and bytes numbers: 4 minutes; tests/test_bench.py runs the tool",
    "python tools/real_data.py": "14 recipes, 10 epochs each: about 70 minutes on 2 cores; tests/test_defaults.py "
                                 "trains two recipes on the same digits for 2 epochs",
    "python tools/gpu_only_lines.py": "the whole suite under coverage.py (~30 minutes); tests/test_gpu_only_lines.py "
                                      "checks how it files each line, and the committed list against docs/testing.md",
    "python tools/mutation_check.py":
        "about 2 hours of test runs (257 mutants), 69 minutes with --jobs 2 at 255; its edits are listed in "
        "docs/testing.md and run by hand (python tools/mutation_check.py)",
    "python tools/mutation_check.py --jobs 2": "the same 257 mutants two at a time: 69 minutes at 255",
    # Each mutant reruns the recipe's tests: minutes per recipe (5 and 4 here, half the rest of this test).
    "python tools/mutation_check.py --recipes ddp_compile,ddp_zero,ddp_uneven": MUTANTS,
    "python tools/mutation_check.py --recipes ddp_comm_hooks": MUTANTS,
    "python tools/mutation_check.py --recipes ddp_torchrun,lm_ddp,lm_tp,lm_pp,lm_fsdp_tp,fsdp": MUTANTS,
    "python tools/mutation_check.py --recipes ddp_uneven,ddp_zero --edits join_buffer_sync,zero_bucket_view": MUTANTS,
    "python tools/mutation_check.py --recipes lm_ddp,lm_tp": MUTANTS,
    "python tools/mutation_check.py --recipes lm_moe": MUTANTS,
    "python tools/mutation_check.py --recipes lm_moe --edits lm_moe_dropped_experts_kept,lm_moe_rows_to_every_rank,"
    "lm_moe_experts_on_every_row,lm_moe_expert_grads_world_zeroed": MUTANTS,
    "python tools/mutation_check.py --recipes gpu_decode --edits gpu_decode_global_generator,gpu_decode_resume_reseed":
        MUTANTS,
    "python tools/mutation_check.py --edits hang_stacks,debug_level,ddp_checked_group": MUTANTS,
    "python tools/mutation_check.py --edits preempt_vote,lm_preempt_vote,resume_bucket_layout,lm_resume_bucket_layout,"
    "seeded_samples,skip_first,restart_after_save": MUTANTS,
    "python tools/mutation_check.py --edits async_named_early,lm_async_named_early,lm_async_cpu_copy": MUTANTS,
    "python tools/make_jpegs.py data/jpegs --train 20000 --val 1000":
        "21,000 JPEGs of 500x375 px: over 2 minutes on 2 cores (17 s on 16); tests/test_make_jpegs.py runs the tool "
        "small, and tests/test_gpu_decode.py trains on what it makes",
    "python tools/lm_bench.py --rounds 2": "every language-model entry on cpu:1 and cpu:2, twice, and the bare loop: "
                                          "about 5 minutes; docs/benchmarks.md gives its table",
    "python tools/lm_bench.py --devices cpu:1 --rounds 2": "lm_ddp with and without checkpointing on cpu:1, twice, "
                                                          "and the bare loop: 2 minutes (202 s in the suite); "
                                                          "docs/benchmarks.md gives its numbers",
    "python tools/lm_bench.py --activations": "the default model on 2 processes (50 s); tests/test_lm_tp.py runs the "
                                              "same count at a small size",
    "python tools/lm_bench.py --comm": "six layouts of the default model on 2 and 4 processes (a minute); "
                                       "tests/test_lm_tp.py runs the same measurement at a small size",
    "python tools/gpu_bench.py --out bench/gpu.json --md bench/gpu_table.md":
        "GPU 0 at resnet50 and GPT-2 small's sizes: it needs a GPU; tests/test_gpu_bench.py runs it with --device cpu",
    "python tools/gpu_bench.py --render DIR/bench --tier DIR/tier.xml --tree SHA --md bench/gpu.md":
        "DIR holds a GPU session's unpacked .tgz files; tests/test_gpu_bench.py renders the first run's JSONs with a "
        "stand-in tier.xml",
    "python tools/tune_loader.py --dataset imagefolder --data-root ~/my_data --batch-size 256 --processes 4 "
    "--device cuda": "--device cuda needs a GPU; tests/test_tune_loader.py runs the tool on the CPU",
    # fp16 on a CPU runs, 10-50x slower than fp32: a step of resnet18 takes minutes. The same flags run at small
    # scale in test_conformance (torch_amp:fp16, apex_amp:O1-O3) and test_divergence (fp16's scale rule).
    "./launch.sh recipes/torch_amp.py 0,1,3 --amp-dtype fp16": FP16,
    "./launch.sh recipes/torch_amp.py 0,1,3 --dataset cifar100 --amp-dtype fp16 --channels-last": FP16,
    "./launch.sh recipes/apex_amp.py 0,1,3 --opt-level O2": FP16,
    "./launch.sh recipes/apex_amp.py 0,1,3 --dataset cifar100 --opt-level O2 --epochs 30": FP16,
    "./launch.sh recipes/apex_amp.py 0,1,3 --dataset cifar100 --opt-level O2 --epochs 30 --resume "
    "runs/apex_amp/checkpoint.pt": FP16,
    "MAX_RESTARTS=3 ./launch.sh recipes/apex_amp.py 0,1,3 --opt-level O2 --resume auto": FP16,
    "./launch.sh recipes/fsdp.py cpu:2 --arch resnet50 --epochs 3 --synthetic-train 256 --batch-size 32 --workers 1":
        "docs/benchmarks.md's save stall: resnet50 for 24 steps, a minute; tests/test_fsdp.py runs --async-save",
    "./launch.sh recipes/fsdp.py cpu:2 --arch resnet50 --epochs 3 --synthetic-train 256 --batch-size 32 --workers 1 "
    "--async-save": "docs/benchmarks.md's save stall: a minute; tests/test_fsdp.py runs --async-save on tiny",
    "./launch.sh recipes/lm_ddp.py cpu:2 --steps 60 --save-every 10 --eval-every 30 --val-windows 16":
        LM_SAVE_STALL,
    "./launch.sh recipes/lm_ddp.py cpu:2 --steps 60 --save-every 10 --eval-every 30 --val-windows 16 --async-save":
        LM_SAVE_STALL,
    "./launch.sh recipes/lm_tp.py cpu:2 --steps 60 --save-every 10 --eval-every 30 --val-windows 16":
        LM_SAVE_STALL,
    "./launch.sh recipes/lm_tp.py cpu:2 --steps 60 --save-every 10 --eval-every 30 --val-windows 16 --async-save":
        LM_SAVE_STALL,
    "python -m pytest": SUITE,
    "python -m pytest -n 2 --dist loadfile": SUITE,
    'python -m pytest -m "not slow"': SUITE,
    "python -m pytest -m gpu": "the GPU tier: it needs a GPU (tests/test_gpu.py)",
    "python -m pytest -m gpu tests/test_gpu.py": "the GPU tier: it needs a GPU (tests/test_gpu.py)",
    "python -m pytest -m gpu tests/test_gpu.py -n 8": "the GPU tier spread over 8 processes: it needs a GPU",
    "python -m pytest -m gpu --collect-only": "tests/test_gpu_tier.py runs it with the GPUs hidden: exit 0, a test "
                                              "per recipe",
    "python3 -m venv .venv": "the set-up of the environment this suite runs in (.ci/run makes its own)",
    "NCCL_DEBUG=INFO ./launch.sh recipes/ddp_torchrun.py 0,1 --max-steps 20":
        "NCCL's log of its transports: GPUs only (gloo ignores the variable; the recipe's 2-process run is the "
        "quickstart's)",
}
# Documented failures on a CPU box: (exit code, a line the error output must hold).
APEX_NEEDS_A_GPU = (2, "error: NVIDIA apex needs a GPU and none is visible")
FAILS_HERE = {"--impl apex": APEX_NEEDS_A_GPU,
              "--sync-bn": (2, "error: --sync-bn needs GPUs: torch's SyncBatchNorm refuses CPU tensors")}


# --------------------------------------------------------------------------------------------- reading
def _joined(lines):
    """Lines with trailing-backslash continuations joined, comments (`  # ...`) cut, blank ones dropped."""
    out, pending = [], ""
    for line in lines:
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        line = " ".join(re.sub(r"\s+#\s.*$", "", line).split())
        if line:
            out.append(line)
    return out


def _is_command(text):
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS and len(words) > 1 and (
        words[0] not in ("python", "python3") or words[1].startswith(("recipes/", "tools/", "-m")))


def _from_text(text, fenced):
    found = []
    for block in fenced:
        # `pip install -r requirements.txt && ./launch.sh ...`: each part of an && chain is a command of its own
        found += [part for line in _joined(block.splitlines()) for part in line.split(" && ") if _is_command(part)]
    for span in re.findall(r"`([^`]+)`", text):  # inline code may wrap onto the next line
        span = re.sub(r"\s+\.\.\.$", "", " ".join(span.split()))  # `torchrun ... recipes/x.py ...`: its flags
        found += [part for part in span.split(" && ") if _is_command(part)]
    return found


def documented():
    """[(where, command)] in the order they appear: README.md, docs/*.md, then each recipe's docstring."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
        prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
        found += [(path.name, c) for c in _from_text(prose, fenced)]
    for path in sorted((REPO / "recipes").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=True)
        found += [(path.name, c) for c in _from_text(doc, [doc])]
    seen, unique = set(), []
    for where, command in found:
        if command not in seen and command not in TEMPLATES:
            seen.add(command)
            unique.append((where, command))
    return unique


# ----------------------------------------------------------------------------------------- stand-ins
def _devices(word):
    """A GPU list or G:N as the CPU stand-in with the same process count; anything else as it is."""
    if re.fullmatch(r"\d+(,\d+)*", word):
        return f"cpu:{len(word.split(','))}"
    if re.fullmatch(r"\d+:\d+", word):
        return f"cpu:{word.split(':')[1]}"
    return word


def _flag(words, name):
    return words[words.index(name) + 1] if name in words else None


def stand_in(command, data):
    """(argv, env changes, node count) that run `command` on this CPU box."""
    words = shlex.split(command)
    env = {}
    while ASSIGNMENT.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    program, rest = words[0], words[1:]
    gpus = env.pop("CUDA_VISIBLE_DEVICES", None)
    nodes = int(env.get("NNODES", 1))
    if nodes > 1:  # every node on this machine: node 0's address is ours
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU stand-in, also where a GPU is present
    recipe = None
    if program == "./launch.sh":
        argv = [str(REPO / "launch.sh")]
        recipe, rest = rest[0], rest[1:]
        argv.append(recipe)
        if rest and not rest[0].startswith("-"):
            argv.append(_devices(rest.pop(0)))
    elif program == "torchrun":
        argv = [str(__import__("pathlib").Path(sys.executable).parent / "torchrun")]
        recipe = next(w for w in rest if w.startswith("recipes/"))
        argv += [str(REPO / w) if w == recipe else w for w in rest[:rest.index(recipe) + 1]]
        rest = rest[rest.index(recipe) + 1:]
    else:  # python recipes/x.py, python tools/x.py, python -m ...
        argv = [sys.executable]
        if rest[0] == "-m":
            argv += rest[:2]
            if "torch.distributed.launch" in rest[1]:
                recipe = next(w for w in rest if w.startswith("recipes/"))
                argv += [str(REPO / w) if w == recipe else w for w in rest[2:rest.index(recipe) + 1]]
                rest = rest[rest.index(recipe) + 1:]
            else:
                rest = rest[2:]
        else:
            script, rest = rest[0], rest[1:]
            argv.append(str(REPO / script))
            recipe = script if script.startswith("recipes/") else None
            if script == "recipes/ddp_spawn.py" and gpus:  # one worker per visible GPU: --nproc on the CPU
                rest += ["--nproc", str(len(gpus.split(",")))]
            if script == "tools/pack_rec.py":  # the user's identity folders: the digits, one folder per class
                rest = [str(data / "train"), "packed", *rest[2:]]
            if script == "tools/tune_loader.py":
                rest = [data_word(w, data) for w in rest] + ["--rounds", "1", "--batches", "2"]
    if recipe is None:
        return argv + rest, env, nodes
    name = recipe.split("/")[-1][:-3]
    # --profile records from step 3 (steps 1-2 are warm-up): 4 steps, 2 of them profiled
    length = ["--max-steps", "4"] if "--profile" in rest else ["--max-steps", "1"]
    if name.startswith("lm_"):  # text: the user's folder becomes a real one every machine has (the json package)
        if "--text" in rest:
            rest[rest.index("--text") + 1] = str(Path(sysconfig.get_paths()["stdlib"]) / "json")
        return argv + rest + length, env, nodes
    # Data a CPU box cannot have, replaced by data it can.
    if _flag(rest, "--dataset") == "cifar100" or (name != "mx_face_prefetch" and "--dataset" not in rest):
        rest = [("synthetic" if w == "cifar100" else w) for w in rest]
        rest += ["--synthetic-train", "512" if "--profile" in rest else "128", "--synthetic-val", "48"]
        if "--image-size" not in rest:  # small in every way: 8 px (still below 64: the same stem and transforms)
            rest += ["--image-size", "8"]
    if _flag(rest, "--dataset") == "imagefolder":
        rest[rest.index("--data-root") + 1] = str(data)
        if "--image-size" not in rest:  # 64 px, not the default 224: the large-image stem and transforms all the same
            rest += ["--image-size", str(SMALL_IMAGES)]  # (at 224 one step of 128 images took 45-50 core-seconds)
    if _flag(rest, "--amp-dtype") == "bf16" and "--batch-size" not in rest and cpu_amp_default() == "fp32":
        # No native bf16 on this CPU: a bf16 convolution takes aten's slow reference kernel, 8-12 s for resnet18's
        # backward on a micro-batch of 32 at 8 px (docs/testing.md). 2 images a process and micro-step, not 32: the
        # fewest BatchNorm trains on where an 8 px image leaves the last stage 1 x 1 (torch_amp's bf16 command on 1
        # process 14.7 -> 6.2 core-seconds, fsdp's resnet50 on 4 34 -> 20, against 8 images).
        processes = int(argv[-1].split(":")[1]) if argv[-1].startswith("cpu:") else 1
        rest += ["--batch-size", str(2 * processes * int(_flag(rest, "--accum-steps") or 1))]
    if name == "mx_face_prefetch" and _flag(rest, "--rec") != "synthetic":
        rest[rest.index("--rec") + 1] = str(data / "rec")
        if "--num-classes" in rest:
            rest[rest.index("--num-classes") + 1] = "10"
    return argv + rest + length, env, nodes


def data_word(word, data):
    return str(data) if word.startswith("~/") else word


def producer(index, commands):
    """The earlier command whose output `commands[index]` reads (--resume, --init-from), or None."""
    where, command = commands[index]
    words = shlex.split(command)
    if "tools/plot_profile.py" in words:  # draws the traces of the --profile run printed before it
        return next((j for j in range(index - 1, -1, -1) if commands[j][0] == where
                     and "--profile" in shlex.split(commands[j][1]) and commands[j][1] not in NOT_RUN), None)
    resume, init = _flag(words, "--resume"), _flag(words, "--init-from")
    if not init and resume in (None, "auto"):  # auto: goes on from a checkpoint if there is one, else starts
        return None
    recipe = next((w for w in words if w.startswith("recipes/")), None)
    wanted = f"recipes/{init.split('/')[1]}.py" if init else recipe
    arch = _flag(words, "--arch")
    for j in [*range(index - 1, -1, -1), *(range(index + 1, len(commands)) if init else [])]:
        other_where, other = commands[j]
        other_words = shlex.split(other)
        if wanted in other_words and _flag(other_words, "--arch") == arch and (init or other_where == where) and (
                other not in NOT_RUN and "--resume" not in other_words):
            return j
    return None


# ------------------------------------------------------------------------------------------------- run
COMMANDS = documented()


def test_the_commands_are_read_from_the_files():
    """The reader finds what a person sees: the quickstart, the docstrings' launch lines, inline commands."""
    commands = [c for _, c in COMMANDS]
    assert "./launch.sh recipes/ddp_torchrun.py cpu:2 --dataset synthetic --arch tiny --epochs 3" in commands
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        assert any(f"recipes/{recipe.name}" in c for w, c in COMMANDS if w == recipe.name), recipe.name
    assert any(c.startswith("NNODES=2 NODE_RANK=0 MASTER_ADDR=") for c in commands)
    assert any(c.startswith("CUDA_VISIBLE_DEVICES=0,1,3 torchrun") for c in commands)
    assert not set(NOT_RUN) - set(commands), "NOT_RUN lists a command the files no longer print"
    # tests/test_defaults.py leaves the 3-process default run of these recipes to their documented 0,1,3 commands.
    for recipe in sorted(p.stem for p in (REPO / "recipes").glob("*.py")):
        on_three = [c for c in commands if f"recipes/{recipe}.py 0,1,3" in c and c not in NOT_RUN
                    and not any(k in c for k in FAILS_HERE) and "--batch-size" not in c]
        assert on_three or recipe in THREE_HERE, f"no documented 0,1,3 command runs {recipe} at its default batch"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_data")
    assert export(folder, 16, per_class=20) == (200, 50)  # real scans, few: one step of the default batch of 128
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {}  # index -> the working folder each command ran in (for the ones that read its output); and each
    # stand-in that ran and passed -> its command


def _run(argv, env, cwd, nodes):
    """The command's result per node. ./launch.sh, `python recipes/...` and `python tools/...` run on the warm path
    (tests/warm.py): launch.sh --dry-run parses the command, the ranks are forked from the warm server with what
    torchrun gives them; a recipe or a tool run by `python` is one process forked from it, as tests/conftest.py's
    run_script forks a tool (torch imported already, one thread). torchrun and `python -m torch.distributed.launch`
    start new interpreters, as typed: the launchers are what those commands show."""
    full = launch_env({**env, "PYTHONUNBUFFERED": "1"})
    if argv[0] == str(REPO / "launch.sh"):
        jobs = [warm.launch_job(argv[1:], {**full, "NODE_RANK": str(node)} if nodes > 1 else full, cwd)
                for node in range(nodes)]
    elif argv[0] == sys.executable and argv[1].startswith((str(REPO / "recipes"), str(REPO / "tools"))):
        jobs = [warm.direct_job(argv[1:], full, cwd)]
    else:
        jobs = [None]
    if all(job is not None for job in jobs):
        return [job if isinstance(job, subprocess.CompletedProcess) else job.wait(600) for job in jobs]
    if nodes == 1:
        return [run_group(argv, env=full, cwd=cwd, timeout=600)]
    procs = [subprocess.Popen(argv, env={**full, "NODE_RANK": str(node)}, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for node in range(nodes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return results


GRAD_STRIDES = re.compile(r"grad\.sizes\(\) = \[([\d, ]*)\], strides\(\) = \[([\d, ]*)\]\s*"
                          r"bucket_view\.sizes\(\) = \[([\d, ]*)\], strides\(\) = \[([\d, ]*)\]")


def same_layout(sizes, strides, bucket_sizes, bucket_strides):
    """The warning's two tensors hold the same bytes in the same order: equal sizes, and equal strides wherever a
    size is above 1 (a size-1 dimension's stride is never used to address an element)."""
    sizes, strides, bucket_sizes, bucket_strides = ([int(x) for x in t.split(",") if x.strip()]
                                                    for t in (sizes, strides, bucket_sizes, bucket_strides))
    return sizes == bucket_sizes and len(strides) == len(bucket_strides) == len(sizes) and all(
        a == b for n, a, b in zip(sizes, strides, bucket_strides, strict=True) if n > 1)


def test_a_grad_strides_warning_is_spurious_only_where_the_strides_differ_at_size_1():
    """The layout check the commands' run applies, on the warning ddp_compile prints and on two real mismatches."""
    seen = ("grad.sizes() = [512, 256, 1, 1], strides() = [256, 1, 256, 256]\n"
            "bucket_view.sizes() = [512, 256, 1, 1], strides() = [256, 1, 1, 1] (Triggered internally at ...)")
    assert [same_layout(*w) for w in GRAD_STRIDES.findall(seen)] == [True]
    assert not same_layout("64, 3, 3, 3", "27, 1, 9, 3", "64, 3, 3, 3", "27, 9, 3, 1")  # channels-last 3x3
    assert same_layout("1, 512", "1, 1", "1, 512", "512, 1")
    assert not same_layout("512, 2", "1, 512", "512, 2", "2, 1")  # transposed


ORDER = sorted(range(len(COMMANDS)), key=lambda i: (producer(i, COMMANDS) is not None, i))


@pytest.mark.slow
@pytest.mark.parametrize("index", ORDER, ids=[f"{COMMANDS[i][0]}:{COMMANDS[i][1][:70]}" for i in ORDER])
def test_every_documented_command_runs_on_a_cpu_stand_in(index, digits, folders, tmp_path):
    where, command = COMMANDS[index]
    if command in NOT_RUN:
        pytest.skip(f"{where}: not run here: {NOT_RUN[command]}")
    argv, env, nodes = stand_in(command, digits)
    source = producer(index, COMMANDS)
    same = (tuple(map(str, argv)), tuple(sorted(env.items())), nodes, source)  # e.g. `0,1` and `cpu:2`, alike
    if same in folders:
        pytest.skip(f"{where}: on the CPU it is the same command as {folders[same]!r}, which ran and passed")
    cwd = tmp_path / "cwd"
    if source is not None:
        assert source in folders, f"{command!r} needs {COMMANDS[source][1]!r} to have run first"
        shutil.copytree(folders[source], cwd)
    else:
        cwd.mkdir()
    results = _run(argv, env, cwd, nodes)
    folders[index] = cwd
    shown = "\n".join(f"exit {r.returncode}\nstdout:\n{r.stdout[-1500:]}\nstderr:\n{r.stderr[-2500:]}" for r in results)
    print(f"{where}: {command}\n  ran: {' '.join(map(str, argv))} {env}")
    failure = next((FAILS_HERE[k] for k in FAILS_HERE if k in command), None)
    if failure:
        code, line = failure
        assert all(r.returncode == code for r in results), shown
        assert any(line in r.stderr for r in results), shown
        folders[same] = command
        return
    assert all(r.returncode == 0 for r in results), shown
    folders[same] = command
    words = shlex.split(command)
    if any(w.startswith("recipes/") for w in words):
        assert sum(r.stdout.count("\nRESULT {") + r.stdout.startswith("RESULT {") for r in results) == 1, shown
        # The default global batch on this many processes (3 for every 0,1,3 command): 128 rounded down to a
        # multiple of processes x --accum-steps, said on the setup line (dp.py: one process, its own line).
        setup = re.search(r"^setup: world_size=(\d+) .*?global_batch=(\d+) ", "".join(r.stdout for r in results), re.M)
        if "--batch-size" not in map(str, argv) and "recipes/dp.py" not in words:  # the stand-in's own: not checked
            parts = int(setup[1]) * int(_flag(words, "--accum-steps") or 1)
            # tensor and pipeline parallel: every rank takes the whole batch (lm_pp's microbatches divide it)
            parts = 1 if {"recipes/lm_tp.py", "recipes/lm_pp.py"} & set(words) else parts
            default = 32 if any(w.startswith("recipes/lm_") for w in words) else 128  # sequences, images
            assert int(setup[2]) == default // parts * parts, setup[0]
    # DDP's "Grad strides do not match bucket view strides" (ddp_compile.py's docstring: spurious, a 1x1
    # convolution's weight from the compiled backward): each one printed is the same layout as its bucket's, and
    # ddp_compile's resnet18 shows it, so the docstring's note stays true.
    err = "".join(r.stderr for r in results)
    stride_warnings = GRAD_STRIDES.findall(err)
    assert len(stride_warnings) == err.count("Grad strides do not match bucket view strides"), shown
    assert not [w for w in stride_warnings if not same_layout(*w)], shown
    if "recipes/ddp_compile.py" in words and "--arch" not in words:
        assert stride_warnings, f"torch no longer warns: drop ddp_compile.py's note on it\n{shown}"
    if "--profile" in words:  # the table, every rank's row, after the 2 steps the stand-in's 4 leave it
        out = "".join(r.stdout for r in results)
        assert "profile: this run's steps 3-4, traces in" in out, shown
        assert 0 in profile_table(out), shown
    recipe = next((w for w in words if w.startswith("recipes/")), None)
    if recipe:  # the run's weights where the command says (or the recipe's default), whole: torch.load reads them
        out = cwd / (_flag(list(map(str, argv)), "--out-dir") or f"runs/{Path(recipe).stem}")
        weights = torch.load(out / "model.pt", weights_only=True, map_location="cpu")
        assert weights and all(isinstance(v, torch.Tensor) for v in weights.values()), shown
