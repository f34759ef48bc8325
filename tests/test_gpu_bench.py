"""tools/gpu_bench.py on the CPU, so that it runs the first time on a GPU: one real run at tiny sizes (every section,
3 timed steps after 1 warm-up) shared by the tests, its JSON's keys and numbers, the medians recomputed from the
recorded steps, the table's rows; bad flags fail in one line; the MFU arithmetic and the datasheet peaks exactly."""

import argparse
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_script

from common.data import usable_cores
from common.lm import Transformer
from tools import gpu_bench, junit

STEPS, WARMUP = 3, 1
TIMED = {"throughput": [()], "overhead": [("recipe",), ("bare",)], "compile": [("eager",), ("compiled",)],
         "lm": [("lm_ddp",), ("lm_tp",), ("lm_ddp_compiled",), ("lm_tp_compiled",), ("lm_fsdp_tp",),
                ("lm_fsdp_tp_compiled",)], "amp": [("tf32",), ("bf16",)]}
LM_ROWS = [key[0] for key in TIMED["lm"]]


def gpu_bench_cli(*args, timeout=480, cwd=REPO):
    """The tool's command line, forked from the warm server (tests/warm.py: torch already imported)."""
    return run_script([REPO / "tools" / "gpu_bench.py", *args], timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_bench")
    proc = gpu_bench_cli("--device", "cpu", "--steps", STEPS, "--warmup", WARMUP, "--peak-tflops", "1",
                         "--out", folder / "gpu.json", "--md", folder / "gpu.md")
    report = json.loads((folder / "gpu.json").read_text()) if (folder / "gpu.json").is_file() else None
    md = (folder / "gpu.md").read_text() if (folder / "gpu.md").is_file() else ""
    return proc, report, md


def numbers(value, path=""):
    """Every number in a JSON value, with where it is."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from numbers(item, f"{path}[{i}]")


def test_it_runs_every_section(run):
    proc, report, _ = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    # none from a child: make_jpegs' pool ends its workers with SIGTERM, whose handler (TimeUp) they inherit
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert report is not None
    assert list(report["sections"]) == list(gpu_bench.SECTIONS)
    assert not [name for name, s in report["sections"].items() if "error" in s]


def test_the_json_has_its_keys(run):
    _, report, _ = run
    assert {"tool", "command", "settings", "environment", "peak", "goals", "anchors", "sections", "wall_s"} <= set(
        report)
    env = report["environment"]
    assert {"device", "device_name", "driver", "torch", "cuda", "python", "date"} <= set(env)
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["driver"] is None
    assert report["command"].startswith("python tools/gpu_bench.py --device cpu")
    assert report["peak"] == {"tflops": 1.0, "source": "--peak-tflops"}
    assert report["anchors"]["dle"]["mixed_images_per_sec"] == 2470 and report["anchors"]["dle"]["speedup"] == 2.63
    s = report["sections"]
    assert {"images_per_sec", "anchor_images_per_sec", "ratio_to_anchor"} <= set(s["throughput"])
    assert {"recipe", "bare", "ratio"} <= set(s["overhead"])
    assert {"eager", "compiled", "speedup", "compile_s"} <= set(s["compile"])
    # ddp_compile's model compiled whole before DDP: one graph (DDPOptimizer's pieces count once), no break
    assert (s["compile"]["compiled"]["graphs"], s["compile"]["compiled"]["graph_breaks"]) == (1, 0), s["compile"]
    assert {"lm_ddp", "lm_tp", "references", "tp_over_ddp_step"} <= set(s["lm"])
    assert {"tf32", "bf16", "speedup"} <= set(s["amp"])
    for name in LM_ROWS:
        assert {"tokens_per_sec", "mfu", "flops_per_token", "n_matmul_params", "achieved_tflops",
                "first_step_s", "top_ops"} <= set(s["lm"][name]) and "error" not in s["lm"][name], s["lm"][name]
    # issue 66: the recipes' --compile (each block in place; lm_fsdp_tp's before fully_shard): graphs compiled, none
    # broken; the ratios of the steps
    for name in ("lm_ddp_compiled", "lm_tp_compiled", "lm_fsdp_tp_compiled"):
        assert (s["lm"][name]["graphs"], s["lm"][name]["graph_breaks"]) == (1, 0), s["lm"][name]  # the blocks share it
    lm = s["lm"]
    assert lm["compile_error"] is None
    assert lm["tp_over_ddp_step_compiled"] == lm["lm_tp_compiled"]["median_ms"] / lm["lm_ddp_compiled"]["median_ms"]
    assert lm["compiled_speedup"] == lm["lm_ddp"]["median_ms"] / lm["lm_ddp_compiled"]["median_ms"]
    # lm_fsdp_tp at one process (a 1 x 1 mesh: FSDP2 and the plan), its steps against lm_ddp's, eager and compiled
    assert lm["fsdp_tp_over_ddp_step"] == lm["lm_fsdp_tp"]["median_ms"] / lm["lm_ddp"]["median_ms"]
    assert lm["fsdp_tp_over_ddp_step_compiled"] == (lm["lm_fsdp_tp_compiled"]["median_ms"] /
                                                    lm["lm_ddp_compiled"]["median_ms"])
    # each row also written as it ended, beside the JSON (a time limit on the section then keeps them): the last, whole
    partial = json.loads(Path(report["settings"]["out"] + ".lm.partial").read_text())
    assert partial == {k: v for k, v in lm.items() if k != "section_s"}
    # AdamW's step alone, each implementation on plain and DTensor parameters; this torch (2.14) leaks no DTensorSpec
    o = lm["optimizer"]
    assert o["chosen"] == {"plain": {"fused": True}, "dtensor": {"fused": True}}
    for key in ("plain_foreach", "plain_fused", "dtensor_foreach", "dtensor_fused"):
        assert o[key]["timed_steps"] == 20 and o[key]["median_ms"] > 0
        assert o[key]["params"] == 2 + 2 * 16 + 3  # the embeddings, 2 blocks of 16 tensors, ln_f and the head
        assert o[key]["dtensor_specs_left_per_step"] == 0, (key, o[key])
    # where a step's time goes, for a missed goal's cause: the profiled ops of each measurement
    for ops in (s["throughput"]["top_ops"], s["overhead"]["top_ops"]["recipe"], s["overhead"]["top_ops"]["bare"],
                s["compile"]["compiled"]["top_ops"], *(s["lm"][name]["top_ops"] for name in LM_ROWS)):
        assert ops and {"op", "calls_per_step", "self_cpu_ms", "self_device_ms"} <= set(ops[0])
        assert [o["self_cpu_ms"] for o in ops] == sorted((o["self_cpu_ms"] for o in ops), reverse=True)


def test_every_number_is_finite_and_every_measure_positive(run):
    _, report, _ = run
    found = list(numbers(report["sections"]))
    assert found
    for path, value in found:
        assert math.isfinite(value), path
        if not re.sub(r"\[\d+\]$", "", path).endswith(("graph_breaks", "warmup_steps", "specs_left_per_step",
                                                       "recompiles")) and ".top_ops" not in path:
            # (an op may take 0 ms; a leak-free optimizer leaves no DTensorSpec)
            assert value > 0, path


def test_each_median_is_of_the_requested_steps(run):
    _, report, _ = run
    for section, keys in TIMED.items():
        for key in keys:
            m = report["sections"][section]
            for part in key:
                m = m[part]
            assert m["timed_steps"] == STEPS == len(m["steps_ms"]), (section, key)
            assert m["warmup_steps"] == WARMUP
            assert m["median_ms"] == statistics.median(m["steps_ms"]), (section, key)
            assert m["min_ms"] == min(m["steps_ms"]) and m["max_ms"] == max(m["steps_ms"])
            rate = next(v for k, v in m.items() if k.endswith("_per_sec"))
            per_step = 8 if section != "lm" else 4 * 32  # the CPU's batch: 8 images, or 4 sequences of 32 bytes
            assert rate == pytest.approx(per_step * 1000 / m["median_ms"])
    s = report["sections"]
    assert s["overhead"]["ratio"] == pytest.approx(s["overhead"]["recipe"]["median_ms"] / s["overhead"]["bare"][
        "median_ms"])
    # the recipe's default precision against TF32 (fp16 on a GPU; here the CPU's default), bf16 beside it
    amp, default = s["amp"], s["amp"]["default"]
    assert default == gpu_bench.harness.cpu_amp_default() == s["throughput"]["amp"]
    assert amp[default]["images_per_sec"] == s["throughput"]["images_per_sec"]  # one measurement, shared
    assert amp["speedup"] == pytest.approx(amp[default]["images_per_sec"] / amp["tf32"]["images_per_sec"])
    assert amp["bf16_speedup"] == pytest.approx(amp["bf16"]["images_per_sec"] / amp["tf32"]["images_per_sec"])
    assert default == "bf16" or s["throughput"]["bf16"]["images_per_sec"] == amp["bf16"]["images_per_sec"]
    for name in LM_ROWS:  # one model, one count of FLOPs; the MFU against --peak-tflops 1
        lm = s["lm"][name]
        assert (lm["n_matmul_params"], lm["flops_per_token"]) == (s["lm"]["lm_ddp"]["n_matmul_params"],
                                                                 s["lm"]["lm_ddp"]["flops_per_token"]), name
        assert lm["flops_per_token"] == gpu_bench.lm_flops_per_token(gpu_bench.parse_args(["--device", "cpu"]),
                                                                     lm["n_matmul_params"])
        assert lm["achieved_tflops"] == pytest.approx(lm["tokens_per_sec"] * lm["flops_per_token"] / 1e12), name
        assert lm["mfu"] == pytest.approx(lm["tokens_per_sec"] * lm["flops_per_token"] / 1e12), name


def test_the_data_section_runs_each_path_as_the_recipes_own_job(run):
    # Section 6 (issue 65): three real ./launch.sh jobs on the files tools/make_jpegs.py made; each figure is its job's
    # last epoch line, the cores its processes' CPU seconds over its wall time, the ratio the best file path's.
    _, report, md = run
    d = report["sections"]["data"]
    assert d["files"] == 48 and "48 training files" in d["config"]
    recipes = {"in_memory": "recipes/torch_amp.py", "cpu_decode": "recipes/torch_amp.py",
               "gpu_decode": "recipes/gpu_decode.py"}
    for name, recipe in recipes.items():
        path = d[name]
        words = shlex.split(path["command"])
        assert words[:3] == ["./launch.sh", recipe, "cpu:1"] and words[words.index("--dataset") + 1] == (
            "synthetic" if name == "in_memory" else "imagefolder"), words
        # At most the cores the job may use (affinity, a container's limit), not the machine's os.cpu_count(); 0.5
        # over for the wall clock read around the job.
        busy = path["cores_busy"]
        assert busy == pytest.approx(path["cpu_s"] / path["wall_s"]) and 0 < busy <= usable_cores() + 0.5
        assert path["amp"] == "fp32" or path["amp"] == "bf16"  # the CPU default here, as torch_amp.py says
    for name in ("cpu_decode", "gpu_decode"):
        assert d[name]["of_in_memory"] == pytest.approx(d[name]["images_per_sec"] / d["in_memory"]["images_per_sec"])
    assert d["ratio"] == max(d["cpu_decode"]["of_in_memory"], d["gpu_decode"]["of_in_memory"])
    assert d["best"] in ("cpu_decode", "gpu_decode") and d[d["best"]]["of_in_memory"] == d["ratio"]
    row = next(line for line in md.splitlines() if line.startswith("| 6 data"))
    assert f"GPU decode {d['gpu_decode']['images_per_sec']:,.0f} img/s" in row and "n/a (not a GPU)" in row
    # Compiled (issue 65): each job again with the recipes' --compile, the same command otherwise: the same numbers
    # (the data path and the step are the same; inductor's kernels sum in another order), one training graph on the
    # one rank, none compiled again, no graph break (the forward's own_ms hooks are left off under --compile).
    assert d["compile_error"] is None
    for name in recipes:
        eager, compiled = d[name], d[f"{name}_compiled"]
        words, eager_words = shlex.split(compiled["command"]), shlex.split(eager["command"])
        words.remove("--compile")
        out = eager_words[eager_words.index("--out-dir") + 1]
        assert words == [w + "_compiled" if w == out else w for w in eager_words], (words, eager_words)
        assert compiled["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-4), (name, compiled, eager)
        assert compiled["val_acc1"] == eager["val_acc1"], name
        assert compiled["compiled_graphs"][0] - compiled["eval_graphs"][0] == 1, compiled
        assert (compiled["recompiles"], compiled["graph_breaks"]) == ([0], [0]), compiled
        assert "compiled_graphs" not in eager
    assert d["ratio_compiled"] == max(d[f"{n}_decode_compiled"]["of_in_memory"] for n in ("cpu", "gpu"))
    for name in recipes:  # each job's whole output kept beside the JSON (a job that fails on the GPU: its traceback)
        log = (Path(report["settings"]["out"]).with_name(f"gpu.json.data-{name}.log")).read_text()
        assert log.startswith(f"$ {d[name]['command']}\nexit 0\n--- stdout\n") and "RESULT " in log, log[:300]
    assert f"Compiled: GPU decode {d['gpu_decode_compiled']['images_per_sec']:,.0f} img/s" in row
    # Each job's figures also written as it ends, beside the JSON (a time limit on the section then keeps them).
    partial = json.loads(Path(report["settings"]["out"] + ".data.partial").read_text())
    jobs = [name + suffix for suffix in ("", "_compiled") for name, _, _ in gpu_bench.DATA_PATHS]
    assert jobs[:2] == ["in_memory", "gpu_decode"]  # the goals' jobs first: a section cut short keeps them
    assert list(partial) == ["config", "files", "compile_error", *jobs]
    assert all(partial[job] == {k: v for k, v in d[job].items() if k != "of_in_memory"} for job in jobs), partial


def h200_rows(section, figures):
    """The table's rows ({"| 6 data": line, ...}) of a report holding one section's figures, as an H200 run's."""
    env = {"device": "cuda", "device_name": "NVIDIA H200", "driver": "1", "torch": "2.11", "cuda": "13.0", "cpu": "-"}
    report = {"sections": {section: figures}, "environment": env, "wall_s": 1.0, "command": "c",
              "peak": {"tflops": 989.0, "source": "datasheet"}}
    args = argparse.Namespace(arch="resnet50", image_size=224, batch_size=256, steps=3, warmup=1)
    return {line.split(" | ")[0]: line for line in gpu_bench.table(report, args).splitlines() if line.startswith("| ")}


def test_a_data_job_that_fails_keeps_its_error_and_the_other_paths_their_figures(tmp_path):
    # On a GPU each path is a first: one that fails (a decoder, a compile on that torch) must not cost the others.
    args = argparse.Namespace(out=tmp_path / "gpu.json")
    failed = gpu_bench.data_job(args, "gpu_decode", ["recipes/no_such.py", "cpu:1"])  # launch.sh refuses it at once
    assert set(failed) == {"command", "error"} and failed["command"] == "./launch.sh recipes/no_such.py cpu:1"
    assert failed["error"].startswith("exit 2: launch.sh: error: recipe"), failed
    log = (tmp_path / "gpu.json.data-gpu_decode.log").read_text()
    assert log.startswith("$ ./launch.sh recipes/no_such.py cpu:1\nexit 2\n") and "not found" in log, log
    slow = tmp_path / "slow.py"  # a job past its limit: its output so far kept (bytes there, text=True or not)
    slow.write_text("# launcher: python\nimport time\nprint('started', flush=True)\ntime.sleep(20)\n")
    late = gpu_bench.data_job(args, "late", [str(slow), "cpu:1"], timeout=4)
    assert late["error"].startswith("exit timed out after 4 s"), late
    assert "exit timed out after 4 s\n--- stdout\nstarted\n" in (tmp_path / "gpu.json.data-late.log").read_text()
    ran = {"amp": "fp16", "cores_busy": 9.0}
    out = {"compile_error": None, "in_memory": {"images_per_sec": 100.0, **ran},
           "cpu_decode": {"images_per_sec": 90.0, **ran}, "gpu_decode": failed,
           "in_memory_compiled": {"images_per_sec": 200.0, **ran},
           "cpu_decode_compiled": {"images_per_sec": 150.0, **ran},
           "gpu_decode_compiled": {"images_per_sec": 190.0, **ran}}
    gpu_bench.data_ratios(out)
    assert (out["best"], out["ratio"], out["best_compiled"], out["ratio_compiled"]) == (
        "cpu_decode", 0.9, "gpu_decode", 0.95)
    assert "of_in_memory" not in out["gpu_decode"]
    row = h200_rows("data", out)["| 6 data"]
    assert "GPU decode failed (exit 2: launch.sh: error: recipe" in row and "CPU decode 90 img/s" in row, row
    assert row.endswith("| eager 0.90x; compiled 0.95x | missed (of the jobs that ran) |"), row
    del out["in_memory"]["images_per_sec"], out["ratio"], out["best"]  # the in-memory job failed too: no eager ratio
    out["in_memory"]["error"] = "exit 1: a traceback's last line"
    row = h200_rows("data", out)["| 6 data"]
    assert row.endswith("| compiled 0.95x | met (of the jobs that ran) |"), row


def test_a_language_model_row_that_fails_leaves_the_others_on_the_page():
    # The recipes' --compile never ran on a GPU: a row that fails there holds its error (run_lm), and the page says
    # what ran; a ratio whose rows did not both run is "-".
    ok = {"tokens_per_sec": 500000.0, "mfu": 0.40, "median_ms": 65.0, "first_step_s": 20.0, "graphs": 2,
          "graph_breaks": 0, "achieved_tflops": 400.0}
    lm = {"compile_error": None, "lm_ddp": ok, "lm_ddp_compiled": {**ok, "mfu": 0.46},
          "lm_tp": {"error": "RuntimeError: boom"}, "lm_tp_compiled": ok}
    rows = h200_rows("lm", lm)
    assert rows["| 4 lm_ddp"].endswith("| 46.0% | met |"), rows
    assert "| eager failed: RuntimeError: boom; compiled 500,000 tokens/s, MFU 40.0% |" in rows["| 4 lm_tp"], rows
    assert rows["| 4 lm_tp"].endswith("| - | not measured |"), rows
    lm.update(lm_tp=ok, lm_ddp_compiled={"error": "BackendCompilerFailed: x"}, tp_over_ddp_step=1.5)
    rows = h200_rows("lm", lm)
    assert "| eager 500,000 tokens/s, MFU 40.0%; compiled failed: BackendCompilerFailed: x |" in rows["| 4 lm_ddp"]
    assert rows["| 4 lm_tp"].endswith("| 1.50x; - | eager met; compiled - |"), rows


def test_the_table_has_each_sections_row(run):
    proc, _, md = run
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
    assert [r.split()[-1] for r in rows if r != "section"] == list(gpu_bench.ROWS)
    for label, line in rows.items():
        assert line in proc.stdout
        if label != "section":
            assert "failed" not in line
    assert "2,470 img/s" in rows["1 throughput"] and "n/a (not a GPU)" in rows["1 throughput"]
    assert "llm.c: up to ~60%" in rows["4 lm_ddp"] and "nanoGPT: not verified" in rows["4 lm_ddp"]
    assert "goal: compiled MFU >= 45%" in rows["4 lm_ddp"] and "compiled " in rows["4 lm_ddp"]
    assert "<= 1.6 eager, <= 1.1 compiled" in rows["4 lm_tp"] and "n/a (not a GPU)" in rows["4 lm_tp"]
    lm = run[1]["sections"]["lm"]
    cells = [c.strip() for c in rows["4 lm_fsdp_tp"].split("|")[1:-1]]
    assert cells[2].startswith("lm_ddp's step, eager; compiled") and cells[4] == "reference only", cells
    assert cells[3] == f"{lm['fsdp_tp_over_ddp_step']:.2f}x; {lm['fsdp_tp_over_ddp_step_compiled']:.2f}x", cells
    assert cells[1].startswith(f"eager {lm['lm_fsdp_tp']['tokens_per_sec']:,.0f} tokens/s, MFU ") and (
        f"; compiled {lm['lm_fsdp_tp_compiled']['tokens_per_sec']:,.0f} tokens/s" in cells[1]), cells
    assert "2.63x" in rows["5 amp"]


def test_the_fsdp_tp_row_says_why_a_row_is_missing():
    """A lm_fsdp_tp row that could not run at world size 1 holds its one-line error, which the table row shows; no
    compiler: the eager figures alone, and why."""
    eager = {"tokens_per_sec": 1234.4, "mfu": None}
    lm = {"lm_fsdp_tp": eager, "lm_fsdp_tp_compiled": {"error": "RuntimeError: no 1 x 1 mesh"}, "compile_error": None,
          "fsdp_tp_over_ddp_step": 1.234}
    assert gpu_bench.fsdp_tp_row(lm) == ["4 lm_fsdp_tp", "eager 1,234 tokens/s, MFU - (no peak); compiled failed: "
                                         "RuntimeError: no 1 x 1 mesh", gpu_bench.fsdp_tp_row(lm)[2], "1.23x",
                                         "reference only"]
    lm = {"lm_fsdp_tp": {"error": "ValueError: x"}, "compile_error": "no C compiler"}
    assert gpu_bench.fsdp_tp_row(lm)[1:4:2] == ["eager failed: ValueError: x; compiled: not measured (no C compiler)",
                                               "-"]


SESSION = REPO / "tools" / "gpu_session.sh"


def session(*argv, timeout=120, env=None):
    """tools/gpu_session.sh with this interpreter, and no GPU even where there is one: its sections fail at once."""
    return subprocess.run([str(SESSION), *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


def test_the_session_script_runs_the_tools_sections_in_its_order_and_plans_calls_that_fit_a_loan():
    """tools/gpu_session.sh: the same sections as the tool, in its run order; the two calls its header plans fit a
    loan (15 minutes with the machine's start, 10 a call): the first's deadline inside its timeout, the second's
    language models under their own limit with time left for the tier."""
    text = SESSION.read_text()
    order = re.search(r"^RUN_ORDER=\(([^)]*)\)", text, re.M)[1].split()
    limits = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", re.search(r"^declare -A LIMIT=\((.*)\)$", text,
                                                                             re.M)[1])}
    assert tuple(order) == gpu_bench.RUN_ORDER and set(limits) == set(gpu_bench.SECTIONS)
    first = re.search(r"1\. timeout_s (\d+): export GPU_SESSION_END=\$\(\( \$\(date \+%s\) \+ (\d+) \)\); "
                      r"tools/gpu_session.sh bench \"\$OUT\" data$", text, re.M)
    timeout, end = int(first[1]), int(first[2])
    assert end < timeout <= 600
    assert re.search(r"export GPU_SESSION_END=\$\(\( \$\(date \+%s\) \+ LEFT - 45 \)\); tools/gpu_session.sh bench "
                     r"\"\$OUT\" lm;\n#\s+tools/gpu_session.sh tier \"\$OUT\"$", text, re.M)
    start, loan = 30, 900
    left = loan - start - timeout  # the second call's LEFT at the latest
    assert left - 45 - limits["lm"] >= 60, left  # the tier's language models (about 40 s) fit after lm's limit


