"""The user's own command: the defaults run on any process count, and train well on small real images.

- Every recipe starts and trains on 1, 3 and 5 processes with no flag but the data and the length: the default
  global batch is rounded down to a multiple of the processes (126 on 3, 125 on 5) and said in the setup line. On 3,
  each recipe's documented 0,1,3 command does it (tests/test_documented_commands.py), but fsdp and apex_amp
  here.
- What the defaults choose by image size: the small-image ResNet stem and pad-and-crop below 64 px,
  RandomResizedCrop from 64 px, the flip switch, the learning rate from the global batch, the warm-up's values.
- A recipe at its defaults learns real images (scikit-learn's handwritten digits, as a JPEG ImageFolder and as a
  packed .rec) well above chance in a few epochs. tools/real_data.py is the full 10-epoch table docs/recipes.md quotes.
"""

import math
import re
import subprocess
import sys

import pytest
import torch
import torchvision.transforms as T
from conftest import IMAGE_RECIPES, launch, load_recipe, result_of

from common import harness
from common.data import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD, device_normalize, transforms
from common.models import _parameters_on_meta, build_model
from common.schedule import default_lr, warmup_cosine, warmup_steps
from tools import real_data
from tools.real_data import export


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """scikit-learn's digits (8 px scans) at 12 px: train/ and val/ ImageFolders of JPEGs, and rec/ packed by
    tools/pack_rec.py."""
    folder = tmp_path_factory.mktemp("digits")
    assert export(folder, DIGITS_PX) == (1437, 360)
    return folder


@pytest.fixture(scope="module")
def few_digits(tmp_path_factory):
    """The same, 20 training and 5 validation scans of each digit: enough for a run of two steps."""
    folder = tmp_path_factory.mktemp("few_digits")
    assert export(folder, 16, per_class=20) == (200, 50)
    return folder


DIGITS_PX = 12  # the real-image runs (below): as well trained as at 16 px, for 0.77x the CPU


def data_flags(recipe, digits, size):
    if recipe == "mx_face_prefetch":
        return ["--rec", digits / "rec", "--image-size", str(size)]
    return ["--dataset", "imagefolder", "--data-root", digits, "--image-size", str(size)]


# 3 processes: the other recipes have a documented 0,1,3 command at their default batch, which
# tests/test_documented_commands.py runs on cpu:3 and checks the rounded global batch of. fsdp's say 0,1,2,3, and
# apex_amp's are fp16 (O2) or --impl apex, which a CPU does not run.
# gpu_decode's are one GPU's (its lesson: what feeds one GPU), a 224 px run at 47 core-seconds as a 0,1,3 command.
THREE_HERE = {"fsdp", "apex_amp", "gpu_decode"}
# 5 processes (125 of 128, 25 each): the recipes whose setup is not the flagship's copy (dp splits the batch itself,
# ddp_launch and ddp_spawn start otherwise, torch_amp divides by --accum-steps too, fsdp shards); the flagship's
# siblings share its lines, which the flagship's run and their own 1- and 3-process runs already cover. ddp_compile
# at 5 would compile resnet18 five times at once on 2 cores: 90 s of the suite for lines the flagship runs.
FIVE_HERE = {"dp", "ddp_torchrun", "ddp_launch", "ddp_spawn", "torch_amp", "fsdp"}
# ddp_compile's default run is its documented 0,1,3 command's (resnet18 compiled on 3 ranks, checked there for its
# default batch): on 1 process the same compile again cost 72-92 s of a worker with inductor's cache cold, as on a
# fresh CI machine (issue 66's measurement), for the flagship's lines and DDPOptimizer at a world of 1.
NONE_HERE = {"ddp_compile"}
CASES = [(recipe, n) for recipe in IMAGE_RECIPES
         for n in (*((1,) if recipe not in NONE_HERE else ()), *((3,) if recipe in THREE_HERE else ()),
                   *((5,) if recipe in FIVE_HERE else ()))]
