"""TensorBoard curves for the recipes (--tb-dir): the same tags in every recipe, written by rank 0 alone.

    tb = TensorBoard(args.tb_dir, args.tb_every, is_main, flags=vars(args), start_step=step)
    ...  # after each optimizer step, with the epoch's meters:
    tb.step(step, loss_meter, acc_meter, lr=optimizer.param_groups[0]["lr"])
    ...  # after each epoch's line, with the values the recipe all-reduced for it:
    tb.epoch(step, device, train_loss=..., val_acc1=..., ...)

Local: no method here is a collective, so any of these lines can go under `if is_main:` (on the other ranks the
object is off anyway). Tags (x axis: the optimizer step, which a resumed run continues):
  train/loss, train/acc1      mean over the last --tb-every steps of rank 0's own samples (no all-reduce per log;
                              the epoch/ tags are over every rank's)
  train/lr, train/loss_scale  the learning rate; the AMP recipes' loss scale (fp16)
  epoch/...                   each epoch's printed numbers, as the recipe reduced them: train_loss, train_acc1,
                              val_loss, val_acc1, val_acc5, images_per_sec; and peak_mem_mb, rank 0's own peak
  text "flags"                the run's flags

A resumed run (--resume) opens a new event file with purge_step just after its checkpoint's step, so the points
an interrupted run wrote after that checkpoint are dropped and the curves go on without repeats or gaps.
Without --tb-dir, and on every rank but 0, every method is a no-op (and tensorboard is not imported).
--tb-dir is checked at start-up with --out-dir (broadcast_out_dir_check(..., tb_dir=)).
"""

from common.utils import peak_memory_mb


class TensorBoard:
    def __init__(self, tb_dir, every, is_main, flags, start_step=0):
        self.on, self.every, self.writer = tb_dir is not None, every, None
        self._meters, self._last = None, (0.0, 0.0, 0)
        if self.on and is_main:
            from torch.utils.tensorboard import SummaryWriter  # only with --tb-dir: it costs a second to import

            self.writer = SummaryWriter(tb_dir, purge_step=start_step + 1 if start_step else None)
            self.writer.add_text("flags", "\n".join(f"    --{k.replace('_', '-')} {v}" for k, v in flags.items()),
                                 start_step)

    def step(self, step, loss_meter, acc_meter, lr, loss_scale=None):
        """After each optimizer step. Every `every` steps rank 0 writes the mean of its meters' growth since the last
        log (reading it waits for the device). loss_scale: a function, read only then."""
        if self.writer is None or step % self.every:
            return
        if self._meters is not loss_meter:  # a new epoch's meters: they count from zero
            self._meters, self._last = loss_meter, (0.0, 0.0, 0)
        now = (float(loss_meter.sum), float(acc_meter.sum), loss_meter.count)
        loss_sum, acc_sum, count = (a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        if count:
            self.writer.add_scalar("train/loss", loss_sum / count, step)
            self.writer.add_scalar("train/acc1", acc_sum / count, step)
            self.writer.add_scalar("train/lr", lr, step)
            if loss_scale is not None:
                self.writer.add_scalar("train/loss_scale", loss_scale(), step)

    def epoch(self, step, device, **scalars):
        """After each epoch: the scalars as given, and rank 0's peak memory on `device`."""
        if self.writer is None:
            return
        for name, value in {**scalars, "peak_mem_mb": peak_memory_mb(device)}.items():
            self.writer.add_scalar(f"epoch/{name}", float(value), step)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