@pytest.mark.parametrize("argv, message", [
    ([], "usage: tools/gpu_session.sh bench OUT [SECTION...] | tools/gpu_session.sh tier OUT"),
    (["bench", "OUT", "lm", "speed"], "no section 'speed'; name some of: throughput amp overhead lm compile data"),
    (["bench", "OUT", ""], "no section ''; name some of: "),
    (["tier", "OUT", "lm"], "tier takes no sections; usage: "),
    (["bench_all", "OUT"], "no part 'bench_all'; usage: "),
])
def test_the_session_script_refuses_bad_usage_in_one_line(tmp_path, argv, message):
    proc = session(*[tmp_path / "out" if word == "OUT" else word for word in argv])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"gpu_session.sh: {message}") and not (tmp_path / "out").exists()


def unpacked(out, name, into):
    """The files a part packed into OUT/NAME.tgz (all OUT holds: a lent machine returns 8 files a call), unpacked."""
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.tgz"], list(out.iterdir())
    with tarfile.open(out / f"{name}.tgz") as tar:
        tar.extractall(into, filter="data")
    return into


def test_the_session_script_names_a_failed_section_and_goes_on(tmp_path):
    """Without a GPU each section fails at once, with the tool's own line in its log; the script says which, exits 1,
    and the machine's description is written first; OUT holds one file, the part's .tgz."""
    proc = session("bench", tmp_path / "out", "amp", "overhead")
    assert proc.returncode == 1, proc.stderr
    said = ("gpu_bench: error: --device cuda: no CUDA GPU here; --device cpu runs the tiny check "
            "(tests/test_gpu_bench.py)")
    assert re.fullmatch(rf"amp: exit 2 after \d+ s; {re.escape(said)}\noverhead: exit 2 after \d+ s; "
                        rf"{re.escape(said)}\ngpu_session.sh: wrote {tmp_path}/out/bench-amp-overhead.tgz\n",
                        proc.stdout), proc.stdout
    got = unpacked(tmp_path / "out", "bench-amp-overhead", tmp_path / "got")
    for section in ("amp", "overhead"):
        log = (got / "bench" / f"{section}.log").read_text()
        assert said in log, log
        assert not (got / "bench" / f"{section}.json").exists()
    machine = (got / "machine.txt").read_text()
    assert f"torch {importlib.metadata.version('torch')} torchvision {importlib.metadata.version('torchvision')}" in \
        machine and "nvidia-smi: not found" in machine, machine


