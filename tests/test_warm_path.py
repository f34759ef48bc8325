"""The warm path (tests/warm.py) against the real one: every recipe run both ways with the same flags computes the
same (its RESULT numbers, its epoch lines, its model.pt byte for byte), and a warm job behaves as launch.sh's does
where the tests look: fresh state in each rank, torchrun's environment and exit codes, its stop of the other ranks
when one fails, the real path wherever the warm one could differ."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import warm
from conftest import LAUNCH, RECIPES, REPO, epoch_lines, launch, launch_env, result_of, run_direct
from jobs import started_with

from tools.procs import run_group

IMAGE = ["--arch", "tiny_bn", "--workers", "0", "--batch-size", "32", "--epochs", "1", "--lr", "0.1", "--image-size",
         "16", "--synthetic-train", "128", "--synthetic-val", "37"]
LM = ["--n-layer", "2", "--n-head", "4", "--d-model", "32", "--block-size", "32", "--seq-len", "16", "--batch-size",
      "8", "--steps", "4", "--eval-every", "2", "--val-windows", "8"]
FLAGS = {  # recipe: (devices, flags): small, and each recipe's own launcher
    **{r: ("cpu:2", ["--dataset", "synthetic", *IMAGE]) for r in RECIPES if not r.startswith("lm_")},
    "dp": ("cpu:1", ["--dataset", "synthetic", *IMAGE]),
    "mx_face_prefetch": ("cpu:2", ["--rec", "synthetic", *IMAGE]),
    "lm_ddp": ("cpu:2", LM),
    "lm_tp": ("cpu:2", LM),
    "lm_pp": ("cpu:2", [*LM[:1], "4", *LM[2:]]),  # a stage of 2 blocks on each of 2 ranks
    "lm_fsdp_tp": ("cpu:4", LM),
    "lm_moe": ("cpu:2", LM),  # 4 of 8 experts on each of 2 ranks (--ep 2): the all-to-alls
}
TIMING = re.compile(r"per_sec|mem|unix|_ms$|seconds|time")  # RESULT fields that differ between any two runs


@pytest.fixture(autouse=True)
def _warm_on(monkeypatch):
    """The warm path is this file's subject: on here also where COOKBOOK_WARM=0 turns it off for the suite."""
    monkeypatch.setattr(warm, "ENABLED", True)


def test_every_recipe_has_flags_here():
    assert set(FLAGS) == set(RECIPES)


def numbers(proc):
    return {k: v for k, v in result_of(proc).items() if not TIMING.search(k)}


@pytest.mark.slow
@pytest.mark.real_path("it runs each recipe both ways")
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_two_paths_compute_the_same(recipe, tmp_path):
    devices, flags = FLAGS[recipe]
    args = [f"recipes/{recipe}.py", devices, *flags]
    tmp = tmp_path / "tmp"  # the real job's TMPDIR (torchrun's two launchers; their recipes compile nothing)
    tmp.mkdir()
    env = launch_env({"TMPDIR": str(tmp)} if recipe in ("ddp_torchrun", "ddp_launch") else {})
    real = run_group([str(LAUNCH), *args, "--out-dir", tmp_path / "real"], env=env, cwd=REPO, timeout=600)
    assert result_of(real)["world_size"] == int(devices.split(":")[1]), real.stdout
    # The launcher's folders went with it: its stacks folder, and torchrun's log folder inside it (tools/torchrun.py's
    # logs_in; left to torchrun, every launch leaves a torchelastic_* folder behind).
    # (torch's import makes an empty torchinductor_<user> there, its compile cache: not the launcher's to remove.)
    assert [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "launch_stacks_"))] == [], real.stderr
    if recipe == "ddp_launch":  # launch.sh chose the real legacy launcher from the recipe's marker, and it trained
        assert "torch.distributed.launch" in real.stderr.splitlines()[0], real.stderr
    warm.forbidden.why = None
    job = warm.launch_job([*args, "--out-dir", tmp_path / "warm"], launch_env(), REPO)
    assert isinstance(job, warm.Job), warm.last_real_path_reason
    hot = job.wait(600)
    assert numbers(hot) == numbers(real)
    assert epoch_lines(hot.stdout) == epoch_lines(real.stdout)
    assert (tmp_path / "real" / "model.pt").read_bytes() == (tmp_path / "warm" / "model.pt").read_bytes()
    # launch.sh's line heads both: the same job as it parsed it (the port aside)
    strip = re.compile(r"master \S+")
    assert strip.sub("", hot.stderr.splitlines()[0]) == strip.sub("", real.stderr.splitlines()[0])


