"""common/recordio.py and tools/pack_rec.py on real files, cross-checked against mxnet 1.9.1 where it imports.

mxnet 1.9.1 (the last release) imports only with numpy<1.24 and python<3.12, so the cross-checks skip, with
the reason in pytest's summary, in the project venv; run this file with a venv that has mxnet to run them.
"""

import io
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import warm
from conftest import import_mxnet
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from common.recordio import (
    MAGIC,
    IndexedRecordReader,
    IRHeader,
    MXFaceDataset,
    RecordIOError,
    RecordWriter,
    encode_record,
    pack,
    unpack,
)
from tools.pack_rec import pack_folder

REPO = Path(__file__).resolve().parents[1]
M = struct.pack("<I", MAGIC)  # the magic as it appears in the file: 0a 23 d7 ce


@pytest.fixture(scope="module")
def mx():
    module, why = import_mxnet()
    if module is None:
        pytest.skip(f"mxnet not importable ({why}); needs mxnet==1.9.1 with numpy<1.24, python<3.12: "
                    "cross-check not run")
    return module


def chunks_at(rec_bytes, offset):
    """[(cflag, length)] of the record at offset, walked independently of the module under test."""
    out = []
    while True:
        magic, lrec = struct.unpack_from("<II", rec_bytes, offset)
        assert magic == MAGIC
        cflag, length = lrec >> 29, lrec & ((1 << 29) - 1)
        out.append((cflag, length))
        offset += 8 + length + (-length % 4)
        if cflag in (0, 3):
            return out


def sample_records():
    """(key, header, payload): scalar and array labels, every length mod 4, magics aligned and not."""
    rng = np.random.default_rng(0)
    records = [
        (0, IRHeader(0, 3.0, 0, 0), b""),
        (1, IRHeader(5, 1.5, 11, 22), b"a"),  # pack ignores a caller's flag: 0 for a scalar label...
        (2, IRHeader(9, [1.0, 2.5], 2, 0), b"ab"),  # ...and the label count for an array
        (3, IRHeader(0, np.arange(3, dtype=np.float32), 3, 0), b"abc"),
        # after the 24-byte header, payload offset 4 is record offset 28: aligned, so dmlc splits there
        (4, IRHeader(0, 7.0, 4, 0), b"wxyz" + M + b"q"),
        (5, IRHeader(0, 7.0, 5, 0), M + b"abcd" + M + M + b"tail!"),  # three splits, one empty middle part
        (6, IRHeader(0, 7.0, 6, 0), b"xy" + M + b"z"),  # unaligned magic: plain data, one chunk
        (7, IRHeader(0, [9.0], 7, 0), b"1234" + M),  # flag 1: 4 label bytes shift the payload by 4, still aligned
    ]
    for key in range(8, 40):
        records.append((key, IRHeader(0, float(key), key, 0), rng.bytes(int(rng.integers(0, 300)))))
    return records


def write_pure(tmp_path, records, name="pure"):
    idx, rec = tmp_path / f"{name}.idx", tmp_path / f"{name}.rec"
    with RecordWriter(idx, rec) as writer:
        for key, header, payload in records:
            writer.write_idx(key, pack(header, payload))
    return idx, rec


def assert_same_header(got, want):
    assert (got.flag, got.id, got.id2) == (want.flag, want.id, want.id2)
    if want.flag == 0:
        assert isinstance(got.label, float) and got.label == want.label
    else:
        assert got.label.dtype == np.float32 and np.array_equal(got.label, want.label)


def packed_header(header):
    """The header pack/unpack should give back: flag 0 for a scalar, flag n and float32 array otherwise."""
    if isinstance(header.label, float):
        return IRHeader(0, header.label, header.id, header.id2)
    label = np.asarray(header.label, dtype=np.float32)
    return IRHeader(label.size, label, header.id, header.id2)