def test_the_session_script_cuts_a_step_at_its_deadline_and_keeps_what_ended(tmp_path):
    """A step that outlives what is left before GPU_SESSION_END is stopped there (less the 25 s kept back), its log
    packed, and what it started stopped, a child in a session of its own too (torchrun's ranks, the tier's jobs), but
    nothing else on the machine (a job whose command line names a recipe, as another user's would); the next step,
    with no time left, is not run and says so. A stand-in interpreter that only sleeps."""
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\n[ \"$1\" = -c ] && { echo 'python x torch y torchvision z'; exit 0; }\n"
                       f"echo started; setsid sleep 300 & echo $! > {tmp_path / 'child'}; exec sleep 60\n")
    sleeper.chmod(0o755)
    bystander = subprocess.Popen(["bash", "-c", "exec -a 'python recipes/ddp_torchrun.py' sleep 300"])
    end = int(time.time()) + 25 + 12  # 12 s for the first section (10 at least), none for the second
    try:
        proc = subprocess.run([str(SESSION), "bench", str(tmp_path / "out"), "amp", "overhead"], capture_output=True,
                              text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHON": str(sleeper),
                                                                    "GPU_SESSION_END": str(end)})
        assert bystander.poll() is None  # not the session's: left running
    finally:
        bystander.kill()
    child = int((tmp_path / "child").read_text())
    assert not os.path.exists(f"/proc/{child}") or "Z" in open(f"/proc/{child}/stat").read().split()[2]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = unpacked(tmp_path / "out", "bench-amp-overhead", tmp_path / "got")
    cut = (got / "bench" / "amp.log").read_text()
    assert re.fullmatch(r"started\ngpu_session.sh: ran out of its 1[0-2] s\n", cut), cut
    assert re.fullmatch(r"gpu_session.sh: not run: -?\d+ s left before GPU_SESSION_END\n",
                        (got / "bench" / "overhead.log").read_text())
    assert re.search(r"^amp: exit 124 after 1[0-3] s; gpu_session.sh: ran out of its", proc.stdout, re.M), \
        proc.stdout
    bad = session("bench", tmp_path / "bad", "amp", env={"GPU_SESSION_END": "in 5 minutes"})
    assert bad.returncode == 2 and bad.stderr.startswith("gpu_session.sh: GPU_SESSION_END='in 5 minutes' is not "
                                                         "seconds since the epoch"), bad.stderr