PROBE = textwrap.dedent("""\
    # launcher: torchrun
    import json, os, signal, sys
    import torch
    import torch.distributed as dist
    fresh = {"initialized": dist.is_initialized(), "seed_draw": torch.rand(1).item() if "--draw" in sys.argv else None,
             "numpy_draw": __import__("numpy").random.rand(),
             "threads": torch.get_num_threads(), "sigint_default": signal.getsignal(signal.SIGINT) is
             signal.default_int_handler, "sigusr1_ignored": signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN,
             "argv": sys.argv[1:], "cwd": os.getcwd(), "pgid_is_pid": os.getpgid(0) == os.getpid(),
             "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                     "MASTER_ADDR", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")}}
    torch.manual_seed(int(os.environ.get("RANK", 0)))  # a seed set here must not reach the next job
    dist.init_process_group("gloo")
    dist.barrier()
    print("PROBE " + json.dumps(fresh), flush=True)
    dist.destroy_process_group()
    """)
# A job whose rank 1 exits with code 3 once rank 0 is up; rank 0 waits to be stopped. No torch: a real-path run of it
# costs torchrun's start, not two more imports of torch.
FAILING = textwrap.dedent("""\
    # launcher: torchrun
    import os, sys, time
    if os.environ["RANK"] == "0":
        open("rank0_up", "w").close()
        time.sleep(60)  # the launcher must stop it
    deadline = time.monotonic() + 30
    while not os.path.exists("rank0_up") and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
    """)


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def probes(proc):
    return [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("PROBE ")]


