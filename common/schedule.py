"""The learning-rate rule and schedule every recipe uses: the rate scales with the global batch, a linear warm-up,
then a cosine decay, stepped after every optimizer step.

    args.lr = args.lr or default_lr(args.batch_size)    # 0.1 at a global batch of 128, 0.025 at 32
    scheduler = warmup_cosine(optimizer, args.epochs, steps_per_epoch, args.warmup_epochs)
    ...  # after each optimizer.step():
    scheduler.step()
"""

import math

import torch

BASE_LR, BASE_BATCH = 0.1, 128  # SGD with momentum 0.9: ResNet's rate for a batch of 128 (He et al.)


def default_lr(global_batch, base=BASE_LR):
    """`base` at a global batch of 128, in proportion to other batches: the linear scaling rule (Goyal et al.,
    2017). k times the batch averages the gradient over k times the samples, so one step k times as long goes
    about as far as k steps did."""
    return base * global_batch / BASE_BATCH


def warmup_steps(epochs, steps_per_epoch, warmup_epochs):
    """Optimizer steps of linear warm-up: --warmup-epochs worth, at most a third of the run (a one-epoch run warms
    up for a third of its steps, not all of them)."""
    return min(round(warmup_epochs * steps_per_epoch), epochs * steps_per_epoch // 3)


def warmup_cosine(optimizer, epochs, steps_per_epoch, warmup_epochs, start_step=0):
    """LambdaLR over optimizer steps: (s + 1) / W for the first W steps, then cosine from the full rate to 0 at the
    end of the last epoch. Why a warm-up: at step 0 the weights are random and BatchNorm's statistics are those of
    the initial network; the full rate at once throws the weights far before the statistics catch up (a first
    epoch whose val_loss is in the thousands). start_step: a resumed run's place, start_epoch x THIS run's steps per
    epoch (a checkpoint from another world size or batch counted other steps), built after the optimizer's state is
    loaded (whose groups keep the rate the schedule scales, as `initial_lr`)."""
    total, warmup = epochs * steps_per_epoch, warmup_steps(epochs, steps_per_epoch, warmup_epochs)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    for group in optimizer.param_groups:  # LambdaLR starts past step 0 only from an initial_lr
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)
