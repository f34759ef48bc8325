"""mx_face_prefetch.py on real .rec files made by tools/pack_rec.py, its errors, and the loader benchmark."""

import math
import re
import shutil

import pytest
import torch
from conftest import import_mxnet, launch, load_recipe, make_imagefolder, result_of, run_direct
from jobs import error_lines
from PIL import Image

from tools.bench_loader import main as bench_loader
from tools.bench_recordio import main as bench_recordio
from tools.pack_rec import pack_folder

FACES = ["--arch", "tiny", "--image-size", "32", "--batch-size", "16"]


@pytest.fixture(scope="module")
def faces_rec(tmp_path_factory):
    """5 identities x 40 PNG faces (a colour each, plus noise) packed into train.rec/train.idx."""
    tmp = tmp_path_factory.mktemp("faces")
    make_imagefolder(tmp / "src", classes=5, train_per_class=40, val_per_class=0, size=32)
    assert pack_folder(tmp / "src" / "train", tmp / "rec").images == 200
    return tmp / "rec"


@pytest.mark.slow
def test_trains_on_a_packed_rec_well_above_chance(faces_rec, tmp_path):
    proc = launch("recipes/mx_face_prefetch.py", "cpu:2", "--rec", faces_rec, *FACES, "--workers", "1",
                  "--epochs", "3", "--out-dir", tmp_path)
    result = result_of(proc)
    assert (result["recipe"], result["world_size"], result["val_samples"]) == ("mx_face_prefetch", 2, 20)
    assert result["val_acc1"] >= 60, result  # 5 identities: chance is 20%
    assert f"data: {faces_rec} reader=auto train=180 val=20 classes=5" in proc.stdout
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["head.weight"].shape == (5, 128) and not any(k.startswith("module.") for k in state)


def test_faces_of_other_shapes_are_resized_to_the_square(tmp_path):
    # pack_rec keeps each image's size: a .rec of faces 40 x 32, 32 x 40 and 32 x 32 trains at --image-size 32 (a
    # Resize of the short side alone gave 32 x 40 and 40 x 32: no batch could stack them).
    src = make_imagefolder(tmp_path / "src", classes=2, train_per_class=10, val_per_class=0, size=32) / "train"
    for k, path in enumerate(sorted(src.rglob("*.png"))):
        image = Image.open(path)
        image.resize([(40, 32), (32, 40), (32, 32)][k % 3]).save(path)
    assert {Image.open(p).size for p in src.rglob("*.png")} == {(40, 32), (32, 40), (32, 32)}
    assert pack_folder(src, tmp_path / "rec").images == 20
    proc = launch("recipes/mx_face_prefetch.py", "cpu:1", "--rec", tmp_path / "rec", "--arch", "tiny",
                  "--image-size", "32", "--batch-size", "6", "--workers", "0", "--epochs", "1",
                  "--out-dir", tmp_path / "out")
    assert result_of(proc)["steps"] == 3, proc.stderr[-2000:]  # 18 training faces: 3 steps of 6


@pytest.mark.slow
def test_synthetic_needs_no_data(tmp_path):
    proc = launch("recipes/mx_face_prefetch.py", "cpu:2", "--rec", "synthetic", *FACES, "--workers", "0",
                  "--batch-size", "64", "--epochs", "2", "--out-dir", tmp_path)
    assert result_of(proc)["val_acc1"] > 30  # 10 classes


@pytest.mark.parametrize(("damage", "message"), [
    ("idx", "train.idx: idx line 3 malformed: 'garbage' (expected 'key<TAB>offset')"),
    ("rec", "is outside"),  # a .rec cut short: the idx points past its end
    ("header", "/train.rec has no header record 0 giving the identity count; pass --num-classes"),
])
@pytest.mark.slow
def test_a_damaged_file_fails_at_start_with_one_line(faces_rec, tmp_path, damage, message):
    bad = tmp_path / "bad"
    shutil.copytree(faces_rec, bad)
    if damage == "idx":
        lines = (bad / "train.idx").read_text().splitlines()
        (bad / "train.idx").write_text("\n".join(lines[:2] + ["garbage"] + lines[3:]) + "\n")
    elif damage == "header":  # an idx that does not list record 0: every record is an image, of no stated count
        lines = (bad / "train.idx").read_text().splitlines()
        (bad / "train.idx").write_text("\n".join(line for line in lines if not line.startswith("0\t")) + "\n")
    else:
        data = (bad / "train.rec").read_bytes()
        (bad / "train.rec").write_bytes(data[: len(data) // 2])
    proc = run_direct("mx_face_prefetch", "--rec", bad, *FACES)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    if damage == "rec":
        assert "train.rec" in proc.stderr and "truncated .rec?" in proc.stderr


def test_arcface_target_logit_never_rises_as_the_angle_grows():
    # cos(t + m) alone rises again past t = pi - m: s=64, m=0.5 at t=3.0 gave d(target)/d(cos t) = -2.49 s, a
    # gradient pushing the hardest samples away from their class. insightface's cos(t) - m sin(m) takes over there.
    s, m = 64.0, 0.5
    head = load_recipe("mx_face_prefetch").MarginHead(2, 1, "arcface", s, m)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0]]))
    theta = torch.cat([torch.linspace(0.01, math.pi - 0.001, 400), torch.tensor([3.0, math.pi - m - 1e-3,
                                                                                  math.pi - m + 1e-3])]).sort()[0]
    theta.requires_grad_(True)
    target = head(torch.stack([theta.cos(), theta.sin()], 1), torch.zeros(len(theta), dtype=torch.long))[:, 0]
    (slope,) = torch.autograd.grad(target.sum(), theta)  # each row's own: d(target)/d(t) = -sin(t) d(target)/d(cos)
    assert (slope <= 0).all(), theta[slope > 0]
    assert (target.diff() <= 1e-4).all(), theta[1:][target.diff() > 1e-4]  # across the switch at pi - m as well
    arc = theta < math.pi - m
    assert torch.allclose(target[arc], s * torch.cos(theta[arc] + m), atol=1e-3)
    assert torch.allclose(target[~arc], s * (torch.cos(theta[~arc]) - m * math.sin(m)), atol=1e-3)


