"""tools/bench.py. Exactly, on constructed inputs: the interleaved schedule, the median/range arithmetic on recorded
runs, the comparisons and their "within noise" marking in the tables. On the CPU: a two-recipe run of two rounds
whose table cells are recomputed from the recipes' own RESULT lines in the JSON; a run with failing and missing
entries; and a stand-in recipe whose second of three runs fails."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
from conftest import REPO, result_of, run_group
from PIL import Image

from common.data import usable_cores
from common.models import build_model
from tools import lm_bench
from tools.bench import (
    BARE,
    COLUMNS,
    ENTRIES,
    add_derived,
    compare,
    comparisons,
    cpu_threads,
    hardware,
    main,
    markdown,
    parse_args,
    parse_entry,
    plot,
    recipe_command,
    schedule,
    select,
    summarize,
    summarize_entry,
    summarize_time,
    table_rows,
)

FAST = ["--devices", "cpu:2", "--arch", "tiny", "--batch-size", "16", "--image-size", "16", "--steps", "4"]
BATCH = 16
CELL = re.compile(r"(-?[0-9.]+) \((-?[0-9.]+)–(-?[0-9.]+)\)")  # "median (lowest–highest)"


def bench(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "CUDA_VISIBLE_DEVICES", "LAUNCH_DRY_RUN")}
    return run_group([sys.executable, str(REPO / "tools" / "bench.py"), *map(str, args)], env=env, cwd=REPO,
                     timeout=timeout)


def tables(md):
    """Every markdown table in `md`, each as a list of {column: cell}."""
    found, block = [], []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip("|").split("|")])
        elif block:
            found.append([dict(zip(block[0], row, strict=True)) for row in block[2:]])
            block = []
    return found


def table(md):
    """The results table as {(recipe, mode): {column: cell}}."""
    return {(row["recipe"], row["mode"]): row for row in tables(md)[0]}


def comparison_table(md):
    """The comparisons table as {(entry, against): {column: cell}}."""
    return {(row["entry"], row["against"]): row for row in tables(md)[1]}


def close(cell, value):
    """cell (as printed, rounded) equals value to the cell's last printed digit."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return float(cell) == pytest.approx(value, abs=0.5 * 10**-decimals + 1e-9)


def cell_matches(cell, values, median=None):
    """A 'median (lowest–highest)' cell equals the median (or `median`), min and max of `values`, to its printed
    digits."""
    match = CELL.fullmatch(cell)
    assert match, cell
    expected = (statistics.median(values) if median is None else median, min(values), max(values))
    return all(close(printed, value) for printed, value in zip(match.groups(), expected, strict=True))


# ------------------------------------------------------------------ constructed inputs, exact
ARGS = argparse.Namespace(batch_size=64)


def recorded(name, ips, launch_s, peaks, devices="cpu:2", round_=1, state=None):
    """A run as run_entry records it (the RESULT fields bench.py reads), with add_derived's numbers added."""
    base, _, mode = name.partition(":")
    run = {"name": name, "recipe": base, "mode": mode or "-", "devices": devices, "threads_per_process": 1,
           "round": round_, "t_launch": 1000.0,
           "result": {"world_size": len(peaks), "device": "cpu", "images_per_sec": ips, "peak_mem_mb": max(peaks),
                      "peak_mem_mb_per_rank": peaks, "first_step_end_unix": 1000.0 + launch_s,
                      **({"state_bytes_per_rank": state} if state else {})}}
    add_derived(run, ARGS)
    return run


def test_schedule_interleaves():
    assert schedule(["A", "B", "C"], 3) == [(1, "A"), (1, "B"), (1, "C"), (2, "A"), (2, "B"), (2, "C"),
                                            (3, "A"), (3, "B"), (3, "C")]
    assert schedule(["A", "B", BARE], 2) == [(1, "A"), (1, "B"), (1, BARE), (2, "A"), (2, "B"), (2, BARE)]
    assert schedule(["A", "B"], 1) == [(1, "A"), (1, "B")]
    assert schedule([], 4) == []


