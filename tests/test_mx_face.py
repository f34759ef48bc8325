"""mx_face_prefetch.py on real .rec files made by tools/pack_rec.py, its errors, and the loader benchmark."""

import re
import shutil

import pytest
import torch
from conftest import import_mxnet, launch, make_imagefolder, result_of, run_direct
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
