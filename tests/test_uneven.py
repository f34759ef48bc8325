"""recipes/ddp_uneven.py (issue 27): ranks with different numbers of batches, on real gloo processes.

With Join the run finishes and equals a reference loop that processes every rank's batches: at each step the
ranks that still have a batch contribute their gradient, each divided by the world size (DDP's average, a joined
rank adding zeros), then one SGD step. Without Join (the recipe with its `with Join(...)` removed) the rank that runs
out first leaves the others in an all-reduce until --dist-timeout, and the job ends with the one-line timeout error.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, epoch_losses, launch, load_recipe, result_of
from jobs import error_lines
from torch.utils.data import DataLoader, Subset

from common.data import build_datasets
from common.models import build_model
from common.schedule import warmup_cosine

# tiny: no BatchNorm, whose statistics DDP takes from one rank per forward; --no-flip: the batches alone decide.
TRAIN, SHARD, EPOCHS, LR = 128, 20, 2, 0.1
FLAGS = ["--arch", "tiny", "--workers", "0", "--epochs", EPOCHS, "--lr", LR, "--image-size", 16, "--no-flip",
         "--synthetic-train", TRAIN, "--synthetic-val", 37, "--shard-size", SHARD, "--dist-timeout", 20]


def reference(world, batch):
    """(per-epoch mean loss over every rank's samples, the weights) of the recipe's uneven job, in one process."""
    torch.set_num_threads(1)  # as each recipe process: another thread count sums in another order
    train_set, _, _ = build_datasets("synthetic", image_size=16, synthetic_train=TRAIN, synthetic_val=37, flip=False)
    shard_of = load_recipe("ddp_uneven").shard_of
    loaders = [DataLoader(Subset(train_set, shard_of(len(train_set), SHARD, rank, world)), batch_size=batch // world,
                          shuffle=True, generator=torch.Generator().manual_seed(rank)) for rank in range(world)]
    torch.manual_seed(0)
    model = build_model("tiny", 10, 16)
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
        losses.append(total / count)
    return losses, model.state_dict(), [len(loader) for loader in loaders]


@pytest.mark.parametrize(("devices", "batch"), [("cpu:2", 32), ("cpu:3", 30)])
def test_join_finishes_and_equals_the_reference_over_every_ranks_batches(tmp_path, devices, batch):
    world = int(devices.split(":")[1])
    proc = launch("recipes/ddp_uneven.py", devices, *FLAGS, "--batch-size", batch, "--out-dir", tmp_path)
    losses, weights, counts = reference(world, batch)
    assert len(set(counts)) > 1, counts  # the ranks' batch counts do differ
    assert f"steps_per_epoch={max(counts)} batches_per_rank={counts}" in proc.stdout, proc.stdout
    result = result_of(proc)
    assert (result["world_size"], result["steps"]) == (world, EPOCHS * max(counts)), result
    assert epoch_losses(proc.stdout) == pytest.approx(losses, abs=1e-4)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert max((saved[k] - weights[k]).abs().max().item() for k in saved) < 1e-6
    assert result["val_acc1"] > 30, result  # it learns: 10 classes


def test_without_join_the_rank_left_waiting_ends_the_job_at_the_timeout(tmp_path):
    text = (REPO / "recipes" / "ddp_uneven.py").read_text()
    assert text.count("        with Join([model]):\n") == 1
    (tmp_path / "recipes").mkdir()
    (tmp_path / "common").symlink_to(REPO / "common")
    recipe = tmp_path / "recipes" / "ddp_uneven.py"
    recipe.write_text(text.replace("        with Join([model]):\n", "        if True:\n"))
    proc = launch(recipe, "cpu:2", *FLAGS, "--batch-size", 32, "--dist-timeout", 5, "--out-dir", tmp_path / "out")
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    errors = error_lines(proc.stderr)
    assert errors and all(re.search(r"another rank did not join a collective within --dist-timeout", e)
                          for e in errors), proc.stderr
    assert not (tmp_path / "out" / "model.pt").exists()


def test_a_shard_size_that_leaves_a_rank_no_data_is_one_line(tmp_path):
    proc = launch("recipes/ddp_uneven.py", "cpu:3", *FLAGS, "--shard-size", 64, "--out-dir", tmp_path)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: --shard-size 64 leaves rank 2 no sample of 128: every rank needs a shard; try --shard-size 42"], \
        proc.stderr