# ----------------------------------------------------------------------------------- pure round trip
def test_round_trip_headers_labels_payloads(tmp_path):
    records = sample_records()
    idx, rec = write_pure(tmp_path, records)
    reader = IndexedRecordReader(idx, rec)
    assert reader.keys.tolist() == [key for key, _, _ in records] and len(reader) == len(records)
    for key, header, payload in reversed(records):  # random access, not just sequential
        got_header, got_payload = unpack(reader.read_idx(key))
        assert got_payload == payload, key
        assert_same_header(got_header, packed_header(header))


def test_split_only_at_aligned_magic_as_dmlc_does(tmp_path):
    idx, rec = write_pure(tmp_path, sample_records())
    raw = rec.read_bytes()
    offsets = dict(line.split("\t") for line in idx.read_text().splitlines())
    flags = {int(k): chunks_at(raw, int(v)) for k, v in offsets.items()}
    assert flags[4] == [(1, 28), (3, 1)]  # header 24 + "wxyz", then "q"; the magic itself is not stored
    assert flags[5] == [(1, 24), (2, 4), (2, 0), (3, 5)]
    assert flags[6] == [(0, 24 + 7)]
    assert flags[7] == [(1, 24 + 4 + 4), (3, 0)]
    assert all(f == [(0, f[0][1])] for k, f in flags.items() if k not in (4, 5, 7))
    # every record starts 4-byte aligned: padding follows the total length
    assert all(int(v) % 4 == 0 for v in offsets.values()) and len(raw) % 4 == 0


def test_encode_record_bytes_by_hand():
    lrec = lambda cflag, n: struct.pack("<I", cflag << 29 | n)  # noqa: E731
    assert encode_record(b"") == M + lrec(0, 0)
    assert encode_record(b"abcde") == M + lrec(0, 5) + b"abcde" + b"\0\0\0"
    assert encode_record(b"wxyz" + M + b"q") == M + lrec(1, 4) + b"wxyz" + M + lrec(3, 1) + b"q\0\0\0"
    assert encode_record(b"w" + M + b"q") == M + lrec(0, 6) + b"w" + M + b"q\0\0"


def test_idx_text_and_sparse_idx_and_large_records(tmp_path):
    rng = np.random.default_rng(1)
    big = bytearray(rng.bytes(3 << 20))  # > the reader's 1 MiB readahead
    big[1 << 20:(1 << 20) + 4] = M  # and split at 1 MiB and 2 MiB + 4
    big[(2 << 20) + 4:(2 << 20) + 8] = M
    records = [(k, IRHeader(0, float(k), k, 0), rng.bytes(100 + k)) for k in range(6)]
    records.insert(3, (100, IRHeader(0, 1.0, 100, 0), bytes(big)))
    idx, rec = write_pure(tmp_path, records)
    lines = idx.read_text().splitlines()
    assert lines[0] == "0\t0" and all(line.count("\t") == 1 for line in lines)
    # An idx listing every other record: readahead then spans records it does not need; results must not change.
    sparse = tmp_path / "sparse.idx"
    sparse.write_text("".join(line + "\n" for line in lines[1::2]))
    for idx_path in (idx, sparse):
        reader = IndexedRecordReader(idx_path, rec)
        for key, _, payload in records:
            if key in reader:
                assert unpack(reader.read_idx(key))[1] == payload


def test_pickled_reader_reopens(tmp_path):
    idx, rec = write_pure(tmp_path, sample_records())
    reader = IndexedRecordReader(idx, rec)
    first = reader.read_idx(5)
    clone = pickle.loads(pickle.dumps(reader))  # what a spawn-started DataLoader worker gets
    assert clone.read_idx(5) == first and clone._fd != reader._fd