# torch_amp's default on a CPU: bf16 where oneDNN runs it natively, else fp32, and why (tests/test_harness.py checks
# both answers against the CPU's own).
AMP_HERE = harness.cpu_amp_default()


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "processes"), CASES)
def test_every_recipe_runs_at_its_defaults_on_any_process_count(recipe, processes, few_digits, tmp_path):
    """`./launch.sh recipes/X.py cpu:N --max-steps 2` with only the data given: 250 digits at 8 px (resnet18 at
    its defaults otherwise). dp.py is one process whatever N is (DataParallel splits the batch itself)."""
    proc = launch(f"recipes/{recipe}.py", f"cpu:{processes}", *data_flags(recipe, few_digits, 8), "--max-steps", "2",
                  "--out-dir", tmp_path / "out", timeout=600)
    result = result_of(proc)
    world = 1 if recipe == "dp" else processes
    batch = 128 // world * world
    per_epoch = int(re.search(r"steps_per_epoch=(\d+)", proc.stdout).group(1))
    assert result["world_size"] == world and result["steps"] == min(2, per_epoch) >= 1, result  # 1 epoch, the default
    said = "batch=128 (split across the GPUs)" if recipe == "dp" else (
        f"global_batch={batch} ({batch // world} per process x {world}")
    assert said in proc.stdout, proc.stdout
    assert result["val_samples"] == (20 if recipe == "mx_face_prefetch" else 50)  # every sample, once (the face
    # recipe holds out every 10th image of each identity in the .rec)
    assert (tmp_path / "out" / "model.pt").is_file()
    if recipe == "torch_amp":
        said = f"amp: {AMP_HERE} autocast={AMP_HERE == 'bf16'} grad_scaler=False ({harness.cpu_amp_default(why=True)})"
        assert said in proc.stdout.splitlines(), proc.stdout


def test_the_defaults_resolve_by_world_size_and_image_size():
    for recipe in IMAGE_RECIPES:  # the language models' defaults: tests/test_lm.py
        module = load_recipe(recipe)
        for world, (batch, lr) in {1: (128, 0.1), 2: (128, 0.1), 3: (126, 0.0984375), 5: (125, 0.09765625),
                                   8: (128, 0.1)}.items():  # the batch that divides, the lr scaled to it
            args = module.parse_args([])
            parts = 1 if recipe == "dp" else world  # dp.py is one process: DataParallel splits the batch itself
            module.check_args(args, parts)
            expected = (128, 0.1) if recipe == "dp" else (batch, lr)
            assert (args.batch_size, args.lr) == (expected[0], pytest.approx(expected[1])), (recipe, world)
            assert args.warmup_epochs == 1 and not args.no_flip
            if recipe == "apex_amp":  # fp16 runs 10-50x slower than fp32 on a CPU: O0 there, O1 on a GPU
                assert args.opt_level == ("O1" if torch.cuda.is_available() else "O0")
        if recipe != "mx_face_prefetch":
            assert module.parse_args(["--dataset", "imagefolder"]).image_size is None  # resolved by check_args:
            args = module.parse_args(["--dataset", "imagefolder"])
            module.check_args(args, 2)
            assert args.image_size == 224
        given = module.parse_args(["--lr", "0.3", "--batch-size", "64"])
        module.check_args(given, 1 if recipe == "dp" else 2)
        assert (given.lr, given.batch_size) == (0.3, 64)  # a given rate and batch are kept as they are


def test_small_images_get_the_small_image_stem():
    with _parameters_on_meta():  # the layers' shapes, not their values: no memory, no initialization (vgg11: 1.7 s)
        for size, kernel, stride, pooled in [(32, 3, 1, False), (63, 3, 1, False), (64, 7, 2, True),
                                             (224, 7, 2, True)]:
            model = build_model("resnet18", 10, size)
            assert model.conv1.kernel_size == (kernel, kernel) and model.conv1.stride == (stride, stride), size
            assert isinstance(model.maxpool, torch.nn.MaxPool2d) == pooled, size
        small = build_model("resnet50", 10, 32)
        assert small.conv1.out_channels == 64 and isinstance(small.maxpool, torch.nn.Identity)
        assert build_model("vgg11", 10, 32).features[0].kernel_size == (3, 3)  # only the ResNet family is changed
        assert build_model("tiny", 10, 32).features[0].kernel_size == (3, 3)
    # A 32 px image keeps 4 x 4 px at the last block instead of 1 x 1.
    features = torch.nn.Sequential(*list(build_model("resnet18", 10, 32).children())[:-2]).eval()
    assert features(torch.zeros(1, 3, 32, 32)).shape[-2:] == (4, 4)


