"""tools/bench.py on the CPU: a two-recipe, few-step run checked against the recipes' own RESULT lines,
and a run with a failing and a missing entry."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, result_of, run_group
from PIL import Image

from tools.bench import ENTRIES, parse_entry, select

FAST = ["--devices", "cpu:2", "--arch", "tiny", "--batch-size", "16", "--image-size", "16", "--steps", "4"]
BATCH = 16


def bench(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "CUDA_VISIBLE_DEVICES", "LAUNCH_DRY_RUN")}
    return run_group([sys.executable, str(REPO / "tools" / "bench.py"), *map(str, args)], env=env, cwd=REPO,
                     timeout=timeout)


def table(md):
    """The results table as {(recipe, mode): {column: cell}}."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]
    return {(row["recipe"], row["mode"]): row for row in rows}


def close(cell, value):
    """cell (as printed, rounded) equals value to the cell's last printed digit."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return float(cell) == pytest.approx(value, abs=0.5 * 10**-decimals + 1e-9)


@pytest.fixture(scope="module")
def two_recipes(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = bench("--recipes", "ddp_torchrun,dp", "--out", out, *FAST)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, out


@pytest.mark.slow
def test_table_matches_result_lines(two_recipes):
    proc, out = two_recipes
    md = (out / "results.md").read_text()
    report = json.loads((out / "results.json").read_text())
    rows = table(md)
    assert set(rows) == {("ddp_torchrun", "-"), ("dp", "-")}
    assert len(report["runs"]) == 2 and not report["failed"]
    for run in report["runs"]:
        # The RESULT line as the recipe printed it, parsed the way the recipe tests parse it.
        result = result_of(subprocess.CompletedProcess([], 0, run["result_line"] + "\n", ""))
        row = rows[(result["recipe"], "-")]
        ips = result["images_per_sec"]
        expected = {
            "images/s": ips,
            "s / 20 it": 20 * BATCH / ips,
            "launch -> step 1 (s)": result["first_step_end_unix"] - run["t_launch"],
            "step ms": 1000 * BATCH / ips,
            "bare ms": run["bare_step_ms"],
            "step / bare": (1000 * BATCH / ips) / run["bare_step_ms"],
            "world size": result["world_size"],
        }
        for column, value in expected.items():
            assert value > 0, (column, value)
            assert close(row[column], value), (result["recipe"], column, row[column], value)
        per_rank = [float(cell) for cell in row["peak MB per rank"].split(" / ")]
        assert len(per_rank) == len(result["peak_mem_mb_per_rank"]) == result["world_size"]
        for printed, peak in zip(per_rank, result["peak_mem_mb_per_rank"], strict=True):
            assert printed > 0 and close(f"{printed:.1f}", peak)
        assert row["device"] == result["device"] == "cpu"
        assert run["launch_to_first_step_s"] == pytest.approx(expected["launch -> step 1 (s)"])
        assert run["step_vs_bare"] == pytest.approx(expected["step / bare"])
    assert rows[("dp", "-")]["devices"] == "cpu" and rows[("ddp_torchrun", "-")]["devices"] == "cpu:2"
    assert "torch" in md and report["hardware"]["cores"] == os.cpu_count()
    assert next(line for line in md.splitlines() if line.startswith("| ddp_torchrun")) in proc.stdout  # printed too


@pytest.mark.slow
def test_png_is_valid(two_recipes):
    _, out = two_recipes
    with Image.open(out / "results.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


@pytest.mark.slow
def test_failed_and_missing_entries(tmp_path):
    """A bad flag fails the entry, the next one still runs, a missing recipe file is skipped; exit 1."""
    proc = bench("--recipes", "broken,ghost,broken_too", "--out", tmp_path, *FAST,
                 "--add-entry", "broken=recipes/ddp_torchrun.py --no-such-flag",
                 "--add-entry", "ghost=recipes/no_such_recipe.py",
                 "--add-entry", "broken_too=recipes/dp.py --no-such-flag")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "FAILED broken:" in proc.stderr and "FAILED broken_too:" in proc.stderr
    assert "ddp_torchrun.py: error: unrecognized arguments: --no-such-flag" in proc.stderr
    assert "skipping ghost" in proc.stdout and "run(s) failed: broken, broken_too" in proc.stderr
    md = (tmp_path / "results.md").read_text()
    # argparse's exit code 2, passed on by launch.sh (torchrun itself would have made it 1)
    assert "Failed: broken (exit code 2), broken_too (exit code 2)" in md and "missing): ghost" in md


def test_selection():
    assert [e.name for e in select("torch_amp", ENTRIES)] == ["torch_amp:fp16", "torch_amp:bf16", "torch_amp:fp32"]
    assert [e.name for e in select("dp,torch_amp:bf16,dp", ENTRIES)] == ["dp", "torch_amp:bf16"]
    entry = parse_entry("amp_cl=recipes/torch_amp.py --amp-dtype bf16 --channels-last")
    assert (entry.name, entry.recipe, entry.args) == ("amp_cl", "recipes/torch_amp.py",
                                                      ("--amp-dtype", "bf16", "--channels-last"))
    with pytest.raises(ValueError, match="unknown recipe entry 'nope'"):
        select("nope", ENTRIES)
    with pytest.raises(ValueError, match="NAME=RECIPE"):
        parse_entry("no_equals_sign")
