"""launch.sh: device parsing, bad input, ports, launcher choice, multi-node, via --dry-run (no torch import)."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LAUNCH, REPO, launch, run_script, stand_in_command

from tools import free_port as free_port_tool
from tools.free_port import ephemeral_range, free_port


def dry_run(*args, env=None, cwd=REPO):
    """Returns (env dict, argv list, stderr) of the command launch.sh would run."""
    proc = launch("--dry-run", *args, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout.strip())
    env_words = [w for w in words if "=" in w and not w.startswith("-") and w.split("=")[0].isupper()]
    return dict(w.split("=", 1) for w in env_words), words[len(env_words):], proc.stderr


def error_line(proc):
    """launch.sh's refusal of bad input: exit 2, nothing on stdout, one line on stderr, "launch.sh: error: ...";
    that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith("launch.sh: error: "), lines[0]
    return lines[0]


def flag(argv, name):
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}="))


@pytest.mark.parametrize(("devices", "visible", "nprocs"), [
    ("0,1,3", "0,1,3", 3),
    ("2", "2", 1),
    ("3,0", "3,0", 2),
    ("cpu", "", 2),
    ("cpu:3", "", 3),
    ("cpu:1", "", 1),
])
def test_device_forms(devices, visible, nprocs, fake_gpus):
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", devices, "--epochs", "1", env=fake_gpus(4))
    assert env["CUDA_VISIBLE_DEVICES"] == visible
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # ids mean what nvidia-smi shows
    assert flag(argv, "nproc-per-node") == str(nprocs)
    assert argv[-3:] == ["recipes/ddp_torchrun.py", "--epochs", "1"]


def test_devices_omitted_uses_all_gpus(fake_gpus):
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", "--lr", "0.1", env=fake_gpus(3))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert flag(argv, "nproc-per-node") == "3"
    assert argv[-2:] == ["--lr", "0.1"]  # a recipe flag is not taken for DEVICES


def test_devices_omitted_respects_cuda_visible_devices(fake_gpus):
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", env={**fake_gpus(4), "CUDA_VISIBLE_DEVICES": "1,2"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert flag(argv, "nproc-per-node") == "2"


def test_empty_cuda_visible_devices_means_cpu(fake_gpus):
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", env={**fake_gpus(4), "CUDA_VISIBLE_DEVICES": ""})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and flag(argv, "nproc-per-node") == "2"
    assert "CUDA_VISIBLE_DEVICES is empty, running cpu:2" in stderr


@pytest.mark.parametrize("hidden", ["-1", "NoDevFiles"])  # CUDA's "no device", SLURM's for a job given no GPU
def test_cuda_visible_devices_that_hides_every_gpu_means_cpu(fake_gpus, hidden):
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", env={**fake_gpus(4), "CUDA_VISIBLE_DEVICES": hidden})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and flag(argv, "nproc-per-node") == "2"
    assert f"launch.sh: CUDA_VISIBLE_DEVICES={hidden} hides every GPU, running cpu:2" in stderr


def test_devices_given_over_a_cuda_visible_devices_say_which_gpus_run(fake_gpus):
    # A scheduler gave GPUs 2,3 (without device cgroups); DEVICES 0,1 is nvidia-smi's numbering: GPUs 0 and 1 run,
    # and launch.sh says so, once, where the two differ.
    env, _, stderr = dry_run("recipes/ddp_torchrun.py", "0,1", env={**fake_gpus(4), "CUDA_VISIBLE_DEVICES": "2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert ("launch.sh: DEVICES 0,1 replaces CUDA_VISIBLE_DEVICES=2,3: GPU(s) 0,1 by nvidia-smi's numbering will run; "
            "omit DEVICES to run on the ones it names") in stderr.splitlines()
    _, _, stderr = dry_run("recipes/ddp_torchrun.py", "2,3", env={**fake_gpus(4), "CUDA_VISIBLE_DEVICES": "2,3"})
    assert "replaces" not in stderr


def test_a_gpu_list_split_by_a_space_is_one_line(fake_gpus):
    proc = launch("recipes/ddp_torchrun.py", "0,", "1", env=fake_gpus(4))  # ./launch.sh recipes/x.py 0, 1
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "launch.sh: error: the GPU list '0, 1' has a space in it; write it without one, e.g. 0,1")


def test_leading_zeros_are_decimal():
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", "cpu",
                           env={"NNODES": "09", "NODE_RANK": "08", "MASTER_ADDR": "h", "MASTER_PORT": "029500"})
    assert (flag(argv, "nnodes"), flag(argv, "node-rank"), flag(argv, "master-port")) == ("9", "8", "29500")


def test_devices_omitted_without_gpu_runs_cpu2_and_says_so(fake_gpus):
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", env=fake_gpus(0))
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert flag(argv, "nproc-per-node") == "2"
    assert "no GPU found, running cpu:2" in stderr


@pytest.mark.parametrize(("devices", "gpus", "message"), [
    ("0,,1", 4, "bad GPU list '0,,1': an empty entry between commas"),
    (",1", 4, "an empty entry between commas"),
    ("a,b", 4, "bad DEVICES 'a,b': expected a GPU list like 0,1,3, or G:N (N processes on GPU G), or cpu, or cpu:N"),
    ("0,1,1", 4, "GPU 1 is listed twice in '0,1,1'; list each GPU once, e.g. 0,1"),
    ("3,1,01", 4, "GPU 1 is listed twice in '3,1,01'; list each GPU once, e.g. 3,1"),  # in order: rank 0 keeps GPU 3
    ("0,7", 4, "GPU 7 does not exist: this machine has 4 GPU(s), ids 0-3; e.g. 0,1,2,3"),
    ("0,1", 0, "DEVICES '0,1' asks for GPUs, but this machine has none (nvidia-smi, or torch without it); use cpu"),
    ("0:2", 0, "DEVICES '0:2' asks for GPUs, but this machine has none"),
    ("3:2", 2, "GPU 3 does not exist: this machine has 2 GPU(s), ids 0-1"),
    ("0:0", 2, "bad DEVICES '0:0': G:N needs N >= 1 processes, e.g. 0:2"),
    ("GPU-1a2b,GPU-1a2b", 2, "a GPU is listed twice in 'GPU-1a2b,GPU-1a2b'; list each once"),
    # CUDA would drop an id it does not know and every one after it, and the recipe would train on the CPU
    ("GPU-00000001,GPU-typo", 2, "GPU GPU-typo is not on this machine: nvidia-smi -L lists GPU-00000000,GPU-00000001; "
                                 "pass ids from it, or numbers like 0,1"),
    ("-1", 4, "bad DEVICES '-1': to run without GPUs pass cpu or cpu:N, e.g. cpu:2"),  # not a recipe flag
    ("cpu:0", 0, "cpu:N needs a whole number N >= 1"),
    ("cpu:two", 0, "cpu:N needs a whole number N >= 1"),
])
def test_bad_devices(devices, gpus, message, fake_gpus, tmp_path):
    # Refused before any Python starts (a second, not torch's import): PYTHON is a stand-in that leaves a mark.
    stand_in_command(tmp_path, "python", f"touch {tmp_path / 'ran'}\nexit 1\n")
    proc = launch("recipes/ddp_torchrun.py", devices, env={**fake_gpus(gpus), "PYTHON": str(tmp_path / "python")})
    assert message in error_line(proc)
    assert not (tmp_path / "ran").exists()