# ---------------------------------------------------------------------------------- corrupt files
@pytest.fixture
def small_rec(tmp_path):
    records = [(k, IRHeader(0, float(k), k, 0), bytes(range(k, k + 40))) for k in range(5)]
    records.append((5, IRHeader(0, 5.0, 5, 0), b"abcd" + M + b"0123456789"))  # multi-part, last
    idx, rec = write_pure(tmp_path, records)
    offsets = {int(k): int(v) for k, v in (line.split("\t") for line in idx.read_text().splitlines())}
    return idx, rec, offsets


def read_error(idx, rec, key):
    with pytest.raises(RecordIOError) as info:
        IndexedRecordReader(idx, rec).read_idx(key)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_magic_names_file_key_offset(small_rec):
    idx, rec, offsets = small_rec
    raw = bytearray(rec.read_bytes())
    raw[offsets[2]] ^= 0xFF
    rec.write_bytes(bytes(raw))
    message = read_error(idx, rec, 2)
    assert str(rec) in message and "key 2" in message
    assert f"bad magic 0x{MAGIC ^ 0xFF:08x} at offset {offsets[2]}" in message
    assert unpack(IndexedRecordReader(idx, rec).read_idx(3))[1] == bytes(range(3, 43))  # neighbours unaffected


@pytest.mark.parametrize("cut", [4, 30, -20], ids=["in-first-chunk-header", "in-first-chunk", "in-second-chunk"])
def test_truncated_rec_names_file_and_key(small_rec, cut):
    idx, rec, offsets = small_rec
    raw = rec.read_bytes()
    end = offsets[5] + cut if cut > 0 else len(raw) + cut
    rec.write_bytes(raw[:end])
    message = read_error(idx, rec, 5)
    assert str(rec) in message and "key 5" in message and "truncated" in message


def test_idx_offset_into_a_record_part(small_rec):
    idx, rec, offsets = small_rec
    second_part = offsets[5] + 8 + 24 + 4  # header 24 + "abcd" ends the first chunk
    idx.write_text(idx.read_text().replace(f"5\t{offsets[5]}", f"5\t{second_part}"))
    message = read_error(idx, rec, 5)
    assert str(rec) in message and "key 5" in message and "cflag 3" in message


@pytest.mark.parametrize("bad_line, expected", [
    ("3\t", "idx line 4 malformed"),
    ("3 120", "idx line 4 malformed"),
    ("three\t120", "idx line 4 malformed"),
    ("3\t120\textra", "idx line 4 malformed"),
    ("3\t999999", "key 3: offset 999999 at idx line 4 is outside"),
    ("1\t0", "key 1: listed twice"),
])
def test_malformed_idx_names_file_and_line(small_rec, bad_line, expected):
    idx, rec, _ = small_rec
    lines = idx.read_text().splitlines()
    lines[3] = bad_line
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordIOError) as info:
        IndexedRecordReader(idx, rec)
    assert str(idx) in str(info.value) and expected in str(info.value)


def test_missing_key_and_short_record(small_rec, tmp_path):
    idx, rec, _ = small_rec
    message = read_error(idx, rec, 42)
    assert str(rec) in message and "key 42" in message and "missing" in message
    with pytest.raises(RecordIOError, match="shorter than the 24-byte IRHeader"):
        unpack(b"\0" * 23)
    with pytest.raises(RecordIOError, match="promises 3 float32 labels"):
        unpack(struct.pack("<IfQQ", 3, 0, 0, 0) + b"\0" * 8)
    # The dataset adds file and key to unpack's message.
    with RecordWriter(tmp_path / "train.idx", tmp_path / "train.rec") as writer:
        writer.write_idx(0, b"short")
    with pytest.raises(RecordIOError) as info:
        MXFaceDataset(tmp_path)
    assert str(tmp_path / "train.rec") in str(info.value) and "key 0" in str(info.value)


