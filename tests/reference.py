"""What a recipe's job should compute, written out as one plain single-process loop: the specification the
conformance suite (tests/test_conformance.py) holds every recipe to.

A DDP job of W ranks, each training on its shard of the global batch, is the same as one process that runs each
rank's shard through the model in turn and averages the gradients, with two details of DDP made explicit:
- the order: DistributedSampler's permutation of epoch e (set_epoch(e)), rank r taking every W-th index;
- BatchNorm: each rank normalises with its own shard's statistics, and the running statistics that count
  are rank 0's (DDP copies rank 0's buffers to the others, so theirs are overwritten and rank 0's never are).
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.utils.data import RandomSampler
from torch.utils.data.distributed import DistributedSampler

from common.models import recomputed_batchnorm
from common.schedule import warmup_cosine


class Plain:
    """fp32: no autocast, no loss scaling."""

    def __init__(self, clip=None):
        self.clip = clip

    def initialize(self, model, optimizer):
        return model, optimizer

    def autocast(self):
        return contextlib.nullcontext()

    def cast_input(self, images):
        return images

    def backward(self, loss, optimizer):
        loss.backward()

    def step(self, optimizer):
        if self.clip:
            torch.nn.utils.clip_grad_norm_(_params(optimizer), self.clip)
        optimizer.step()


class Autocast(Plain):
    """torch.amp as torch_amp.py uses it: autocast to `dtype`, a GradScaler for fp16, unscale before clipping."""

    def __init__(self, dtype, clip=None):
        super().__init__(clip)
        self.dtype = dtype
        self.scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def autocast(self):
        return torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32)

    def backward(self, loss, optimizer):
        self.scaler.scale(loss).backward()

    def step(self, optimizer):
        if self.clip:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(_params(optimizer), self.clip)
        self.scaler.step(optimizer)
        self.scaler.update()


class ApexLevels:
    """apex.amp's opt levels O0-O3 from plain torch, the table in apex_amp.py's docstring, written as an object (the
    recipe writes the same steps inline in its loop, so this checks them: the conformance suite compares the two)."""

    def __init__(self, opt_level, keep_batchnorm_fp32, device):
        self.opt_level, self.device_type = opt_level, device.type
        self.keep_bn_fp32 = opt_level == "O2" or keep_batchnorm_fp32
        self.scaler = torch.amp.GradScaler(device.type, enabled=opt_level in ("O1", "O2"))
        self.scales_loss = self.scaler.is_enabled()
        self.masters = []  # O2: (fp16 model parameter, its fp32 master copy)

    def initialize(self, model, optimizer):
        if self.opt_level in ("O2", "O3"):
            model.half()
            for m in model.modules():
                if self.keep_bn_fp32 and isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    # fp32 statistics; cast its fp16 input up and its output back down.
                    m.float()
                    m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
                    m.register_forward_hook(lambda mod, args, out: out.half())
        if self.opt_level == "O2":  # the optimizer updates fp32 masters; fp16 weights lose small updates
            for group in optimizer.param_groups:
                params = []
                for p in group["params"]:
                    if p.dtype == torch.float16:
                        self.masters.append((p, p.detach().float().requires_grad_()))
                        p = self.masters[-1][1]
                    params.append(p)
                group["params"] = params
        for group in optimizer.param_groups:  # fused SGD and a skipped first step: see recipes/torch_amp.py
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return model, optimizer

    def autocast(self):
        return torch.autocast(self.device_type, dtype=torch.float16, enabled=self.opt_level == "O1")

    def cast_input(self, images):
        return images.half() if self.opt_level in ("O2", "O3") else images

    def backward(self, loss, optimizer):
        self.scaler.scale(loss).backward()  # a no-op scale for O0 and O3

    def step(self, optimizer):
        for p, master in self.masters:  # fp16 gradients (still scaled) -> fp32 master gradients
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.scaler.step(optimizer)  # unscale; skip the step if any gradient is inf/nan
        self.scaler.update()
        with torch.no_grad():
            for p, master in self.masters:
                p.copy_(master)

    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0  # O0, O3: no scaling (apex: 1.0)

    def load_optimizer_state(self, optimizer, state):
        optimizer.load_state_dict(state)  # O2's masters exist from initialize(): the momentum stays fp32
        for group in optimizer.param_groups:  # a plain SGD's checkpoint would switch fused off (GradScaler then fails)
            group.update(fused=True, foreach=None)

    def state_dict(self):
        return self.scaler.state_dict()

    def load_state_dict(self, state):
        self.scaler.load_state_dict(state)
        with torch.no_grad():
            for p, master in self.masters:  # as apex does: masters re-made from the loaded model
                master.copy_(p)


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def shard_orders(dataset, world, epoch, seed, sampler):
    """Each rank's sample order in `epoch`: DistributedSampler's with set_epoch, or (one process) RandomSampler's
    `sampler`, a RandomSampler over `dataset` drawing from its own generator, as recipes/dp.py builds it."""
    if sampler is not None:
        return [list(sampler)]
    orders = []
    for rank in range(world):
        shard = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        shard.set_epoch(epoch)
        orders.append(list(shard))
    return orders


def train(model, mixed, train_set, **kwargs):
    """_train with one CPU thread, as each recipe process has here (OMP_NUM_THREADS = cores / processes), whatever
    an earlier test of the same pytest process set (tools/bench.py's bare loop sets its own): another thread count
    sums in another order, and bf16 or fp16 roundings then drift apart by more than the tolerances."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, mixed, train_set, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _train(model, mixed, train_set, *, world, epochs, batch, lr, accum=1, seed=0, one_process_shuffle=False,
           with_labels=False, warmup_epochs=1, fused=False, rank0_losses=None):
    """Train `model` (built after torch.manual_seed(seed), as the recipes build it) the way a W-rank job would.
    mixed: Plain, Autocast or ApexLevels. fused: SGD(fused=True), as the AMP recipes build it (one kernel;
    in fp16 its updates round apart from the for-each SGD's). Returns (per-epoch mean training loss, model); a list
    passed as rank0_losses gets rank 0's own per-epoch mean (its shard alone: what --tb-dir's train/loss averages)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, fused=fused)
    model, optimizer = mixed.initialize(model, optimizer)
    if fused:  # as torch_amp.py: momentum buffers start at zero (ApexLevels does it in initialize)
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(seed)) if one_process_shuffle else None
    micro = batch // world // accum
    shard = len(train_set) if sampler is not None else math.ceil(len(train_set) / world)  # DistributedSampler pads
    steps_per_epoch = shard // micro // accum
    # The recipes' schedule (common/schedule.py), stepped after every optimizer step as they step it.
    scheduler = warmup_cosine(optimizer, epochs, steps_per_epoch, warmup_epochs)

    def batch(order, start):
        images, labels = zip(*(train_set[i] for i in order[start:start + micro]), strict=True)
        return torch.stack(images), torch.tensor(labels)

    def forward(images, labels):
        return model(mixed.cast_input(images), labels) if with_labels else model(mixed.cast_input(images))

    losses = []
    for epoch in range(epochs):
        model.train()
        if hasattr(train_set, "set_epoch"):  # SeededSamples: each sample's augmentation seeded by its epoch too
            train_set.set_epoch(epoch)
        orders = shard_orders(train_set, world, epoch, seed, sampler)
        steps = min(len(order) // micro for order in orders) // accum
        total, count, total0, count0 = 0.0, 0, 0.0, 0
        for step in range(steps):
            optimizer.zero_grad()
            for rank, order in enumerate(orders):
                kept = {k: v.clone() for k, v in model.named_buffers()}  # rank 0's statistics are the ones kept
                for m in range(accum):
                    images, labels = batch(order, (step * accum + m) * micro)
                    with mixed.autocast():
                        output = forward(images, labels)
                        loss = F.cross_entropy(output.float(), labels)
                    mixed.backward(loss / (accum * world), optimizer)  # DDP averages over ranks; /K per micro-step
                    total, count = total + loss.item() * len(labels), count + len(labels)
                    if rank == 0:
                        total0, count0 = total0 + loss.item() * len(labels), count0 + len(labels)
                if rank:
                    with torch.no_grad():
                        for name, buffer in model.named_buffers():
                            buffer.copy_(kept[name])
            mixed.step(optimizer)
            scheduler.step()
        # The recipes then recompute BatchNorm's statistics from each rank's last 4 (micro-)batches of the epoch,
        # and keep rank 0's.
        with recomputed_batchnorm(model), mixed.autocast():
            for start in [(step * accum + m) * micro for step in range(steps) for m in range(accum)][-4:]:
                forward(*batch(orders[0], start))
        losses.append(total / count)
        if rank0_losses is not None:
            rank0_losses.append(total0 / count0)
    return losses, model


@torch.no_grad()
def evaluate(model, mixed, val_set):
    """(mean loss, top-1 %, samples) over the whole validation set in one process, in the recipe's precision."""
    model.eval()
    total, correct = 0.0, 0
    for start in range(0, len(val_set), 50):
        images, labels = zip(*(val_set[i] for i in range(start, min(start + 50, len(val_set)))), strict=True)
        images, labels = torch.stack(images), torch.tensor(labels)
        with mixed.autocast():
            output = model(mixed.cast_input(images)).float()
        total += F.cross_entropy(output, labels, reduction="sum").item()
        # top-1 as the recipes take it, the first of torch.topk's 5 (common.utils.accuracy): between tied logits
        # (fp16's coarse steps, on a CPU with AVX512-FP16: apex_amp O3) topk and argmax may pick differently
        correct += (output.topk(min(5, output.size(1)), dim=1).indices[:, 0] == labels).sum().item()
    return total / len(val_set), 100.0 * correct / len(val_set), len(val_set)
