"""recipes/gpu_decode.py (issue 65): real JPEG files, their bytes handed over by the workers, decoded, cropped, flipped
and normalised in the main process (on a GPU by nvjpeg; here by the CPU's decoder, the same lines).

One real run per world size on a small ImageFolder of real photographs (tools/make_jpegs.py, with the files ImageNet
really holds beside plain RGB JPEGs: grayscale, CMYK, a PNG named .JPEG, a progressive JPEG), checked against a
one-process loop (tests/reference.py) fed the same samples one at a time through the recipe's own per-sample code:
- the losses, the weights and exact evaluation equal the reference's (sharding, batching, the prefetch thread, DDP);
- what each rank's workers handed over (RESULT's handed_per_rank) is the bytes of the files of its own shard, and only
  the files the GPU's decoder cannot take (CMYK, PNG) crossed as pixels (tests/instrument's LOG_SAMPLES_DIR: the
  sample ids each rank's loader took, in its own process);
- a run stopped mid-epoch and resumed (--save-every) ends with the uninterrupted run's weights;
- the box and flip are torchvision's RandomResizedCrop and RandomHorizontalFlip drawn from each sample's seed, by a
  generator of the sample's own: a sample loaded in a thread while the step draws from torch's (dropout) is the same;
- a file that nothing decodes stops the run with one line naming it, from a worker or from the main process.
"""

import collections
import json
import re
import threading
import time

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from conftest import (
    DEBUGGING,
    ddp_counts,
    debugging_took_effect,
    epoch_losses,
    instrument_env,
    launch,
    load_recipe,
    result_of,
    rng_env,
    rng_streams,
    samples_seen,
)
from jobs import error_lines
from PIL import Image
from reference import Autocast, Plain, evaluate, train
from test_conformance import read_curves

from common.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    NameFailingSamples,
    SampleError,
    build_datasets,
    device_normalize,
)
from common.models import build_model
from tools.make_jpegs import class_name, make_set

SIZE, EPOCHS, LR, BATCH = 16, 2, 0.1, 16
FLAGS = ["--dataset", "imagefolder", "--arch", "tiny_bn", "--workers", "0", "--epochs", EPOCHS, "--lr", LR,
         "--image-size", SIZE, "--save-every", 3]
# As torch_amp's conformance cases: fp16 with its scaler, 2 micro-batches a step (no_sync, the loss / 2) and clipping
# after unscale_ on 2 ranks; fp32 in channels-last on 3.
MODES = {"cpu:2": ["--amp-dtype", "fp16", "--accum-steps", 2, "--clip-grad", 1.0],
         "cpu:3": ["--amp-dtype", "fp32", "--channels-last", *DEBUGGING, "--tb-every", 2]}  # and conftest's
# debugging flags, and TensorBoard's curves (--tb-dir: each run's out/tb), whose steps check the run for divergence
ODD = {"cmyk_0.JPEG", "png_0.JPEG"}  # the files PIL decodes in the worker (gray and progressive go to the decoder)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """128 + 4 odd training files and 37 validation files of 40 x 30 px (portrait ones 30 x 40), 10 classes."""
    root = tmp_path_factory.mktemp("photos")
    make_set(root, train=128, val=37, classes=10, size=(40, 30), jobs=1, odd=True)
    return root


def sources(root):
    train_files, val_files, _ = build_datasets("imagefolder", root, SIZE)
    return train_files.dataset, val_files.dataset  # the ImageFolders under NameFailingSamples


def decoded(recipe, samples, size, files, split="train"):
    """The recipe's main-process part (decode_batch) on the CPU, for its worker's samples: (images, labels)."""
    return recipe.decode_batch(recipe.collate(samples), torch.device("cpu"), size, torch.contiguous_format,
                               device_normalize("imagefolder", "cpu"), collections.Counter(), split, files)


def levels(images):
    """Normalised images back to levels of 255, as the files' pixels are."""
    mean, std = (torch.tensor(v).view(3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))
    return images * std + mean