def test_each_rank_starts_fresh_with_what_torchrun_gives_it(probe, tmp_path):
    first = launch(probe, "cpu:2", "--draw", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert warm.last_real_path_reason is None  # it did run warm
    second = launch(probe, "cpu:2", "--draw", cwd=tmp_path)
    a, b = probes(first), probes(second)
    assert [p["env"]["RANK"] for p in a] == ["0", "1"]  # rank 0's output first
    for p in a + b:
        assert not p["initialized"] and p["threads"] == 1 and p["sigint_default"] and p["sigusr1_ignored"]
        assert p["pgid_is_pid"] and p["argv"] == ["--draw"] and p["cwd"] == str(tmp_path)
        assert p["env"]["WORLD_SIZE"] == "2" and p["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert p["env"]["OMP_NUM_THREADS"] == "1" and p["env"]["CUDA_VISIBLE_DEVICES"] == ""
    # torch's default generator seeded anew in each process from the OS, as a new interpreter seeds it: not the
    # server's (every rank would draw the same), not the seed the first job's ranks set after their draw
    draws = [p["seed_draw"] for p in a + b]
    assert len(set(draws)) == len(draws), draws
    assert {p["numpy_draw"] for p in a + b}.__len__() == 4  # numpy's global generator too
    assert first.stderr.startswith("launch.sh: 2 process(es) per node on cpu, 1 node(s), torchrun")


def test_one_process_gets_the_threads_launch_sh_gives_it(probe, tmp_path):
    proc = launch(probe, "cpu:1", cwd=tmp_path)
    [p] = probes(proc)
    assert p["threads"] == 2 and p["env"]["OMP_NUM_THREADS"] == "2"  # 2 cores / 1 process


def test_the_legacy_launcher_passes_local_rank_as_a_flag(probe, tmp_path):
    probe.write_text(PROBE.replace("# launcher: torchrun", "# launcher: torch.distributed.launch"))
    proc = launch(probe, "cpu:2", cwd=tmp_path)
    assert [p["argv"] for p in probes(proc)] == [["--local-rank=0"], ["--local-rank=1"]]


def test_a_failed_rank_stops_the_others_and_the_job_exits_with_its_code(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    (tmp_path / "warm").mkdir()
    (tmp_path / "real").mkdir()
    proc = launch(script, "cpu:2", cwd=tmp_path / "warm", timeout=50)
    assert warm.last_real_path_reason is None  # it did run warm
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"launch\.sh: job failed: rank 1 \(pid \d+\) exited with code 3; rank 0 \(pid \d+\) was "
                        r"stopped \(SIGTERM\) \(each rank's own output is above\)", last), last
    # the real path says the same
    real = run_group([str(LAUNCH), script, "cpu:2"], env=launch_env(), cwd=tmp_path / "real", timeout=50)
    assert real.returncode == 3
    assert re.sub(r"pid \d+", "", real.stderr.strip().splitlines()[-1]) == re.sub(r"pid \d+", "", last)


COMPILING = textwrap.dedent("""\
    # launcher: torchrun
    import json
    import torch
    from torch._dynamo.utils import counters
    torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(8))
    print("PROBE " + json.dumps(counters["inductor"]), flush=True)
    """)


def test_the_ranks_of_a_job_compile_in_turn_and_the_later_one_loads_the_graph(tmp_path):
    # tests/warm_server.py's compile_in_turn: one rank lowers the graph, the other loads it from inductor's cache
    # (a cache of this test's own, cold); without the lock both start together and both miss it.
    script = tmp_path / "compiling.py"
    script.write_text(COMPILING)
    proc = launch(script, "cpu:2", cwd=tmp_path, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert warm.last_real_path_reason is None  # it did run warm
    assert proc.returncode == 0, proc.stderr
    counts = [(c.get("fxgraph_cache_miss", 0), c.get("fxgraph_cache_hit", 0)) for c in probes(proc)]
    assert sorted(counts) == [(0, 1), (1, 0)]  # (misses, hits) of each rank


def test_launch_sh_still_parses_every_warm_job(tmp_path):
    proc = launch("recipes/ddp_torchrun.py", "cpu:0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "launch.sh: error: bad DEVICES 'cpu:0': cpu:N needs a whole number N >= 1, e.g. cpu:2"


@pytest.mark.parametrize(("env", "why"), [
    ({"TORCH_LOGS": "+dynamo"}, "TORCH_LOGS: read once when Python or torch starts"),
    ({"PYTHONHASHSEED": "7"}, "PYTHONHASHSEED: read once"),
    ({"MAX_RESTARTS": "1"}, "MAX_RESTARTS: torchrun restarts the ranks"),
    ({"FAULT_KILL_ON_WRITE": "latest.pt:1"}, "tests/faults acts on the launcher"),
    ({"FAULT_KILL_MID_WRITE": "model.pt:2"}, "tests/faults acts on the launcher"),
])
def test_what_the_warm_path_cannot_do_takes_the_real_path(env, why, probe, tmp_path):
    job = warm.launch_job([probe, "cpu:2"], launch_env(env), tmp_path)
    assert job is None and warm.last_real_path_reason.startswith(why), warm.last_real_path_reason


@pytest.mark.real_path("checks the marker itself")
def test_a_test_marked_real_path_gets_the_real_path(tmp_path):
    script = tmp_path / "hello.py"  # no torch in the ranks: the launcher is what runs differently here
    script.write_text("# launcher: torchrun\nimport os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")
    proc = launch(script, "cpu:2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0", "rank 1"], proc.stdout
    assert warm.last_real_path_reason.startswith("marked real_path: checks the marker itself")


def test_run_direct_is_one_warm_process_and_a_timeout_kills_it(tmp_path):
    result = result_of(run_direct("ddp_torchrun", "--dataset", "synthetic", *IMAGE, "--out-dir", tmp_path))
    assert warm.last_real_path_reason is None and result["world_size"] == 1
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    job = warm.direct_job([script], launch_env(), tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(1)
    for pid in job.pids:  # killed and reaped, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not job.folder.exists()  # nor its output files


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("import atexit\natexit.register(print, 'atexit ran')\nraise ValueError('boom')\n")
    proc = warm.direct_job([script], launch_env(), tmp_path).wait(30)
    assert proc.returncode == 1
    assert "Traceback (most recent call last):" in proc.stderr and proc.stderr.rstrip().endswith("ValueError: boom")
    assert proc.stdout == "atexit ran\n"  # the interpreter's exit: atexit functions run
    same = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert (same.returncode, same.stdout) == (1, proc.stdout)


def test_an_uncaught_ctrl_c_ends_by_sigint_as_python_does(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text("raise KeyboardInterrupt\n")
    proc = warm.direct_job([script], launch_env(), tmp_path).wait(30)
    same = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert proc.returncode == same.returncode == -2
    assert proc.stderr.rstrip().endswith("KeyboardInterrupt") and same.stderr.rstrip().endswith("KeyboardInterrupt")


def _spawned(rank, folder, fail):
    import time

    print(f"rank {rank} says", flush=True)
    (folder / f"{rank}.pid").write_text(str(os.getpid()))
    if fail == "raise" and rank == 1:
        raise ValueError("boom in rank 1")
    if fail == "exit" and rank == 1:
        while not (folder / "0.pid").exists():
            time.sleep(0.01)
        sys.exit(3)
    if fail == "exit":
        time.sleep(60)  # stopped by the join, as spawn's


def test_warm_spawn_joins_as_torch_multiprocessing_spawn_does(tmp_path, capfd):
    # conftest.warm_spawn's processes: forked from the warm server, joined and reported as torch's spawn reports them
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    warm.spawn(_spawned, args=(tmp_path, None), nprocs=2)
    assert capfd.readouterr().out == "rank 0 says\nrank 1 says\n"  # what they printed, rank by rank
    with pytest.raises(ProcessRaisedException) as raised:
        warm.spawn(_spawned, args=(tmp_path, "raise"), nprocs=2)
    assert raised.value.error_index == 1 and "ValueError: boom in rank 1" in str(raised.value)
    assert "-- Process 1 terminated with the following error:\nTraceback" in str(raised.value)
    for path in tmp_path.glob("*.pid"):
        path.unlink()
    with pytest.raises(ProcessExitedException) as ended:
        warm.spawn(_spawned, args=(tmp_path, "exit"), nprocs=2)
    assert (ended.value.error_index, ended.value.exit_code) == (1, 3)
    assert str(ended.value) == "process 1 terminated with exit code 3"
    rank0 = int((tmp_path / "0.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)  # stopped, not left sleeping


# A `python` job that starts its own workers with mp.spawn, as ddp_spawn.py does: what each worker starts with.
SPAWNS = textwrap.dedent("""\
    # launcher: python
    import json, os, signal, sys
    import numpy
    import torch
    import torch.multiprocessing as mp
    RUNS = [__name__]  # module level: spawn runs it again in each worker, as __mp_main__

    def worker(rank, parent):
        # one write of the whole line (under `python -u` print writes the line and its end apart, and the other
        # worker's line can come between them on a shared pipe); below PIPE_BUF, so no other write splits it
        os.write(1, ("WORKER " + json.dumps({
            "rank": rank, "pid": os.getpid(), "runs": RUNS, "main": sys.modules["__main__"].__name__,
            "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
            "set_before_spawn": os.environ.get("SET_BEFORE_SPAWN"), "threads": torch.get_num_threads(),
            "parent_is_job": os.getppid() == parent,
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigusr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
            "sigusr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "forked_warm": "warm_mp" in sys.modules,
            "sitecustomize": os.environ.get("SITE_RAN_IN"), "torch_draw": torch.rand(1).item(),
            "numpy_draw": numpy.random.rand()}) + "\\n").encode())
        if rank == 1 and "--fail" in sys.argv:
            raise ValueError("worker 1 failed")

    if __name__ == "__main__":
        RUNS.append("the parent's main")  # a worker does not see this
        torch.manual_seed(0)
        numpy.random.seed(0)
        os.environ["SET_BEFORE_SPAWN"] = "yes"
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # an ignored signal stays ignored in the workers
        signal.signal(signal.SIGTERM, lambda *a: None)  # a handler does not reach them
        try:
            mp.spawn(worker, args=(os.getpid(),), nprocs=2)
        except mp.ProcessRaisedException as exc:
            print(f"error: worker {exc.error_index} failed{exc.msg}", file=sys.stderr, flush=True)
            sys.exit(5)
    """)


def workers(proc):
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("WORKER ")]


def test_a_python_jobs_spawned_workers_start_as_new_interpreters_would(tmp_path):
    """ddp_spawn's workers on the warm path (tests/warm_mp.py): forks of a clean copy of the job's process, each
    starting as multiprocessing's spawn start method starts a new interpreter, which the real path runs."""
    import numpy
    import torch

    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS)
    (tmp_path / "site").mkdir()  # a sitecustomize on PYTHONPATH, which a new interpreter imports at start-up
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN_IN'] = str(os.getpid())\n")
    env = {"PYTHONPATH": str(tmp_path / "site")}
    seeded_draws = {torch.rand(1, generator=torch.Generator().manual_seed(0)).item(),
                    numpy.random.RandomState(0).rand()}
    runs = {}
    for way in ("real", "warm"):
        (tmp_path / way).mkdir()
        if way == "real":
            # started as a terminal starts a job (a suite started by `cmd &` has SIGINT ignored, and a `python` job
            # would pass that on; the warm path gives its jobs SIGINT at its default, as a terminal does)
            proc = subprocess.run([str(LAUNCH), script, "cpu:1", "--flag"], env=launch_env(env), cwd=tmp_path / way,
                                  capture_output=True, text=True, timeout=120, start_new_session=True,
                                  preexec_fn=started_with())
        else:
            proc = launch(script, "cpu:1", "--flag", cwd=tmp_path / way, env=env)
            assert warm.last_real_path_reason is None  # it did run warm
        assert proc.returncode == 0, proc.stderr
        runs[way] = sorted(workers(proc), key=lambda w: w["rank"])
    for real, hot in zip(runs["real"], runs["warm"], strict=True):
        assert (real.pop("forked_warm"), hot.pop("forked_warm")) == (False, True)  # the warm ones were forks
        assert hot.pop("cwd").endswith("/warm") and real.pop("cwd").endswith("/real")
        assert hot.pop("parent_is_job") is False and real.pop("parent_is_job") is True  # the zygote is their parent
        assert hot.pop("sitecustomize") == str(hot["pid"]) and real.pop("sitecustomize") == str(real.pop("pid"))
        hot.pop("pid")
        draws = [hot.pop("torch_draw"), real.pop("torch_draw"), hot.pop("numpy_draw"), real.pop("numpy_draw")]
        assert len(set(draws)) == 4 and seeded_draws.isdisjoint(draws)  # from the OS, not the parent's seed
        assert hot == real
        assert hot["runs"] == ["__mp_main__"] and hot["main"] == "__mp_main__" and hot["argv"] == ["--flag"]
        assert hot["set_before_spawn"] == "yes" and hot["sigint"] and hot["sigusr2_ignored"] and hot["sigterm_default"]
        assert hot["sigusr1_ignored"]  # as tools/torchrun.py starts a job's processes, and they inherit it
    assert [w["rank"] for w in runs["warm"]] == [0, 1]
    # a worker that raises: its traceback reaches the parent through torch's error file, as with spawned workers
    proc = launch(script, "cpu:1", "--fail", cwd=tmp_path / "warm")
    assert proc.returncode == 5, proc.stderr
    assert "error: worker 1 failed" in proc.stderr and proc.stderr.rstrip().endswith("ValueError: worker 1 failed")