def test_an_earlier_lines_error_is_reported_first(small_rec):
    # The repeats are found by sorting the keys, after the lines that are checked one by one: the error the reader
    # reports is still the one on the earliest line, as when a dict found the repeat on reading it.
    idx, rec, offsets = small_rec
    lines = idx.read_text().splitlines()
    for bad, error in [({2: "1\t0", 4: "garbage"}, f"key 1: listed twice (idx lines with offsets {offsets[1]} and 0, "
                                                     "the second at line 3)"),
                       ({2: "1\t999999"}, f"key 1: listed twice (idx lines with offsets {offsets[1]} and 999999, "
                                          "the second at line 3)"),
                       ({2: "2\t999999", 4: "2\t0"}, "key 2: offset 999999 at idx line 3 is outside")]:
        idx.write_text("\n".join(bad.get(i, line) for i, line in enumerate(lines)) + "\n")
        with pytest.raises(RecordIOError) as info:
            IndexedRecordReader(idx, rec)
        assert str(info.value).startswith(f"{idx}: {error}"), info.value


def test_face_header_with_one_label(tmp_path):
    with RecordWriter(tmp_path / "train.idx", tmp_path / "train.rec") as writer:
        writer.write_idx(0, pack(IRHeader(0, [5.0], 0, 0), b""))
    with pytest.raises(RecordIOError, match=r"train.rec: key 0: header record has 1 label\(s\), expected 2"):
        MXFaceDataset(tmp_path)


# ---------------------------------------------------------------------------------------- packer
SIZES = {"alice": [(20, 16), (24, 24)], "bob": [(16, 30), (32, 20), (18, 18)], "carol": [(28, 12)] * 4}


def make_tree(root):
    """root/<identity>/NN.png in RGB, RGBA and L; sorted names give alice=0, bob=1, carol=2."""
    rng = np.random.default_rng(0)
    modes = ["RGB", "RGBA", "L"]
    for name, sizes in SIZES.items():
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate(sizes):
            # A flat colour of its own plus a gradient: smooth enough that JPEG keeps it recognisable.
            colour = rng.integers(30, 200, size=4)
            ramp = np.linspace(0, 50, w)[None, :, None]
            pixels = np.clip(colour + ramp + np.zeros((h, w, 4)), 0, 255).astype(np.uint8)
            pixels[..., 3] = 255
            image = Image.fromarray(pixels, "RGBA").convert(modes[i % 3])
            image.save(root / name / f"{i:02d}.png")
    (root / "alice" / "notes.txt").write_text("not an image: skipped, as ImageFolder skips it")
    return root


@pytest.fixture
def packed(tmp_path):
    src = make_tree(tmp_path / "src")
    result = pack_folder(src, tmp_path / "rec")
    return src, tmp_path / "rec", result


def test_pack_layout_and_dataset(packed):
    src, out, result = packed
    assert (result.identities, result.images) == (3, 9)
    assert result.bytes == (out / "train.rec").stat().st_size and not list(out.glob("*.partial"))
    reader = IndexedRecordReader(out / "train.idx", out / "train.rec")
    assert reader.keys.tolist() == list(range(13))
    header0, payload0 = unpack(reader.read_idx(0))
    assert header0.flag == 2 and list(header0.label) == [10, 13] and payload0 == b""
    for key, want in zip(range(10, 13), [(1, 3), (3, 6), (6, 10)], strict=True):
        header, payload = unpack(reader.read_idx(key))
        assert header.flag == 2 and tuple(header.label) == want and payload == b""

    dataset = MXFaceDataset(out)
    assert len(dataset) == 9 and dataset.identity_range == (10, 13)
    originals = [(label, path) for label, name in enumerate(SIZES) for path in sorted((src / name).glob("*.png"))]
    for i, (want_label, path) in enumerate(originals):
        header, _ = unpack(reader.read_idx(i + 1))
        assert header.flag == 0 and header.label == float(want_label)
        image, label = dataset[i]
        original = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1) / 255
        assert type(label) is int and label == want_label
        assert image.dtype == torch.float32 and image.shape == original.shape
        assert (image - original).abs().mean() < 0.02  # the same picture, through JPEG q95