# launch.sh's syntax (G:N, cpu:N) is no fix for CUDA_VISIBLE_DEVICES, which CUDA reads too
HINT = " (with no DEVICES given, launch.sh reads CUDA_VISIBLE_DEVICES: fix or unset it, or pass DEVICES)"


@pytest.mark.parametrize(("inherited", "gpus", "message"), [
    ("0,7", 4, "GPU 7 in CUDA_VISIBLE_DEVICES='0,7' does not exist: this machine has 4 GPU(s), ids 0-3; e.g. 0,1,2,3"),
    ("0,1", 0, "CUDA_VISIBLE_DEVICES='0,1' asks for GPUs, but this machine has none (nvidia-smi, or torch without it); "
               "unset it, or pass DEVICES cpu or cpu:N, e.g. cpu:2"),
    ("a,b", 4, "bad CUDA_VISIBLE_DEVICES='a,b': expected a GPU list like 0,1,3, or G:N (N processes on GPU G), or cpu, "
               "or cpu:N" + HINT),
    ("0:0", 4, "bad CUDA_VISIBLE_DEVICES='0:0': G:N needs N >= 1 processes, e.g. 0:2" + HINT),
    ("0,1,1", 4, "GPU 1 is listed twice in CUDA_VISIBLE_DEVICES='0,1,1'; list each GPU once, e.g. 0,1" + HINT),
    ("0,,1", 4, "bad GPU list CUDA_VISIBLE_DEVICES='0,,1': an empty entry between commas; write ids separated by "
                "single commas, e.g. 0,1,3" + HINT),
    ("GPU-1,GPU-1", 2, "a GPU is listed twice in CUDA_VISIBLE_DEVICES='GPU-1,GPU-1'; list each once" + HINT),
    ("GPU-00000001,GPU-typo", 2, "GPU GPU-typo in CUDA_VISIBLE_DEVICES='GPU-00000001,GPU-typo' is not on this "
                                 "machine: nvidia-smi -L lists GPU-00000000,GPU-00000001; pass ids from it, or numbers "
                                 "like 0,1"),
])
def test_a_bad_inherited_cuda_visible_devices_is_named_not_devices(inherited, gpus, message, fake_gpus):
    # DEVICES omitted: the list is the environment's, and an error naming DEVICES sent the user to the command line.
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", env={**fake_gpus(gpus), "CUDA_VISIBLE_DEVICES": inherited})
    assert error_line(proc) == f"launch.sh: error: {message}"


@pytest.mark.parametrize("devices", [None, "0,1", "GPU-00000001", "GPU-abc"])
@pytest.mark.parametrize(("smi", "code", "said"), [
    # after a driver update, before a reboot: read as "no GPU", an 8-GPU job would train on the CPU
    ("Failed to initialize NVML: Driver/library version mismatch", 18,
     "nvidia-smi -L failed (exit 18): Failed to initialize NVML: Driver/library version mismatch; fix the GPU driver, "
     "or pass cpu or cpu:N to run on the CPU"),
    ("", 9, "nvidia-smi -L failed (exit 9): no output; fix the GPU driver"),
])
def test_a_failing_nvidia_smi_is_said_in_one_line_not_read_as_no_gpu(devices, smi, code, said, tmp_path):
    env = stand_in_command(tmp_path / "smi", "nvidia-smi", f'echo "{smi}"\nexit {code}\n' if smi else f"exit {code}\n")
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", *([devices] if devices else []), env=env)
    line = error_line(proc)
    assert line.startswith(f"launch.sh: error: {said}"), line


@pytest.mark.parametrize(("args", "message"), [
    # each reached every rank as a recipe flag: N copies of argparse's usage and an unrecognized argument
    (["--arch", "tiny", "cpu:2"], "DEVICES 'cpu:2' comes after a recipe flag; put it right after RECIPE: ./launch.sh "
                                  "RECIPE cpu:2 [recipe args...]"),
    (["--epochs", "1", "cpu"], "DEVICES 'cpu' comes after a recipe flag"),
    (["cpu:2", "--dry-run"], "--dry-run goes before RECIPE: ./launch.sh --dry-run RECIPE [DEVICES] [recipe args...]"),
    (["--dry-run"], "--dry-run goes before RECIPE"),
    (["--lr", "1", "--arch", "tiny", "cpu"], "DEVICES 'cpu' comes after a recipe flag"),
])
def test_launch_sh_s_own_words_after_the_recipe_flags_are_one_line(args, message, fake_gpus):
    proc = launch("recipes/ddp_torchrun.py", *args, env=fake_gpus(2))
    line = error_line(proc)
    assert message in line, line


def test_a_flag_s_value_cpu_and_a_recipe_s_own_dry_run_reach_the_recipe(tmp_path):
    _, argv, _ = dry_run("recipes/ddp_torchrun.py", "--out-dir", "cpu", "--tb-dir", "cpu:2")
    assert argv[-4:] == ["--out-dir", "cpu", "--tb-dir", "cpu:2"]
    own = tmp_path / "own.py"  # a user's recipe with a --dry-run of its own
    own.write_text('# launcher: torchrun\nimport argparse\nargparse.ArgumentParser().add_argument("--dry-run")\n')
    assert dry_run(str(own), "cpu:1", "--dry-run")[1][-1] == "--dry-run"


