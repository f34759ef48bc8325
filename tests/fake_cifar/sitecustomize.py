"""A TEST DOUBLE of torchvision's CIFAR-100 download (this machine has no internet), for the tests of nodes that
share one --data-root (tests/test_cluster.py, tests/test_common.py).

Python imports this module at start-up when tests/fake_cifar is on PYTHONPATH. With FAKE_CIFAR_DOWNLOADS=PATH set,
once torchvision.datasets.cifar is imported, install() replaces the one function its CIFAR100.download() calls after
finding the files missing or not whole, download_and_extract_archive. The stand-in appends one line to PATH per
call (a download), then writes a tiny cifar-100-python folder in the real format (TRAIN and TEST images of 32x32,
100 classes) as the real extraction does: straight under the final names, a quarter of a file at a time, over
FAKE_CIFAR_SECONDS seconds in all (default 2), so that a second download or a read of a half-written file has time
to happen. CIFAR100's md5 table is pointed at these files, so torchvision's own check (each file's md5) tells a
half-written file from a whole one, as it does with the real archive. Nothing else in torchvision is changed.
"""

import hashlib
import importlib.abc
import importlib.util
import os
import pickle
import sys
import time

TRAIN, TEST = 64, 16


def files():
    """{name: bytes} of the tiny cifar-100-python folder, the same in every process (seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    split = {name: {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": [i % 100 for i in range(n)]}
             for name, n in (("train", TRAIN), ("test", TEST))}
    meta = {"fine_label_names": [f"class{i}" for i in range(100)]}
    return {"train": pickle.dumps(split["train"]), "test": pickle.dumps(split["test"]), "meta": pickle.dumps(meta)}


def install(cifar, log, seconds=2.0):
    """Replace `cifar` (the module torchvision.datasets.cifar)'s download with the stand-in, logging to `log`."""
    content = files()
    md5 = {name: hashlib.md5(data).hexdigest() for name, data in content.items()}
    cls = cifar.CIFAR100
    cls.train_list, cls.test_list = [["train", md5["train"]]], [["test", md5["test"]]]
    cls.meta = {**cls.meta, "md5": md5["meta"]}

    def download_and_extract_archive(url, download_root, extract_root=None, filename=None, md5=None,
                                     remove_finished=False):
        with open(log, "a") as f:  # one short append: lines from processes at once do not mix
            f.write(f"download pid={os.getpid()} node={os.environ.get('NODE_RANK', '-')} into={download_root}\n")
        folder = os.path.join(extract_root or download_root, cls.base_folder)
        os.makedirs(folder, exist_ok=True)
        for name, data in content.items():
            with open(os.path.join(folder, name), "wb") as f:
                for quarter in range(4):
                    f.write(data[quarter * len(data) // 4:(quarter + 1) * len(data) // 4])
                    f.flush()
                    time.sleep(seconds / 12)

    cifar.download_and_extract_archive = download_and_extract_archive


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds torchvision.datasets.cifar as usual, and installs the stand-in once it has run (importing torchvision
    here would cost every process, launchers too, over a second)."""

    def find_spec(self, name, path, target=None):
        if name != "torchvision.datasets.cifar":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install(module, os.environ["FAKE_CIFAR_DOWNLOADS"], float(os.environ.get("FAKE_CIFAR_SECONDS", "2")))

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FAKE_CIFAR_DOWNLOADS") and "torchvision.datasets.cifar" in sys.modules:  # a rank forked from
    # tests/warm_server.py, which imported torchvision before this ran
    install(sys.modules["torchvision.datasets.cifar"], os.environ["FAKE_CIFAR_DOWNLOADS"],
            float(os.environ.get("FAKE_CIFAR_SECONDS", "2")))
elif os.environ.get("FAKE_CIFAR_DOWNLOADS"):
    sys.meta_path.insert(0, _PatchOnImport())
