"""Model builders: torchvision classifiers by name, plus tiny CNNs for fast CPU runs and tests."""

import contextlib
import difflib
import re

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


def build_model(arch, num_classes, image_size=None):
    """A torchvision classifier by name (random weights), or a tiny CNN. image_size below 64 px: the ResNet family
    gets the CIFAR stem, a 3x3 stride-1 convolution and no max-pool. ImageNet's stem (a 7x7 stride-2 convolution,
    then a stride-2 max-pool) cuts a 32 px image to 8 px before the first block, and the last block works on 1 px.
    The same threshold picks the transforms (common.data.transforms)."""
    check_arch(arch)
    if arch in TINY:
        return TinyCNN(num_classes, **TINY[arch])
    import torchvision

    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if image_size is not None and image_size < SMALL_IMAGES and isinstance(model, torchvision.models.ResNet):
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits
        model.maxpool = nn.Identity()
    return model


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