def test_num_classes_below_the_labels_is_one_line(faces_rec, tmp_path):
    # With a header (5 identities): refused at start-up. Without one: the first sample whose label has no row in
    # the head, checked where it loads (a DataLoader worker). Before: a traceback per rank (on a GPU a device assert).
    proc = run_direct("mx_face_prefetch", "--rec", faces_rec, *FACES, "--num-classes", "3")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"[rank 0] error: num_classes 3 (--num-classes) is below the 5 identities in {faces_rec / 'train.rec'}'s "
        "header record 0: pass 5 or more, or leave it out"], proc.stderr
    flat = tmp_path / "flat"
    shutil.copytree(faces_rec, flat)
    lines = (flat / "train.idx").read_text().splitlines()  # the 200 images, not the header or identity records
    (flat / "train.idx").write_text("".join(line + "\n" for line in lines if 1 <= int(line.split()[0]) <= 200))
    proc = run_direct("mx_face_prefetch", "--rec", flat, *FACES, "--num-classes", "3", "--workers", "1",
                      "--out-dir", tmp_path / "out")
    errors = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    said = (rf"\[rank 0\] error: train sample \d+ does not load: RecordIOError: {re.escape(str(flat / 'train.rec'))}: "
            r"key \d+: label [34] is not in 0 \.\. 2 \(num_classes 3\): pass the identity count as num_classes "
            r"\(--num-classes\)")
    assert re.fullmatch(said, errors[0]), errors


@pytest.mark.slow
def test_reader_mxnet(faces_rec, tmp_path):
    proc = run_direct("mx_face_prefetch", "--rec", faces_rec, *FACES, "--reader", "mxnet", "--workers", "0",
                      "--max-steps", "3", "--out-dir", tmp_path)
    if import_mxnet()[0] is not None:  # the same records through mx.recordio
        assert result_of(proc)["val_samples"] == 20
    else:
        assert proc.returncode == 2
        assert "mxnet does not import" in proc.stderr and "use reader='python'" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_loader_benchmark_prints_both_epoch_times(capsys):
    plain, prefetched = bench_loader(["--batches", "6", "--load-ms", "4", "--compute-ms", "4"])
    out = capsys.readouterr().out
    assert plain > 0 and prefetched > 0
    assert re.search(r"^DataLoader:  [\d.]+ s/epoch \(6 batches", out, re.M)
    assert re.search(r"^DataLoaderX: [\d.]+ s/epoch", out, re.M) and "speed-up: " in out


@pytest.mark.parametrize("flags, said", [
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--batches", "0"], "--batches 0 must be at least 1"),
    (["--load-ms", "nan"], "--load-ms nan must be 0 or more"),
    (["--workers", "-1"], "--workers -1 must be 0 or more"),
    (["--device", "cuda"], "--device cuda: no CUDA GPU here; --device cpu measures the same on the CPU")])
def test_loader_benchmark_refuses_bad_flags_in_one_line(capsys, flags, said):
    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda is no error")
    with pytest.raises(SystemExit) as exit_:
        bench_loader(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().splitlines()[-1].endswith(f"error: {said}"), err


def test_reader_benchmark_without_the_files_is_one_line(tmp_path, capsys):
    (tmp_path / "train.rec").write_bytes(b"")  # the index is missing
    with pytest.raises(SystemExit) as exit_:
        bench_recordio(["--rec-dir", str(tmp_path)])
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        f"bench_recordio: error: --rec-dir {tmp_path}: no {tmp_path / 'train.idx'} (tools/pack_rec.py writes both)\n")


def test_reader_benchmark_prints_records_per_second(capsys):
    assert bench_recordio(["--records", "300"]) == 0
    out = capsys.readouterr().out
    rates = re.findall(r"^(pure-python|mxnet)\s+([\d,]+) records/s  \(300 records", out, re.M)
    assert ("pure-python" in dict(rates)) and all(int(rate.replace(",", "")) > 0 for _, rate in rates)
    # mxnet's line is either a rate (where it imports, as in CI) or says why it did not run.
    assert "mxnet" in dict(rates) or re.search(r"^mxnet\s+not run: mxnet does not import here", out, re.M)