def test_a_uuid_on_a_machine_whose_nvidia_smi_lists_no_gpu_is_refused_in_one_line(fake_gpus):
    # the list's grep matched nothing: with pipefail the script ended there, exit 1 and not a word
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", "GPU-abc", env=fake_gpus(0))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "launch.sh: error: GPU GPU-abc is not on this machine: nvidia-smi -L lists no UUID; pass ids from it, or "
        "numbers like 0,1"], proc.stderr


def test_a_uuid_nvidia_smi_lists_runs_and_replacing_cuda_visible_devices_is_said(fake_gpus):
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", "GPU-00000001",
                                env={**fake_gpus(2), "CUDA_VISIBLE_DEVICES": "GPU-00000000"})
    assert (env["CUDA_VISIBLE_DEVICES"], flag(argv, "nproc-per-node")) == ("GPU-00000001", "1")
    assert "launch.sh: DEVICES GPU-00000001 replaces CUDA_VISIBLE_DEVICES=GPU-00000000; omit DEVICES to run on the " \
           "ones it names" in stderr, stderr
    # A UUID's first characters name the GPU too, as CUDA takes them (NVIDIA's CUDA_VISIBLE_DEVICES docs)
    assert dry_run("recipes/ddp_torchrun.py", "GPU-0000000", env=fake_gpus(1))[0]["CUDA_VISIBLE_DEVICES"] == \
        "GPU-0000000"


def test_n_processes_share_one_gpu(fake_gpus):
    # NCCL refuses two ranks on one GPU: harness.check_gpu reads RANKS_PER_GPU, puts every rank on that GPU, uses gloo.
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", "1:2", env=fake_gpus(2))
    assert (env["CUDA_VISIBLE_DEVICES"], env["RANKS_PER_GPU"], flag(argv, "nproc-per-node")) == ("1", "2", "2")
    assert "2 process(es) per node on GPU 1 shared by 2 processes (gloo: NCCL takes one process per GPU)" in stderr
    env, argv, _ = dry_run("recipes/ddp_spawn.py", "0:3", env=fake_gpus(1))  # spawn reads the same variables
    assert (env["CUDA_VISIBLE_DEVICES"], env["RANKS_PER_GPU"], env["NPROC_PER_NODE"]) == ("0", "3", "3")
    assert dry_run("recipes/ddp_torchrun.py", "0,1", env=fake_gpus(2))[0]["RANKS_PER_GPU"] == "1"


@pytest.mark.parametrize(("devices", "where", "asked"), [("cpu:4", "cpu", 4), ("0,1,3", "GPU 0,1,3", 3),
                                                         ("0:2", "GPU 0", 2)])
def test_a_recipe_that_starts_its_own_processes_is_not_given_a_count(devices, where, asked, fake_gpus):
    # A '# launcher: python' recipe decides its processes: dp.py one ("4 process(es) per node on cpu" was false),
    # ddp_spawn.py NPROC_PER_NODE, half that with --model-parallel. launch.sh says what it set, not a count.
    for recipe in ("dp.py", "ddp_spawn.py"):
        env, argv, stderr = dry_run(f"recipes/{recipe}", devices, env=fake_gpus(4))
        assert stderr.splitlines()[-1].startswith(
            f"launch.sh: one {recipe} per node on {where}, which starts its own processes (NPROC_PER_NODE={asked}), "
            "1 node(s), python, master "), stderr
        assert argv[1:] == [f"recipes/{recipe}"] and env["NPROC_PER_NODE"] == str(asked)
    assert "launch.sh: 4 process(es) per node on cpu," in dry_run("recipes/ddp_torchrun.py", "cpu:4")[2]


@pytest.mark.parametrize("devices", [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-1d5ee8a9-79a7-4fa9-9b2e-4f4c1e44cd0e",
    "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0",
    "MIG-bfbb0c2f-4bda-5ce5-b67f-0f5c13a5dc4e"])
@pytest.mark.parametrize("how", ["DEVICES", "inherited CUDA_VISIBLE_DEVICES"])
def test_gpu_uuids_and_mig_ids_pass_through(devices, how):
    # As job schedulers set CUDA_VISIBLE_DEVICES: no nvidia-smi numbering to check, CUDA takes them as they are.
    args, env = ([devices], None) if how == "DEVICES" else ([], {"CUDA_VISIBLE_DEVICES": devices})
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", *args, "--epochs", "1", env=env)
    assert env["CUDA_VISIBLE_DEVICES"] == devices
    assert flag(argv, "nproc-per-node") == str(devices.count(",") + 1) and argv[-2:] == ["--epochs", "1"]


