"""recipes/ddp_uneven.py (issue 27): ranks with different numbers of batches, on real gloo processes.

With Join the run finishes and equals a reference loop that processes every rank's batches: at each step the ranks
that still have a batch contribute their gradient, each divided by the world size (DDP's average, a joined rank
adding zeros), then one SGD step; BatchNorm's statistics are recomputed at each epoch's end from rank 0's last
batches (the ones the recipe keeps), and evaluation with them is exact. Without Join (the recipe with its `with
Join(...)` removed) the rank that runs out first leaves the others in an all-reduce until --dist-timeout, and the
job ends with the one-line timeout error.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEBUGGING,
    ddp_counts,
    debugging_took_effect,
    epoch_losses,
    instrument_env,
    launch,
    load_recipe,
    recipe_with_one_line_edited,
    result_of,
    rng_env,
    samples_seen,
)
from jobs import error_lines
from reference import Plain, evaluate
from torch.utils.data import DataLoader, Subset

from common.data import build_datasets
from common.models import build_model, recomputed_batchnorm
from common.schedule import warmup_cosine

# tiny_bn: BatchNorm (train mode uses each batch's statistics, so only the recompute decides the saved ones);
# --no-flip: the batches alone decide.
TRAIN, SHARD, EPOCHS, LR = 128, 20, 2, 0.1
FLAGS = ["--arch", "tiny_bn", "--workers", "0", "--epochs", EPOCHS, "--lr", LR, "--image-size", 16, "--no-flip",
         "--synthetic-train", TRAIN, "--synthetic-val", 37, "--shard-size", SHARD, "--dist-timeout", 20]


@pytest.fixture
def one_thread():
    """One torch thread for the test, as each recipe process has (another thread count sums in another order); the
    pytest process's own count put back after it, so that later tests of this worker do not depend on the order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(world, batch):
    """(per-epoch mean loss over every rank's samples, the model, each rank's batch count) of the recipe's uneven
    job, in one process: under one_thread."""
    assert torch.get_num_threads() == 1, "reference() runs under the one_thread fixture"
    train_set, _ = datasets()
    shard_of = load_recipe("ddp_uneven").shard_of
    loaders = [DataLoader(Subset(train_set, shard_of(len(train_set), SHARD, rank, world)), batch_size=batch // world,
                          shuffle=True, generator=torch.Generator().manual_seed(rank)) for rank in range(world)]
    torch.manual_seed(0)
    model = build_model("tiny_bn", 10, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    steps = max(len(loader) for loader in loaders)
    scheduler = warmup_cosine(optimizer, EPOCHS, steps, 1)
    losses = []
    for _ in range(EPOCHS):
        batches = [list(loader) for loader in loaders]
        total, count = 0.0, 0
        for step in range(steps):
            optimizer.zero_grad()
            for mine in batches:
                if step < len(mine):  # a rank out of batches adds zeros, and the sum is still divided by world
                    images, labels = mine[step]
                    loss = F.cross_entropy(model(images), labels)
                    (loss / world).backward()
                    total, count = total + loss.item() * len(labels), count + len(labels)
            optimizer.step()
            scheduler.step()
        with recomputed_batchnorm(model):  # rank 0's last (up to) 4 batches, through the final weights
            for images, _ in batches[0][-4:]:
                model(images)
        losses.append(total / count)
    return losses, model, [len(loader) for loader in loaders]


def datasets():
    train_set, val_set, _ = build_datasets("synthetic", image_size=16, synthetic_train=TRAIN, synthetic_val=37,
                                           flip=False)
    return train_set, val_set


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "batch"), [("cpu:2", 32), ("cpu:3", 30)])
def test_join_finishes_and_equals_the_reference_over_every_ranks_batches(tmp_path, devices, batch, one_thread):
    world = int(devices.split(":")[1])
    counted = tmp_path / "counts"
    counted.mkdir()
    debugging = DEBUGGING if world == 3 else ()  # conftest's debugging flags: the same numbers, and their effect
    proc = launch("recipes/ddp_uneven.py", devices, *FLAGS, "--batch-size", batch, *debugging, "--out-dir", tmp_path,
                  env=rng_env(tmp_path / "rng", instrument_env(COUNT_DDP_DIR=counted,
                                                               LOG_SAMPLES_DIR=tmp_path / "samples")))
    losses, model, counts = reference(world, batch)
    # tests/instrument counts DDP's forwards with autograd off: evaluation goes around the wrapper (model.module).
    assert [count["eval_forwards"] for count in ddp_counts(counted)] == [0] * world
    # forward_sync_buffers=False: no buffer broadcast before a forward, and so under Join no per-step agreement on the
    # rank to copy from (a blocking all-reduce and a host read); one agreement per epoch remains, Join's choice of
    # the rank whose final weights every rank takes.
    assert [(c["buffer_syncs"], c["common_rank_agreements"]) for c in ddp_counts(counted)] == [(0, EPOCHS)] * world
    assert len(set(counts)) > 1, counts  # the ranks' batch counts do differ
    # What each rank computed (tests/instrument's LOG_SAMPLES_DIR, in its own process): every epoch, exactly the
    # samples of its own files (consecutive runs of --shard-size, dealt out in turn), each once, its last batch short;
    # together every sample once. Evaluation: strided shards, together the whole set once.
    seen = samples_seen(tmp_path / "samples")
    files = [range(start, min(start + SHARD, TRAIN)) for start in range(0, TRAIN, SHARD)]
    for epoch in range(EPOCHS):
        for rank in range(world):
            batches = seen[("train", world, rank, epoch)]
            own = [i for k, file in enumerate(files) if k % world == rank for i in file]
            assert sorted(i for batch in batches for i in batch) == own, (epoch, rank, batches)
            assert [len(batch) for batch in batches][:-1] == [batch // world] * (len(batches) - 1), batches
            assert len(batches) == counts[rank], (counts, batches)
        shards = [sorted(i for batch in seen[("eval", world, rank, epoch)] for i in batch) for rank in range(world)]
        assert shards == [list(range(rank, 37, world)) for rank in range(world)], shards
    assert f"steps_per_epoch={max(counts)} batches_per_rank={counts}" in proc.stdout, proc.stdout
    result = result_of(proc)
    assert (result["world_size"], result["steps"]) == (world, EPOCHS * max(counts)), result
    # its images/s counts what every rank trained after the first step (each rank's first batch full): rank 0's count
    # of global batches over-counted the steps that some ranks sit out and the short last batches
    assert result["timed_images"] == EPOCHS * TRAIN - batch, result
    assert epoch_losses(proc.stdout) == pytest.approx(losses, abs=1e-4)
    saved, weights = torch.load(tmp_path / "model.pt", weights_only=True), model.state_dict()
    assert max((saved[k].float() - weights[k].float()).abs().max().item() for k in saved) < 1e-6
    assert result["val_acc1"] > 30, result  # it learns: 10 classes
    # Evaluation is exact: every rank scored with rank 0's recomputed statistics, the ones model.pt holds.
    model.load_state_dict(saved)
    loss, acc1, samples = evaluate(model, Plain(), datasets()[1])
    assert (result["val_samples"], result["val_acc1"]) == (samples, pytest.approx(acc1, abs=1e-3))
    assert float(re.findall(r"val_loss=([\d.]+)", proc.stdout)[-1]) == pytest.approx(loss, abs=1.5e-4)
    debugging_took_effect(proc, tmp_path, counted, world, debugging)


@pytest.mark.slow
def test_without_join_the_rank_left_waiting_ends_the_job_at_the_timeout(tmp_path):
    recipe = recipe_with_one_line_edited(tmp_path, "ddp_uneven", "        with Join([model]):\n", "        if True:\n")
    proc = launch(recipe, "cpu:2", *FLAGS, "--batch-size", 32, "--dist-timeout", 5, "--out-dir", tmp_path / "out")
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    # The short rank went on to the epoch's end and its next collective; the long rank waited in its gradient
    # all-reduce: one of them times out, and the other then loses the connection to it.
    errors = error_lines(proc.stderr)
    assert any("another rank did not join a collective within --dist-timeout" in e for e in errors), proc.stderr
    assert all(re.search(r"another rank did not join a collective within --dist-timeout|lost the connection to "
                         r"another rank", e) for e in errors) and len(errors) <= 2, proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()


def test_a_shard_size_that_leaves_a_rank_no_data_or_a_batch_of_one_is_one_line(tmp_path):
    proc = launch("recipes/ddp_uneven.py", "cpu:3", *FLAGS, "--shard-size", 64, "--out-dir", tmp_path)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: --shard-size 64 leaves rank 2 no sample of 128: every rank needs a shard; try --shard-size 42"], \
        proc.stderr
    # fewer samples than ranks: no --shard-size helps (the hint above would say 0, or 1 again)
    few = launch("recipes/ddp_uneven.py", "cpu:3", *FLAGS, "--synthetic-train", 2, "--out-dir", tmp_path)
    assert few.returncode == 2 and error_lines(few.stderr) == [
        "error: 2 training samples cannot give each of 3 ranks one"], few.stderr
    # 125 samples in files of 20 on 2 ranks: rank 0 holds 65, 4 batches of 16 and one of 1, which BatchNorm cannot
    # train on where its map is 1 x 1 (mobilenet_v2 at 32 px: a ValueError's traceback on one rank): refused up front
    one = launch("recipes/ddp_uneven.py", "cpu:2", *FLAGS, "--synthetic-train", 125, "--batch-size", 32,
                 "--out-dir", tmp_path)
    assert one.returncode == 2 and error_lines(one.stderr) == [
        "error: rank 0's last batch would hold 1 sample (16 a process): BatchNorm's statistics of one (an error where "
        "its map is 1 x 1); change --batch-size or --shard-size"], one.stderr
    assert "step=" not in one.stdout