def test_a_bad_flag_fails_in_one_line():
    proc = gpu_bench_cli("--device", "cpu", "--steps", "0", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_bench: error: --steps 0 must be >= 1"


@pytest.mark.parametrize("argv, message", [
    (["--only", "throughput,speed"], "--only 'throughput,speed': expected some of"),
    (["--warmup", "-1"], "--warmup -1 must be >= 0"),
    (["--peak-tflops", "nan"], "--peak-tflops nan must be a finite number > 0"),
    (["--lm-heads", "5"], "--n-head 5 must divide --d-model 32"),
    (["--arch", "resnet5"], "unknown --arch 'resnet5'"),
    (["--tier", "tier.xml"], "--tier goes with --render"),
])
def test_bad_input_in_process(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_bench.parse_args(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_bench: error: ") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--arch", "tiny"])
    assert "--device cuda: no CUDA GPU here" in capsys.readouterr().err


def test_gpt2_small_flops_per_token():
    """N counted by hand for GPT-2 small's shape over 256 bytes: 12 blocks of 7,087,872 (four d x d projections
    with biases, the MLP's d x 4d and 4d x d with biases, two norms), the final norm and the untied 768 x 256 head;
    the embeddings are lookups. Then nanoGPT's 6N + 12 L d T."""
    with torch.device("meta"):
        model = Transformer(12, 12, 768, 1024)
    n = gpu_bench.matmul_params(model)
    block = 4 * (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    assert n == 12 * block + 2 * 768 + 768 * 256 == 85_252_608
    args = gpu_bench.parse_args(["--device", "cpu", "--lm-layers", "12", "--lm-heads", "12", "--lm-d-model", "768",
                                 "--lm-seq-len", "1024"])
    assert gpu_bench.lm_flops_per_token(args, n) == 6 * n + 12 * 12 * 768 * 1024 == 624_761_856


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                          ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                          ("NVIDIA H200 NVL", None), ("NVIDIA L4", None)])
def test_the_peak_by_device_name(name, tflops):
    peak = gpu_bench.peak_for({"device": "cuda", "device_name": name}, None)
    assert peak["tflops"] == tflops
    assert ("--peak-tflops" in peak["source"]) == (tflops is None)
    assert gpu_bench.peak_for({"device": "cuda", "device_name": name}, 500.0)["tflops"] == 500.0