def test_pack_keeps_a_16_bit_pngs_picture_and_skips_hidden_files(tmp_path):
    ramp = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 to 65,472: PIL's RGB clips it white
    (tmp_path / "src" / "bob").mkdir(parents=True)
    Image.fromarray(ramp).save(tmp_path / "src" / "bob" / "16bit.png")
    (tmp_path / "src" / "bob" / "._16bit.png").write_bytes(b"\0\5\26\7 macOS metadata, no image")
    result = pack_folder(tmp_path / "src", tmp_path / "rec")
    assert (result.identities, result.images) == (1, 1)
    image = np.asarray(MXFaceDataset(tmp_path / "rec", transform=lambda im: im)[0][0], dtype=np.float32)
    assert np.abs(image[..., 0] - (ramp >> 8)).mean() < 2  # the ramp through JPEG q95, not 255


def test_pack_resize_quality_and_flat_dataset(tmp_path):
    src = make_tree(tmp_path / "src")
    small = pack_folder(src, tmp_path / "q30", quality=30, size=8)
    big = pack_folder(src, tmp_path / "q95", quality=95, size=8)
    assert small.bytes < big.bytes
    dataset = MXFaceDataset(tmp_path / "q30", transform=lambda im: im.size)
    assert [dataset[i] for i in range(len(dataset))] == [((8, 8), label) for label in (0, 0, 1, 1, 1, 2, 2, 2, 2)]
    # Without a flag>0 record 0 every key is an image, and array labels give their first element.
    (tmp_path / "flat").mkdir()
    with RecordWriter(tmp_path / "flat" / "train.idx", tmp_path / "flat" / "train.rec") as writer:
        for key, path in enumerate(sorted(src.glob("*/*.png"))):
            label = float(key) if key == 0 else [key, 99.0]  # key 0 flag 0: not a header
            writer.write_idx(key, pack(IRHeader(0, label, key, 0), path.read_bytes()))
    flat = MXFaceDataset(tmp_path / "flat")
    assert flat.identity_range is None and [flat[i][1] for i in range(len(flat))] == list(range(9))


def run_packer(*args):
    """`python tools/pack_rec.py ARGS`, forked from the warm server where it can be (tests/warm.py): the tool imports
    torch through common/, 4.5 s of CPU a new interpreter."""
    argv = ["tools/pack_rec.py", *map(str, args)]
    job = warm.direct_job(argv, dict(os.environ), REPO)
    if job is not None:
        return job.wait(120)
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_pack_cli(tmp_path):
    src = make_tree(tmp_path / "src")
    proc = run_packer(src, tmp_path / "out", "--quality", 90, "--size", 16)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "3 identities, 9 images" in lines[0]
    assert f"({(tmp_path / 'out' / 'train.rec').stat().st_size} bytes)" in lines[0]


@pytest.mark.parametrize("case", ["missing", "no-classes", "empty-class", "corrupt-image", "truncated-image",
                                  "broken-chunk", "too-many-pixels"])
def test_pack_cli_bad_input_exits_2_with_one_line(tmp_path, case):
    src = tmp_path / "src"
    expected = str(src)
    if case != "missing":
        make_tree(src)
    if case == "no-classes":
        for path in sorted(src.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (src / "loose.png").write_bytes(b"")
        expected = "no class folders"
    elif case == "empty-class":
        (src / "dave").mkdir()
        expected = str(src / "dave")
    elif case == "corrupt-image":
        (src / "bob" / "01.png").write_bytes(b"not a png at all")
        expected = str(src / "bob" / "01.png")
    elif case == "truncated-image":
        path = src / "carol" / "02.png"
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        expected = str(path)
    elif case == "broken-chunk":  # PIL raises SyntaxError for a bad chunk after the first: an Exception, no OSError
        noise = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)  # incompressible: 2 IDATs
        buffer = io.BytesIO()
        Image.fromarray(noise).save(buffer, "PNG")
        data = bytearray(buffer.getvalue())
        second = data.index(b"IDAT", data.index(b"IDAT") + 4)
        data[second:second + 4] = b"\xb5\xe9%\xea"
        (src / "bob" / "01.png").write_bytes(bytes(data))
        expected = f"{src / 'bob' / '01.png'}: cannot read image (broken PNG file"
    elif case == "too-many-pixels":  # 180 Mpx of blank 1-bit PNG, 22 kB: over PIL's DecompressionBombError limit
        Image.new("1", (20000, 9000)).save(src / "bob" / "01.png")
        expected = f"{src / 'bob' / '01.png'}: Image size (180000000 pixels) exceeds limit"
    proc = run_packer(src, tmp_path / "out")
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: ") and expected in proc.stderr
    assert not (tmp_path / "out" / "train.rec").exists() and not list(tmp_path.glob("out/*.partial"))


