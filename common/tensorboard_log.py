"""TensorBoard curves for the recipes (--tb-dir): the same tags in every recipe, written by rank 0 alone.

    tb = TensorBoard(args.tb_dir, args.tb_every, is_main, device, flags=vars(args), start_step=step)
    ...  # after each optimizer step, with the epoch's meters:
    tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"])
    ...  # after each epoch's line:
    tb.epoch(step, train_loss=..., val_acc1=..., ...)

Tags (x axis: the optimizer step, which a resumed run continues):
  train/loss, train/acc1      mean over the last --tb-every steps, over every rank's samples
  train/lr, train/loss_scale  the learning rate; the AMP recipes' loss scale (fp16)
  epoch/...                   each epoch's printed numbers: train_loss, train_acc1, val_loss, val_acc1, val_acc5,
                              images_per_sec; and peak_mem_mb, the largest over the ranks
  text "flags"                the run's flags

A resumed run (--resume) opens a new event file with purge_step just after its checkpoint's step, so the points
an interrupted run wrote after that checkpoint are dropped and the curves go on without repeats or gaps.
Without --tb-dir every method is a no-op: no collective, no import of tensorboard.
"""

import torch
import torch.distributed as dist

from common.outputs import check_out_dir
from common.utils import peak_memory_mb


class TensorBoard:
    def __init__(self, tb_dir, every, is_main, device, flags, start_step=0):
        self.on, self.every, self.device, self.writer = tb_dir is not None, every, device, None
        self._meters, self._last = None, (0.0, 0.0, 0)
        if not self.on:
            return
        # An unwritable --tb-dir fails now, like --out-dir; every rank takes part (the check is a collective).
        check_out_dir(tb_dir, is_main, {"events.out.tfevents": 2**20}, flag="--tb-dir")
        if is_main:
            from torch.utils.tensorboard import SummaryWriter  # only with --tb-dir: it costs a second to import

            self.writer = SummaryWriter(tb_dir, purge_step=start_step + 1 if start_step else None)
            self.writer.add_text("flags", "\n".join(f"    --{k.replace('_', '-')} {v}" for k, v in flags.items()),
                                 start_step)

    def step(self, step, loss_meter, acc_meter, lr, loss_scale=None):
        """After each optimizer step, on every rank. Every `every` steps it all-reduces the meters' growth since
        the last log (a collective) and rank 0 writes it. loss_scale: a function, read only then (a GPU sync)."""
        if not self.on or step % self.every:
            return
        if self._meters is not loss_meter:  # a new epoch's meters: they count from zero
            self._meters, self._last = loss_meter, (0.0, 0.0, 0)
        now = (loss_meter.sum, acc_meter.sum, loss_meter.count)
        window = torch.stack([torch.as_tensor(a, dtype=torch.float64, device=self.device) -
                              torch.as_tensor(b, dtype=torch.float64, device=self.device)
                              for a, b in zip(now, self._last, strict=True)])
        self._last = now
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(window)
        loss_sum, acc_sum, count = window.tolist()
        if self.writer is not None and count:
            self.writer.add_scalar("train/loss", loss_sum / count, step)
            self.writer.add_scalar("train/acc1", acc_sum / count, step)
            self.writer.add_scalar("train/lr", lr, step)
            if loss_scale is not None:
                self.writer.add_scalar("train/loss_scale", loss_scale(), step)

    def epoch(self, step, **scalars):
        """After each epoch, on every rank (the peak memory is a max over the ranks: a collective)."""
        if not self.on:
            return
        peak = torch.tensor(peak_memory_mb(self.device), dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if self.writer is not None:
            for name, value in {**scalars, "peak_mem_mb": peak.item()}.items():
                self.writer.add_scalar(f"epoch/{name}", value, step)
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
