"""Dataset builders: synthetic (learnable, no files), CIFAR-100 (torchvision) and ImageFolder (your data).

build_datasets() returns (train_set, val_set, num_classes) and raises DataError with a one-line,
actionable message on missing or malformed data; recipes turn that into `error: ...` and exit 2.
A file that fails to load during training raises SampleError naming the sample (recipes exit 1).
"""

import contextlib
import fcntl
import itertools
import math
import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from common.models import SMALL_IMAGES
from common.utils import OneLineError

CIFAR_MEAN, CIFAR_STD = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FACES_MEAN, FACES_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # insightface's: (x - 127.5) / 127.5
DEFAULT_IMAGE_SIZE = {"synthetic": 32, "cifar100": 32, "imagefolder": 224}


class DataError(OneLineError):
    """Missing or malformed data; the message says what to do. Raised out of a recipe's main(), one_line_errors()
    prints it on every rank (a missing folder may be missing on one node only) and exits 2, as a bad flag does."""

    code = 2


class SampleError(OneLineError):
    """One sample failed to load (a corrupt image, a bad record); the one-line message names the split,
    the sample's index in the whole dataset and, where there is one, its file."""

    def __init__(self, message):
        # An exception raised in a DataLoader worker is re-built in the training process from its text:
        # "Caught SampleError in DataLoader worker process N.\nOriginal Traceback ...\n...SampleError: <ours>".
        if message.startswith("Caught SampleError"):
            ours = [line for line in message.splitlines() if line.startswith(f"{__name__}.SampleError: ")]
            message = ours[-1].split(": ", 1)[1] if ours else message
        super().__init__(message)


class NameFailingSamples(Dataset):
    """Wraps a dataset so that a sample that fails to load raises SampleError naming its index and file,
    not a bare decoder error from deep inside a worker."""

    def __init__(self, dataset, split):
        self.dataset, self.split = dataset, split

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(index)  # past the end: how a plain `for x in dataset` stops, not a broken sample
        try:
            return self.dataset[index]
        except Exception as exc:
            samples = getattr(self.dataset, "samples", None)  # ImageFolder: (path, class) per index
            where = f" ({samples[index][0]})" if samples is not None else ""
            detail = " ".join(str(exc).split())  # one line, whatever the decoder wrote
            raise SampleError(f"{self.split} sample {index}{where} does not load: {type(exc).__name__}: "
                              f"{detail}") from exc


class SyntheticImages(Dataset):
    """Random images whose class is learnable: each class has its own mean colour and pattern.

    Sample i is generated from (seed, split, i) alone, so every rank and every DataLoader worker
    sees the same sample for the same index, and the data needs no memory up front. torch's CPU generator keeps a
    seed's low 32 bits: the splits draw from the two halves of those, so no validation sample is a training sample
    below 2**31 training samples.
    """

    def __init__(self, num_samples, num_classes=10, image_size=32, split="train", seed=0):
        self.num_samples, self.num_classes, self.image_size = num_samples, num_classes, image_size
        self.base_seed = seed * 1_000_003 + (0 if split == "train" else 2**31)
        g = torch.Generator().manual_seed(seed)
        colour = torch.randn(num_classes, 3, 1, 1, generator=g)
        pattern = torch.randn(num_classes, 3, 4, 4, generator=g)
        pattern = torch.nn.functional.interpolate(pattern, size=image_size, mode="bilinear")
        self.prototypes = 0.5 * colour + 0.5 * pattern

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.base_seed + index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        noise = torch.randn(3, self.image_size, self.image_size, generator=g)
        return self.prototypes[label] + noise, label


# The most DataLoader workers a process gets by default. The training transforms at 224 px (JPEG decode,
# RandomResizedCrop, flip, ToTensor, Normalize) ran at 240-300 images per CPU-second here (AMD EPYC, PIL, photos of
# 500x375 and 640x427), and one A100 trains ResNet-50 in mixed precision at 2470 images/s (NVIDIA's
# DeepLearningExamples, ConvNets/resnet50v1.5): about 9 busy workers, where the old ceiling of 4 fed under half of
# it. 16 leaves room for faster GPUs and smaller models; past it, more workers mostly add memory (each holds 2
# batches ahead and its own copy of the dataset object) and start-up. Measure yours: tools/tune_loader.py.
MAX_DEFAULT_WORKERS = 16


def sample_seed(seed, epoch, index):
    """The seed of sample `index`'s random augmentation in `epoch` of a run seeded `seed`."""
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % 2**64