# ------------------------------------------------------------------------------------------ memory
def test_the_index_is_numpy_arrays_and_reads_as_before(tmp_path):
    # A dict and lists of Python ints: ~115 bytes a key, copied page by page into every forked worker (each read
    # writes a refcount). Keys out of order, with gaps and a multi-part record: what the dict gave, the arrays give.
    records = [(k, IRHeader(0, float(k), k, 0), bytes([k % 256]) * k) for k in (7, 3, 50, 4, 1000)]
    records.append((9, IRHeader(0, 9.0, 9, 0), b"abcd" + M + b"tail"))
    idx, rec = write_pure(tmp_path, records)
    reader = IndexedRecordReader(idx, rec)
    assert not [name for name, value in vars(reader).items() if isinstance(value, (list, dict, set, tuple))]
    arrays = [reader.keys, reader._bounds, *vars(reader.idx).values()]
    assert all(type(a) is np.ndarray and a.dtype == np.int64 for a in arrays), [type(a) for a in arrays]
    assert reader.keys.tolist() == list(reader.idx) == [7, 3, 50, 4, 1000, 9]  # idx order, as mxnet's .keys
    assert reader.idx == {int(k): int(v) for k, v in (line.split("\t") for line in idx.read_text().splitlines())}
    for key, _, payload in records:
        assert unpack(reader.read_idx(np.int64(key)))[1] == payload and key in reader
    for key, named in [(5, "5"), (2000, "2000"), (-1, "-1"), (np.int64(8), "8"), ("7", "'7'"), (7.5, "7.5")]:
        assert key not in reader
        with pytest.raises(RecordIOError) as info:
            reader.read_idx(key)
        assert str(info.value) == f"{rec}: key {named} missing from {idx}"


def test_a_large_index_costs_bytes_per_key(tmp_path):
    n = 20_000
    (tmp_path / "big.idx").write_text("".join(f"{k}\t{k * 64}\n" for k in range(n)))
    with open(tmp_path / "big.rec", "wb") as f:
        f.truncate(n * 64)  # sparse: the index alone is measured
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reader = IndexedRecordReader(tmp_path / "big.idx", tmp_path / "big.rec")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(reader) == n and reader.idx[n - 1] == (n - 1) * 64
    assert held / n <= 32, held / n  # 24: keys, offsets, bounds (int64); 115 as a dict and lists of ints