@pytest.fixture
def without_nvidia_smi(tmp_path):
    """PATH with every command but nvidia-smi (a container without the driver's utility capability), and a
    stand-in torch whose CUDA counts FAKE_GPUS devices when CUDA_VISIBLE_DEVICES is unset, else 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in reversed(os.environ["PATH"].split(os.pathsep)):  # earlier PATH entries win
        if os.path.isdir(folder):
            for entry in os.scandir(folder):
                if entry.name != "nvidia-smi":
                    target = bin_dir / entry.name
                    target.unlink(missing_ok=True)
                    target.symlink_to(entry.path)
    fake = tmp_path / "fake_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import os\nclass cuda:\n    @staticmethod\n    def device_count():\n"
        "        env = os.environ\n"
        "        ok = 'CUDA_VISIBLE_DEVICES' not in env and env.get('CUDA_DEVICE_ORDER') == 'PCI_BUS_ID'\n"
        "        return int(env['FAKE_GPUS']) if ok else 0\n")
    return lambda gpus: {"PATH": str(bin_dir), "PYTHONPATH": str(fake.parent), "FAKE_GPUS": str(gpus)}


def test_without_nvidia_smi_cuda_counts_the_gpus(without_nvidia_smi):
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", env=without_nvidia_smi(2))  # omitted: all GPUs, not cpu:2
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and flag(argv, "nproc-per-node") == "2"
    env, _, _ = dry_run("recipes/ddp_torchrun.py", "1", env=without_nvidia_smi(2))
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    proc = launch("recipes/ddp_torchrun.py", "2", env=without_nvidia_smi(2))
    assert proc.returncode == 2 and "GPU 2 does not exist: this machine has 2 GPU(s)" in proc.stderr
    env, argv, stderr = dry_run("recipes/ddp_torchrun.py", env=without_nvidia_smi(0))
    assert flag(argv, "nproc-per-node") == "2" and "no GPU found, running cpu:2" in stderr


def test_missing_recipe_lists_the_real_ones():
    proc = launch("recipes/nope.py", "cpu")
    assert proc.returncode == 2
    assert "recipe 'recipes/nope.py' not found; try one of:" in proc.stderr
    assert "recipes/ddp_torchrun.py" in proc.stderr and "recipes/dp.py" in proc.stderr


@pytest.mark.parametrize("typed", ["recipes/ddp_torchrun", "ddp_torchrun", "ddp_torchrun.py"])
def test_a_recipe_named_without_py_or_recipes_gets_the_one_that_exists(typed, tmp_path):
    for cwd in (REPO, tmp_path):  # a path from here or from the repo root, as launch.sh takes it
        proc = launch("--dry-run", typed, "cpu", cwd=cwd)
        assert error_line(proc) == \
            f"launch.sh: error: recipe '{typed}' not found; did you mean recipes/ddp_torchrun.py?"


def test_recipe_without_launcher_marker(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('hi')\n")
    proc = launch(script, "cpu")
    assert proc.returncode == 2
    assert "has no '# launcher: torchrun|torch.distributed.launch|python' line" in proc.stderr


def test_unknown_launch_option():
    proc = launch("--fast", "recipes/dp.py")
    assert proc.returncode == 2 and "unknown option '--fast'" in proc.stderr


@pytest.mark.parametrize(("marker", "module"), [
    ("torchrun", [str(REPO / "tools/torchrun.py")]),  # torchrun's code, with a one-line failure report
    ("torch.distributed.launch", [str(REPO / "tools/torchrun.py"), "--legacy-launch"]),
    ("python", []),
])
def test_launcher_comes_from_the_recipe_marker(tmp_path, marker, module):
    script = tmp_path / "r.py"
    script.write_text(f'"""doc"""\n# launcher: {marker}\n')
    env, argv, _ = dry_run(script, "cpu:2", "--x", "1")
    assert argv[0] == sys.executable and argv[1:1 + len(module)] == module
    assert argv[-3:] == [str(script), "--x", "1"]
    if marker == "python":  # no launcher flags; the recipe reads the environment (mp.spawn does)
        assert not any(a.startswith("--nproc-per-node") for a in argv)
        assert env["NPROC_PER_NODE"] == "2" and env["MASTER_PORT"].isdigit()
    else:
        assert flag(argv, "nproc-per-node") == "2" and flag(argv, "nnodes") == "1"


def test_real_recipes_declare_their_launchers():
    assert dry_run("recipes/dp.py", "cpu")[1][:2] == [sys.executable, "recipes/dp.py"]
    assert dry_run("recipes/ddp_torchrun.py", "cpu")[1][:2] == [sys.executable, str(REPO / "tools/torchrun.py")]


def test_works_from_another_directory(tmp_path):
    _, argv, _ = dry_run("recipes/ddp_torchrun.py", "cpu", cwd=tmp_path)
    assert argv[-1] == str(REPO / "recipes/ddp_torchrun.py")
    proc = subprocess.run([str(LAUNCH), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: ./launch.sh" in proc.stdout


def test_launch_dry_run_env_equals_flag():
    proc = launch("recipes/ddp_torchrun.py", "cpu", env={"LAUNCH_DRY_RUN": "1", "MASTER_PORT": "29613"})
    assert proc.returncode == 0 and "--master-port=29613" in proc.stdout


@pytest.mark.parametrize("value", ["true", "yes", "on", "2"])
def test_launch_dry_run_other_than_1_or_0_is_refused_not_run(value, tmp_path):
    # Only 1 printed the command: `LAUNCH_DRY_RUN=true` started the job for real.
    script = tmp_path / "r.py"
    script.write_text("# launcher: python\nprint('ran')\n")
    proc = launch(script, "cpu:1", env={"LAUNCH_DRY_RUN": value})
    assert error_line(proc) == (f"launch.sh: error: LAUNCH_DRY_RUN='{value}' must be 1 (print the command, as "
                                "--dry-run does) or 0 (run it); unset it to run")
    proc = launch("--dry-run", script, "cpu:1", env={"LAUNCH_DRY_RUN": value})  # the flag prints: nothing runs
    assert proc.returncode == 0 and "ran" not in proc.stdout and f"{script}" in proc.stdout, proc


def test_master_port_from_environment_is_used():
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", "cpu", env={"MASTER_PORT": "29614"})
    assert env["MASTER_PORT"] == "29614" and flag(argv, "master-port") == "29614"
    assert flag(argv, "master-addr") == "127.0.0.1"


def test_default_master_port_is_free_and_below_the_kernels_ephemeral_range():
    # A port from bind(0) is ephemeral: another job's outgoing connection could take it before torchrun listens on
    # it (EADDRINUSE, seen with 8 jobs at once on a GPU machine). The default is a random free one below that range.
    low = ephemeral_range()[0]
    ports = {int(dry_run("recipes/ddp_torchrun.py", "cpu")[0]["MASTER_PORT"]) for _ in range(3)}
    assert all(max(1024, low - 12000) <= port < low for port in ports), (ports, low)
    assert len(ports) > 1, ports  # random, not one fixed port that two jobs started together would share


def test_busy_master_port_fails_clearly():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launch("recipes/ddp_torchrun.py", "cpu", env={"MASTER_PORT": str(port)})
    assert proc.returncode == 2
    assert f"MASTER_PORT={port} is already in use" in proc.stderr and "unset MASTER_PORT" in proc.stderr
    # An interpreter that does not run cannot check the port: said as that, not as a port in use (slurm/train.sbatch
    # sets MASTER_PORT on nodes whose PATH may lack the environment's python).
    proc = launch("recipes/ddp_torchrun.py", "cpu", env={"MASTER_PORT": str(port), "PYTHON": "/no/such/python"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "launch.sh: error: could not run '/no/such/python' to check MASTER_ADDR and MASTER_PORT; set PYTHON to your "
        "environment's python"], proc.stderr


@pytest.mark.parametrize(("env", "message"), [
    # a cluster job's MASTER_ADDR left exported: node 0's ranks would retry their connection for 15 minutes
    ({"MASTER_ADDR": "192.0.2.1"}, "MASTER_ADDR=192.0.2.1 is not an address of this machine, and node 0 (NODE_RANK=0) "
                                   "hosts the rendezvous there; set it to this node's address, or unset it"),
    ({"NNODES": "2", "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}, "MASTER_ADDR=192.0.2.1 is not an address"),
    ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such-host.invalid does not resolve to an address"),
    # libgomp would warn and run a thread per core in every process
    ({"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS='abc' must be a whole number >= 1 (threads per process; a list "
                                 "such as 4,2 for nested levels); unset it for cores / processes"),
    ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0' must be a whole number >= 1"),
    ({"OMP_NUM_THREADS": "4,0"}, "OMP_NUM_THREADS='4,0' must be a whole number >= 1"),
])
def test_a_master_addr_not_on_node_0_and_a_bad_thread_count_are_one_line(env, message):
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", "cpu", env=env)
    line = error_line(proc)
    assert message in line, line


def test_a_master_addr_of_this_machine_and_other_nodes_addresses_pass():
    for addr in ("localhost", socket.gethostname()):
        assert dry_run("recipes/ddp_torchrun.py", "cpu", env={"MASTER_ADDR": addr})[0]["MASTER_ADDR"] == addr
    # node 1 only connects to node 0's address: not this machine's, and not checked here
    env, _, _ = dry_run("recipes/ddp_torchrun.py", "cpu", env={"NNODES": "2", "NODE_RANK": "1",
                                                               "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"})
    assert env["MASTER_ADDR"] == "192.0.2.1"
    for threads in ("3", "4,2"):  # a list: libgomp's threads per nested level
        assert dry_run("recipes/ddp_torchrun.py", "cpu", env={"OMP_NUM_THREADS": threads})[0]["OMP_NUM_THREADS"] == \
            threads


@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_bad_master_port(port):
    proc = launch("recipes/ddp_torchrun.py", "cpu", env={"MASTER_PORT": port})
    assert proc.returncode == 2 and "is not a port number" in proc.stderr


def test_jobs_started_together_get_different_free_ports():
    procs = [subprocess.Popen([str(LAUNCH), "--dry-run", "recipes/ddp_torchrun.py", "cpu"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}) for _ in range(6)]
    ports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        ports.append(int(out.split("MASTER_PORT=")[1].split()[0]))
    assert len(set(ports)) == len(ports)
    for port in ports:  # and each was free when picked
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_picked_lately_is_not_picked_again_until_its_hold_ends(tmp_path, monkeypatch):
    # Two launches whose random draws meet (the 6 above shared 21092 once in a suite run: 1 in 800): the second takes
    # its next draw. A pick older than HOLD_S is free again; a file that cannot be used keeps nothing, and the pick
    # goes on.
    recent = tmp_path / "ports"
    draws = iter([25000, 25000, 25001, 25000, 25002])
    monkeypatch.setattr(free_port_tool.random, "randint", lambda low, high: next(draws))
    assert [free_port(recent=recent) for _ in range(3)] == [25000, 25001, 25002]
    assert sorted(int(line.split()[0]) for line in recent.read_text().splitlines()) == [25000, 25001, 25002]
    recent.write_text(f"25000 {time.time() - free_port_tool.HOLD_S - 1}\nnot a line\n")
    draws = iter([25000])
    assert free_port(recent=recent) == 25000
    draws = iter([25003])
    assert free_port(recent=tmp_path / "no" / "such" / "folder") == 25003


# tools/free_port.py LOW HIGH (a job's own port range)
def free_port_cli(*args, tmp):
    """`python tools/free_port.py ARGS` with TMPDIR=tmp (where tempfile has not read TMPDIR yet, the picks it keeps go
    there, not into the user's file)."""
    return run_script([REPO / "tools" / "free_port.py", *args], env={**os.environ, "TMPDIR": str(tmp)})


def test_free_port_with_a_range_prints_only_a_port_in_it(tmp_path):
    # A range under 1000 ports: it made no draw and printed the kernel's pick, 41119 for 29500 29600, exit 0.
    ports = [int(free_port_cli(29500, 29600, tmp=tmp_path).stdout) for _ in range(3)]
    assert all(29500 <= port < 29600 for port in ports) and len(set(ports)) == 3, ports  # kept picks: 3 different
    # ... kept in TMPDIR's file, not the user's in /tmp (a warm rank reads its own TMPDIR, as a new interpreter does)
    kept = (tmp_path / f"ddp-cookbook-ports-{os.getuid()}").read_text().split()
    assert sorted(map(int, kept[::2])) == sorted(ports), kept
    # A small range is walked: every port but one of ten was picked lately, so that one it is.
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]  # free once closed
    recent = tmp_path / "picks"
    recent.write_text("".join(f"{p} {time.time()}\n" for p in range(port - 5, port + 5) if p != port))
    assert free_port(port - 5, port + 5, recent=recent) == port
    with pytest.raises(OSError, match=rf"no free port in \[{port - 5}, {port + 5}\)"):  # now all ten are taken
        free_port(port - 5, port + 5, recent=recent)