class OneAtATime(torch.utils.data.Dataset):
    """The recipe's samples one at a time: its worker's part (EncodedImages, seeded per sample), then its main
    process's part (decode_batch) on a batch of one."""

    def __init__(self, root, train):
        self.recipe = load_recipe("gpu_decode")
        files = sources(root)[0 if train else 1]
        self.images = self.recipe.EncodedImages(files, SIZE, train, train, seed=0)
        self.items = NameFailingSamples(self.images, "train")
        self.files = files

    def set_epoch(self, epoch):
        self.images.set_epoch(epoch)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        images, labels = decoded(self.recipe, [self.items[index]], SIZE, self.files)
        return images[0], int(labels[0])


@pytest.fixture(scope="module", params=[("cpu:2", BATCH), ("cpu:3", 15)], ids=["cpu:2", "cpu:3"])
def run(request, photos, tmp_path_factory):
    devices, batch = request.param
    world = int(devices.split(":")[1])
    out = tmp_path_factory.mktemp(f"gpu_decode_{world}")
    proc = launch("recipes/gpu_decode.py", devices, *FLAGS, *MODES[devices], "--data-root", photos, "--batch-size",
                  batch, "--out-dir", out, "--tb-dir", out / "tb",
                  env=instrument_env(LOG_SAMPLES_DIR=out / "samples", COUNT_DDP_DIR=out / "ddp"))
    mixed, accum = (Autocast(torch.float16, 1.0), 2) if world == 2 else (Plain(), 1)
    torch.manual_seed(0)
    losses, model = train(build_model("tiny_bn", 10), mixed, OneAtATime(photos, True), world=world, epochs=EPOCHS,
                          batch=batch, lr=LR, accum=accum, fused=True)
    return {"proc": proc, "out": out, "world": world, "batch": batch, "losses": losses, "model": model,
            "mixed": mixed, "accum": accum}


