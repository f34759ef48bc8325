"""tools/gpu_bench.py on the CPU, so that it runs the first time on a GPU: one real run at tiny sizes (every section,
3 timed steps after 1 warm-up) shared by the tests, its JSON's keys and numbers, the medians recomputed from the
recorded steps, the table's rows; bad flags fail in one line; the MFU arithmetic and the datasheet peaks exactly."""

import json
import math
import statistics

import pytest
import torch
from conftest import REPO, run_script

from common.lm import Transformer
from tools import gpu_bench

STEPS, WARMUP = 3, 1
TIMED = {"throughput": [()], "overhead": [("recipe",), ("bare",)], "compile": [("eager",), ("compiled",)],
         "lm": [("lm_ddp",), ("lm_tp",)], "amp": [("tf32",), ("bf16",)]}


def gpu_bench_cli(*args, timeout=240):
    """The tool's command line, forked from the warm server (tests/warm.py: torch already imported)."""
    return run_script([REPO / "tools" / "gpu_bench.py", *args], timeout=timeout)


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
    assert s["compile"]["compiled"]["graphs"] >= 1
    assert {"lm_ddp", "lm_tp", "references", "tp_over_ddp_step"} <= set(s["lm"])
    assert {"tf32", "bf16", "speedup"} <= set(s["amp"])
    for name in ("lm_ddp", "lm_tp"):
        assert {"tokens_per_sec", "mfu", "flops_per_token", "n_matmul_params", "achieved_tflops"} <= set(s["lm"][name])
    # where a step's time goes, for a missed goal's cause: the profiled ops of each measurement
    for ops in (s["throughput"]["top_ops"], s["overhead"]["top_ops"]["recipe"], s["overhead"]["top_ops"]["bare"],
                s["compile"]["compiled"]["top_ops"], s["lm"]["lm_ddp"]["top_ops"], s["lm"]["lm_tp"]["top_ops"]):
        assert ops and {"op", "calls_per_step", "self_cpu_ms", "self_device_ms"} <= set(ops[0])
        assert [o["self_cpu_ms"] for o in ops] == sorted((o["self_cpu_ms"] for o in ops), reverse=True)


def test_every_number_is_finite_and_every_measure_positive(run):
    _, report, _ = run
    found = list(numbers(report["sections"]))
    assert found
    for path, value in found:
        assert math.isfinite(value), path
        if not path.endswith(("graph_breaks", "warmup_steps")) and ".top_ops" not in path:  # an op may take 0 ms
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
    assert s["amp"]["speedup"] == pytest.approx(s["amp"]["bf16"]["images_per_sec"] / s["amp"]["tf32"][
        "images_per_sec"])
    lm = s["lm"]["lm_ddp"]
    assert lm["mfu"] == pytest.approx(lm["tokens_per_sec"] * lm["flops_per_token"] / 1e12)  # --peak-tflops 1


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
    assert "2.63x" in rows["5 amp"]


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