# ---------------------------------------------------------- --render: bench/gpu.md from the first GPU run's JSONs
RUN_DIR = "bench/gpu-2026-11-28-h200"
RENDER = ["--render", RUN_DIR, "--tree", "b41c64a", "--md", "bench/gpu.md"]


def committed_page():
    return (REPO / "bench" / "gpu.md").read_text()


def run_file(name):
    return (REPO / RUN_DIR / name).read_text()


def section(name):
    return json.loads(run_file(f"{name}.json"))["sections"][name]


def table_rows(page):
    """{label: [cells]} of the page's table (above the marker)."""
    rows = [line.split(" | ") for line in page.split(gpu_bench.MARKER)[0].splitlines() if line.startswith("| ")]
    return {cells[0].removeprefix("| "): [c.removesuffix(" |") for c in cells[1:]] for cells in rows}


def figure(text, pattern):
    """The number the pattern's group holds in text (thousands commas dropped)."""
    found = re.search(pattern, text)
    assert found, pattern
    return float(found[1].replace(",", ""))


def test_the_committed_page_regenerates_byte_for_byte(tmp_path):
    """bench/gpu.md's own command (its header names it), run in a copy of bench/: the same bytes, the header and
    table from the JSONs, the hand-written text below the marker kept."""
    page = committed_page()
    assert f"Written by `{shlex.join(['python', 'tools/gpu_bench.py', *RENDER])}`" in page
    shutil.copytree(REPO / RUN_DIR, tmp_path / RUN_DIR)
    (tmp_path / "bench" / "gpu.md").write_text(page)
    proc = gpu_bench_cli(*RENDER, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bench" / "gpu.md").read_bytes() == (REPO / "bench" / "gpu.md").read_bytes()


def test_a_new_page_is_the_generated_part(tmp_path, monkeypatch, capsys):
    """No page yet: everything above the marker, the marker, nothing below it."""
    shutil.copytree(REPO / RUN_DIR, tmp_path / RUN_DIR)
    monkeypatch.chdir(tmp_path)
    assert gpu_bench.main(RENDER) == 0
    head = committed_page().split(gpu_bench.MARKER)[0] + gpu_bench.MARKER + "\n"
    assert (tmp_path / "bench" / "gpu.md").read_text() == head
    assert capsys.readouterr().out == "gpu_bench: wrote bench/gpu.md\n"


def test_the_pages_table_has_the_jsons_figures():
    rows = table_rows(committed_page())
    assert list(rows) == ["section", "1 throughput", "2 overhead", "3 compile", "4 lm_ddp", "4 lm_tp", "5 amp"]
    t, o, c, lm, a = (section(name) for name in ("throughput", "overhead", "compile", "lm", "amp"))
    measured, _, ratio, verdict = rows["1 throughput"]
    assert figure(measured, r"^([\d,]+) img/s") == round(t["images_per_sec"])  # 4,635
    assert figure(measured, r"step ([\d.]+) ms") == round(t["median_ms"], 1)
    assert figure(ratio, r"([\d.]+)x") == round(t["images_per_sec"] / 2470, 2) and verdict == "met"
    measured, _, ratio, verdict = rows["2 overhead"]
    assert figure(measured, r"step ([\d.]+) ms") == round(o["recipe"]["median_ms"], 2)
    assert figure(measured, r"loop's ([\d.]+) ms") == round(o["bare"]["median_ms"], 2)
    assert figure(ratio, r"([\d.]+)x") == round(o["recipe"]["median_ms"] / o["bare"]["median_ms"], 3)
    assert verdict == "met"
    measured, _, ratio, verdict = rows["3 compile"]
    assert figure(measured, r"compiled ([\d,]+) img/s") == round(c["compiled"]["images_per_sec"])
    assert figure(measured, r"eager ([\d,]+)") == round(c["eager"]["images_per_sec"])
    assert figure(ratio, r"([\d.]+)x") == round(c["speedup"], 2) and verdict == "met"
    for name in ("lm_ddp", "lm_tp"):
        measured = rows[f"4 {name}"][0]
        assert figure(measured, r"^([\d,]+) tokens/s") == round(lm[name]["tokens_per_sec"])
        mfu = lm[name]["tokens_per_sec"] * lm[name]["flops_per_token"] / 989e12  # the H200's dense bf16 peak
        assert figure(measured, r"MFU ([\d.]+)%") == round(100 * mfu, 1)
    assert figure(rows["4 lm_tp"][0], r"([\d.]+)x lm_ddp's step") == round(
        lm["lm_tp"]["median_ms"] / lm["lm_ddp"]["median_ms"], 2)
    measured, _, ratio, verdict = rows["5 amp"]
    assert figure(measured, r"bf16 ([\d,]+) img/s") == round(a["bf16"]["images_per_sec"])
    assert figure(measured, r"TF32 ([\d,]+)") == round(a["tf32"]["images_per_sec"])
    assert figure(ratio, r"([\d.]+)x") == round(a["bf16"]["images_per_sec"] / a["tf32"]["images_per_sec"], 2)
    assert verdict == "missed"


def test_the_pages_prose_has_the_files_figures():
    """The hand-written part's headline figures, each worked out here from the file it names."""
    prose = committed_page().split(gpu_bench.MARKER)[1]
    a, lm = section("amp"), section("lm")
    probe, jpegs, synthetic = run_file("probe.log"), run_file("real_jpegs.log"), run_file("user_synthetic.log")
    fp16 = figure(probe, r"torch.float16 channels-last eager: ([\d,]+) img/s")
    bf16 = figure(probe, r"torch.bfloat16 channels-last eager: ([\d,]+) img/s")
    tf32 = a["tf32"]["images_per_sec"]
    assert f"{fp16:,.0f} / {tf32:,.2f} = {fp16 / tf32:.3f}" in prose and f"**{fp16 / tf32:.2f}x**" in prose
    assert f"fp16 with GradScaler {fp16:,.0f} images/s against bf16 {bf16:,.0f}**: {fp16 / bf16:.2f}x" in prose
    ops = {o["op"]: o["self_device_ms"] for o in a["bf16"]["top_ops"]}
    norm = ops["aten::native_batch_norm"] + ops["aten::native_batch_norm_backward"]
    assert f"takes {norm:.1f} ms ({100 * norm / a['bf16']['median_ms']:.0f}%)" in prose
    assert f"**MFU {100 * lm['lm_ddp']['mfu']:.1f}%**" in prose
    assert f"**{lm['tp_over_ddp_step']:.2f}x lm_ddp's**" in prose
    epoch2 = figure(jpegs, r"epoch=2/2 .* img/s=([\d.]+)")
    result = json.loads(jpegs.split("RESULT ")[1].splitlines()[0])["images_per_sec"]
    memory = json.loads(synthetic.split("RESULT ")[1].splitlines()[0])["images_per_sec"]
    assert f"**{epoch2:,.0f} images/s in its second epoch** (its RESULT line, " in prose
    assert f"both epochs after the first step: {result:,.0f})" in prose and f"against {memory:,.0f} on" in prose
    assert f"data {100 * (1 - epoch2 / memory):.0f}%" in prose
    one_core = figure(jpegs, r"PIL pipeline, one core: ([\d,]+) img/s")
    assert f"ToTensor,\nNormalize) at {one_core:,.0f} images/s" in prose


def test_a_render_of_a_folder_without_json_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = gpu_bench_cli("--render", tmp_path / "empty", "--md", tmp_path / "gpu.md", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"gpu_bench: error: --render {tmp_path / 'empty'}: no *.json in that folder\n"
    assert not (tmp_path / "gpu.md").exists()


@pytest.mark.parametrize("content, message", [
    (None, "no such file or folder"),
    ("{", "not JSON"),
    ('{"tool": "other"}', "not a tools/gpu_bench.py report"),
])
def test_bad_render_input_in_process(tmp_path, capsys, content, message):
    folder = tmp_path / "run"
    if content is not None:
        folder.mkdir()
        (folder / "x.json").write_text(content)
    assert gpu_bench.main(["--render", str(folder), "--md", str(tmp_path / "gpu.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_bench: error: ") and message in err


def test_an_md_or_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    # --render wrote --md after merging, with a traceback; a measuring run found it after its first section.
    (tmp_path / "file").write_text("a file, not a folder")
    for args, line in (
            (["--render", str(REPO / RUN_DIR), "--md", "/proc/x/g.md"], "--md /proc/x/g.md: cannot write it ("),
            (["--render", str(REPO / RUN_DIR), "--md", str(tmp_path / "file" / "g.md")],
             f"--md {tmp_path / 'file' / 'g.md'}: cannot write it (File exists)"),  # its folder: mkdir's error
            (["--device", "cpu", "--only", "throughput", "--md", "/proc/x/g.md"],
             "--md /proc/x/g.md: cannot make or write its folder ("),
            (["--device", "cpu", "--only", "throughput", "--out", str(tmp_path / "file" / "g.json")],
             f"--out {tmp_path / 'file' / 'g.json'}: cannot make or write its folder (Not a directory)")):
        assert gpu_bench.main(args) == 2, args
        out, err = capsys.readouterr()
        assert err.startswith(f"gpu_bench: error: {line}") and err.count("\n") == 1, (args, err)
        assert "gpu_bench: throughput" not in out  # nothing measured


def test_two_hosts_of_one_machine_kind_merge_each_driver_named(tmp_path, capsys):
    """A lent H200 is one of several hosts: another driver build is the same measurement, and the page names both."""
    lm = json.loads(run_file("lm.json"))
    lm["environment"]["driver"] = "580.159.03"
    (tmp_path / "lm.json").write_text(json.dumps(lm))
    amp = REPO / RUN_DIR / "amp.json"
    md = tmp_path / "gpu.md"
    assert gpu_bench.main(["--render", str(amp), str(tmp_path / "lm.json"), "--md", str(md)]) == 0, \
        capsys.readouterr().err
    assert "; driver 580.159.04 and 580.159.03; torch 2.11.0+cu130" in md.read_text()


def test_a_section_stopped_at_its_time_limit_keeps_the_rows_that_ended(tmp_path, monkeypatch, capsys):
    """SIGTERM (tools/gpu_session.sh's `timeout`) in the middle of a section: --out is written all the same, that
    section holding the rows that had ended and marked cut_short, the page saying which are missing; the sections
    after it are not run; exit 1. The real signal, to this process, from a stand-in of run_lm's second row."""
    def two_rows(args, device, cache, peak):
        out = {"config": "c", "compile_error": None}
        gpu_bench.keep_partial(args, "lm", out)
        out["lm_ddp"] = {"tokens_per_sec": 1000.0, "mfu": None, "median_ms": 4.0}
        gpu_bench.keep_partial(args, "lm", out)
        os.kill(os.getpid(), signal.SIGTERM)  # during lm_tp's row
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the section")

    monkeypatch.setattr(gpu_bench, "run_lm", two_rows)
    monkeypatch.setattr(gpu_bench, "run_data", lambda *a: pytest.fail("a section after the cut ran"))
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "gpu.json"
    assert gpu_bench.main(["--device", "cpu", "--only", "lm,data", "--out", str(out)]) == 1
    assert signal.getsignal(signal.SIGTERM) is before  # main() gives the handler back
    err = capsys.readouterr().err
    assert "gpu_bench: lm cut short: stopped by SIGTERM after " in err, err
    sections = json.loads(out.read_text())["sections"]
    assert list(sections) == ["lm"] and sections["lm"]["lm_ddp"]["tokens_per_sec"] == 1000.0
    assert re.fullmatch(r"stopped by SIGTERM after \d+ s: the rows that had not ended are not measured",
                        sections["lm"]["cut_short"])
    rows = h200_rows("lm", sections["lm"])
    assert "| eager 1,000 tokens/s, MFU - (no peak); compiled not measured (the section was cut short) |" in \
        rows["| 4 lm_ddp"], rows
    assert "| eager not measured (the section was cut short); compiled not measured" in rows["| 4 lm_tp"], rows
    # Cut before the section's first row (in its imports): its JSON is written all the same, and the page says so.
    def no_rows(args, device, cache, peak):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(gpu_bench, "run_lm", no_rows)
    assert gpu_bench.main(["--device", "cpu", "--only", "lm", "--out", str(out)]) == 1
    cut = json.loads(out.read_text())["sections"]["lm"]
    assert set(cut) == {"cut_short", "section_s"}, cut
    assert "| eager not measured (the section was cut short); compiled not measured" in h200_rows("lm", cut)[
        "| 4 lm_ddp"]
    data = {"config": "c", "files": 8, "compile_error": None, "in_memory": {"images_per_sec": 100.0, "amp": "fp16",
                                                                            "cores_busy": 2.0},
            "gpu_decode": {"images_per_sec": 97.0, "amp": "fp16", "cores_busy": 3.0}}
    cut = gpu_bench.cut_short("data", data, gpu_bench.TimeUp("SIGTERM"), 400.0)
    assert (cut["best"], cut["ratio"]) == ("gpu_decode", 0.97) and "ratio_compiled" not in cut
    row = h200_rows("data", cut)["| 6 data"]
    assert "CPU decode not measured (the section was cut short)" in row and "in memory 100 img/s" in row, row
    assert row.endswith("| eager 0.97x | met (of the jobs that ran) |"), row


def test_render_refuses_mixed_runs_and_a_page_without_the_marker(tmp_path, capsys):
    """JSONs of two machines, or one section twice, make no table; a page without the marker is not overwritten."""
    amp = json.loads(run_file("amp.json"))
    amp["environment"]["torch"] = "2.12.0"
    (tmp_path / "amp.json").write_text(json.dumps(amp))
    md = tmp_path / "gpu.md"
    assert gpu_bench.main(["--render", str(REPO / RUN_DIR / "lm.json"), str(tmp_path / "amp.json"),
                           "--md", str(md)]) == 2
    assert "lm.json: environment torch '2.11.0+cu130' differs from" in capsys.readouterr().err  # amp ran first
    assert gpu_bench.main(["--render", str(REPO / RUN_DIR), str(REPO / RUN_DIR / "lm.json"), "--md", str(md)]) == 2
    assert "section lm is also in" in capsys.readouterr().err
    md.write_text("by hand\n")
    assert gpu_bench.main(["--render", str(REPO / RUN_DIR), "--md", str(md)]) == 2
    assert "has no marker line" in capsys.readouterr().err and md.read_text() == "by hand\n"


# The GPU tier as tools/gpu_session.sh runs it, with a test module in place of tests/test_gpu.py: its language-model
# test's name and printed line (the real one's need a GPU), a failed run among them, another test printing a
# look-alike line, a skip, and a test -m gpu leaves out.
TIER_DOUBLE = """\
import json

import pytest

RUNS = {"lm_ddp": {"tokens_per_sec": 409636.4, "val_bpb": 3.6312, "peak_mem_mb": 1534.2},
        "lm_moe": {"tokens_per_sec": 201234.4, "val_bpb": 3.7021, "peak_mem_mb": 2101.0},
        "lm_tp": {"tokens_per_sec": 83357.0, "val_bpb": 4.2, "peak_mem_mb": 1600.0}}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_every_language_model_learns_on_one_gpu(recipe):
    print("step=200/200 train_loss=2.5")
    print(f"{recipe}: {json.dumps(RUNS[recipe])}")
    assert RUNS[recipe]["val_bpb"] < 4.0


@pytest.mark.gpu
def test_lm_ddp_bf16_autocast_tracks_fp32():
    print('lm_ddp: {"tokens_per_sec": 1.0, "val_bpb": 9.0, "peak_mem_mb": 1.0}')


@pytest.mark.gpu
def test_two_ranks():
    pytest.skip("needs 2 GPUs")


def test_on_the_cpu():
    pass
"""


def tier_xml(folder, drop=(), spread=("-n", "2")):
    """Run TIER_DOUBLE with tools/gpu_session.sh's TIER_ARGS (less `drop`), under pytest-xdist as the session runs
    the tier (`spread`); the JUnit XML's path."""
    args = shlex.split(re.search(r"^TIER_ARGS=\((.*)\)", SESSION.read_text(), re.M)[1])
    args = [a for a in args if a not in drop]
    folder.mkdir()
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: the GPU tier\n")
    (folder / "test_gpu.py").write_text(TIER_DOUBLE)
    proc = subprocess.run([sys.executable, "-m", "pytest", *args, *spread, "-p", "no:cacheprovider", "--junitxml",
                           "tier.xml", "test_gpu.py"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "1 failed, 3 passed, 1 skipped" in proc.stdout, proc.stdout
    return folder / "tier.xml"


def test_the_tier_stopped_at_its_limit_keeps_the_tests_that_ended(tmp_path):
    """tools/gpu_session.sh stops the tier at its limit with TIER_SIGNAL: pytest, under xdist as there, still writes
    its JUnit XML, with the tests that ended and their printed lines (on SIGTERM, timeout's default, it writes none).
    The limit, 15 s, must outlast xdist's start (3 interpreters) and test_ends: 0.7-2.9 s measured; test_runs_on
    sleeps 120 s, so the signal still cuts it short."""
    signal_name = re.search(r"^TIER_SIGNAL=(\w+)$", SESSION.read_text(), re.M)[1]
    args = shlex.split(re.search(r"^TIER_ARGS=\((.*)\)", SESSION.read_text(), re.M)[1])
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: the GPU tier\n")
    (tmp_path / "test_gpu.py").write_text("import time\n\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_ends():\n"
                                          "    print('lm_moe: {}')\n\n\n@pytest.mark.gpu\ndef test_runs_on():\n"
                                          "    time.sleep(120)\n")
    proc = subprocess.run(["timeout", "-s", signal_name, "--kill-after", "20", "15", sys.executable, "-m", "pytest",
                           *args, "-n", "2", "-p", "no:cacheprovider", "--junitxml", "tier.xml", "test_gpu.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 124, proc.stdout[-2000:]
    cases, _ = junit.read(tmp_path / "tier.xml")  # (and not the test it cut short: a testcase without a name there)
    assert [case[:2] for case in cases] == [("test_gpu.py::test_ends", "passed")] and "\nlm_moe: {}\n" in cases[0][2]


def test_the_tiers_language_model_runs_go_on_the_page(tmp_path, capsys):
    """--render --tier: a row per language model from the tier's JUnit XML (a failed run's figures too), the tier's
    totals; the rows come from tools/gpu_session.sh's own pytest options, without which pytest keeps no output of a
    test that passed: then one line says what to run."""
    md = tmp_path / "bench" / "gpu.md"
    render = ["--render", str(REPO / RUN_DIR), "--tier", str(tier_xml(tmp_path / "tier")), "--md", str(md)]
    assert gpu_bench.main(render) == 0, capsys.readouterr().err
    page = md.read_text()
    part = page.split(gpu_bench.MARKER)[0].split("The language models on one GPU, from the GPU tier ([tier.xml]"
                                                 "(../tier/tier.xml)")[1]
    assert "The tier: 5 tests, 3 passed, 1 failed, 0 errors, 1 skipped, " in part
    assert table_rows(part) == {"lm_ddp": ["409,636", "3.631", "1,534 MB", "passed"],
                                "lm_moe": ["201,234", "3.702", "2,101 MB", "passed"],
                                "lm_tp": ["83,357", "4.200", "1,600 MB", "failed"], "recipe": ["tokens/s",
                                "val_bpb", "peak memory", "test"]}
    assert page.split(gpu_bench.MARKER)[0].startswith(committed_page().split(gpu_bench.MARKER)[0].split("\n\n")[0])
    render[3] = str(tier_xml(tmp_path / "quiet", drop={"-o", "junit_logging=system-out"}, spread=()))
    md.unlink()
    assert gpu_bench.main(render) == 2
    err = capsys.readouterr().err
    assert err == (f"gpu_bench: error: --tier {render[3]}: no test_every_language_model_learns_on_one_gpu run printed "
                   f"its RESULT there; run the tier with -o junit_logging=system-out, as tools/gpu_session.sh tier "
                   f"does\n") and not md.exists()
    (tmp_path / "bad.xml").write_text("<testsuites><testsuite")
    render[3] = str(tmp_path / "bad.xml")
    assert gpu_bench.main(render) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gpu_bench: error: --tier {render[3]}: not a JUnit XML file")


def test_render_of_the_cpu_run_has_its_table(run, tmp_path, capsys):
    """One JSON (here the CPU run's) renders to the table its own --md got, under the generated header."""
    _, _, md = run
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "gpu.json").write_text(json.dumps(run[1]))
    assert gpu_bench.main(["--render", str(folder), "--md", str(tmp_path / "page.md")]) == 0
    page = (tmp_path / "page.md").read_text()
    assert md.partition("\n\n")[2] in page and "- tree: not recorded in the JSONs" in page
    assert page.endswith(gpu_bench.MARKER + "\n")