def test_free_port_with_no_free_port_in_its_range_or_bad_arguments_is_one_line(tmp_path):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = free_port_cli(port, port + 1, tmp=tmp_path)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"error: no free port in [{port}, {port + 1}): each is in use or was picked in the last " \
        "120 s; give a wider range\n"
    for args in (["x", "y"], ["0", "10"], ["10", "10"], ["5", "65537"], ["29500"]):
        proc = free_port_cli(*args, tmp=tmp_path)
        assert (proc.returncode, proc.stdout) == (2, "") and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stderr.startswith("error: ")
        assert proc.stderr.endswith("usage: python tools/free_port.py [LOW HIGH]\n")


def test_a_master_port_taken_after_launch_sh_checked_it_is_one_line():
    # launch.sh checks MASTER_PORT, but another process can take it before torchrun listens: its DistNetworkError,
    # one line from tools/torchrun.py, not the agent's traceback.
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run_script([REPO / "tools" / "torchrun.py", "--nnodes=1", "--nproc-per-node=1", "--node-rank=0",
                           "--master-addr=127.0.0.1", f"--master-port={port}", REPO / "recipes" / "ddp_torchrun.py"])
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: the rendezvous failed: The server socket has "
                                                   "failed to listen") and f"port: {port}" in lines[0], proc.stderr


