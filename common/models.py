"""Model builders: torchvision classifiers by name, plus tiny CNNs for fast CPU runs and tests."""

import contextlib
import difflib
import functools
import re
import warnings

import torch
import torch.nn as nn


class TinyCNN(nn.Module):
    """Two conv layers and no BatchNorm: fast on CPU, and its result does not depend on world size.

    batchnorm=True ("tiny_bn") adds BatchNorm, for the mixed-precision recipes that treat it specially.
    unused_branch=True adds a head that forward() never calls. Its parameters get no gradient, which
    DDP rejects unless find_unused_parameters=True (the DDP error write-up 000 hit).
    """

    def __init__(self, num_classes, unused_branch=False, batchnorm=False):
        super().__init__()
        def norm(channels):
            return [nn.BatchNorm2d(channels)] if batchnorm else []  # no placeholder: tiny keeps its keys

        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), *norm(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), *norm(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(32, num_classes)
        self.aux_head = nn.Linear(32, num_classes) if unused_branch else None

    def forward(self, x):
        return self.fc(self.features(x))


TINY = {"tiny": {}, "tiny_unused": {"unused_branch": True}, "tiny_bn": {"batchnorm": True}}


def arch_names():
    import torchvision  # only for its models: importing it costs each process over a second

    return sorted(TINY) + sorted(torchvision.models.list_models(module=torchvision.models))


def check_arch(arch):
    """Raise ValueError naming the closest known architectures when `arch` is unknown."""
    if arch in TINY:  # no need to import torchvision to know these
        return
    names = arch_names()
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3) or ["tiny", "resnet18", "resnet50"]
        raise ValueError(f"unknown --arch {arch!r}; did you mean {', '.join(close)}?")


SMALL_IMAGES = 64  # below this side (px): the small-image ResNet stem, and pad-and-crop (common.data.transforms)
# googlenet, inception_v3: no auxiliary logits (a namedtuple in training, which the loss refuses), and their init said.
BUILD_KWARGS = {"googlenet": {"aux_logits": False, "init_weights": True},
                "inception_v3": {"aux_logits": False, "init_weights": True}}


def build_model(arch, num_classes, image_size=None):
    """A torchvision classifier by name (random weights), or a tiny CNN. image_size below 64 px: the ResNet family
    gets the CIFAR stem, a 3x3 stride-1 convolution and no max-pool. ImageNet's stem (a 7x7 stride-2 convolution,
    then a stride-2 max-pool) cuts a 32 px image to 8 px before the first block, and the last block works on 1 px.
    The same threshold picks the transforms (common.data.transforms)."""
    check_arch(arch)
    if arch in TINY:
        return TinyCNN(num_classes, **TINY[arch])
    import torchvision

    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **BUILD_KWARGS.get(arch, {}))
    if image_size is not None and image_size < SMALL_IMAGES and isinstance(model, torchvision.models.ResNet):
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits
        model.maxpool = nn.Identity()
    return model