def test_summarize():
    assert summarize([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert summarize([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.0, 4.0)  # an even count: the mean of the middle two
    assert summarize([7.5]) == (7.5, 7.5, 7.5)
    assert summarize([5.0, 5.0, 1.0]) == (5.0, 1.0, 5.0)
    with pytest.raises(ValueError):
        summarize([])


def test_summarize_time_keeps_the_median_inside_the_runs_range():
    # the median of times is 1 / the median of rates; for one run that is 1 / (1 / v), which rounds past v for
    # 25.899085861793406 (CI's plot then refused a negative whisker): the median stays within [lowest, highest]
    for v in (25.899085861793406, 28.190966061526385, 61.840715977566404, 0.391):
        assert summarize_time([v]) == (v, v, v)
    median, low, high = summarize_time([25.899085861793406, 28.190966061526385])
    assert low <= median <= high and median == pytest.approx(2 / (1 / 25.899085861793406 + 1 / 28.190966061526385))
    assert summarize_time([2.0, float("inf")]) == (4.0, 2.0, float("inf"))  # rates 0.5 and 0: their median 0.25


def test_compare_within_noise():
    # overlapping ranges, touching ones included: within noise, whatever the medians say
    c = compare([10.0, 12.0, 11.0], [8.0, 9.0, 10.0])
    assert (c["ratio"], c["within_noise"], c["verdict"]) == (11.0 / 9.0, True, "within noise")
    assert compare([1.0, 10.0, 5.0], [4.0, 5.0, 4.5])["verdict"] == "within noise"  # one range inside the other
    # disjoint ranges: a real difference, its direction from the medians
    c = compare([10.0, 12.0, 11.0], [8.0, 9.0, 9.5])
    assert (c["ratio"], c["within_noise"], c["verdict"]) == (11.0 / 9.0, False, "faster")
    assert c["entry_summary"] == (11.0, 10.0, 12.0) and c["against_summary"] == (9.0, 8.0, 9.5)
    assert (c["entry_runs"], c["against_runs"]) == (3, 3)
    assert compare([8.0, 9.0, 9.5], [10.0, 12.0, 11.0])["verdict"] == "slower"
    # times: lower is better, so a longer step is "slower"
    assert compare([20.0, 21.0], [10.0, 11.0], higher_is_better=False)["verdict"] == "slower"
    assert compare([10.0, 11.0], [20.0, 21.0], higher_is_better=False)["verdict"] == "faster"
    # one run on a side: no range, no verdict
    c = compare([10.0], [8.0, 9.0])
    assert (c["ratio"], c["within_noise"], c["verdict"]) == (10.0 / 8.5, None, "one run: no range")


def test_median_and_range_of_recorded_runs():
    runs = [recorded("ddp_torchrun", 1000.0, 5.0, [700.0, 710.0], state=[66168, 66168]),
            recorded("ddp_torchrun", 4000.0, 7.0, [720.0, 705.0], state=[66168, 66168]),
            recorded("ddp_torchrun", 2000.0, 6.0, [710.0, 700.0], state=[66168, 66168])]
    run = runs[0]
    assert (run["world_size"], run["replicas"], run["batch_per_replica"], run["bare_device"]) == (2, 2, 32, "cpu")
    assert run["step_ms"] == pytest.approx(64.0) and run["s_per_20_it"] == pytest.approx(1.28)
    row = summarize_entry(runs, bare_ms=[8.0, 16.0, 10.0], attempts=4)
    assert row["images_per_sec"] == {"median": 2000.0, "low": 1000.0, "high": 4000.0}
    assert row["launch_to_first_step_s"] == {"median": 6.0, "low": 5.0, "high": 7.0}
    assert row["bare_step_ms"] == {"median": 10.0, "low": 8.0, "high": 16.0}
    assert [row["step_ms"][k] for k in ("median", "low", "high")] == pytest.approx([32.0, 16.0, 64.0])
    assert [row["s_per_20_it"][k] for k in ("median", "low", "high")] == pytest.approx([0.64, 0.32, 1.28])
    assert row["peak_mem_mb_per_rank"] == [710.0, 705.0]  # each rank's own median
    assert row["step_vs_bare"] == pytest.approx(3.2)  # ratio of the medians: 32 / 10
    assert (row["runs"], row["attempts"]) == (3, 4)
    cells = dict(zip(["recipe", "mode", "world size", "device", "devices", "runs", "images/s", "s / 20 it",
                      "peak MB per rank", "state kB per rank", "all-reduce kB / step", "launch -> step 1 (s)",
                      "step ms", "bare ms", "step / bare"],
                     table_rows([row])[0], strict=True))
    assert cells == {"recipe": "ddp_torchrun", "mode": "-", "world size": "2", "device": "cpu", "devices": "cpu:2",
                     "runs": "3/4", "images/s": "2000.0 (1000.0–4000.0)", "s / 20 it": "0.640 (0.320–1.280)",
                     "peak MB per rank": "710.0 / 705.0", "state kB per rank": "64.6 / 64.6",
                     "all-reduce kB / step": "-", "launch -> step 1 (s)": "6.00 (5.00–7.00)",
                     "step ms": "32.00 (16.00–64.00)", "bare ms": "10.00 (8.00–16.00)", "step / bare": "3.200"}
    # an even count of runs: the mean of the middle two
    row = summarize_entry(runs[:2], bare_ms=[8.0, 16.0], attempts=2)
    assert row["images_per_sec"] == {"median": 2500.0, "low": 1000.0, "high": 4000.0}
    assert row["peak_mem_mb_per_rank"] == [710.0, 707.5]


def test_an_even_count_of_runs_derives_the_step_times_from_the_median_images_per_sec():
    # The footnote: s / 20 it = 20 x global batch / images/s, step ms = global batch / images/s, for the medians too.
    # Runs of 1000 and 4000 images/s: median 2500, so 64 / 2500 s a step (25.6 ms), not the mean of 64 and 16 ms (40).
    runs = [recorded("ddp_torchrun", 1000.0, 5.0, [700.0, 710.0]),
            recorded("ddp_torchrun", 4000.0, 7.0, [720.0, 705.0])]
    row = summarize_entry(runs, bare_ms=[8.0, 16.0], attempts=2)
    assert [row["step_ms"][k] for k in ("median", "low", "high")] == pytest.approx([25.6, 16.0, 64.0])
    assert [row["s_per_20_it"][k] for k in ("median", "low", "high")] == pytest.approx([0.512, 0.32, 1.28])
    assert row["s_per_20_it"]["median"] == pytest.approx(20 * 64 / row["images_per_sec"]["median"])
    assert row["step_vs_bare"] == pytest.approx(25.6 / 12.0)
    cells = dict(zip(COLUMNS, table_rows([row])[0], strict=True))
    assert (cells["s / 20 it"], cells["step ms"]) == ("0.512 (0.320–1.280)", "25.60 (16.00–64.00)")
    # The comparison with the bare loop takes the same median as the table's step ms.
    (made,) = comparisons([e for e in ENTRIES if e.name == "ddp_torchrun"], {"ddp_torchrun": runs},
                          {"ddp_torchrun": [8.0, 16.0]})
    assert made["entry_summary"] == pytest.approx((25.6, 16.0, 64.0)) and made["ratio"] == pytest.approx(25.6 / 12)


def test_against():
    """DDP entries against dp; fsdp, ddp_compile and ddp_zero against DDP; comm hooks against none; AMP modes against
    their fp32 sibling;
    references against nothing."""
    against = {e.name: e.against for e in ENTRIES}
    assert against == {"dp": None, "ddp_torchrun": "dp", "ddp_launch": "dp", "ddp_spawn": "dp", "ddp_checkpoint": "dp",
                       "torch_amp:fp16": "torch_amp:fp32", "torch_amp:bf16": "torch_amp:fp32", "torch_amp:fp32": None,
                       "apex_ddp": "dp", "fsdp": "ddp_torchrun", "ddp_compile": "ddp_torchrun",
                       "ddp_zero": "ddp_torchrun", "ddp_comm_hooks:none": None,
                       "ddp_comm_hooks:bf16": "ddp_comm_hooks:none", "ddp_comm_hooks:fp16": "ddp_comm_hooks:none",
                       "ddp_comm_hooks:powersgd": "ddp_comm_hooks:none", "apex_amp:O0": None,
                       "apex_amp:O1": "apex_amp:O0", "apex_amp:O2": "apex_amp:O0", "apex_amp:O3": "apex_amp:O0"}


def constructed_report():
    """dp, two DDP entries (one clearly faster than dp, one within noise of it), torch_amp fp16/fp32, bf16 failed in
    every round, apex_amp:O1 without its O0; three rounds, except torch_amp:fp16, whose round 2 failed."""
    chosen = select("dp,ddp_torchrun,ddp_launch,torch_amp,apex_amp:O1", ENTRIES)
    ips = {"dp": [1000.0, 1100.0, 1050.0], "ddp_torchrun": [1500.0, 1400.0, 1600.0],
           "ddp_launch": [1080.0, 1200.0, 1150.0], "torch_amp:fp16": [500.0, 520.0],
           "torch_amp:fp32": [1300.0, 1250.0, 1350.0], "apex_amp:O1": [480.0, 490.0, 470.0]}
    runs_by_name = {name: [recorded(name, v, 5.0, [700.0] if name == "dp" else [700.0, 700.0],
                                    devices="cpu" if name == "dp" else "cpu:2", round_=i + 1)
                           for i, v in enumerate(values)] for name, values in ips.items()}
    runs_by_name["torch_amp:bf16"] = []
    for run in runs_by_name["apex_amp:O1"]:  # the recipe's first line, as run_entry keeps it
        run["impl_line"] = "impl: apex O1 (apex build: python-only (no amp_C: a host sync per gradient tensor))"
    # step ms = global batch / images/s = 64000 / ips
    bare = {"dp": [55.0, 60.0, 58.0], **{name: [20.0, 22.0, 21.0] for name in ips if name != "dp"}}
    made = comparisons(chosen, runs_by_name, bare)
    entries = [summarize_entry(runs_by_name[e.name], bare[e.name], 3) for e in chosen if runs_by_name[e.name]]
    failed = [{"name": "torch_amp:fp16", "round": 2, "error": "exit code 1"},
              *({"name": "torch_amp:bf16", "round": r, "error": "exit code 1"} for r in (1, 2, 3))]
    return {"settings": {"arch": "tiny", "batch_size": 64, "image_size": 32, "steps": 50, "workers": 0,
                         "devices": "cpu:2", "repeats": 3, "command": "python tools/bench.py --repeats 3"},
            "hardware": {"cpu": "a CPU", "cores": 2, "gpus": [], "torch": "2.x", "python": "3.11", "platform": "Linux",
                         "date": "today"},
            "entries": entries, "comparisons": made, "runs": [r for v in runs_by_name.values() for r in v],
            "bare_runs": [], "failed": failed, "failed_entries": ["torch_amp:bf16"], "skipped": []}


def test_comparisons_only_where_both_ran():
    made = constructed_report()["comparisons"]
    assert [(c["entry"], c["against"], c["measure"]) for c in made] == [
        ("ddp_torchrun", "dp", "images/s"), ("ddp_launch", "dp", "images/s"),
        ("torch_amp:fp16", "torch_amp:fp32", "images/s"),  # not bf16 (no run) nor apex_amp:O1 (O0 not selected)
        *((name, BARE, "step ms") for name in ("dp", "ddp_torchrun", "ddp_launch", "torch_amp:fp16", "torch_amp:fp32",
                                               "apex_amp:O1"))]
    by = {(c["entry"], c["against"]): c for c in made}
    assert by["ddp_torchrun", "dp"]["ratio"] == 1500.0 / 1050.0 and by["ddp_torchrun", "dp"]["verdict"] == "faster"
    assert by["ddp_launch", "dp"]["ratio"] == 1150.0 / 1050.0 and by["ddp_launch", "dp"]["verdict"] == "within noise"
    fp16 = by["torch_amp:fp16", "torch_amp:fp32"]
    assert fp16["ratio"] == 510.0 / 1300.0 and fp16["verdict"] == "slower" and fp16["entry_runs"] == 2
    # step ms against the bare loop: dp 64000 / [1000, 1100, 1050] = 58.2-64.0 ms against 55-60 ms: overlap
    assert by["dp", BARE]["verdict"] == "within noise"
    assert by["dp", BARE]["ratio"] == pytest.approx((64000 / 1050) / 58.0)
    assert by["ddp_torchrun", BARE]["entry_summary"] == pytest.approx((64000 / 1500, 40.0, 64000 / 1400))
    assert by["ddp_torchrun", BARE]["verdict"] == "slower"  # 40.0-45.7 ms against 20-22 ms
    assert by["ddp_torchrun", BARE]["ratio"] == pytest.approx((64000 / 1500) / 21.0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # matplotlib's pyparsing calls, on import
def test_tables_mark_within_noise(tmp_path):
    report = constructed_report()
    md = markdown(report)
    rows, compared = table(md), comparison_table(md)
    assert list(rows) == [("dp", "-"), ("ddp_torchrun", "-"), ("ddp_launch", "-"), ("torch_amp", "fp16"),
                          ("torch_amp", "fp32"), ("apex_amp", "O1")]
    assert rows["dp", "-"]["images/s"] == "1050.0 (1000.0–1100.0)" and rows["dp", "-"]["runs"] == "3/3"
    assert rows["torch_amp", "fp16"]["images/s"] == "510.0 (500.0–520.0)"
    assert compared["ddp_torchrun", "dp"] == {
        "entry": "ddp_torchrun", "against": "dp", "measure": "images/s", "ratio of medians": "1.429",
        "entry: median (range)": "1500.0 (1400.0–1600.0)", "against: median (range)": "1050.0 (1000.0–1100.0)",
        "verdict": "faster"}
    assert compared["ddp_launch", "dp"]["verdict"] == "within noise"
    assert compared["ddp_launch", "dp"]["ratio of medians"] == "1.095"
    assert compared["torch_amp:fp16", "torch_amp:fp32"]["verdict"] == "slower"
    assert compared["dp", BARE]["verdict"] == "within noise"
    assert [c["verdict"] for c in report["comparisons"]] == [row["verdict"] for row in compared.values()]
    # The chart (Mermaid: drawn by the code host from the text) has the table's medians, in its order.
    chart = md.split("```mermaid\n")[1].split("```")[0]
    assert 'x-axis ["dp", "ddp_torchrun", "ddp_launch", "torch_amp:fp16", "torch_amp:fp32", "apex_amp:O1"]' in chart
    bars = re.search(r"bar \[(.*)\]", chart)[1].split(", ")
    assert bars == [rows[key]["images/s"].split(".")[0] for key in rows] and bars[0] == "1050", bars
    assert "Failed runs: torch_amp:fp16 round 2 (exit code 1), torch_amp:bf16 round 1 (exit code 1)" in md
    assert "No successful run, left out of the tables: torch_amp:bf16" in md
    # An apex row says what it measured: a python-only apex is not apex's speed on a GPU.
    assert ("What the apex entries ran (their first line): apex_amp:O1: `impl: apex O1 (apex build: python-only "
            "(no amp_C: a host sync per gradient tensor))`") in md
    assert "3 run(s) per entry, in interleaved rounds" in md
    plot(report, tmp_path / "results.png")
    with Image.open(tmp_path / "results.png") as image:
        image.verify()
        assert image.format == "PNG"


def test_args():
    assert parse_args([]).repeats >= 3
    with pytest.raises(SystemExit) as exc:
        parse_args(["--repeats", "0"])
    assert exc.value.code == 2
    args = parse_args(["--workers", "3", "--repeats", "1"])
    command = recipe_command(ENTRIES[1], "cpu:2", args, "/tmp/out")
    assert command[command.index("--workers") + 1] == "3"  # per process, passed on as it is


def test_args_messages(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "-1"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(": error: --repeats must be >= 1")  # one line, exit 2
    for args, message in ((["--workers", "-1"], "--workers must be >= 0 (DataLoader workers per process)"),
                          (["--timeout", "0"], "--timeout must be > 0 (seconds one recipe run may take)"),
                          (["--timeout", "nan"], "--timeout must be > 0 (seconds one recipe run may take)")):
        with pytest.raises(SystemExit) as exc:
            parse_args(args)
        assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f": error: {message}")
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "DataLoader workers per process (default 0)" in " ".join(capsys.readouterr().out.split())


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


def test_an_entry_name_given_twice_is_refused_in_one_line(monkeypatch, capsys):
    # Both would be launched each round and summarised as one row of twice the runs
    code, out, err = bench_here(monkeypatch, capsys, "--add-entry", "ddp_torchrun=recipes/ddp_torchrun.py --sync-bn",
                                "--recipes", "ddp_torchrun")
    assert (code, out) == (2, "")
    assert err == "bench: error: --add-entry 'ddp_torchrun': an entry of that name exists already; give it another " \
        "name\n"


@pytest.mark.parametrize("out", ["/proc/benchout", "{tmp}/file/sub"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_first_run(out, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("a file, not a folder")
    out = out.format(tmp=tmp_path)
    code, stdout, err = bench_here(monkeypatch, capsys, "--recipes", "ddp_torchrun", "--out", out, *FAST)
    assert (code, stdout) == (2, "")  # nothing launched
    assert err.count("\n") == 1, err
    assert err.startswith(f"bench: error: --out {out}: cannot make or write that folder ("), err


def test_the_bare_loops_threads_are_launch_shs_from_the_cores_this_process_may_use(monkeypatch):
    # A Slurm job's 4 CPUs of a 64-core node: launch.sh's nproc says 4, os.cpu_count() 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 9, 10, 11})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (usable_cores(), cpu_threads(1), cpu_threads(2), cpu_threads(8)) == (4, 4, 2, 1)
    assert hardware()["cores"] == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3  # the user's, as launch.sh keeps it


def test_lm_bench_refuses_a_run_with_no_timed_step(capsys):
    for args in (["--steps", "1"], ["--steps", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exit_:
            lm_bench.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("lm_bench: error: --steps ") and err.count("\n") == 1, err


@pytest.mark.parametrize("devices", ["foo", "cpu:0", "cpu:1,foo", "cpu:1,0", "0,,1", "cpu:1,"])
def test_lm_bench_refuses_devices_launch_sh_does_not_take_before_any_launch(devices, monkeypatch, capsys):
    # `--devices foo` launched every entry, each failing, and printed an empty table; cpu:0 was taken
    monkeypatch.setattr(lm_bench, "launch", lambda *args: pytest.fail(f"launched {args}"))
    with pytest.raises(SystemExit) as exit_:
        lm_bench.main(["--devices", devices])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == f"lm_bench: error: --devices {devices!r}: expected cpu:N entries " \
        "(cpu:1,cpu:2, N >= 1) or one GPU list like 0,1\n"


# ------------------------------------------------------------------------------ real runs, CPU
@pytest.fixture(scope="module")
def two_recipes(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = bench("--recipes", "ddp_torchrun,dp", "--repeats", 2, "--out", out, *FAST)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, out


@pytest.mark.slow
def test_table_matches_result_lines(two_recipes):
    proc, out = two_recipes
    md = (out / "results.md").read_text()
    report = json.loads((out / "results.json").read_text())
    rows = table(md)
    assert set(rows) == {("ddp_torchrun", "-"), ("dp", "-")}
    assert len(report["runs"]) == 4 and not report["failed"] and report["settings"]["repeats"] == 2
    # Interleaved, as launched (t_launch) and as run (the bare loops' start): round 1 then round 2, each entry
    # once per round, then the bare loop of each (batch, device, threads): ddp's 8 images, dp's 16.
    events = sorted([(r["t_launch"], r["round"], r["name"]) for r in report["runs"]]
                    + [(b["t_start"], b["round"], f"bare {b['batch']}") for b in report["bare_runs"]])
    assert [e[1:] for e in events] == [(1, "ddp_torchrun"), (1, "dp"), (1, "bare 8"), (1, "bare 16"),
                                       (2, "ddp_torchrun"), (2, "dp"), (2, "bare 8"), (2, "bare 16")]
    medians = {}
    for name in ("ddp_torchrun", "dp"):
        runs = [r for r in report["runs"] if r["name"] == name]
        # each RESULT line as the recipe printed it, parsed the way the recipe tests parse it
        results = [result_of(subprocess.CompletedProcess([], 0, r["result_line"] + "\n", "")) for r in runs]
        ips = [res["images_per_sec"] for res in results]
        step_ms = [1000 * BATCH / v for v in ips]
        world_size = results[0]["world_size"]
        bare_ms = [b["step_ms"] for b in report["bare_runs"] if b["batch"] == BATCH // world_size]
        assert len(bare_ms) == 2
        row = rows[(name, "-")]
        expected = {
            "images/s": ips,
            "s / 20 it": [20 * BATCH / v for v in ips],
            "launch -> step 1 (s)": [res["first_step_end_unix"] - r["t_launch"] for res, r in zip(results, runs,
                                                                                                   strict=True)],
            "step ms": step_ms,
            "bare ms": bare_ms,
        }
        # the step times' medians: from the median images/s (2 runs: not the mean of the two times)
        medians_of = {"s / 20 it": 20 * BATCH / statistics.median(ips),
                      "step ms": 1000 * BATCH / statistics.median(ips)}
        for column, values in expected.items():
            assert all(v > 0 for v in values), (column, values)
            assert cell_matches(row[column], values, medians_of.get(column)), (name, column, row[column], values)
        assert close(row["step / bare"], medians_of["step ms"] / statistics.median(bare_ms))
        assert row["runs"] == "2/2" and row["world size"] == str(world_size)
        per_rank = [float(cell) for cell in row["peak MB per rank"].split(" / ")]
        assert len(per_rank) == world_size
        for printed, peaks in zip(per_rank, zip(*(res["peak_mem_mb_per_rank"] for res in results), strict=True),
                                  strict=True):
            assert printed > 0 and close(f"{printed:.1f}", statistics.median(peaks))
        assert row["device"] == results[0]["device"] == "cpu"
        held = results[0]["state_bytes_per_rank"]  # every recipe reports it (harness.gather_result_line)
        assert len(held) == world_size and row["state kB per rank"] == " / ".join(f"{b / 1024:.1f}" for b in held)
        medians[name, "held"] = held
        medians[name] = statistics.median(ips)
        ranges = {"ips": (min(ips), max(ips)), "step": (min(step_ms), max(step_ms)), "bare": (min(bare_ms),
                                                                                            max(bare_ms))}
        medians[name, "ranges"] = ranges
        compared = comparison_table(md)[name, BARE]
        overlap = ranges["step"][0] <= ranges["bare"][1] and ranges["bare"][0] <= ranges["step"][1]
        assert compared["verdict"] == ("within noise" if overlap else "slower" if ranges["step"][0] > ranges["bare"][1]
                                       else "faster")
    assert rows[("dp", "-")]["devices"] == "cpu" and rows[("ddp_torchrun", "-")]["devices"] == "cpu:2"
    ddp_vs_dp = comparison_table(md)["ddp_torchrun", "dp"]
    assert close(ddp_vs_dp["ratio of medians"], medians["ddp_torchrun"] / medians["dp"])
    # The same model and optimizer: dp's one process holds what each DDP rank holds, a full copy.
    assert medians["dp", "held"] == medians["ddp_torchrun", "held"][:1]
    (lo, hi), (dp_lo, dp_hi) = medians["ddp_torchrun", "ranges"]["ips"], medians["dp", "ranges"]["ips"]
    assert ddp_vs_dp["verdict"] == ("within noise" if lo <= dp_hi and dp_lo <= hi else "faster" if lo > dp_hi
                                    else "slower")
    assert "torch" in md and report["hardware"]["cores"] == usable_cores()  # what launch.sh counts, not cpu_count
    assert next(line for line in md.splitlines() if line.startswith("| ddp_torchrun")) in proc.stdout  # printed too


@pytest.mark.slow
def test_comm_hook_entries_report_the_bytes_they_all_reduce(tmp_path):
    # One run each of DDP's own all-reduce and PowerSGD (from step 3 of 4): the column is the last step's bytes, as
    # tests/instrument counted them: every fp32 gradient, and PowerSGD's factors of tiny's three weight matrices.
    proc = bench("--recipes", "ddp_comm_hooks:none,ddp_comm_hooks:powersgd", "--repeats", 1, "--out", tmp_path, *FAST)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = table((tmp_path / "results.md").read_text())
    report = json.loads((tmp_path / "results.json").read_text())
    model = build_model("tiny", 10, 16)
    full = 4 * sum(p.numel() for p in model.parameters())
    factors = 4 * sum((p.shape[0] + p[0].numel()) if p.dim() > 1 else p.numel() for p in model.parameters())
    sent = {r["mode"]: r["allreduce_bytes_per_step"] for r in report["runs"]}
    assert sent == {"none": [[full] * 4] * 2, "powersgd": [[full, full, factors, factors]] * 2}, sent
    assert rows[("ddp_comm_hooks", "none")]["all-reduce kB / step"] == f"{full / 1024:.1f}"
    assert rows[("ddp_comm_hooks", "powersgd")]["all-reduce kB / step"] == f"{factors / 1024:.1f}"
    assert comparison_table((tmp_path / "results.md").read_text())["ddp_comm_hooks:powersgd", "ddp_comm_hooks:none"]


@pytest.mark.slow
def test_png_is_valid(two_recipes):
    _, out = two_recipes
    with Image.open(out / "results.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


FLAKY = '''# launcher: python
"""A stand-in recipe: its second run fails, the others print a RESULT line with images/s = 1000 x the run's number."""
import json, sys, time
from pathlib import Path
count = Path(__file__).with_suffix(".count")
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n == 2:
    sys.exit("flaky: error: the second run fails")
print("RESULT " + json.dumps({"recipe": "flaky", "world_size": 2, "device": "cpu", "images_per_sec": 1000.0 * n,
                              "peak_mem_mb": 20.0 + n, "peak_mem_mb_per_rank": [10.0 + n, 20.0 + n],
                              "first_step_end_unix": time.time()}))
'''


def bench_here(monkeypatch, capsys, *args):
    """tools/bench.py's main() in this process, which has torch imported already: (exit code, stdout, stderr).
    The environment is as bench() gives it, and main()'s own changes to it are undone afterwards."""
    for name in ("MASTER_PORT", "CUDA_VISIBLE_DEVICES", "LAUNCH_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # main() sets it; the teardown restores what was here
    code = main([*map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # matplotlib's pyparsing calls, on import
def test_failed_and_missing_entries(tmp_path, monkeypatch, capsys):
    """A bad flag fails the entry, the next one still runs, a missing recipe file is skipped; exit 1."""
    steady = tmp_path / "steady.py"
    steady.write_text(FLAKY)  # its first run succeeds
    code, out, err = bench_here(monkeypatch, capsys, "--recipes", "broken,ghost,steady", "--repeats", 1,
                                "--out", tmp_path / "out", *FAST,
                                "--add-entry", "broken=recipes/ddp_torchrun.py --no-such-flag",
                                "--add-entry", "ghost=recipes/no_such_recipe.py",
                                "--add-entry", f"steady={steady}")
    assert code == 1, err[-4000:]
    assert "FAILED broken (round 1/1):" in err and "FAILED steady" not in err
    assert "ddp_torchrun.py: error: unrecognized arguments: --no-such-flag" in err
    assert "skipping ghost" in out and "1 run(s) failed: broken (1 of 1)" in err
    md = (tmp_path / "out" / "results.md").read_text()
    # argparse's exit code 2, passed on by launch.sh (torchrun itself would have made it 1)
    assert "Failed runs: broken round 1 (exit code 2)" in md
    assert "No successful run, left out of the tables: broken" in md and "missing): ghost" in md
    rows = table(md)
    assert list(rows) == [("steady", "-")] and rows["steady", "-"]["images/s"] == "1000.0 (1000.0–1000.0)"
    assert [(c["entry"], c["against"]) for c in tables(md)[1]] == [("steady", BARE)]
    assert comparison_table(md)["steady", BARE]["verdict"] == "one run: no range"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # matplotlib's pyparsing calls, on import
def test_failed_repeat(tmp_path, monkeypatch, capsys):
    """An entry whose round 2 of 3 fails is reported, summarized from rounds 1 and 3, and bench exits 1."""
    flaky = tmp_path / "flaky.py"
    flaky.write_text(FLAKY)
    code, out, err = bench_here(monkeypatch, capsys, "--recipes", "flaky", "--repeats", 3, "--out", tmp_path / "out",
                                *FAST, "--add-entry", f"flaky={flaky}")
    assert code == 1, err[-4000:]
    assert "FAILED flaky (round 2/3): exit code 1" in err and "flaky: error: the second run fails" in err
    assert "1 run(s) failed: flaky (1 of 3)" in err
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Failed runs: flaky round 2 (exit code 1)" in md and "No successful run" not in md
    row = table(md)["flaky", "-"]
    assert row["runs"] == "2/3" and row["images/s"] == "2000.0 (1000.0–3000.0)"
    # 16 images at the median 2000 images/s: 8 ms (not 10.67, the mean of the two runs' 16 and 5.33)
    assert row["step ms"] == "8.00 (5.33–16.00)" and row["peak MB per rank"] == "12.0 / 22.0"
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["name"], r["round"], r["images_per_sec"]) for r in report["runs"]] == [("flaky", 1, 1000.0),
                                                                                    ("flaky", 3, 3000.0)]
    assert [(f["name"], f["round"]) for f in report["failed"]] == [("flaky", 2)]
    assert [b["round"] for b in report["bare_runs"]] == [1, 2, 3]  # the bare loop still runs in every round
    bare_ms = [b["step_ms"] for b in report["bare_runs"]]
    assert cell_matches(row["bare ms"], bare_ms)
    assert comparison_table(md)["flaky", BARE]["verdict"] in ("faster", "slower", "within noise")


@pytest.mark.slow
def test_results_that_cannot_be_written_are_printed_first_and_one_line(tmp_path, monkeypatch, capsys):
    """--out passes the check before the first run, and is gone when the runs end: the tables are printed, then one
    line says what could not be written; exit 1."""
    steady = tmp_path / "steady.py"
    steady.write_text(FLAKY)  # its first run succeeds
    monkeypatch.setattr("tools.bench.unwritable_folder", lambda label, folder: None)
    code, out, err = bench_here(monkeypatch, capsys, "--recipes", "steady", "--repeats", 1, "--out", "/proc/benchout",
                                *FAST, "--add-entry", f"steady={steady}")
    assert code == 1 and table(out)["steady", "-"]["images/s"] == "1000.0 (1000.0–1000.0)", err[-4000:]
    assert err.count("\n") == 1 and err.startswith("bench: error: cannot write to --out /proc/benchout: "), err
    assert "the tables are printed above" in err and "Traceback" not in err