def test_the_transforms_follow_the_image_size_and_the_flip_switch():
    def kinds(compose):
        return [type(t).__name__ for t in compose.transforms]

    train, val = transforms(32, True)
    assert kinds(train) == ["Resize", "CenterCrop", "RandomCrop", "RandomHorizontalFlip", "PILToTensor"]
    assert train.transforms[2].padding == 4 and kinds(val) == ["Resize", "CenterCrop", "PILToTensor"]
    train, _ = transforms(16, False)
    assert "RandomHorizontalFlip" not in kinds(train) and train.transforms[2].padding == 2
    train, val = transforms(224, True)
    assert kinds(train) == ["RandomResizedCrop", "RandomHorizontalFlip", "PILToTensor"]
    assert kinds(val) == ["Resize", "CenterCrop", "PILToTensor"] and val.transforms[0].size == 256
    image = T.ToPILImage()(torch.rand(3, 20, 28))  # any input size comes out at the size asked for, as uint8
    assert train(image).shape == (3, 224, 224) and train(image).dtype == torch.uint8
    assert transforms(32, True)[0](image).shape == (3, 32, 32)


def test_device_normalize_is_the_workers_old_to_tensor_and_normalize():
    # Issue 65: the workers hand over uint8; the recipes normalise on the device what ToTensor and Normalize made.
    pixels = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    for name, (mean, std) in (("imagefolder", (IMAGENET_MEAN, IMAGENET_STD)), ("cifar100", (CIFAR_MEAN, CIFAR_STD)),
                              ("faces", ([0.5] * 3, [0.5] * 3))):  # mx_face_prefetch's RecordIO: insightface's
        ours = device_normalize(name, torch.device("cpu"))(pixels)
        theirs = T.Normalize(mean, std)(pixels.float() / 255)
        assert ours.dtype == torch.float32 and (ours - theirs).abs().max() < 1e-5, name
    last = pixels.contiguous(memory_format=torch.channels_last)
    assert device_normalize("imagefolder", torch.device("cpu"))(last).is_contiguous(memory_format=torch.channels_last)
    floats = torch.randn(2, 3, 4, 4)  # synthetic images are made as floats: unchanged
    assert device_normalize("synthetic", torch.device("cpu"))(floats) is floats