def any_image_size(arch):
    """True for the archs check_image_size() passes without a look: the tiny CNNs and torchvision's ResNet family
    (resnet*, resnext*, wide_resnet*). Their convolutions pad (a side of n px leaves ceil(n / stride)), and an
    adaptive pool ends them: any side from 1 px works with build_model's small-image stem, and 64 px and more (2 px
    at the last block) with ImageNet's."""
    if arch in TINY:
        return True
    import torchvision

    return torchvision.models.get_model_builder(arch).__module__ == "torchvision.models.resnet"


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, each parameter and buffer a module registers moves to the meta device: a model of shapes, without
    memory or initialization (vit_h_14 would hold 2.5 GB). Not `with torch.device("meta")`: that also puts the
    tensors a builder computes with there, and regnet's builder reads its block widths back (.tolist())."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter_on_meta(self, name, param):
        if type(param) is nn.Parameter and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(self, name, param)

    def buffer_on_meta(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter_on_meta, buffer_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


@functools.lru_cache(maxsize=8)
def _meta_model(arch, small):
    with _parameters_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # googlenet's and inception_v3's FutureWarning: the line must stay one line
        return build_model(arch, 10, 1 if small else SMALL_IMAGES).eval()


def _size_error(arch, size):
    """The error torchvision's `arch` raises for a batch of size x size px images, on the meta device (shapes only:
    milliseconds to a few tenths of a second), or None when it takes them or the meta device cannot tell."""
    try:
        model = _meta_model(arch, size < SMALL_IMAGES)
        with torch.no_grad():  # eval mode: train mode's batch norm runs in Python on meta, 3x slower; same shapes
            model(torch.empty(2, 3, size, size, device="meta"))
    except (AssertionError, RuntimeError, ValueError) as exc:  # ViT asserts, convolutions and pools raise these; so
        return exc  # does an op without a meta kernel (NotImplementedError) at every size: image_size_needed lets it by
    except Exception:  # anything else (a builder that needs real tensors: a TypeError, say): the real run will tell
        return None
    return None


# The sizes tried for a suggestion: first any size torchvision's error names, then 2x and 4x the run's and these
# above it, then these below it (nearest first).
SIZES_TO_TRY = (64, 128, 224, 256, 299, 384, 512, 1024)


@functools.cache
def image_size_needed(arch, size):
    """None when `arch` takes size x size px images; else (n, at_least): --image-size n works. at_least: 2n works
    too, so n is a minimum, the smallest size above the run's that works (binary search: alexnet 63, inception_v3
    75); else a fixed size (the ViTs 224; maxvit_t 224, which also takes 221-223). Found by forward passes on the
    meta device, each size tried, none assumed; also None when no size tried works there (an arch the meta device
    cannot run: the real run says what is wrong). Cached: every recipe's check_args in one process costs one search."""
    if any_image_size(arch):
        return None
    error = _size_error(arch, size)
    if error is None:
        return None
    named = [int(n) for n in re.findall(r"[Ee]xpected (\d+)", str(error))]  # ViT: "Expected 224 but got 32"
    ladder = sorted({n for n in (2 * size, 4 * size, *SIZES_TO_TRY) if n > size})
    failed = {size}
    for n in dict.fromkeys(named + ladder + sorted((n for n in SIZES_TO_TRY if n < size), reverse=True)):
        if n != size and _size_error(arch, n) is None:
            break
        failed.add(n)
    else:
        return None
    at_least = n > size and _size_error(arch, 2 * n) is None  # 2n too: a minimum, not a fixed size
    if at_least:  # the smallest, between the largest size that failed below n and n (each size tried, not assumed)
        low = max(f for f in failed if f < n)
        while n - low > 1:
            middle = (low + n) // 2
            low, n = (middle, n) if _size_error(arch, middle) is not None else (low, middle)
    return n, at_least


def check_image_size(arch, image_size, default_for=None):
    """Raise ValueError when torchvision's `arch` cannot take image_size x image_size px images, naming the
    --image-size it takes. default_for: the --dataset whose default image_size is (the message says so)."""
    needed = image_size_needed(arch, image_size)
    if needed is None:
        return
    n, at_least = needed
    which = f"images of at least {n} px" if at_least else f"{n} px images"
    whence = f" (the default for --dataset {default_for})" if default_for else ""
    raise ValueError(f"--arch {arch} needs {which}, not {image_size} px{whence}: "
                     f"{'add' if default_for else 'use'} --image-size {n}{' or more' if at_least else ''}")


def unused_parameters_error(exc, module):
    """One line for DDP's unused-parameter RuntimeError (naming the parameters), or None for other errors."""
    text = str(exc)
    if "find_unused_parameters" not in text:
        return None
    names = [name for name, p in module.named_parameters() if p.requires_grad]  # DDP counts only these
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    indices = [int(i) for i in found.group(1).split()] if found else []
    which = ", ".join(names[i] for i in indices if i < len(names)) or "some parameters"
    return (f"{which} got no gradient (the forward pass skipped them), which DDP rejects by default; "
            "rerun with --find-unused-parameters, or remove the unused layers")


@contextlib.contextmanager
def recomputed_batchnorm(model):
    """Inside, BatchNorm layers forget their running statistics and take the plain mean of those of the batches run
    through `model`, in train mode, without gradients. After, they keep those statistics, and their momentum and the
    model's mode are as before; if no batch ran, the old statistics are put back.

    Why: with momentum 0.1 the running statistics trail the weights (each keeps 0.9^k of the batch k steps ago, and
    at first of the initial 0 and 1); after a short or fast-moving epoch they no longer fit, and eval, which uses
    them, scores a model that never existed (resnet18, one default epoch on synthetic data: val_loss 132 with the
    trailing statistics, 0.68 with recomputed ones). Local: no collective, unless the forward has one (FSDP's
    all-gathers, SyncBatchNorm's: there every rank must run the same number of batches).

    The plain mean: the k-th batch gets momentum 1/k, set before each forward. torch's momentum=None does the same
    sum, but apex's python SyncBatchNorm multiplies by the momentum and fails on None."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, {k: v.clone() for k, v in m.named_buffers(recurse=False)}) for m in norms]
    training = model.training
    seen = dict.fromkeys(norms, 0)

    def plain_mean(module, _inputs):
        seen[module] += 1
        module.momentum = 1.0 / seen[module]

    hooks = [m.register_forward_pre_hook(plain_mean) for m in norms]
    for m in norms:
        m.reset_running_stats()
    model.train()
    try:
        with torch.no_grad():
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for m, (momentum, buffers) in zip(norms, saved, strict=True):
            m.momentum = momentum
            if seen[m] == 0:  # no batch ran: keep what it had
                with torch.no_grad():
                    for name, value in buffers.items():
                        getattr(m, name).copy_(value)
        model.train(training)
