"""--arch against the run's image size: every torchvision classifier either takes the default 32 px or is refused at
start-up with one line naming an --image-size that it takes (ViTs need 224), checked on the meta device (shapes
only: no weights, no data), and the same line through the real launcher instead of a traceback per rank."""

import re
import time
import warnings

import pytest
import torch
import torchvision
from conftest import IMAGE_RECIPES, launch, load_recipe
from jobs import error_lines

from common import models
from common.models import build_model, check_image_size

CLASSIFIERS = sorted(torchvision.models.list_models(module=torchvision.models))
# What torchvision 0.29 needs (image_size_needed: the --image-size, and whether larger ones work too); README.md's
# --arch row names them. Every other classifier takes 32 px.
NEEDED = {"alexnet": (63, True), "inception_v3": (75, True), "maxvit_t": (224, False), "vit_b_16": (224, False),
          "vit_b_32": (224, False), "vit_h_14": (224, False), "vit_l_16": (224, False), "vit_l_32": (224, False)}
# The quick tier: one of each kind of refusal, googlenet (built without its auxiliary heads), regnet (its builder
# computes with tensors) and a few of the rest; all 80 classifiers and the launch: -m slow (the file: 73 s on 2 cores).
QUICK = {"alexnet", "inception_v3", "maxvit_t", "vit_b_16", "googlenet", "regnet_x_400mf",
         "efficientnet_b0", "mobilenet_v3_small", "swin_t", "squeezenet1_1", "resnet18"}
REFUSED = re.compile(r"--arch (\w+) needs (images of at least (\d+) px|(\d+) px images), not 32 px "
                     r"\(the default for --dataset synthetic\): add --image-size (\d+)( or more)?")


def meta_forward_fails(arch, size):
    """A training-mode forward of a batch of 2 at size x size px on the meta device (check_image_size runs eval mode:
    this also shows that training takes the same sizes): the exception, or None when it returns (2, 10) logits."""
    with models._parameters_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # googlenet's and inception_v3's FutureWarning about their init
        model = build_model(arch, 10, size).train()
    try:
        out = model(torch.empty(2, 3, size, size, device="meta"))
    except (AssertionError, RuntimeError, ValueError) as exc:
        return exc
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10), (arch, type(out))  # no auxiliary logits
    return None


def tiered(archs):
    return [a if a in QUICK else pytest.param(a, marks=pytest.mark.slow) for a in archs]


@pytest.mark.parametrize("arch", tiered(CLASSIFIERS))
def test_every_torchvision_classifier_takes_32_px_or_is_refused_naming_a_size_it_takes(arch):
    assert models.image_size_needed(arch, 32) == NEEDED.get(arch)
    try:
        check_image_size(arch, 32, "synthetic")
    except ValueError as exc:
        said = REFUSED.fullmatch(str(exc))
        assert said and said.group(1) == arch, str(exc)
        size, at_least = int(said.group(5)), bool(said.group(6))
        assert int(said.group(3) or said.group(4)) == size and bool(said.group(3)) == at_least, str(exc)
        assert meta_forward_fails(arch, 32) is not None  # refused for a reason
        assert meta_forward_fails(arch, size) is None, f"{exc}, but {size} px fails too"
        if at_least:  # the smallest: one pixel less fails, twice as many works
            assert meta_forward_fails(arch, size - 1) is not None and meta_forward_fails(arch, 2 * size) is None
    else:
        assert meta_forward_fails(arch, 32) is None, f"{arch} was let through at 32 px"


@pytest.mark.parametrize("arch", tiered(a for a in CLASSIFIERS if models.any_image_size(a)))
def test_the_resnets_check_image_size_skips_take_the_smallest_size_of_each_stem(arch):
    # 1 px with build_model's small-image stem (below 64 px), 64 px with ImageNet's; larger sides only shrink less.
    assert meta_forward_fails(arch, 1) is None and meta_forward_fails(arch, 64) is None


def test_a_size_too_large_or_given_by_hand_is_refused_too():
    with pytest.raises(ValueError) as vit:
        check_image_size("vit_b_16", 256)  # above the one size it takes: the one torchvision's error names
    assert str(vit.value) == "--arch vit_b_16 needs 224 px images, not 256 px: use --image-size 224"
    with pytest.raises(ValueError) as small:
        check_image_size("vgg11", 16)
    assert str(small.value) == "--arch vgg11 needs images of at least 32 px, not 16 px: use --image-size 32 or more"
    check_image_size("vit_b_16", 224)
    check_image_size("tiny", 1)


@pytest.mark.parametrize("recipe", IMAGE_RECIPES)
def test_every_recipe_refuses_an_arch_that_cannot_take_its_default_size_in_check_args(recipe, capsys):
    module = load_recipe(recipe)
    with pytest.raises(SystemExit) as leaving:
        module.check_args(module.parse_args(["--arch", "vit_b_16"]), 1)
    default = "112 px: use" if recipe == "mx_face_prefetch" else "32 px (the default for --dataset synthetic): add"
    assert leaving.value.code == 2 and capsys.readouterr().err == (
        f"error: --arch vit_b_16 needs 224 px images, not {default} --image-size 224\n")
    module.check_args(module.parse_args(["--arch", "vit_b_16", "--image-size", "224"]), 1)  # the size it names


@pytest.mark.slow  # a real 2-process job: most of its 10-20 s is each rank importing torch and torchvision
def test_launch_of_a_vit_at_the_default_size_says_one_line_and_exits_2():
    start = time.monotonic()
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", "--dataset", "synthetic", "--arch", "vit_b_16", timeout=120)
    print(f"vit_b_16 at 32 px: exit {proc.returncode} after {time.monotonic() - start:.1f} s")
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: --arch vit_b_16 needs 224 px images, not 32 px (the default for "
                                        "--dataset synthetic): add --image-size 224"], proc.stderr
    assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr and "setup:" not in proc.stdout


def test_an_arch_the_meta_device_cannot_run_is_let_through_for_the_real_run_to_judge(monkeypatch):
    # An op without a meta kernel (a future torchvision's, say) must not refuse a run that may well work: let through.
    def cannot(arch, small):
        raise NotImplementedError("no meta kernel")

    monkeypatch.setattr(models, "_meta_model", cannot)
    models.image_size_needed.cache_clear()
    try:
        assert models.image_size_needed("vit_b_16", 32) is None  # NotImplementedError fails every size: let through
        check_image_size("vit_b_16", 32, "synthetic")  # no error: the real run says what is wrong
    finally:
        models.image_size_needed.cache_clear()

    def needs_real_tensors(arch, small):  # not a size error at all: no size is judged
        raise TypeError("expected a real tensor")

    monkeypatch.setattr(models, "_meta_model", needs_real_tensors)
    assert models._size_error("vit_b_16", 32) is None


def test_an_arch_that_fails_at_every_size_tried_is_let_through_too(monkeypatch):
    # No size to suggest: refusing with a size that does not work either would send the user round in circles.
    monkeypatch.setattr(models, "_size_error", lambda arch, size: AssertionError(f"Wrong image height {size}"))
    models.image_size_needed.cache_clear()
    try:
        assert models.image_size_needed("alexnet", 32) is None
    finally:
        models.image_size_needed.cache_clear()