def test_the_learning_rate_rule_and_the_warm_up():
    assert default_lr(128) == 0.1 and default_lr(32) == 0.025 and default_lr(126) == pytest.approx(0.0984375)
    assert default_lr(32, base=0.02) == 0.005
    assert warmup_steps(10, 45, 1) == 45 and warmup_steps(1, 10, 1) == 3 and warmup_steps(10, 45, 0) == 0
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.4)
    schedule = warmup_cosine(optimizer, 10, 45, 1)
    rates = []
    for _ in range(450):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:3] == pytest.approx([0.4 / 45, 0.8 / 45, 1.2 / 45]) and rates[44] == pytest.approx(0.4)
    last = 0.4 * 0.5 * (1 + math.cos(math.pi * 404 / 405))
    assert rates[45] == pytest.approx(0.4) and rates[-1] == pytest.approx(last)
    assert all(a >= b for a, b in zip(rates[45:], rates[46:], strict=False))  # then only down
    assert rates[45 + 405 // 2] == pytest.approx(0.2, rel=0.01)  # half-way through the cosine: half the rate


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ddp_torchrun", "mx_face_prefetch"])
def test_the_defaults_learn_real_images_well_above_chance(recipe, digits, tmp_path):
    """Real scans at the defaults (resnet18, warm-up, cosine, lr from the batch), 12 px, batch 32, 2 epochs, no flip:
    far above chance (10%), and a first-epoch val_loss that BatchNorm's statistics, recomputed at the epoch's end,
    keep low (measured at 12 px: 96.1% and 0.44 for ddp_torchrun, 93.8% and 0.35 for mx_face_prefetch, 50 and 43
    core-seconds a run; at 16 px: 93.9% and 0.69, 93.8% and 0.32, in 64 and 56; at 8 px, the scans' own size,
    ddp_torchrun reached only 82.2%)."""
    proc = launch(f"recipes/{recipe}.py", "cpu:2", *data_flags(recipe, digits, DIGITS_PX), "--batch-size", "32",
                  "--epochs", "2", "--no-flip", "--out-dir", tmp_path / "out", timeout=900)
    result = result_of(proc)
    losses = [float(v) for v in re.findall(r"^epoch=1/2 .*?val_loss=(\S+)", proc.stdout, re.M)]
    assert result["val_acc1"] >= 90, proc.stdout
    assert losses and losses[0] < 2, proc.stdout


def test_a_resumed_schedule_is_placed_by_this_runs_steps():
    """A resume builds the schedule at start_epoch x this run's steps per epoch, after loading the optimizer: it gives
    the rate a straight run has there, also when the checkpoint came from another world size (other step counts)
    or from before this schedule (a CosineAnnealingLR state is not read at all)."""
    straight_sgd = torch.optim.SGD([torch.zeros(1)], lr=0.4)
    straight = warmup_cosine(straight_sgd, 10, 45, 1)
    for _ in range(90):  # two epochs
        straight_sgd.step()
        straight.step()
    saved = straight_sgd.state_dict()
    resumed_sgd = torch.optim.SGD([torch.zeros(1)], lr=0.4)
    warmup_cosine(resumed_sgd, 10, 45, 1)  # as the recipes build it before the resume block
    resumed_sgd.load_state_dict(saved)
    resumed = warmup_cosine(resumed_sgd, 10, 45, 1, start_step=2 * 45)
    assert resumed_sgd.param_groups[0]["lr"] == straight_sgd.param_groups[0]["lr"]  # bitwise
    for _ in range(100):
        for sgd, schedule in ((straight_sgd, straight), (resumed_sgd, resumed)):
            sgd.step()
            schedule.step()
        assert resumed_sgd.param_groups[0]["lr"] == straight_sgd.param_groups[0]["lr"]


def test_real_data_starts_the_recipes_with_its_own_python_and_keeps_a_table_it_was_not_asked_to_replace(
        tmp_path, monkeypatch, capsys):
    started = []

    def fake_run(argv, **kwargs):  # a test double of the recipe's run: its command and environment, an epoch line
        started.append((argv, kwargs["env"]))
        return subprocess.CompletedProcess(argv, 0, stdout="epoch=1/1 x val_loss=0.5 val_acc1=90.0\n", stderr="")

    monkeypatch.setattr(real_data, "export", lambda folder, size: (8, 2))
    monkeypatch.setattr(real_data.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHON", "python3")  # what launch.sh would start without it: another interpreter's python3
    out = tmp_path / "bench"
    assert real_data.main(["--epochs", "1", "--out", str(out)]) == 0
    assert [argv[1] for argv, _ in started] == [f"recipes/{real_data.RECIPES[n][0]}.py" for n in real_data.RECIPES]
    assert {env["PYTHON"] for _, env in started} == {sys.executable}
    table = (out / "real_data.md").read_text()
    capsys.readouterr()
    # Two recipes into that folder would replace the table of all: refused, unless --update
    for args, message in ((["--recipes", "dp,fsdp", "--epochs", "1"], f"error: {out / 'real_data.json'} holds an "
                           "earlier run's table: --update to rerun only dp, fsdp in it, or --out elsewhere"),
                          (["--size", "4"], "error: --size 4 must be at least 8"),
                          (["--epochs", "0"], "error: --epochs 0 must be at least 1")):
        with pytest.raises(SystemExit) as exit_:
            real_data.main([*args, "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err == f"real_data: {message}\n"
    assert (out / "real_data.md").read_text() == table
    assert real_data.main(["--recipes", "dp,fsdp", "--epochs", "1", "--out", str(out), "--update"]) == 0
    assert (out / "real_data.md").read_text() == table  # the same two rows again, the others kept