def test_training_and_eval_equal_the_one_process_reference(run, photos):
    proc, world = run["proc"], run["world"]
    result = result_of(proc)
    steps = EPOCHS * (-(-132 // world) // (run["batch"] // world))  # DistributedSampler pads 132 to a multiple
    assert (result["recipe"], result["world_size"], result["steps"]) == ("gpu_decode", world, steps), result
    assert epoch_losses(proc.stdout) == pytest.approx(run["losses"], abs=1e-4), (proc.stdout, run["losses"])
    saved, weights = torch.load(run["out"] / "model.pt", weights_only=True), run["model"].state_dict()
    diffs = {k: (saved[k].float() - weights[k].float()).abs().max().item() for k in saved}
    stats = max(diffs.pop(k) for k in list(diffs) if "running_" in k)
    assert max(diffs.values()) < 1e-6 and stats < 1e-5, (max(diffs.values()), stats)  # channels-last: sums' order
    # Exact evaluation: every validation file once, scored as one process scores the saved model.
    model = build_model("tiny_bn", 10)
    model.load_state_dict(saved)
    loss, acc1, samples = evaluate(model, run["mixed"], OneAtATime(photos, False))  # in the run's precision
    assert samples == result["val_samples"] == 37 and result["val_acc1"] == pytest.approx(acc1, abs=1e-3)
    assert float(re.findall(r"val_loss=([\d.]+)", proc.stdout)[-1]) == pytest.approx(loss, abs=1.5e-4)


def test_each_rank_is_handed_its_own_files_bytes_and_pixels_only_for_what_the_gpu_cannot_decode(run, photos):
    # handed_per_rank: per rank [images, encoded bytes, images decoded by the workers] of its training batches.
    files = sources(photos)[0].samples
    seen = samples_seen(run["out"] / "samples")
    expected = []
    for rank in range(run["world"]):
        took = [i for epoch in range(EPOCHS) for batch in seen[("train", run["world"], rank, epoch)] for i in batch]
        odd = [i for i in took if files[i][0].rsplit("/", 1)[1] in ODD]
        encoded = sum(len(open(files[i][0], "rb").read()) for i in took if i not in odd)
        expected.append([len(took), encoded, len(odd)])
    assert result_of(run["proc"])["handed_per_rank"] == expected
    assert sum(r[2] for r in expected) > 0  # the odd files were among them
    for epoch in range(EPOCHS):  # each epoch the ranks' shards are disjoint; evaluation a strided shard each
        mine = [{i for b in seen[("train", run["world"], r, epoch)] for i in b} for r in range(run["world"])]
        assert sum(map(len, mine)) == len(set().union(*mine)), mine
        assert [sorted(i for b in seen[("eval", run["world"], r, epoch)] for i in b) for r in range(run["world"])] == [
            list(range(r, 37, run["world"])) for r in range(run["world"])]


def test_ddp_reduces_once_a_step_and_evaluation_goes_around_the_wrapper(run):
    # tests/instrument's COUNT_DDP_DIR in each rank: one gradient all-reduce a step (2 micro-batches on 2 ranks: the
    # first under no_sync), none from evaluation through the wrapper, no host read of GradScaler's inf flag (fused SGD).
    steps = result_of(run["proc"])["steps"]
    for count in ddp_counts(run["out"] / "ddp"):
        assert (count["grad_allreduces"], count["eval_forwards"], count["scaler_host_reads"]) == (steps, 0, 0), count
        assert [b > 0 for b in count["allreduce_bytes_per_step"]] == ([False] * (run["accum"] - 1) + [True]) * steps
    # The debugging flags on 3 ranks (the same run: they change none of the numbers checked here).
    debugging_took_effect(run["proc"], run["out"], run["out"] / "ddp", run["world"], MODES[f"cpu:{run['world']}"])
    every = 2 if run["world"] == 3 else 20  # --tb-every (20: the default)
    curves = read_curves(run["out"] / "tb")
    assert [s for s, _ in curves.get("train/loss", [])] == list(range(every, steps + 1, every)), sorted(curves)


@pytest.mark.parametrize("run", [("cpu:2", BATCH)], indirect=True, ids=["cpu:2"])
def test_a_run_resumed_mid_epoch_ends_with_the_uninterrupted_runs_weights(run, photos, tmp_path):
    args = ["recipes/gpu_decode.py", "cpu:2", *FLAGS, *MODES["cpu:2"], "--data-root", photos, "--batch-size", BATCH,
            "--out-dir", tmp_path]
    first = launch(*args, "--max-steps", 10, env=rng_env(tmp_path / "rng_first"))  # 8 steps an epoch: saved at
    assert "saved: checkpoint.pt at step 9 (1 of epoch 2)" in first.stdout, first.stdout  # steps 3 and 9, stopped at 10
    resumed = launch(*args, "--resume", "auto", env=rng_env(tmp_path / "rng_resumed"))
    assert result_of(resumed)["steps"] == 16 and "resumed: " in resumed.stdout
    # No rank's torch generator (dropout's, the workers' seeds) starts an epoch where one started before the stop:
    # the resume reseeds by its step (seed + rank again would replay epoch 0's stream).
    before, after = rng_streams(tmp_path / "rng_first"), rng_streams(tmp_path / "rng_resumed")
    assert sorted(before) == [(2, r, e) for r in (0, 1) for e in (0, 1)] and sorted(after) == [(2, 0, 1), (2, 1, 1)]
    assert not set().union(*before.values()) & set().union(*after.values()), (before, after)
    straight, pieced = (torch.load(f / "model.pt", weights_only=True) for f in (run["out"], tmp_path))
    assert max((straight[k].float() - pieced[k].float()).abs().max().item() for k in straight) == 0
    # The epoch's line too: its loss sums went into the checkpoint and on after the resume.
    assert re.findall(r"^epoch=2/2 .*?val_acc5=\S+", resumed.stdout, re.M) == re.findall(
        r"^epoch=2/2 .*?val_acc5=\S+", run["proc"].stdout, re.M)


def test_a_run_resumed_mid_epoch_on_more_processes_goes_on_where_it_stopped(tmp_path):
    # 127 samples at a global batch of 16: 7 steps an epoch on 1 process, 8 on 2 (DistributedSampler pads each shard
    # to 64). Saved 2 steps into epoch 2 (step 9 of 1 process's count), the resume on 2 is at step 8 + 2 = 10 and
    # skips the epoch's first 2 x 16 samples: the saved step less this run's epoch (9 - 8 = 1) skipped 16 of them
    # and trained 16 twice; saved at an epoch's end (step 7) it was step 7 - 8 = -1 and every rank failed.
    args = ["recipes/gpu_decode.py", "--arch", "tiny", "--synthetic-train", 127, "--synthetic-val", 16, "--image-size",
            SIZE, "--batch-size", 16, "--epochs", 2, "--workers", 0, "--save-every", 3, "--out-dir", tmp_path]
    first = launch(args[0], "cpu:1", *args[1:], "--max-steps", 10, env=instrument_env(LOG_SAMPLES_DIR=tmp_path / "a"))
    assert "saved: checkpoint.pt at step 9 (2 of epoch 2)" in first.stdout, first.stdout + first.stderr
    resumed = launch(args[0], "cpu:2", *args[1:], "--resume", "auto",
                     env=instrument_env(LOG_SAMPLES_DIR=tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"^resumed: \S+ epoch=1 step=10 ", resumed.stdout, re.M), resumed.stdout
    assert result_of(resumed)["steps"] == 16
    before = [i for batch in samples_seen(tmp_path / "a")[("train", 1, 0, 1)][:2] for i in batch]
    after = [i for rank in (0, 1) for batch in samples_seen(tmp_path / "b")[("train", 2, rank, 0)] for i in batch]
    assert len(before) == 32 and len(after) == 6 * 16
    # the epoch's permutation, each sample once, but the one the padding repeats (the permutation's first)
    assert set(before) | set(after) == set(range(127)) and len(set(before) & set(after)) == 1, (before, after)
    # A checkpoint written before in_epoch (its steps into the epoch then read from the step) that this run's epochs
    # cannot place: saved at 1 process's epoch end (step 7), on 2 it would be step -1 of epoch 2. One line, no
    # traceback from islice on every rank.
    old = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del old["in_epoch"]
    (tmp_path / "old").mkdir()
    torch.save({**old, "epoch": 1, "step": 7}, tmp_path / "old" / "checkpoint.pt")
    refused = launch(args[0], "cpu:2", *args[1:-1], tmp_path / "old", "--resume", "auto")
    assert refused.returncode == 2 and error_lines(refused.stderr) == [
        f"error: {tmp_path / 'old' / 'checkpoint.pt'} holds no step count in its epoch that this run's 8 steps an "
        "epoch can place: resume it on the process count that saved it"], refused.stderr


def test_the_box_and_flip_are_torchvisions_drawn_from_each_samples_seed(photos):
    # The recipe's sample k of epoch e, against torchvision's own transforms on the same decoded pixels with the
    # generator seeded as SeededSamples seeds it: the same box and flip, pixels within a rounding.
    recipe = load_recipe("gpu_decode")
    files = sources(photos)[0]
    items = recipe.EncodedImages(files, 64, True, True, seed=0)
    standard = T.Compose([T.RandomResizedCrop(64, scale=(0.08, 1.0)), T.RandomHorizontalFlip()])
    flips = []
    for epoch, index in [(0, 0), (0, 5), (1, 5), (3, 17), (0, 40), (2, 77)]:
        items.set_epoch(epoch)
        sample = items[index]
        flips.append(bool(sample[2]))
        ours, _ = decoded(recipe, [sample], 64, files)
        pixels = T.functional.pil_to_tensor(Image.open(files.samples[index][0]).convert("RGB"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((0 * 1_000_003 + epoch) * 10_000_019 + index) % 2**64)
            theirs = standard(pixels)
        assert (levels(ours[0]) - theirs.float()).abs().max() <= 1.01, (epoch, index)
    assert len(set(flips)) == 2  # both ways among these
    again = items[77]  # the same (epoch, index) draws the same again
    assert torch.equal(again[1], items[77][1])


def test_a_sample_loaded_in_a_thread_while_the_step_draws_is_augmented_the_same(photos):
    # With --workers 0 DataLoaderX's thread loads the samples while the step runs, and dropout draws from torch's
    # generator. Here the sample's source blocks mid-load while this thread draws: the sample's box and flip, and the
    # draws, must be what each gets alone (a sample seeded through torch's generator would hand its seed to the
    # draws, and draw its box from where they left it).
    recipe, files = load_recipe("gpu_decode"), sources(photos)[0]

    class Paused(torch.utils.data.Dataset):  # the files' images, the one asked for handed over when the test says
        def __init__(self):
            self.loading, self.go = threading.Event(), threading.Event()

        def __len__(self):
            return len(files)

        def __getitem__(self, index):
            self.loading.set()
            assert self.go.wait(30)
            return T.functional.to_tensor(Image.open(files.samples[index][0]).convert("RGB")) - 0.5, 0

    alone = recipe.EncodedImages(Paused(), SIZE, True, True, seed=5)
    alone.source.go.set()
    box = [alone[i][1:3] for i in range(8)]
    stream = torch.Generator().manual_seed(1)
    draws, going_on = torch.rand(64, generator=stream), torch.rand(4, generator=stream)
    for i in range(8):
        paused, got = recipe.EncodedImages(Paused(), SIZE, True, True, seed=5), []
        loader = threading.Thread(target=lambda: got.append(paused[i]))  # noqa: B023 (joined in this iteration)
        loader.start()
        assert paused.source.loading.wait(30)
        torch.manual_seed(1)
        mine = torch.rand(64)
        paused.source.go.set()
        loader.join()
        assert torch.equal(mine, draws), i
        assert torch.equal(got[0][1], box[i][0]) and got[0][2] == box[i][1], i
        assert torch.equal(torch.rand(4), going_on), i  # and the step's stream goes on from where it was


def test_validation_is_resize_and_center_crop_as_one_resize(tmp_path):
    # torchvision's Resize(size * 8 / 7) then CenterCrop(size), against the recipe's one resize of the same box: within
    # a level of 255 on average (measured 0.72-0.98 on these 200 x 150 photographs; the box 1 px off: 6.9-14).
    make_set(tmp_path, train=2, val=4, classes=2, size=(200, 150), jobs=1)
    recipe, files = load_recipe("gpu_decode"), sources(tmp_path)[1]
    for index in range(4):
        ours, _ = decoded(recipe, [recipe.EncodedImages(files, 64, False, False)[index]], 64, files, "val")
        pixels = T.functional.pil_to_tensor(Image.open(files.samples[index][0]).convert("RGB"))
        theirs = T.Compose([T.Resize(64 * 8 // 7), T.CenterCrop(64)])(pixels).float()
        assert (levels(ours[0]) - theirs).abs().mean() < 1.5, index  # 0.7-1.0; a box 1 px off: 6.9-14


def test_a_16_bit_png_crosses_as_its_picture_scaled_to_8_bits(tmp_path):
    # PIL's convert("RGB") clips 16-bit pixels at 255 (this ramp: 99.6% white); the worker scales them by 1/256
    make_set(tmp_path, train=2, val=2, classes=2, size=(40, 30), jobs=1)
    ramp = (np.arange(30 * 40).reshape(30, 40) * 54).astype(np.uint16)  # 0 to 64,746
    Image.fromarray(ramp).save(tmp_path / "val" / class_name(1) / "zz_16bit.png")
    recipe, files = load_recipe("gpu_decode"), sources(tmp_path)[1]
    index = [path.endswith("zz_16bit.png") for path, _ in files.samples].index(True)
    payload = recipe.EncodedImages(files, 16, False, False)[index][0]
    assert payload.dtype == torch.uint8 and payload.shape == (3, 30, 40)  # pixels, not the file's bytes
    assert torch.equal(payload, torch.from_numpy((ramp >> 8).astype(np.uint8)).expand(3, -1, -1))


def test_a_file_that_nothing_decodes_stops_the_run_with_one_line_naming_it(tmp_path):
    root = tmp_path / "dirty"
    make_set(root, train=30, val=10, classes=2, size=(40, 30), jobs=1, corrupt=True)
    start = time.monotonic()
    proc = launch("recipes/gpu_decode.py", "cpu:2", "--dataset", "imagefolder", "--data-root", root, "--arch", "tiny",
                  "--workers", "1", "--image-size", SIZE, "--batch-size", 8, "--out-dir", tmp_path / "out",
                  env=instrument_env(LOG_SAMPLES_DIR=tmp_path / "samples"))
    took = time.monotonic() - start
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and all(re.fullmatch(r"(\[rank \d\] )?error: train sample \d+ \(\S+/(corrupt|notimage)_0\.JPEG\) "
                                      r"does not load: \w+: .+", line) for line in lines), lines
    assert took < 60, took
    assert not (tmp_path / "out" / "model.pt").exists()
    # The validation workers were forked before the training loader's (the first indices each rank's loaders took,
    # tests/instrument's LOG_SAMPLES_DIR, were evaluation's): not at the first evaluation, right after the training
    # workers shut down in DataLoaderX's thread, where a fork can deadlock on Python <= 3.11 (CPython gh-112275).
    firsts = [json.loads(f.read_text().splitlines()[0]) for f in sorted((tmp_path / "samples").glob("*.jsonl"))]
    assert sorted((r["rank"], r["kind"]) for r in firsts) == [(0, "eval"), (1, "eval")], firsts


def test_a_jpeg_broken_inside_is_named_by_the_main_process(photos):
    # A file with JPEG's header and end marker but no decodable data gets past the worker's look at it; the batch's
    # decode fails, and the main process decodes each file alone to name the one at fault.
    recipe = load_recipe("gpu_decode")
    files = sources(photos)[0]
    good = recipe.EncodedImages(files, SIZE, False, False)
    broken = torch.frombuffer(bytearray(b"\xff\xd8\xff\xdb\x00\x43" + bytes(80) + b"\xff\xd9"), dtype=torch.uint8)
    samples = [good[0], (broken, *good[7][1:])]
    with pytest.raises(SampleError, match=rf"^train sample 7 \({re.escape(files.samples[7][0])}\) does not decode: "):
        decoded(recipe, samples, SIZE, files)


def test_a_batch_that_fails_to_decode_with_every_file_whole_passes_the_decoders_error_on(photos, monkeypatch):
    # The batch's decode fails while each file decodes alone (nvjpeg out of memory on a GPU; here a double of the
    # decoder, named so): no file to blame, so the decoder's own error goes on, not a made-up one about a file.
    recipe = load_recipe("gpu_decode")
    real = recipe.decode_jpeg

    def decode_jpeg_double(data, **kwargs):
        if isinstance(data, list):
            raise RuntimeError("nvjpeg: out of memory (a test double)")
        return real(data, **kwargs)

    monkeypatch.setattr(recipe, "decode_jpeg", decode_jpeg_double)
    files = sources(photos)[0]
    good = recipe.EncodedImages(files, SIZE, False, False)
    assert all(good[i][0].dim() == 1 for i in (0, 1))  # both handed over as the files' bytes
    with pytest.raises(RuntimeError, match=r"^nvjpeg: out of memory \(a test double\)$"):
        decoded(recipe, [good[0], good[1]], SIZE, files)


def test_a_jpeg_only_the_devices_decoder_refuses_is_decoded_by_the_cpus(photos, monkeypatch):
    # nvjpeg refuses some JPEGs that the CPU's libjpeg-turbo decodes (a chroma subsampling it lacks): the batch's decode
    # fails, each file is decoded alone on the device, and the one refused there on the CPU. The batch trains, each
    # image as the plain decode gives it. A double of the device's decoder (named so) refuses the second file.
    recipe = load_recipe("gpu_decode")
    real, files = recipe.decode_jpeg, sources(photos)[0]
    good = recipe.EncodedImages(files, SIZE, False, False)
    samples = [good[0], good[1], good[2]]
    assert all(s[0].dim() == 1 for s in samples)  # handed over as the files' bytes
    expected = decoded(recipe, samples, SIZE, files)
    calls = []

    def decode_jpeg_double(data, **kwargs):
        which = "batch" if isinstance(data, list) else next(k for k, s in enumerate(samples) if s[0] is data)
        calls.append((which, "device" in kwargs))
        if "device" in kwargs and (isinstance(data, list) or data is samples[1][0]):
            raise RuntimeError("nvjpeg: Unknown chroma subsampling (a test double)")
        return real(data, **kwargs)

    monkeypatch.setattr(recipe, "decode_jpeg", decode_jpeg_double)
    images, labels = decoded(recipe, samples, SIZE, files)
    assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    assert calls == [("batch", True), (0, True), (1, True), (1, False), (2, True)]  # only the refused one on the CPU


def test_cifar100_and_a_bad_save_every_are_refused_in_one_line(capsys):
    recipe = load_recipe("gpu_decode")
    for flags, says in [(["--dataset", "cifar100"], "error: --dataset cifar100 holds pixels, not files"),
                        (["--save-every", "0"], "error: --save-every 0 must be >= 1")]:
        with pytest.raises(SystemExit) as leaving:
            recipe.check_args(recipe.parse_args(flags), 2)
        err = capsys.readouterr().err
        assert leaving.value.code == 2 and err.count("\n") == 1 and err.startswith(says), err
