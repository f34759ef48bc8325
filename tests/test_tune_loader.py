"""tools/tune_loader.py: one real sweep on a PNG ImageFolder made here (progress, table, recommendation, chart),
the pure parts exactly, and each bad input as one line and exit code 2."""

import io
import json
import os
import re
import sys

import pytest
import torch
from conftest import REPO, make_imagefolder
from PIL import Image

from common.data import default_worker_count
from tools import tune_loader
from tools.procs import run_group
from tools.tune_loader import cores_per_process, recommend, settings, worker_sweep

BATCH = 8
PROGRESS = re.compile(r"^tune_loader: \[(\d+)/(\d+)\] (DataLoaderX?) workers=(\d+) pin_memory=(True|False): "
                      r"([\d.]+) images/s, ([\d.]+) ms/batch$")
RECOMMENDED = re.compile(r"^recommended: --workers (\d+) \((DataLoaderX?), pin_memory=(True|False)\) "
                         r"at ([\d.]+) images/s$")


def table(stdout):
    """The printed table as a list of {column: cell}."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["loader", "workers", "pin_memory", "images/s", "ms/batch"]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]


def sweep(*args, timeout=120):
    """`python tools/tune_loader.py ARGS` as a user runs it; its process group is killed on a timeout."""
    proc = run_group([sys.executable, str(REPO / "tools" / "tune_loader.py"), *map(str, args)], env=os.environ,
                     cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune_loader")
    data = make_imagefolder(tmp / "data", classes=3, train_per_class=24, val_per_class=2, size=24)
    chart, report = tmp / "chart.png", tmp / "rows.json"
    lines = sweep("--dataset", "imagefolder", "--data-root", data, "--image-size", 16, "--batch-size", 2 * BATCH,
                  "--processes", 2, "--device", "cpu", "--max-workers", 1, "--batches", 3, "--out", chart,
                  "--json", report, "--target", 1e6)  # a million images/s: no row feeds it
    return lines, chart, json.loads(report.read_text())


@pytest.mark.slow
def test_progress_table_and_recommendation(cpu_sweep):
    lines, _, report = cpu_sweep
    stdout = "\n".join(lines)
    progress = [PROGRESS.match(line).groups() for line in lines if PROGRESS.match(line)]
    # workers 0 and 1 (--max-workers 1), each with both loaders; pin_memory only on a GPU
    expected = [("DataLoader", "0"), ("DataLoaderX", "0"), ("DataLoader", "1"), ("DataLoaderX", "1")]
    assert [(p[2], p[3]) for p in progress] == expected
    assert [(p[0], p[1]) for p in progress] == [(str(i), "4") for i in range(1, 5)]
    assert "batch 8 per process (--batch-size 16 / --processes 2)" in lines[0]

    rows = table(stdout)
    assert [(r["loader"], r["workers"], r["pin_memory"]) for r in rows] == [(*e, "False") for e in expected]
    for row, line in zip(rows, progress, strict=True):
        ips, ms = float(row["images/s"]), float(row["ms/batch"])
        assert ips > 0 and ms > 0
        assert (row["images/s"], row["ms/batch"]) == line[5:]  # the progress line said the same
    for row, exact in zip(rows, report["rows"], strict=True):  # the JSON holds the unrounded numbers
        assert float(row["images/s"]) == pytest.approx(exact["images_per_sec"], abs=0.05 + 1e-9)
        assert float(row["ms/batch"]) == pytest.approx(exact["ms_per_batch"], abs=0.005 + 1e-9)
        # Both from the same BATCH-image batches; on the unrounded numbers, as the printed ms/batch has 2 decimals
        # (measured 1.03-9.06 ms: at < 0.5 ms its rounding alone passes 1%).
        assert exact["images_per_sec"] * exact["ms_per_batch"] / 1000 == pytest.approx(BATCH, rel=1e-6)

    recommended = [RECOMMENDED.match(line).groups() for line in lines if RECOMMENDED.match(line)]
    assert len(recommended) == 1
    workers, loader, pin, ips = recommended[0]
    chosen = [r for r in rows if (r["workers"], r["loader"], r["pin_memory"], r["images/s"]) == recommended[0]]
    assert len(chosen) == 1, (recommended, rows)
    # The rule, checked on the printed numbers: the fewest workers among rows within 5% of the fastest,
    # and the fastest of those.
    speeds = [float(r["images/s"]) for r in rows]
    close = [r for r, v in zip(rows, speeds, strict=True) if v >= 0.95 * max(speeds)]
    fewest = min(int(r["workers"]) for r in close)
    assert int(workers) == fewest
    assert float(ips) == max(float(r["images/s"]) for r in close if int(r["workers"]) == fewest)
    assert report["recommended"] == recommend(report["rows"])
    plain = [line for line in lines if line.startswith("  with DataLoader (the loader of most recipes): ")]
    if loader == "DataLoader":
        assert not plain
    else:  # the recipes that build a plain DataLoader get its best row too, by the same rule
        best = recommend([r for r in report["rows"] if r["loader"] == "DataLoader"])
        assert plain == [f"  with DataLoader (the loader of most recipes): --workers {best['workers']} "
                         f"(pin_memory=False) at {best['images_per_sec']:.1f} images/s"]
    assert "rule: the fastest row; among rows within 5% of it, the one with the fewest workers" in stdout
    # What a recipe takes here without --workers (--processes 2), and its DataLoader row where --max-workers 1 has it.
    default = default_worker_count(len(os.sched_getaffinity(0)), 2)
    assert report["settings"]["recipes_default_workers"] == default
    row = [r for r in rows if (r["loader"], r["workers"]) == ("DataLoader", str(default))]
    said = f"DataLoader at {row[0]['images/s']} images/s" if row else "above --max-workers 1, not measured"
    assert (f"  the recipes' default here: --workers {default} (one per core of the process beyond its own, at most "
            f"16): {said}") in lines
    # --target: the step's rate over 2 processes; none of these rows feeds 500,000 a process
    assert report["target"] == {"images_per_sec": 1e6, "per_process": 5e5,
                                "rows": {"DataLoader": None, "DataLoaderX": None}}
    assert tune_loader.target_line(report["rows"], 1e6, 2) in lines


@pytest.mark.slow
def test_chart_is_a_png(cpu_sweep):
    _, chart, _ = cpu_sweep
    with Image.open(chart) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_measure_pin_memory_both_ways(tmp_path):
    lines = sweep("--dataset", "synthetic", "--batch-size", 64, "--processes", 1, "--device", "cuda",
                  "--max-workers", 1, "--batches", 5, "--out", tmp_path / "chart.png")
    rows = table("\n".join(lines))
    assert sorted((r["loader"], r["workers"], r["pin_memory"]) for r in rows) == sorted(
        (loader, workers, pin) for loader in ("DataLoader", "DataLoaderX") for workers in ("0", "1")
        for pin in ("False", "True"))
    assert all(float(r["images/s"]) > 0 for r in rows)


class FlushLog(io.StringIO):
    """stdout that marks each flush with NUL: the text before one is what a pipe passes on at that moment."""

    def flush(self):
        self.write("\0")


@pytest.mark.filterwarnings("ignore::DeprecationWarning:matplotlib")  # matplotlib 3.9 uses pyparsing 3.3's old names
def test_each_row_is_flushed_as_it_finishes(monkeypatch, tmp_path):
    # Into a pipe, print() is held until a flush; multiprocessing flushes before it forks workers, so rows with
    # workers would show up anyway, and the rows without any would wait for the table.
    out = FlushLog()
    monkeypatch.setattr(sys, "stdout", out)
    assert tune_loader.main(["--dataset", "synthetic", "--image-size", "8", "--batch-size", "8", "--processes", "1",
                             "--device", "cpu", "--max-workers", "0", "--batches", "2", "--rounds", "2",
                             "--out", str(tmp_path / "chart.png")]) == 0
    text = out.getvalue()
    progress = [line for line in text.replace("\0", "").splitlines() if PROGRESS.match(line)]
    # round after round: every setting once, then again
    assert [PROGRESS.match(line).group(1, 2, 3) for line in progress] == [
        ("1", "4", "DataLoader"), ("2", "4", "DataLoaderX"), ("3", "4", "DataLoader"), ("4", "4", "DataLoaderX")]
    for line in progress:
        assert line + "\n\0" in text
    assert "(images/s: each row's median of its 2 rounds)" in text


# ------------------------------------------------------------------------------------ pure parts
def test_worker_sweep():
    assert worker_sweep(0) == [0]
    assert worker_sweep(1) == [0, 1]
    assert worker_sweep(2) == [0, 1, 2]
    assert worker_sweep(3) == [0, 1, 2, 3]
    assert worker_sweep(4) == [0, 1, 2, 4]
    assert worker_sweep(6) == [0, 1, 2, 4, 6]
    assert worker_sweep(8) == [0, 1, 2, 4, 8]
    assert worker_sweep(12) == [0, 1, 2, 4, 8, 12]
    # the recipes' default count in its place, where it is within --max-workers
    assert worker_sweep(8, also=7) == [0, 1, 2, 4, 7, 8]
    assert worker_sweep(64, also=16) == [0, 1, 2, 4, 8, 16, 32, 64]
    assert worker_sweep(2, also=1) == worker_sweep(2) and worker_sweep(4, also=7) == worker_sweep(4)


def test_cores_per_process():
    assert cores_per_process(2, 1) == 2
    assert cores_per_process(2, 2) == 1
    assert cores_per_process(2, 4) == 1  # more processes than cores: still one each
    assert cores_per_process(64, 8) == 8
    assert cores_per_process(16, 3) == 5


def test_settings():
    assert settings(2, "cpu", also=3) == settings(2, "cpu")  # the default above --max-workers: not measured
    assert settings(2, "cpu") == [("DataLoader", 0, False), ("DataLoaderX", 0, False), ("DataLoader", 1, False),
                                  ("DataLoaderX", 1, False), ("DataLoader", 2, False), ("DataLoaderX", 2, False)]
    assert settings(1, "cuda") == [("DataLoader", 0, False), ("DataLoader", 0, True), ("DataLoaderX", 0, False),
                                   ("DataLoaderX", 0, True), ("DataLoader", 1, False), ("DataLoader", 1, True),
                                   ("DataLoaderX", 1, False), ("DataLoaderX", 1, True)]


def test_summarize_takes_each_rows_median():
    def measured(loader, workers, ips):
        return {"loader": loader, "workers": workers, "pin_memory": False, "images_per_sec": ips}

    rounds = [measured("DataLoader", 0, 100.0), measured("DataLoaderX", 0, 300.0),
              measured("DataLoader", 0, 80.0), measured("DataLoaderX", 0, 200.0),
              measured("DataLoader", 0, 400.0), measured("DataLoaderX", 0, 250.0)]
    assert tune_loader.summarize(rounds, batch=8) == [
        {"loader": "DataLoader", "workers": 0, "pin_memory": False, "images_per_sec": 100.0, "ms_per_batch": 80.0,
         "rounds_images_per_sec": [100.0, 80.0, 400.0]},
        {"loader": "DataLoaderX", "workers": 0, "pin_memory": False, "images_per_sec": 250.0, "ms_per_batch": 32.0,
         "rounds_images_per_sec": [300.0, 200.0, 250.0]}]


def row(loader, workers, ips, pin=False):
    return {"loader": loader, "workers": workers, "pin_memory": pin, "images_per_sec": ips}


def test_recommend_rule():
    fastest, within, boundary = row("DataLoader", 8, 1000.0), row("DataLoader", 4, 960.0), row("DataLoader", 2, 950.0)
    below = row("DataLoader", 1, 949.9)
    assert recommend([fastest, within]) == within  # fewer workers, within 5%
    assert recommend([fastest, within, boundary, below]) == boundary  # exactly 5% below still counts
    assert recommend([fastest, below]) == fastest  # more than 5% slower: the fastest wins
    faster_same_count = row("DataLoaderX", 4, 970.0, pin=True)
    assert recommend([fastest, within, faster_same_count]) == faster_same_count  # a tie in workers: the faster
    assert tune_loader.recommendation_line(within) == "recommended: --workers 4 (DataLoader, pin_memory=False) at " \
        "960.0 images/s"


def test_target_the_fewest_workers_that_feed_the_step_or_how_long_the_gpu_would_wait():
    rows = [row("DataLoader", 0, 300.0), row("DataLoader", 4, 1200.0), row("DataLoaderX", 8, 1500.0),
            row("DataLoader", 16, 1400.0)]
    # 4,000 images/s over 4 processes: 1,000 each; 4 workers are the fewest that load it
    assert tune_loader.feeding(rows, 1000.0) == rows[1]
    # each loader answered apart: DataLoaderX needs 8 workers for what the recipes' DataLoader gets from 4
    assert tune_loader.target_line(rows, 4000, 4) == ("target: 4,000 images/s over 4 process(es), 1,000.0 each: "
                                                      "--workers 4 (DataLoader, pin_memory=False) feeds it at 1200.0 "
                                                      "images/s; --workers 8 (DataLoaderX, pin_memory=False) feeds "
                                                      "it at 1500.0 images/s")
    assert tune_loader.feeding(rows, 1400.0) == rows[2]  # 8 workers before 16: the fewest that reach it
    # 1,450 a process: only DataLoaderX's row reaches it, and the line says the DataLoader's does not
    assert tune_loader.target_line(rows, 1450, 1).endswith("no DataLoader row feeds it; --workers 8 (DataLoaderX, "
                                                           "pin_memory=False) feeds it at 1500.0 images/s")
    # An H200's fp16 resnet50 step, 6,184 images/s, on one process: the fastest row loads 24% of it
    assert tune_loader.feeding(rows, 6184.0) is None
    line = tune_loader.target_line(rows, 6184, 1)
    assert line.startswith("target: 6,184 images/s over 1 process(es), 6,184.0 each: no row feeds it: the fastest, "
                           "--workers 8 (DataLoaderX), loads 1500.0, 24% of it: the GPU would wait for data 76% of "
                           "each step. Decode on the GPU (recipes/gpu_decode.py"), line


def test_on_a_gpu_only_the_pinned_rows_a_recipe_can_be_set_to_are_recommended_or_feed_the_target():
    # every recipe pins on a GPU: an unpinned row, here the fastest and the fewest workers, is a measurement only
    rows = [row("DataLoader", 0, 2000.0), row("DataLoader", 0, 900.0, pin=True), row("DataLoader", 2, 1000.0),
            row("DataLoader", 2, 1900.0, pin=True), row("DataLoaderX", 0, 2100.0),
            row("DataLoaderX", 0, 950.0, pin=True)]
    assert tune_loader.usable(rows, "cpu") == [rows[0], rows[2], rows[4]]
    assert tune_loader.usable(rows, "cuda") == [rows[1], rows[3], rows[5]]
    assert recommend(tune_loader.usable(rows, "cuda")) == rows[3]  # not workers 0 unpinned, the fastest
    fed = tune_loader.feeding_by_loader(tune_loader.usable(rows, "cuda"), 1500.0)
    assert fed == {"DataLoader": rows[3], "DataLoaderX": None}
    assert tune_loader.target_line(tune_loader.usable(rows, "cuda"), 1500, 1).endswith(
        "--workers 2 (DataLoader, pin_memory=True) feeds it at 1900.0 images/s; no DataLoaderX row feeds it")


def test_help_states_the_rule(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune_loader.main(["--help"])
    assert exit_info.value.code == 0
    assert "within 5% of it, the one with the fewest workers" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("args", "message"), [
    (["--batches", "0"], "--batches 0 must be >= 1"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--processes", "0"], "--processes 0 must be >= 1"),
    (["--max-workers", "-1"], "--max-workers -1 must be >= 0"),
    (["--target", "0"], "--target 0.0 must be > 0 (images/s)"),
    (["--target", "nan"], "--target nan must be > 0 (images/s)"),
    (["--out", "{tmp}/chart.txt"], "--out {tmp}/chart.txt must end in .png, .svg, .pdf (the chart's format)"),
    (["--out", "{tmp}"], "--out {tmp} must end in .png, .svg, .pdf"),  # matplotlib would write {tmp}.png
    (["--batch-size", "10", "--processes", "4"], "--batch-size 10 is the GLOBAL batch and must be a multiple of "
     "--processes 4; try --batch-size 8"),
    # found before measuring, not after it (the JSON's folder was made at the end)
    (["--json", "/proc/x/y.json"], "--json /proc/x/y.json: cannot make or write its folder (No such file or "
     "directory)"),
    (["--json", "{tmp}/file/y.json"], "--json {tmp}/file/y.json: cannot make or write its folder (Not a directory)"),
    (["--out", "/proc/x/chart.png"], "--out /proc/x/chart.png: cannot make or write its folder ("),
    (["--dataset", "imagefolder", "--data-root", "{tmp}/missing"], "--data-root '{tmp}/missing' has no train/ folder"),
    (["--dataset", "imagefolder", "--data-root", "{tmp}/file"], "--data-root '{tmp}/file' has no train/ folder"),
    (["--dataset", "imagefolder", "--data-root", "{tmp}/small", "--batch-size", "64", "--processes", "2"],
     "12 training samples make no full batch of 32 per process"),
])
def test_bad_input_one_line_exit_2(args, message, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    make_imagefolder(tmp_path / "small", classes=2, train_per_class=6, val_per_class=1, size=8)
    code = tune_loader.main(["--device", "cpu", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert message.format(tmp=tmp_path) in err


@pytest.mark.parametrize(("args", "message"), [
    (["--batches", "x"], "argument --batches: invalid int value: 'x'"),
    (["--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist' (choose from "),  # quoted by version
    (["--workers", "4"], "unrecognized arguments: --workers 4"),  # the recipes' flag; this tool sweeps it
], ids=["not-a-number", "not-a-choice", "not-a-flag"])
def test_a_flag_argparse_refuses_is_one_line_not_a_usage_block(args, message, capsys):
    # argparse's own errors printed its 7-line usage block above the message (the other tools: tools/cli.py's one
    # line). In-process: a new interpreter spends 2-4 s importing torch before the parser runs.
    with pytest.raises(SystemExit) as exit_:
        tune_loader.main(args)
    out, err = capsys.readouterr()
    assert "usage:" not in err and "Traceback" not in err, err
    assert (exit_.value.code, out, err.count("\n")) == (2, "", 1) and err.startswith(f"tune_loader: error: {message}")


def test_cuda_without_a_gpu_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["--device", "cuda"], ["--device", "cuda", "--processes", "1"]):
        assert tune_loader.main(args) == 2
        assert capsys.readouterr().err == "error: --device cuda, but torch sees no GPU (torch.cuda.is_available() " \
            "is False); use --device cpu\n"


def test_an_image_that_does_not_load_is_one_line_exit_1(tmp_path, capsys):
    data = make_imagefolder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=1, size=8)
    (data / "train" / "class_1" / "002.png").write_bytes(b"not a png")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    code = tune_loader.main(["--dataset", "imagefolder", "--data-root", str(data), "--batch-size", "8",
                             "--processes", "1", "--device", "cpu", "--max-workers", "0", "--batches", "1",
                             "--out", str(tmp_path / "chart.png")])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("error: train sample "), err
    assert "class_1/002.png) does not load: UnidentifiedImageError" in err
    assert not (tmp_path / "chart.png").exists()
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (affinity, threads)  # left as it found them