def crop_box(height, width, scale, ratio, generator):
    """torchvision's RandomResizedCrop.get_params for an image of height x width, drawing from `generator` instead
    of torch's global one: the same draws in the same order, so the same (top, left, h, w) for a generator seeded
    as the global one was. A thread may call it while another draws from the global generator."""
    area, log_ratio = height * width, torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w, h = int(round(math.sqrt(target_area * aspect_ratio))), int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            return top, left, h, w
    in_ratio = width / height  # no box in 10 draws: the central crop, as torchvision falls back to
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class SeededSamples(Dataset):
    """Sample i of epoch e drawn with the random augmentation of seed (seed, e, i): the same wherever and whenever it
    is loaded, so a run resumed mid-epoch, its DataLoader workers started afresh, augments each remaining sample as
    the uninterrupted run did. (A worker's random stream otherwise depends on the samples it loaded before: the
    batches a resumed run skips.) torch's generator (torchvision's transforms), Python's `random` and NumPy's global
    one (other augmentation libraries) are seeded for the sample, then put back as they were: with --workers 0 the
    loop draws from them too. set_epoch(e) before each epoch's iter(): workers that are not persistent copy it.
    Not for a dataset loaded in a thread (DataLoaderX with --workers 0): the loop's draws would interleave with the
    sample's; draw from a generator of the sample's own there (recipes/gpu_decode.py: sample_seed, crop_box)."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        seed = sample_seed(self.seed, self.epoch, index)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)  # the CPU's alone (torch.manual_seed seeds the GPUs' too)
                random.seed(seed)
                np.random.seed(seed % 2**32)
                return self.dataset[index]
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class SkipFirst(Sampler):
    """A sampler's indices less its first `skip` (set before an epoch's iter(); 0 after it): a run resumed after
    step k of an epoch skips the k x batch samples it already trained on, without loading them. len() is the whole
    epoch's, as the learning-rate schedule counts it."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self):
        return self.sampler.epoch

    def __iter__(self):
        skip, self.skip = self.skip, 0  # once: the next epoch starts at its beginning
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self):
        return len(self.sampler)


