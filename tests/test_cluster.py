"""Cluster scale on one box: ranks die with their launcher, torchrun restarts a killed rank and the job resumes
exactly (MAX_RESTARTS), two launch.sh "nodes" form one world, and slurm/train.sbatch's node part does the same
from SLURM's variables alone."""

import os
import re
import signal
import subprocess
import time

import pytest
import torch
from conftest import REPO, launch, launch_env, result_of
from jobs import Job, job_mid_epoch, survivors

from tools.free_port import free_port

TINY = ["--arch", "tiny", "--workers", "0"]
SBATCH = REPO / "slurm" / "train.sbatch"


def same_weights(a, b):
    a, b = (torch.load(path, weights_only=True) for path in (a, b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ranks_and_their_workers_die_with_a_sigkilled_launcher(tmp_path):
    # torchrun starts each rank in a session of its own: without the parent-death signal tools/torchrun.py gives
    # them, they went on training after `kill -9` of launch.sh (which became torchrun).
    job = job_mid_epoch("ddp_torchrun", tmp_path)
    tree = job.tree()
    assert len(tree) >= 5, tree  # the launcher, 2 ranks, their DataLoader workers
    start = time.monotonic()
    os.kill(job.proc.pid, signal.SIGKILL)
    left = survivors(tree, grace=15)
    took = time.monotonic() - start
    print(f"launcher SIGKILLed: {len(tree)} processes gone in {took:.1f} s")
    assert not left, (left, job.output())
    assert took < 10, took  # the ranks at once; their DataLoader workers notice within 5 s
    job.finish(timeout=30)


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_job_ends_as_if_nothing_happened(tmp_path):
    args = ["recipes/ddp_checkpoint.py", "cpu:2", "--arch", "tiny", "--workers", "1", "--epochs", "3",
            "--synthetic-train", "4096", "--batch-size", "64", "--resume", "auto"]
    straight = launch(*args, "--out-dir", tmp_path / "straight")
    assert result_of(straight)["steps"] == 192
    job = Job(*args, "--out-dir", tmp_path / "killed", env={"MAX_RESTARTS": "1"})
    job.wait_for("best: epoch=1 ")  # epoch 1's latest.pt is on disk
    time.sleep(1.0)  # a second into epoch 2
    victim = job.rank_pid(1)
    os.kill(victim, signal.SIGKILL)
    code = job.finish(timeout=180)
    out, err = "".join(job.stdout), "".join(job.stderr)
    assert code == 0, job.output()
    assert "up to 1 restart(s)" in err
    # After the restart, one line says where the job went on from; the epochs it printed add up.
    said = re.search(rf"^resume: {re.escape(str(tmp_path / 'killed' / 'latest.pt'))} at epoch 1 step 64 .*", out, re.M)
    assert said, out
    print(f"restarted: {said.group(0)}")
    assert re.findall(r"^epoch=(\d)/3", out, re.M) == ["1", "2", "3"], out
    assert same_weights(tmp_path / "straight/model.pt", tmp_path / "killed/model.pt")  # bitwise


@pytest.mark.slow
def test_two_launch_sh_nodes_equal_one_node_with_two_processes(tmp_path):
    args = ["recipes/ddp_torchrun.py", "cpu:1", *TINY, "--max-steps", "6", "--batch-size", "32"]
    port = str(free_port())
    # One thread per process in both: cpu:1 would give a node's one process every core, and another thread
    # count sums a convolution in another order.
    nodes = [Job(*args, "--out-dir", tmp_path / f"node{rank}", env={
        "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
             for rank in (0, 1)]
    assert [node.finish(timeout=180) for node in nodes] == [0, 0], [node.output() for node in nodes]
    one = launch(*args[:1], "cpu:2", *args[2:], "--out-dir", tmp_path / "one", env={"OMP_NUM_THREADS": "1"})
    two_nodes = result_of(subprocess.CompletedProcess([], 0, "".join(nodes[0].stdout), ""))
    assert two_nodes["world_size"] == result_of(one)["world_size"] == 2
    assert two_nodes["train_loss"] == result_of(one)["train_loss"]
    assert same_weights(tmp_path / "node0/model.pt", tmp_path / "one/model.pt")
    assert not (tmp_path / "node1").exists()  # rank 0 saves; the other node writes nothing


@pytest.mark.slow
def test_two_nodes_sharing_a_data_root_download_cifar100_once(tmp_path):
    # Each node's local rank 0 prepares the data just after the rendezvous, so both reach the download together.
    # tests/fake_cifar (a test double of torchvision's download) writes the files slowly, under their final names,
    # as the real one does, and logs each download: without the lock both nodes downloaded (or one read the
    # other's half-written file).
    log, data = tmp_path / "downloads.log", tmp_path / "data"
    port = str(free_port())
    nodes = [Job("recipes/ddp_torchrun.py", "cpu:1", *TINY, "--dataset", "cifar100", "--data-root", data,
                 "--max-steps", "2", "--batch-size", "16", "--out-dir", tmp_path / "out", env={
                     "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                     "PYTHONPATH": str(REPO / "tests" / "fake_cifar"), "FAKE_CIFAR_DOWNLOADS": str(log)})
             for rank in (0, 1)]
    assert [node.finish(timeout=180) for node in nodes] == [0, 0], [node.output() for node in nodes]
    downloads = log.read_text().splitlines()
    print("\n".join(downloads))
    assert len(downloads) == 1 and f"into={data}" in downloads[0], downloads
    assert not any("warning" in "".join(node.stderr) for node in nodes), [node.output() for node in nodes]
    result = result_of(subprocess.CompletedProcess([], 0, "".join(nodes[0].stdout), ""))
    assert (result["world_size"], result["steps"], result["val_samples"]) == (2, 2, 16), result  # both trained
    assert "data: cifar100 train=64 val=16 classes=100" in "".join(nodes[0].stdout)


def sbatch_node(node, env, *args):
    """slurm/train.sbatch's node part, as srun starts it on node `node` of a 2-node allocation."""
    full = launch_env({"SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_SUBMIT_DIR": str(REPO),
                       "COOKBOOK_NODE_PART": "1", **env})
    return subprocess.Popen(["bash", str(SBATCH), *map(str, args)], cwd="/", env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.slow
def test_the_sbatch_node_part_forms_one_world_from_slurms_variables(tmp_path):
    port = free_port(20000, 32000)  # the script's MASTER_PORT: 20000 + SLURM_JOB_ID % 12000
    env = {"SLURM_JOB_ID": str(port - 20000 + 12000 * 7), "SLURM_JOB_NODELIST": "localhost", "DEVICES": "cpu:1"}
    procs = [sbatch_node(node, env, "recipes/ddp_torchrun.py", *TINY, "--max-steps", "3", "--batch-size", "16",
                         "--out-dir", tmp_path) for node in (0, 1)]
    outputs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    for node, (_, err) in enumerate(outputs):
        assert f"slurm/train.sbatch: node {node} of 2 (" in err and f"master localhost:{port}" in err, err
        assert "launch.sh: 1 process(es) per node on cpu, 2 node(s), torchrun" in err
    result = result_of(subprocess.CompletedProcess([], 0, outputs[0][0], ""))
    assert (result["world_size"], result["steps"]) == (2, 3)


@pytest.mark.slow
def test_sbatch_passes_sigusr1_on_requeues_after_the_save_and_the_requeued_run_goes_on(tmp_path):
    # SLURM's --signal=B:USR1@120: the signal reaches the batch shell alone. It passes it to srun (a test double in
    # tests/slurm_double, as are scontrol and the 2 nodes, both here), srun to each node's launch.sh, launch.sh to
    # the ranks: they save, exit 75, and the batch shell requeues the job. The requeued run, the same command, goes
    # on from the save to the end, and requeues nothing.
    port = free_port(20000, 32000)  # the script's MASTER_PORT: 20000 + SLURM_JOB_ID % 12000
    job_id = str(port - 20000 + 12000 * 3)
    env = {"PATH": f"{REPO / 'tests' / 'slurm_double'}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": job_id,
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(REPO), "DEVICES": "cpu:1",
           "SCONTROL_LOG": str(tmp_path / "scontrol.log"), "SRUN_LOG": str(tmp_path / "srun.log"),
           "SLURM_CPUS_PER_TASK": "3",
           # `sbatch --export=NONE`: a step gets SLURM's variables alone unless srun says otherwise (the double too)
           "SLURM_EXPORT_ENV": "NONE"}
    command = ["bash", str(SBATCH), "recipes/ddp_checkpoint.py", *TINY, "--synthetic-train", "8192", "--batch-size",
               "64", "--save-every", "5", "--out-dir", tmp_path / "out", "--resume", "auto"]
    job = Job(env=env, command=list(map(str, command)))
    job.wait_for("saved: ")  # step 5's: training runs on both nodes
    os.kill(job.proc.pid, signal.SIGUSR1)  # the batch shell alone
    assert job.finish(timeout=120) == 75, job.output()
    saved = torch.load(tmp_path / "out" / "latest.pt", weights_only=True)
    assert (saved["epoch"], len(saved["rng"])) == (0, 2) and 5 < saved["step"] < 128, job.output()
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {job_id}\n", job.output()
    assert "srun (test double): tasks ended, exit 75" in "".join(job.stderr), job.output()
    # sbatch's --cpus-per-task passed on: SLURM 22.05's srun no longer takes it from the job; every node's exit code
    # whatever the site's KillOnBadExit; the job's environment whatever sbatch's --export
    assert (tmp_path / "srun.log").read_text() == ("--ntasks-per-node=1\n--export=ALL\n--kill-on-bad-exit=0\n"
                                                   "--cpus-per-task=3\n")
    again = Job(env=env, command=list(map(str, command)))
    assert again.finish(timeout=120) == 0, again.output()
    result = result_of(subprocess.CompletedProcess([], 0, "".join(again.stdout), ""))
    assert (result["world_size"], result["start_step"], result["steps"]) == (2, saved["step"], 128)
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {job_id}\n"  # finished: not requeued again


@pytest.mark.parametrize(("nodelist", "master"), [("gpu[07-08,11],login2", "gpu07"), ("n[001-004]", "n001"),
                                                  ("node7,node9", "node7")])
def test_the_sbatch_node_part_takes_the_first_host_as_master(nodelist, master):
    env = launch_env({"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": nodelist,
                      "SLURM_SUBMIT_DIR": str(REPO), "COOKBOOK_NODE_PART": "1", "DEVICES": "cpu:2",
                      "LAUNCH_DRY_RUN": "1"})
    proc = subprocess.run(["bash", str(SBATCH), "recipes/ddp_torchrun.py", "--epochs", "1"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (f"MASTER_ADDR={master} MASTER_PORT=24242 NNODES=2 NODE_RANK=1" in proc.stdout
            and "--nnodes=2 --nproc-per-node=2 --max-restarts=0 --node-rank=1" in proc.stdout), proc.stdout


def test_sbatch_outside_slurm_says_how_to_submit_it():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SBATCH), "recipes/ddp_torchrun.py"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "slurm/train.sbatch: error: SLURM_JOB_ID is not set: submit it with sbatch --nodes N slurm/train.sbatch "
        "RECIPE [args]")
