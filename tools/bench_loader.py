"""Epoch time of DataLoader vs DataLoaderX when loading a batch and computing on it take about as long.

    python tools/bench_loader.py                       # CPU, 40 batches, ~10 ms load + ~10 ms compute each
    python tools/bench_loader.py --device cuda --batches 200

Loading is simulated by a dataset that sleeps (as file I/O and decoding wait); compute is a real matmul
sized to take --compute-ms (it releases the GIL, as a GPU step does). With --workers 0 a plain DataLoader
loads and computes in turn (about load + compute per batch); DataLoaderX loads the next batches in a
thread meanwhile (about max(load, compute)). Prints one line per loader and the speed-up. On CUDA each step ends
with a synchronize, as a step that reads its loss does: without one, the GPU's queue would let the plain loader
load the next batch while the last step runs, and the two would measure alike.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ when run as a script
from common.loader import DataLoaderX


class SlowDataset(Dataset):
    def __init__(self, n, sample_ms):
        self.n, self.sample_s = n, sample_ms / 1000

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.sample_s)
        return torch.full((3, 32, 32), float(i)), i


def matmul_size_for(ms, device):
    """The square size whose matmul takes about `ms` on this device."""
    size = 64
    while True:
        a = torch.randn(size, size, device=device)
        a @ a  # untimed: the first call on CUDA also loads cuBLAS's kernels and makes its handle
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = (time.perf_counter() - start) / 3 * 1000
        if took >= ms or size >= 8192:
            return size
        size = int(size * max(1.1, min(2.0, (ms / max(took, 1e-3)) ** (1 / 3))))


def epoch_seconds(loader, device, size):
    weights = torch.randn(size, size, device=device)
    start = time.perf_counter()
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        weights @ weights + images.mean()  # the "step"
        if device.type == "cuda":  # the step's end, as a step that reads its loss waits for it
            torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--load-ms", type=float, default=10.0, help="time to load one batch")
    p.add_argument("--compute-ms", type=float, default=10.0, help="time of one step")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for flag in ("batches", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    for flag in ("load_ms", "compute_ms", "workers"):
        if not getattr(args, flag) >= 0:  # nan too
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be 0 or more")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU here; --device cpu measures the same on the CPU")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    size = matmul_size_for(args.compute_ms, device)
    dataset = SlowDataset(args.batches * args.batch_size, args.load_ms / args.batch_size)
    kwargs = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=device.type == "cuda")
    plain = epoch_seconds(DataLoader(dataset, **kwargs), device, size)
    prefetched = epoch_seconds(DataLoaderX(device, dataset, **kwargs), device, size)
    setting = (f"{args.batches} batches, load ~{args.load_ms:g} ms + compute ~{args.compute_ms:g} ms each, "
               f"workers={args.workers}, device={device.type}")
    print(f"DataLoader:  {plain:.3f} s/epoch ({setting})")
    print(f"DataLoaderX: {prefetched:.3f} s/epoch ({setting})")
    print(f"speed-up: {plain / prefetched:.2f}x")
    return plain, prefetched


if __name__ == "__main__":
    main()