def default_worker_count(cores, processes_per_node):
    """One worker per core a process has beyond its own, at most MAX_DEFAULT_WORKERS: 8 processes on a 64-core
    node get 7 each, on 256 logical cores 16 each; 2 processes on 2 cores none. A worker without a core of its own
    only adds the hand-over of each batch (tools/tune_loader.py measured 37% slower here)."""
    return max(0, min(MAX_DEFAULT_WORKERS, cores // max(1, processes_per_node) - 1))


def usable_cores():
    """The cores this process may use, as launch.sh counts them: its CPU affinity (what a Slurm job's --cpus-per-task,
    a taskset or a cpuset leaves it, not the whole machine), and no more than a container's CPU limit (cpu_quota)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return min(cores, quota) if quota else cores


def cpu_quota(root=None):
    """The CPUs a container's limit allows (Docker's --cpus, a Kubernetes pod's CPU limit): its cgroup's CFS quota
    over the period, rounded up; None where there is none. Affinity does not show it: a pod limited to 16 CPUs on a
    128-core node sees 128, and 15 workers for each of 8 processes would take turns on 16. cgroup v2's cpu.max
    ("QUOTA PERIOD", or "max PERIOD": none), else v1's cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us, under
    root (default: $CGROUP_FS, else /sys/fs/cgroup: the container's own cgroup, as Docker and Kubernetes mount it)."""
    root = root or os.environ.get("CGROUP_FS") or "/sys/fs/cgroup"
    for files in (("cpu.max",), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            words = " ".join(open(os.path.join(root, name)).read() for name in files).split()
        except OSError:
            continue
        if len(words) == 2 and all(w.isdigit() for w in words) and int(words[0]) > 0 and int(words[1]) > 0:
            return -(-int(words[0]) // int(words[1]))
        return None  # this file says: no limit (or says nothing this reads)
    return None


def default_workers(workers, processes_per_node):
    """DataLoader workers per process: `workers` (--workers) if given, else default_worker_count() of the cores this
    process may run on (usable_cores)."""
    if workers is not None:
        return workers
    return default_worker_count(usable_cores(), processes_per_node)


def prepare_dataset(name, root):
    """Download what needs downloading. Call on one process per node, then barrier, then build.

    Nodes whose `root` is one shared folder call this at the same moment. torchvision writes the archive and its
    contents straight under their final names, so two downloads at once would write over each other, and a node
    that checked while another was writing would read half a file. So the check and the download run under an
    exclusive lock on ROOT/.download.lock: the nodes take turns, the first downloads, and the others find the files
    whole (torchvision checks each file's md5 first) and download nothing. On a folder of each node's own, each
    node downloads its own copy, as before."""
    if name != "cifar100":
        return
    try:
        import torchvision  # only where it is used: importing it costs each process over a second

        with exclusive_lock(root):
            torchvision.datasets.CIFAR100(root, train=True, download=True)
    except Exception as exc:  # URLError offline, HTTPError, disk full: all need the same advice
        raise DataError(
            f"could not download CIFAR-100 into {root!r} ({type(exc).__name__}: {exc}). Offline? copy "
            f"cifar-100-python.tar.gz from a machine with internet into {root!r}, "
            "or use --dataset synthetic / --dataset imagefolder"
        ) from exc


DOWNLOAD_LOCK = ".download.lock"


@contextlib.contextmanager
def exclusive_lock(folder):
    """Run the block while holding an exclusive fcntl.flock on FOLDER/.download.lock (FOLDER made if missing): the
    processes that lock the same folder run their blocks one at a time, on this machine and, through a shared file
    system, on others. Linux's NFS client makes flock a lock on the server (man 2 flock, "NOTES"); a mount that keeps
    locks within one node (NFS local_lock=flock, Lustre's localflock) gives no turns across nodes, and one with no
    locks at all fails the call: the block then runs unlocked after a warning. The lock ends with the file's last
    descriptor, also when the process is killed, so none is left stale. A folder where the lock file cannot be
    made (read-only: data someone else put there) needs none: nobody can download into it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, DOWNLOAD_LOCK)
    try:
        lock = open(path, "a")  # "a": makes it if missing, never truncates one another process holds
    except OSError:
        lock = None
    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # waits for whoever holds it
            except OSError as exc:  # ENOLCK (NFS without its lock service), ENOSYS (Lustre mounted without flock)
                print(f"warning: cannot lock {path} ({exc.strerror}): nodes sharing this folder may download into "
                      "it at once; download once on one node first", file=sys.stderr, flush=True)
        yield


def transforms(size, flip):
    """(train, val) transforms chosen by image size. Below 64 px (CIFAR-like): the whole image, shifted by up to an
    eighth of its side (pad and crop), as CIFAR training does; ImageNet's RandomResizedCrop keeps as little as 8% of
    the image, which at 32 px is a few pixels of a digit. From 64 px: RandomResizedCrop, and the usual resize and
    center crop for validation. flip: a random horizontal flip, right for photos, wrong for text and digits.
    Both end at a uint8 tensor (PILToTensor), not ToTensor and Normalize: a quarter of float32's bytes to hand over,
    pin and copy, and 1.3x the images a worker hands over (docs/data.md); device_normalize() finishes on the device."""
    import torchvision.transforms as T

    if size < SMALL_IMAGES:
        train = [T.Resize(size), T.CenterCrop(size), T.RandomCrop(size, padding=max(1, size // 8))]
        val = [T.Resize(size), T.CenterCrop(size)]
    else:
        train, val = [T.RandomResizedCrop(size)], [T.Resize(size * 8 // 7), T.CenterCrop(size)]
    tail = [T.PILToTensor()]
    return T.Compose(train + ([T.RandomHorizontalFlip()] if flip else []) + tail), T.Compose(val + tail)


def device_normalize(name, device):
    """What the workers' transforms no longer do (they end at uint8 pixels, 0-255): a function from a batch on
    `device` to float32, x / 255 less the dataset's mean over its std (CIFAR-100's; "faces": insightface's 0.5 and
    0.5, mx_face_prefetch.py's RecordIO; else ImageNet's), per channel, in the batch's memory format. Synthetic images
    are made as floats: they pass unchanged."""
    if name == "synthetic":
        return lambda images: images
    mean, std = {"cifar100": (CIFAR_MEAN, CIFAR_STD), "faces": (FACES_MEAN, FACES_STD)}.get(
        name, (IMAGENET_MEAN, IMAGENET_STD))
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) * 255 for v in (mean, std))
    return lambda images: (images.float() - mean) / std


def add_data_flags(parser):
    """The flags build_datasets() takes (--dataset, --data-root, --image-size, --no-flip, --synthetic-train,
    --synthetic-val): with your own data, replace this call and build_datasets() by your own flags and datasets."""
    parser.add_argument("--dataset", choices=["synthetic", "cifar100", "imagefolder"], default="synthetic")
    parser.add_argument("--data-root", default="./data", help="cifar100: download dir; imagefolder: has train/ val/")
    parser.add_argument("--image-size", type=int, help="default: 32 (synthetic, cifar100), 224 (imagefolder)")
    parser.add_argument("--no-flip", action="store_true", help="no random horizontal flip (text, digits)")
    parser.add_argument("--synthetic-train", type=int, default=2048, help="synthetic: training samples")
    parser.add_argument("--synthetic-val", type=int, default=500, help="synthetic: validation samples")


def build_datasets(name, root=None, image_size=None, synthetic_train=2048, synthetic_val=500, flip=True):
    if name not in DEFAULT_IMAGE_SIZE:
        raise DataError(f"unknown dataset {name!r}; use synthetic, cifar100 or imagefolder")
    size = image_size or DEFAULT_IMAGE_SIZE[name]
    if name == "synthetic":
        return (
            SyntheticImages(synthetic_train, image_size=size, split="train"),
            SyntheticImages(synthetic_val, image_size=size, split="val"),
            10,
        )
    if name == "cifar100":
        import torchvision  # only where it is used: importing it costs each process over a second

        train_tf, val_tf = transforms(size, flip)
        try:
            train = torchvision.datasets.CIFAR100(root, train=True, transform=train_tf)
            val = torchvision.datasets.CIFAR100(root, train=False, transform=val_tf)
        except RuntimeError as exc:
            raise DataError(f"no CIFAR-100 in {root!r} ({exc}); run once online to download it") from exc
        return train, val, 100
    return _imagefolder(root, size, flip)


def check_full_batch(steps, samples, batch_size):
    """A training set too small for one full batch of the GLOBAL `batch_size` (the loaders drop the last partial
    batch, so an epoch would have `steps` = 0 and train on nothing): a DataError saying so, once per node (every
    rank counts the same steps)."""
    if steps == 0:
        raise DataError(f"{samples} training samples make no full batch of {batch_size}; lower --batch-size",
                        all_ranks=False)


def rgb(image):
    """A PIL image as 8-bit RGB, as ImageFolder's loader makes it (image.convert("RGB")), but a 16-bit one (a PNG's
    I;16, or PIL's 32-bit I, how older Pillows open it) keeps its picture: PIL clips such pixels at 255, which makes
    a 16-bit photo nearly all white; here they are scaled by 1/256 (the high byte, as PIL reduces a 16-bit RGB PNG)."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I"):
        from PIL import Image

        pixels = np.asarray(image).astype(np.int64) >> 8
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))  # 2-D uint8: mode L
    return image.convert("RGB")


def load_rgb(path):
    """ImageFolder's loader: the file through rgb()."""
    from PIL import Image

    with open(path, "rb") as f:
        return rgb(Image.open(f))


def is_image_file(path):
    """ImageFolder's test of a file (an image's extension), less hidden files: macOS leaves a `._name.JPEG` of
    metadata beside each file copied to a foreign disk, which is no image and would stop the run when its turn came."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    return not os.path.basename(path).startswith(".") and has_file_allowed_extension(path, IMG_EXTENSIONS)


def _imagefolder(root, size, flip):
    layout = "expected ROOT/train/<class>/*.png|jpg and ROOT/val/<class>/*.png|jpg"
    for split in ("train", "val"):
        path = os.path.join(root, split)
        if not os.path.isdir(path):
            raise DataError(f"--data-root {root!r} has no {split}/ folder; {layout}")
        if not os.access(path, os.R_OK | os.X_OK):
            raise DataError(f"cannot read {path!r} (permissions); {layout}")
    import torchvision

    train_tf, val_tf = transforms(size, flip)
    try:
        train, val = (torchvision.datasets.ImageFolder(os.path.join(root, split), transform=tf, loader=load_rgb,
                                                       is_valid_file=is_image_file)
                      for split, tf in (("train", train_tf), ("val", val_tf)))
    except (FileNotFoundError, PermissionError) as exc:
        raise DataError(f"{exc}; {layout}") from exc
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))[:3]
        only_val = sorted(set(val.classes) - set(train.classes))[:3]
        raise DataError(f"train/ and val/ under {root!r} have different class folders "
                        f"(only in train: {only_train}, only in val: {only_val}); labels would not match")
    return NameFailingSamples(train, "train"), NameFailingSamples(val, "val"), len(train.classes)