# -------------------------------------------------------------------------------------- DataLoader
class WithPid(Dataset):
    """The dataset's sample plus whether the reader's descriptor belongs to the process that read it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        image, label = self.dataset[i]
        return image, label, self.dataset.reader._pid == os.getpid()


def test_forked_dataloader_workers_match_single_process(packed):
    _, out, _ = packed
    dataset = MXFaceDataset(out, transform=lambda im: torch.from_numpy(np.asarray(im.resize((16, 16))).copy()))
    dataset[0]  # the parent opens its descriptor before the fork: workers must not share its file position

    def collect(num_workers):
        loader = DataLoader(WithPid(dataset), batch_size=2, num_workers=num_workers,
                            multiprocessing_context="fork" if num_workers else None)
        images, labels, own_fd = zip(*loader, strict=True)
        return torch.cat(images), torch.cat(labels), all(torch.cat(own_fd).tolist())

    images0, labels0, own0 = collect(0)
    images2, labels2, own2 = collect(2)
    assert own0 and own2 and len(images0) == 9
    assert torch.equal(labels0, labels2) and torch.equal(images0, images2)
    assert labels0.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    # The recipe's val set: the same reader (one index in memory) under its own transform, in forked workers too.
    train = dataset
    dataset = train.with_transform(lambda im: torch.from_numpy(np.asarray(im.resize((16, 16))).copy()) // 2)
    assert dataset.reader is train.reader and type(dataset.imgidx) is np.ndarray  # collect() reads `dataset`
    images_val, labels_val, own_val = collect(2)
    assert own_val and torch.equal(labels_val, labels0) and torch.equal(images_val, images0 // 2)


# ------------------------------------------------------------------------------------------ mxnet
@pytest.mark.filterwarnings("ignore:tostring:DeprecationWarning")
def test_byte_identical_to_mxnet_writer(tmp_path, mx):
    records = sample_records()
    mx_idx, mx_rec = tmp_path / "mx.idx", tmp_path / "mx.rec"
    writer = mx.recordio.MXIndexedRecordIO(str(mx_idx), str(mx_rec), "w")
    for key, header, payload in records:
        assert mx.recordio.pack(header, payload) == pack(header, payload)
        writer.write_idx(key, mx.recordio.pack(header, payload))
    writer.close()
    idx, rec = write_pure(tmp_path, records)
    assert rec.read_bytes() == mx_rec.read_bytes()
    assert idx.read_bytes() == mx_idx.read_bytes()


@pytest.mark.filterwarnings("ignore:tostring:DeprecationWarning")
def test_mxnet_reads_pure_and_pure_reads_mxnet(tmp_path, mx):
    records = sample_records()
    idx, rec = write_pure(tmp_path, records)
    mx_reader = mx.recordio.MXIndexedRecordIO(str(idx), str(rec), "r")
    sequential = mx.recordio.MXRecordIO(str(rec), "r")  # no idx: chunks must chain up exactly
    for key, header, payload in records:
        got_header, got_payload = mx.recordio.unpack(mx_reader.read_idx(key))
        assert got_payload == payload
        assert_same_header(got_header, packed_header(header))
        assert sequential.read() == pack(header, payload)
    assert sequential.read() is None

    mx_idx, mx_rec = tmp_path / "mx.idx", tmp_path / "mx.rec"
    writer = mx.recordio.MXIndexedRecordIO(str(mx_idx), str(mx_rec), "w")
    for key, header, payload in records:
        writer.write_idx(key, mx.recordio.pack(header, payload))
    writer.close()
    reader = IndexedRecordReader(mx_idx, mx_rec)
    for key, header, payload in records:
        got_header, got_payload = unpack(reader.read_idx(key))
        assert got_payload == payload
        assert_same_header(got_header, packed_header(header))


def test_face_dataset_mxnet_reader_matches_python(packed, mx):
    _, out, _ = packed
    ours, theirs = MXFaceDataset(out), MXFaceDataset(out, reader="mxnet")
    assert len(ours) == len(theirs) == 9 and ours.identity_range == theirs.identity_range
    for i in range(len(ours)):
        (a, la), (b, lb) = ours[i], theirs[i]
        assert la == lb and torch.equal(a, b)


def test_face_dataset_mxnet_reader_without_mxnet(packed):
    if import_mxnet()[0] is not None:
        pytest.skip("mxnet imports here: the missing-mxnet error is checked in a venv without it")
    with pytest.raises(RecordIOError, match="mxnet does not import"):
        MXFaceDataset(packed[1], reader="mxnet")