def test_the_ranks_port_of_a_restartable_job_is_below_the_ephemeral_range(monkeypatch):
    # MAX_RESTARTS: each attempt's store hands the ranks a MASTER_PORT that torchrun picks on node 0
    # (RendezvousStoreInfo.build): tools/torchrun.py has it picked below the kernel's ephemeral range.
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import api as rendezvous_api

    from tools import torchrun

    monkeypatch.setattr(rendezvous_api, "get_free_port", rendezvous_api.get_free_port)  # put back after the test
    torchrun.ranks_port_below_the_ephemeral_range()
    low = ephemeral_range()[0]
    ports = [rendezvous_api.RendezvousStoreInfo.build(0, HashStore(), "127.0.0.1").master_port for _ in range(20)]
    assert all(max(1024, low - 12000) <= port < low for port in ports), (ports, low)


def test_multi_node_environment_is_passed_to_torchrun():
    env, argv, _ = dry_run("recipes/ddp_torchrun.py", "cpu:2",
                           env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    assert flag(argv, "nnodes") == "2" and flag(argv, "node-rank") == "1"
    assert flag(argv, "master-addr") == "10.1.2.3" and flag(argv, "master-port") == "29500"
    assert env["NODE_RANK"] == "1"


@pytest.mark.parametrize(("env", "message"), [
    ({"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR (node 0's address) and MASTER_PORT"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, "NODE_RANK='2' must be 0..1"),
    ({"NNODES": "0"}, "NNODES='0' must be a whole number from 1 to 999999 (the number of nodes)"),
    # 20 digits wrapped in bash arithmetic: 2^64 + 1 nodes read as 1, a NODE_RANK of 2^64 as 0
    ({"NNODES": str(2**64 + 1)}, f"NNODES='{2**64 + 1}' must be a whole number from 1 to 999999"),
    ({"NNODES": "2", "NODE_RANK": str(2**64), "MASTER_ADDR": "h", "MASTER_PORT": "29500"},
     f"NODE_RANK='{2**64}' must be 0..1"),
])
def test_bad_multi_node_environment(env, message):
    proc = launch("recipes/ddp_torchrun.py", "cpu", env=env)
    assert proc.returncode == 2 and message in proc.stderr


def test_node_rank_without_nnodes_says_to_set_nnodes():
    # It said "NODE_RANK='1' must be 0..0 (NNODES=1)": true, and silent on the variable to set.
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", "cpu", env={"NODE_RANK": "1"})
    assert error_line(proc) == (
        "launch.sh: error: NODE_RANK=1 needs NNODES, the number of nodes: set NNODES (and MASTER_ADDR, MASTER_PORT) "
        "the same on every node, or unset NODE_RANK for a one-node job")
    assert dry_run("recipes/ddp_torchrun.py", "cpu", env={"NODE_RANK": "0"})[0]["NNODES"] == "1"


def test_max_restarts_goes_to_torchrun_with_a_fresh_store_per_attempt():
    env, argv, stderr = dry_run("recipes/ddp_checkpoint.py", "cpu:2", "--resume", "auto", env={"MAX_RESTARTS": "3"})
    assert flag(argv, "max-restarts") == "3" and flag(argv, "rdzv-backend") == "c10d"
    assert flag(argv, "rdzv-endpoint") == f"127.0.0.1:{env['MASTER_PORT']}"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and "up to 3 restart(s)" in stderr
    env, argv, _ = dry_run("recipes/ddp_checkpoint.py", "cpu:2")  # the default: no restarts, as before
    assert flag(argv, "max-restarts") == "0" and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env
    assert flag(argv, "master-port") == env["MASTER_PORT"]


@pytest.mark.parametrize(("recipe", "value", "message"), [
    ("ddp_spawn", "1", "MAX_RESTARTS needs a recipe started by torchrun; ddp_spawn.py starts its own processes"),
    ("ddp_torchrun", "-1", "MAX_RESTARTS='-1' must be a whole number >= 0"),
])
def test_bad_max_restarts(recipe, value, message):
    proc = launch(f"recipes/{recipe}.py", "cpu:2", env={"MAX_RESTARTS": value})
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["18446744073709551616", "9" * 20, "1000000"])
def test_a_huge_max_restarts_is_refused_not_wrapped(value):
    # bash arithmetic wraps past 2^63: 2^64 became 0 restarts, twenty 9s 7766279631452241919.
    proc = launch("--dry-run", "recipes/ddp_torchrun.py", "cpu:2", env={"MAX_RESTARTS": value})
    assert error_line(proc) == (f"launch.sh: error: MAX_RESTARTS='{value}' must be a whole number >= 0 and at most "
                                "999999 (restarts when a rank fails); unset it for none")
    _, argv, _ = dry_run("recipes/ddp_torchrun.py", "cpu:2", env={"MAX_RESTARTS": "000999999"})
    assert flag(argv, "max-restarts") == "999999"


@pytest.mark.parametrize(("cores", "devices", "threads"), [(8, "cpu:2", "4"), (16, "cpu:3", "5"), (1, "cpu:3", "1")])
def test_cpu_threads_split_across_processes(tmp_path, cores, devices, threads):
    path = stand_in_command(tmp_path, "nproc", f"echo {cores}\n")  # a machine of that many cores
    assert dry_run("recipes/ddp_torchrun.py", devices, env=path)[0]["OMP_NUM_THREADS"] == threads
    env, _, _ = dry_run("recipes/ddp_torchrun.py", devices, env={**path, "OMP_NUM_THREADS": "7"})
    assert env["OMP_NUM_THREADS"] == "7"


def cgroup_files(folder, files):
    """A stand-in for the kernel's cgroup folder (a test double: /sys/fs/cgroup cannot be written here)."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return str(folder)


@pytest.mark.parametrize(("files", "devices", "threads", "quota"), [
    ({"cpu.max": "1600000 100000\n"}, "cpu:8", "2", 16),  # a pod limited to 16 CPUs of a 128-core node
    ({"cpu.max": "150000 100000\n"}, "cpu:1", "2", 2),  # 1.5 CPUs: rounded up
    ({"cpu.max": "max 100000\n", "cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "cpu:2",
     "64", None),  # cgroup v2 says no limit: v1's files are not read
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "cpu:2", "2", 4),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "cpu:2", "64", None),  # v1: no limit
    ({"cpu.max": "25600000 100000\n"}, "cpu:2", "64", 256),  # a limit above the cores: the cores
])
def test_cores_are_nproc_s_at_most_a_container_s_cpu_limit(tmp_path, monkeypatch, files, devices, threads, quota):
    """launch.sh's threads and the recipes' default --workers count the same cores: a Docker --cpus or Kubernetes
    CPU limit (the cgroup's CFS quota, which nproc does not count) caps them."""
    from common.data import cpu_quota, default_workers, usable_cores

    root = cgroup_files(tmp_path / "cgroup", files)
    path = stand_in_command(tmp_path, "nproc", "echo 128\n")  # the node's 128 cores, all in this job's affinity
    env, _, err = dry_run("recipes/ddp_torchrun.py", devices, env={**path, "CGROUP_FS": root})
    assert env["OMP_NUM_THREADS"] == threads
    assert err.startswith("launch.sh: "), err  # its own line first: nothing about the files the cgroup lacks
    assert cpu_quota(root) == quota
    monkeypatch.setenv("CGROUP_FS", root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    processes, cores = int(devices.split(":")[1]), min(128, quota or 128)
    assert usable_cores() == cores
    assert default_workers(None, processes) == min(16, cores // processes - 1)


def test_the_gpu_tier_asked_for_without_cuda_fails_with_one_line():
    """`python -m pytest -m gpu` where CUDA cannot run must not skip everything and pass."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA runs here: the tier itself runs (python -m pytest -m gpu)")
    # `python -m pytest ...`, forked from the warm server (run_script): torch is imported there already
    proc = run_script([Path(pytest.__file__).parent / "__main__.py", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                       "tests/test_gpu.py"], timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    said = [line for line in proc.stdout.splitlines() if "the GPU tier needs CUDA" in line]
    assert len(said) == 1 and f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" in said[0], said
    assert " passed" not in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


def test_the_launcher_names_a_watchdog_abort_and_where_to_look():
    # Under NCCL's default error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) the watchdog aborts the rank whose
    # collective timed out or lost a peer: no Python error is raised, so one_line_errors() never sees it, and this
    # line is what the user gets. torch's own ProcessFailure, as torchrun hands it over (no error file).
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tools.torchrun import describe, root_cause

    aborted = ProcessFailure(local_rank=0, pid=4242, exitcode=-signal.SIGABRT, error_file="/nonexistent")
    stopped = ProcessFailure(local_rank=1, pid=4243, exitcode=-signal.SIGTERM, error_file="/nonexistent")
    stopped.timestamp = aborted.timestamp  # the same second: the abort is the cause, torchrun's SIGTERM the effect
    (first, failure), _ = root_cause({1: stopped, 0: aborted})
    assert describe(first, failure) == (
        "rank 0 (pid 4242) was killed by SIGABRT (under NCCL, its watchdog aborts a rank whose collective timed out "
        "or lost a peer: that rank's output above names which, 'Watchdog caught collective operation timeout' or a "
        "remote error)")
    assert describe(1, stopped) == "rank 1 (pid 4243) was stopped (SIGTERM)"


BYSTANDER = f"""# launcher: torchrun
import sys
sys.path.insert(0, {str(REPO)!r})
import torch.distributed as dist
from common import harness


def main():
    dist.init_process_group("gloo")
    if sys.argv[1] == "fail" and dist.get_rank() == 1:
        harness.die("a bad flag on rank 1 alone", all_ranks=True)
    dist.barrier()  # rank 0 waits here, and loses its peer
    dist.destroy_process_group()


with harness.one_line_errors():
    main()
"""


@pytest.mark.real_path("the launcher's verdict")
def test_the_rank_that_failed_comes_before_the_one_that_lost_it(tmp_path):
    # Rank 1 exits 2 (one line); rank 0, in a barrier, loses its peer and exits 1 within the same second (torchrun's
    # timestamps are whole seconds). The rank that said it lost its peer (its RANK.failed) is not the cause: launch.sh
    # names rank 1 first and exits with its code (without that, 3 runs in 4 named rank 0 and exited 1).
    script = tmp_path / "bystander.py"
    script.write_text(BYSTANDER)
    proc = launch(script, "cpu:2", "fail", timeout=120)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.match(r"launch\.sh: job failed: rank 1 \(pid \d+\) exited with code 2", line), proc.stderr[-3000:]


def test_a_failure_that_a_peer_reported_losing_is_ranked_after_the_cause(tmp_path):
    # note_victims reads which ranks left RANK.failed (a lost peer, a timeout) and keeps their pids for root_cause.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tools import torchrun

    class Handler:
        def __init__(self, pid):
            self.proc = type("Proc", (), {"pid": pid})()

    context = type("Context", (), {"subprocess_handlers": {0: Handler(5000), 1: Handler(5001)},
                                   "envs": {0: {"RANK": "0"}, 1: {"RANK": "1"}}})()
    (tmp_path / "rank0.failed").write_text("[rank 0] error: lost its peer\n")
    torchrun.note_victims(context, tmp_path)
    assert 5000 in torchrun.VICTIMS and 5001 not in torchrun.VICTIMS
    lost = ProcessFailure(local_rank=0, pid=5000, exitcode=1, error_file="/nonexistent")
    cause = ProcessFailure(local_rank=1, pid=5001, exitcode=2, error_file="/nonexistent")
    cause.timestamp = lost.timestamp
    assert torchrun.job_failed({0: lost, 1: cause}) == (
        2, "launch.sh: job failed: rank 1 (pid 5001) exited with code 2; rank 0 (pid 5000) exited with code 1 (each "
           "rank's own output is above)")
    # A rank that timed out waiting for one that hung, which torchrun then stopped: the timeout is what is said.
    hung = ProcessFailure(local_rank=1, pid=5001, exitcode=-signal.SIGTERM, error_file="/nonexistent")
    hung.timestamp = lost.timestamp
    assert torchrun.job_failed({0: lost, 1: hung})[0] == 1
    torchrun.VICTIMS.discard(5000)


def launcher_left_sigint_to_its_default(pid):
    """Whether process `pid` catches SIGUSR1 and neither catches nor ignores SIGINT (/proc/PID/status): what
    tools/torchrun.py sets before it imports torch; a Python that has not got that far catches SIGINT itself."""
    with open(f"/proc/{pid}/status") as f:
        masks = dict(line.split(":\t", 1) for line in f.read().splitlines() if line.startswith(("SigCgt", "SigIgn")))
    caught, ignored = (int(masks[name], 16) for name in ("SigCgt", "SigIgn"))  # bit N-1: signal N
    return bool(caught >> (signal.SIGUSR1 - 1) & 1) and not (caught | ignored) >> (signal.SIGINT - 1) & 1


@pytest.mark.real_path("Ctrl-C reaches the launcher itself")
def test_ctrl_c_while_node_0_waits_for_the_others_stops_it_at_once(tmp_path):
    # NNODES=2 and no node 1: torchrun waits in the rendezvous (C++, up to 600 s), where Python's SIGINT handler
    # cannot run; the launcher leaves SIGINT to its default action until torchrun takes it over with the ranks.
    script = tmp_path / "bystander.py"
    script.write_text(BYSTANDER)
    port = free_port()
    proc = subprocess.Popen([str(LAUNCH), str(script), "cpu:1", "ok"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "NNODES": "2", "NODE_RANK": "0",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the store listens: the rendezvous has begun
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("node 0 never listened on MASTER_PORT")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, (proc.returncode, stderr[-2000:])


def test_ctrl_c_while_the_launcher_imports_torch_ends_it_without_a_traceback(tmp_path):
    # tools/torchrun.py imports torch for a second or more before main(): a Ctrl-C then printed Python's
    # KeyboardInterrupt traceback from inside the import, 35 lines. It ends by the signal, as the shell expects.
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "torchrun.py"), "--nproc-per-node=1", "x.py"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Not a fixed sleep: under load the interpreter's start-up can outlast it, and a SIGINT before the script's
    # signal.signal(SIGINT, SIG_DFL) meets Python's own handler (a traceback). Wait until the kernel shows SIGUSR1
    # caught (the line before) and SIGINT at its default action: the script is past that line, into torch's import.
    deadline = time.monotonic() + 60
    while not launcher_left_sigint_to_its_default(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT and "Traceback" not in stderr, (proc.returncode, stderr[-2000:])
    # Imported (tests import its helpers; pytest needs its KeyboardInterrupt to stop and report), Ctrl-C is left as is.
    probe = tmp_path / "probe.py"
    probe.write_text(f"import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                     f"sys.path.insert(0, {str(REPO)!r})\nimport tools.torchrun\n"
                     "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    probed = run_script([probe])
    assert probed.stdout.strip() == "True", probed.stderr[-2000:]


WAITING_RANK = """
import time
from common.utils import _stack_on_signal
_stack_on_signal()
print("ready", flush=True)


def inside_a_collective():
    time.sleep(120)


inside_a_collective()
"""


def asleep(pid, timeout=60):
    """Returns once the process sleeps in time.sleep (the kernel's wait channel for it names nanosleep); where the
    kernel does not show wait channels, after a second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                channel = f.read()
        except OSError:
            channel = ""
        if "nanosleep" in channel:
            return
        if channel in ("", "0"):  # not shown here
            time.sleep(1)
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not reach time.sleep within {timeout} s")


def test_a_rank_aborted_by_a_watchdog_still_shows_where_the_others_are(tmp_path, capsys):
    # NCCL's watchdog aborts (SIGABRT) a rank whose collective timed out: no Python error, so no RANK.failed, and the
    # launcher still shows where the other ranks are. Real processes and signals (the waiting rank registers as the
    # recipes do); torchrun's SubprocessContext is a stand-in holding their Popen objects and environments.
    from types import SimpleNamespace

    from common.utils import STACKS_ENV
    from tools.torchrun import show_stacks

    folder, script = tmp_path / "stacks", tmp_path / "rank.py"
    folder.mkdir()
    script.write_text(WAITING_RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), STACKS_ENV: str(folder)}
    aborted = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"], env={**env, "RANK": "0"})
    waiting = subprocess.Popen([sys.executable, script], env={**env, "RANK": "1"}, stdout=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout.readline() == "ready\n"
        asleep(waiting.pid)  # past print(): a busy machine may not have run its next line yet
        aborted.wait(timeout=60)
        handlers = {0: SimpleNamespace(proc=aborted), 1: SimpleNamespace(proc=waiting)}
        context = SimpleNamespace(subprocess_handlers=handlers, envs={0: {"RANK": "0"}, 1: {"RANK": "1"}})
        show_stacks(context, folder)
        assert waiting.poll() is None  # the signal left it running: the launcher stops it after, as before
    finally:
        waiting.kill()
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["[rank 0] stack: none, it had ended (killed by SIGABRT) before the others stopped",
                       "[rank 1] stack:"], err
    assert re.fullmatch(r"Main thread 0x[0-9a-f]+ \(most recent call last\):", err[2]), err
    assert err[3:] == [f'  File "{script}", line 12, in <module>', "    inside_a_collective()",
                       f'  File "{script}", line 9, in inside_a_collective', "    time.sleep(120)"], err
    assert not list(folder.iterdir())  # emptied for a restart's new ranks


@pytest.mark.parametrize("gpus", [1, 3])
def test_model_parallel_on_an_odd_gpu_count_is_refused(gpus):
    # 0,1,3 would make one worker of GPUs 0 and 1 and leave the third idle without a word. The count is a test
    # double (tests/fake_gpus): the recipe decides from it before it touches a GPU; the GPU tier runs the real one.
    # Forked from the warm server (run_script), which imports the double's sitecustomize as a new interpreter would.
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "fake_gpus"), "FAKE_CUDA_DEVICE_COUNT": str(gpus)}
    proc = run_script(["recipes/ddp_spawn.py", "--arch", "tiny", "--model-parallel"], env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --model-parallel needs 2 whole GPUs per worker, {gpus} visible: list an even number of GPUs"]
