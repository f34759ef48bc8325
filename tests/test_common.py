"""common/: meters, accuracy, dataset builders on real on-disk formats, DataLoaderX."""

import collections
import errno
import gc
import io
import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torchvision
import torchvision.transforms as T
from conftest import REPO, run_script, spawn_gloo
from jobs import started_with
from PIL import Image
from torch.utils.data import DataLoader, Dataset, TensorDataset

from common import checkpoint
from common.checkpoint import SaveError, cpu_copy, save_atomic
from common.data import (
    DataError,
    SyntheticImages,
    build_datasets,
    default_worker_count,
    default_workers,
    prepare_dataset,
    rgb,
)
from common.loader import DataLoaderX
from common.models import (
    build_model,
    check_arch,
    recomputed_batchnorm,
    unused_parameters_error,
)
from common.utils import AverageMeter, Throughput, accuracy, first_line, gather_values, human, one_line_errors

# ------------------------------------------------------------------------------ meters, accuracy


def test_accuracy_topk():
    output = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5], [0.5, 0.4, 0.1]])
    target = torch.tensor([1, 2, 0, 1])  # top-2 per row: [1,0] [0,2] [2,1] [0,1]
    top1, top2, top5 = accuracy(output, target, topk=(1, 2, 5))
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in (top1, top2, top5))  # no .item(): no sync
    assert float(top1) == pytest.approx(25.0)   # row 0
    assert float(top2) == pytest.approx(75.0)   # rows 0, 1, 3
    assert float(top5) == pytest.approx(100.0)  # k above the class count means every class


def test_average_meter_weights_by_count():
    m = AverageMeter()
    m.update(1.0, n=3)
    m.update(5.0, n=1)
    assert m.avg == pytest.approx(2.0) and m.count == 4
    assert AverageMeter().avg == 0.0


def test_average_meter_keeps_a_tensor_sum_on_the_tensors_device():
    # The training loop passes the loss tensor: summing it where it lives (not float(loss) per step) is what
    # lets a GPU run ahead of the CPU. The sum is fp64, so a long epoch of fp32 losses does not drift.
    m = AverageMeter()
    loss = torch.tensor(0.1, requires_grad=True) * 3
    m.update(loss, n=32)
    m.update(torch.tensor(0.5), n=32)
    assert isinstance(m.sum, torch.Tensor) and m.sum.dtype == torch.float64 and not m.sum.requires_grad
    assert m.avg == pytest.approx((0.3 + 0.5) / 2) and m.count == 64


# The errors a rank meets when its peer hangs or dies, as gloo and NCCL word them (NCCL's text is in
# libtorch_cuda.so and libnccl.so of the torch wheel; the process exits with os._exit, replaced here).
@pytest.mark.parametrize(("error", "says"), [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for "
                  "recv operation to complete"), "another rank did not join a collective within --dist-timeout"),
    (dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
                           "OpType=ALLREDUCE, NumelIn=2, NumelOut=2, Timeout(ms)=5000) ran for 5006 milliseconds "
                           "before timing out."), "another rank did not join a collective within --dist-timeout"),
    (dist.DistBackendError("[Rank 0] Work WorkNCCL(SeqNum=5, OpType=ALLREDUCE) timed out in blocking wait."),
     "another rank did not join a collective within --dist-timeout"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[127.0.0.1]:20417"), "lost the connection to another rank: it failed or was killed"),
    (dist.DistBackendError("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3699, remote "
                           "process exited or there was a network error, NCCL version 2.27.5\nncclRemoteError: A "
                           "call failed possibly due to a network error or a remote process exiting prematurely."),
     "lost the connection to another rank: it failed or was killed"),
])
def test_a_lost_or_hung_peer_gets_one_line_in_gloo_and_nccl_words(error, says, monkeypatch, capsys):
    monkeypatch.setattr("common.utils._leave", lambda code: sys.exit(code))
    with pytest.raises(SystemExit) as leaving, one_line_errors():
        raise error
    assert leaving.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"[rank 0] error: {says}") and first_line(error) in lines[0]


def test_other_runtime_errors_keep_their_traceback():
    with pytest.raises(RuntimeError, match="CUDA out of memory"), one_line_errors():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


PIN_THREAD_SCRIPT = """
import os, queue, sys, threading, time
import torch.multiprocessing as mp
import torch
from torch.utils.data._utils.pin_memory import _pin_memory_loop  # the DataLoader's own pin-memory thread
from common.utils import one_line_errors

def worker(q):  # a DataLoader worker: sends a batch (its storage as a file descriptor), then exits, as on Ctrl-C
    q.put((0, torch.ones(1000)))
    time.sleep(0.5)
    os._exit(0)

class Broken:  # a queue that fails for another reason: that traceback must stay
    def get(self, timeout):
        raise ValueError("not a dead worker")

def pin_thread(in_queue):  # device -1: no accelerator to select, the rest of the loop as on a GPU
    thread = threading.Thread(target=_pin_memory_loop, args=(in_queue, queue.Queue(), -1, threading.Event(), "cpu"))
    thread.start()
    thread.join(30)
    print("thread ended:", not thread.is_alive(), file=sys.stderr, flush=True)

def dead_worker_queue():
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=worker, args=(q,))
    p.start()
    p.join()
    return q

if __name__ == "__main__":
    print("== outside", file=sys.stderr, flush=True)
    pin_thread(dead_worker_queue())
    with one_line_errors():
        print("== inside", file=sys.stderr, flush=True)
        pin_thread(dead_worker_queue())
        print("== other", file=sys.stderr, flush=True)
        pin_thread(Broken())
"""


def test_a_pin_memory_thread_whose_worker_is_gone_dies_quietly_under_one_line_errors(tmp_path):
    # Ctrl-C on a GPU run (drill 7 in tests/test_gpu.py): each rank's DataLoader workers exit on the signal, and the
    # pin-memory thread, unpickling a batch a dead worker sent, dies of ConnectionRefusedError with a traceback on
    # every rank. Reproduced here with torch's own thread function and a real worker process.
    script = tmp_path / "pin.py"
    script.write_text(PIN_THREAD_SCRIPT)
    proc = run_script([script], env={**os.environ, "PYTHONPATH": str(REPO)})  # forked from the warm server
    assert proc.returncode == 0, proc.stderr
    outside, rest = proc.stderr.split("== inside")
    inside, other = rest.split("== other")
    # The control: without one_line_errors the thread prints the dead worker's error.
    assert "in _pin_memory_loop" in outside and re.search(r"(ConnectionRefusedError|FileNotFoundError)", outside)
    assert inside.split() == ["thread", "ended:", "True"], inside  # the same death, nothing printed
    assert "ValueError: not a dead worker" in other and "Traceback" in other  # another error keeps its traceback


CTRL_C_RACE_SCRIPT = """
import os, signal, sys
import torch.distributed as dist
from common.utils import one_line_errors

def sigint_in_contextlib_exit(frame, event, arg):  # the signal lands as contextlib's __exit__ starts
    if event == "call" and frame.f_code.co_name == "__exit__" and frame.f_code.co_filename.endswith("contextlib.py"):
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
with one_line_errors():
    sys.setprofile(sigint_in_contextlib_exit)
    raise RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:5857: Connection reset by peer")
"""


def test_ctrl_c_that_lands_while_a_rank_unwinds_from_a_lost_peer_still_exits_130_quietly(tmp_path):
    # Drill 7 on a GPU (tests/test_gpu.py): the rank that took Ctrl-C first left, its peer's collective failed
    # ("Connection reset by peer"), and its own SIGINT landed inside contextlib's __exit__, before one_line_errors'
    # except clauses: KeyboardInterrupt with a traceback. Here the signal is sent at exactly that point. The script
    # starts with SIGINT at its default, as in a terminal (tests/jobs.py): a suite started as `cmd &` by a script
    # ignores SIGINT, and so does every process it starts; the script then exited 1 with the lost peer's line.
    script = tmp_path / "race.py"
    script.write_text(CTRL_C_RACE_SCRIPT)
    proc = subprocess.run([sys.executable, script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, preexec_fn=started_with())
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "")


def _float64_scalars():
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float64 and o.dim() == 0)


def _meter_worker(rank, port, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    m = AverageMeter()
    m.update(10.0 * (rank + 1), n=rank + 1)  # rank 0: 10 x1, rank 1: 20 x2
    m.all_reduce(torch.device("cpu"))
    left = []
    gc.freeze()  # what exists now (every module's objects) out of gc.get_objects(): it then lists what came since
    for _ in range(5):  # without the wait inside, some tensors were still alive after 2 of 5 single calls
        before = _float64_scalars()
        values = gather_values(700.5 + rank, torch.device("cpu"))
        # Returned only once gloo's worker thread let go of the tensors it gathered: none is left alive, so none can
        # be freed later by that thread, after Python has begun to shut down (which aborts the process).
        left.append(_float64_scalars() - before)
    results[rank] = (m.sum, m.count, m.avg, values, max(left), gather_values([rank, 2.5], torch.device("cpu")))
    dist.destroy_process_group()


def test_average_meter_all_reduce_and_gather_values_across_two_gloo_processes():
    results = spawn_gloo(_meter_worker)
    assert results[0] == results[1] == (50.0, 3, pytest.approx(50.0 / 3), [700.5, 701.5], 0,
                                        [[0.0, 2.5], [1.0, 2.5]])  # a list each: --profile's table rows
    assert gather_values(3, torch.device("cpu")) == [3.0]  # no process group: a world of one
    assert gather_values([3, 4], torch.device("cpu")) == [[3.0, 4.0]]


def test_throughput_leaves_the_first_step_out_and_syncs_only_at_its_boundaries(monkeypatch):
    # start, the warm-up step ends at 5 s, stop at 8 s (two 1.5 s steps); epoch 2: start at 100 s, stop at 103 s.
    clock = iter([0.0, 5.0, 8.0, 100.0, 103.0])
    monkeypatch.setattr("common.utils.time.perf_counter", lambda: next(clock))
    syncs = []
    monkeypatch.setattr(torch.cpu, "synchronize", lambda device=None: syncs.append(device))
    speed = Throughput(torch.device("cpu"))
    speed.start()
    for _ in range(3):
        speed.step(images=64)
    assert speed.stop() == 8.0  # the epoch's seconds, warm-up included
    speed.start()  # the gap between epochs (evaluation) is not training time
    for _ in range(2):
        speed.step(images=64)
    assert speed.stop() == 3.0
    assert (speed.steps, speed.images, speed.seconds) == (4, 256, 6.0)
    assert speed.images_per_sec == pytest.approx(256 / 6) and speed.first_step_at is not None
    assert str(speed.eta(steps_left=30)) == "0:00:45"
    # The device is waited for before each clock read (5), never for a step: a sync per step would stall the GPU.
    assert syncs == [torch.device("cpu")] * 5


def test_own_ms_times_the_data_wait_and_the_forward_and_rides_on_the_meters_all_reduce(monkeypatch):
    # A DDP-like wrapper: `outer` is what the loop calls, `inner` its module. Each step: the loop waits for data from
    # the last step's end until it calls outer; inner's forward is the rank's own compute; the rest (DDP's waits,
    # backward) is not timed. The first step is the warm-up, left out as images/s leaves it out.
    stamps = iter([0.0,  # start()
                   1.0, 2.0, 3.0, 4.0,  # step 1: called, forward starts, forward ends, step ends
                   6.0, 7.0, 9.0, 10.0,  # step 2: data 2 s, forward 2 s
                   11.0, 12.0, 15.0, 20.0])  # step 3: data 1 s, forward 3 s
    monkeypatch.setattr("common.utils.time.monotonic", lambda: next(stamps))
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(inner)
    speed = Throughput(torch.device("cpu"))
    speed.watch(outer, forward=inner)
    speed.start()
    for _ in range(3):
        outer(torch.ones(1, 2))
        speed.step(images=1)
    speed.stop()
    outer(torch.ones(1, 2))  # evaluation, after stop(): not timed (one more stamp would end the iterator)
    assert speed.own_ms == pytest.approx(4000)  # (2 + 2 + 1 + 3) s over 2 steps
    assert speed.spread == ""  # every rank's, once the all-reduce has carried them
    meter = AverageMeter()
    meter.update(1.0, 2)
    meter.all_reduce(torch.device("cpu"), ride=speed)  # no process group here: this rank's alone
    assert speed.own_ms_per_rank == [pytest.approx(4000)] and meter.avg == 1.0
    assert speed.spread == " own_ms=4000.0-4000.0(max/min 1.00, rank 0)"
    speed.own_ms_per_rank = [12.5, 125.0, 13.0]
    assert speed.spread == " own_ms=12.5-125.0(max/min 10.00, rank 1)"
    speed.own_ms_per_rank = [0.0, 0.4]  # a rank whose waits were all below the clock's tick: no ratio, still shown
    assert speed.spread == " own_ms=0.0-0.4(max/min -, rank 1)"


# ------------------------------------------------------------------------------------- models


def test_unknown_arch_suggests_close_names():
    with pytest.raises(ValueError, match="unknown --arch 'resnet19'; did you mean resnet18"):
        check_arch("resnet19")
    assert build_model("resnet18", 7).fc.out_features == 7


def test_recomputed_batchnorm_takes_the_mean_of_the_batches_run_and_restores_the_rest():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).eval()
    norm = model[1]
    norm.running_mean.fill_(5.0)  # statistics that trail the weights
    batches = [torch.randn(8, 3, 5, 5) * 3 + 1 for _ in range(3)]
    with recomputed_batchnorm(model):
        for x in batches:
            model(x)
    with torch.no_grad():
        inputs = [model[0](x) for x in batches]
    expected_mean = torch.stack([h.mean(dim=(0, 2, 3)) for h in inputs]).mean(0)
    expected_var = torch.stack([h.var(dim=(0, 2, 3), unbiased=True) for h in inputs]).mean(0)
    assert torch.allclose(norm.running_mean, expected_mean, atol=1e-6)
    assert torch.allclose(norm.running_var, expected_var, atol=1e-5)
    assert norm.momentum == 0.1 and not model.training and int(norm.num_batches_tracked) == 3
    assert all(p.grad is None for p in model.parameters())
    # With one batch, eval (running statistics) now computes what train mode (the batch's) computes, up to the
    # running variance's unbiased n / (n - 1) (n = 8 x 5 x 5 values per channel).
    with recomputed_batchnorm(model):
        model(batches[0])
    with torch.no_grad():
        assert torch.allclose(model(batches[0]), model.train()(batches[0]), rtol=0.01, atol=0.01)
    # No batch run: the statistics it had are kept, not reset to 0 and 1.
    before = {k: v.clone() for k, v in norm.named_buffers()}
    with recomputed_batchnorm(model.eval()):
        pass
    assert all(torch.equal(before[k], v) for k, v in norm.named_buffers()) and not model.training


def test_unused_parameters_error_names_the_parameters():
    model = build_model("tiny_unused", 10)
    names = [n for n, _ in model.named_parameters()]
    exc = RuntimeError(f"... `find_unused_parameters=True` ... did not receive grad for rank 0: "
                       f"{names.index('aux_head.weight')} {names.index('aux_head.bias')}\n more")
    assert unused_parameters_error(exc, model).startswith("aux_head.weight, aux_head.bias got no gradient")
    assert unused_parameters_error(RuntimeError("CUDA out of memory"), model) is None


# --------------------------------------------------------------------------------------- data


def test_synthetic_is_deterministic_balanced_and_split_dependent():
    train, val, classes = build_datasets("synthetic", synthetic_train=300, synthetic_val=50)
    assert (len(train), len(val), classes) == (300, 50, 10)
    x1, y1 = train[7]
    x2, y2 = SyntheticImages(300)[7]  # another instance (another rank or worker): same sample
    assert torch.equal(x1, x2) and y1 == y2 and x1.shape == (3, 32, 32)
    assert not torch.equal(train[0][0], val[0][0])
    labels = [train[i][1] for i in range(300)]
    assert set(labels) == set(range(10))
    with pytest.raises(IndexError):
        train[300]


def test_no_synthetic_validation_sample_is_a_training_sample_at_any_size():
    # The splits once sat 500,009 seeds apart: --synthetic-train 500,010 trained on val[0]. The samples are made on
    # demand, so a set of two billion costs nothing until read.
    train, val = SyntheticImages(2**31), SyntheticImages(500, split="val")
    for k in (0, 1, 499):
        for offset in (0, 500_009, 2**30, 2**31 - 500):
            assert not torch.equal(train[offset + k][0], val[k][0]), (offset, k)


def test_a_16_bit_png_keeps_its_picture_and_hidden_files_are_not_images(tmp_path, imagefolder):
    # PIL's convert("RGB") clips 16-bit pixels at 255: this ramp (0 to 65,520) would read 99.6% white.
    ramp = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)
    root = tmp_path / "data"
    shutil.copytree(imagefolder, root)
    Image.fromarray(ramp).save(root / "val" / "class_2" / "zz_16bit.png")
    (root / "train" / "class_0" / "._000.png").write_bytes(b"\0\5\26\7 macOS metadata, no image")
    assert Image.open(root / "val" / "class_2" / "zz_16bit.png").mode == "I;16"
    train, val, _ = build_datasets("imagefolder", str(root), image_size=64)
    assert len(train) == 60 and len(val) == 22  # the hidden file is not a sample; the PNG is
    image, label = val[21]
    assert label == 2 and image.dtype == torch.uint8
    # Resize(73) and CenterCrop(64) of the ramp, scaled by 1/256: its mean level, not 255
    scaled = torch.from_numpy((ramp >> 8).astype(np.uint8))[None]
    expected = T.Compose([T.Resize(64 * 8 // 7), T.CenterCrop(64)])(scaled)
    assert (image.float() - expected.float()).abs().max() <= 1
    assert 100 < image.float().mean() < 155 and (image == 255).float().mean() < 0.02
    for mode in ("I", "I;16"):  # older Pillows open a 16-bit PNG as 32-bit I: the same picture
        assert np.array_equal(np.asarray(rgb(Image.fromarray(ramp).convert(mode)))[..., 0], ramp >> 8)


def test_imagefolder_builder_reads_png_tree(imagefolder):
    train, val, classes = build_datasets("imagefolder", str(imagefolder), image_size=16)
    assert (len(train), len(val), classes) == (60, 21, 3)
    image, label = val[20]
    assert image.shape == (3, 16, 16) and label == 2


def test_imagefolder_errors_are_actionable(tmp_path, imagefolder):
    with pytest.raises(DataError, match=r"has no train/ folder; expected ROOT/train/<class>/\*\.png"):
        build_datasets("imagefolder", str(tmp_path / "missing"))
    (tmp_path / "empty" / "train").mkdir(parents=True)
    (tmp_path / "empty" / "val").mkdir()
    with pytest.raises(DataError, match="Couldn't find any class folder"):
        build_datasets("imagefolder", str(tmp_path / "empty"))
    mismatch = tmp_path / "mismatch"
    for split, cls in (("train", "cat"), ("val", "dog")):
        (mismatch / split / cls).mkdir(parents=True)
        (mismatch / split / cls / "a.png").write_bytes((imagefolder / "val/class_0/000.png").read_bytes())
    message = r"different class folders \(only in train: \['cat'\], only in val: \['dog'\]\)"
    with pytest.raises(DataError, match=message):
        build_datasets("imagefolder", str(mismatch))


def test_default_workers_one_per_spare_core_of_each_process_at_most_16(monkeypatch):
    assert [default_worker_count(cores, 8) for cores in (8, 16, 64, 128, 256)] == [0, 1, 7, 15, 16]
    assert [default_worker_count(2, processes) for processes in (1, 2, 4)] == [1, 0, 0]  # never negative
    assert [default_worker_count(cores, 1) for cores in (16, 17, 18, 512)] == [15, 16, 16, 16]
    assert default_worker_count(7, 0) == 6  # 0 processes counts as 1
    # The cores are the process's own (a scheduler's cgroup or taskset), not the machine's.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert default_workers(None, 8) == 7 and default_workers(None, 2) == 16
    assert default_workers(0, 8) == 0 and default_workers(32, 8) == 32  # --workers as given, beyond the ceiling too


def test_cifar100_offline_download_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match="could not download CIFAR-100 .* Offline\\? copy cifar-100-python.tar.gz"):
        prepare_dataset("cifar100", str(tmp_path))


def fake_cifar():
    """tests/fake_cifar/sitecustomize.py, the test double of torchvision's CIFAR-100 download, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_cifar", os.path.join(os.path.dirname(__file__), "fake_cifar",
                                                                             "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # FAKE_CIFAR_DOWNLOADS unset: it installs nothing by itself
    return module


def _prepare_with_the_fake_download(root, log):
    fake_cifar().install(torchvision.datasets.cifar, log, seconds=1.0)  # in this forked process only
    prepare_dataset("cifar100", root)


def test_processes_preparing_one_folder_at_once_download_it_once(tmp_path):
    # What two nodes on one shared --data-root do (tests/test_cluster.py runs the recipes so), as two processes:
    # the second waits for the first's lock, then finds every file whole and downloads nothing.
    root, log = tmp_path / "a" / "data", tmp_path / "downloads.log"  # parents made too
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_prepare_with_the_fake_download, args=(str(root), str(log))) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert len(log.read_text().splitlines()) == 1, log.read_text()
    whole = fake_cifar().files()
    assert {name: (root / "cifar-100-python" / name).read_bytes() for name in whole} == whole
    assert (root / ".download.lock").is_file()


def test_cifar100_in_a_folder_that_takes_no_lock_file_is_used_as_it_is(tmp_path, monkeypatch):
    # A read-only shared folder that someone filled (the tests run as root, whom chmod does not stop: a directory
    # where the lock file would go stands in for it). There is nothing to wait for and nothing to download.
    fake = fake_cifar()
    (tmp_path / "cifar-100-python").mkdir()
    for name, data in fake.files().items():
        (tmp_path / "cifar-100-python" / name).write_bytes(data)
    (tmp_path / ".download.lock").mkdir()
    monkeypatch.setattr(torchvision.datasets.cifar.CIFAR100, "train_list", [["train", None]])
    monkeypatch.setattr(torchvision.datasets.cifar.CIFAR100, "test_list", [["test", None]])
    monkeypatch.setattr(torchvision.datasets.cifar.CIFAR100, "meta", {"filename": "meta", "key": "fine_label_names",
                                                                      "md5": None})
    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive",
                        lambda *args, **kwargs: pytest.fail("downloaded into a folder that had the data"))
    prepare_dataset("cifar100", str(tmp_path))
    assert build_datasets("cifar100", str(tmp_path))[2] == 100


def test_cifar100_builder_on_generated_pickles(tmp_path, monkeypatch):
    # The real archive cannot be downloaded here; torchvision's class reads these files unchanged
    # once its md5 table (which only the real files match) is pointed at them.
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train", 40), ("test", 15)):
        data = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": list(range(n))}
        (folder / name).write_bytes(pickle.dumps(data))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i}" for i in range(100)]}))
    cls = torchvision.datasets.CIFAR100
    monkeypatch.setattr(cls, "train_list", [["train", None]])
    monkeypatch.setattr(cls, "test_list", [["test", None]])
    monkeypatch.setattr(cls, "meta", {"filename": "meta", "key": "fine_label_names", "md5": None})
    train, val, classes = build_datasets("cifar100", str(tmp_path))
    assert (len(train), len(val), classes) == (40, 15, 100)
    image, label = val[3]
    assert image.shape == (3, 32, 32) and label == 3


# -------------------------------------------------------------------------------- DataLoaderX


class FailsAt(Dataset):
    def __init__(self, n, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"corrupt sample {i}")
        return torch.full((2,), float(i)), i


def producer_threads():
    return [t for t in threading.enumerate() if t.name == "DataLoaderX-producer"]


def wait_until(done, timeout=10, every=0.05):
    """Polls done() until it is true or `timeout` seconds pass; the caller asserts what it waited for."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(every)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloaderx_yields_the_same_batches_in_the_same_order(workers):
    ds = TensorDataset(torch.randn(103, 3), torch.arange(103))
    kwargs = dict(batch_size=8, shuffle=True, num_workers=workers)
    plain = list(DataLoader(ds, generator=torch.Generator().manual_seed(5), **kwargs))
    loader = DataLoaderX("cpu", ds, generator=torch.Generator().manual_seed(5), **kwargs)
    prefetched = list(loader)
    assert len(loader) == len(plain) == 13 and len(prefetched) == 13
    for (xa, ya), (xb, yb) in zip(plain, prefetched, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert producer_threads() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloaderx_reraises_a_loading_error_at_the_failing_batch(workers):
    loader = DataLoaderX("cpu", FailsAt(40, bad=9), batch_size=4, num_workers=workers)
    seen = []
    start = time.monotonic()
    with pytest.raises(ValueError, match="corrupt sample 9"):
        for _, idx in loader:
            seen.append(idx.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]  # batch 2 (samples 8-11) raises: within one step
    # Cleaned up before the error reaches the loop, without waiting for a garbage collection that
    # could run anywhere (a regression once took 10 s here, joining stuck workers).
    assert time.monotonic() - start < 5
    assert producer_threads() == [] and multiprocessing.active_children() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloaderx_break_stops_the_thread_and_workers(workers):
    loader = DataLoaderX("cpu", FailsAt(1000, bad=-1), batch_size=2, num_workers=workers, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 3:
            assert len(producer_threads()) == 1
            break
    # No gc.collect(): leaving the loop must be enough.
    wait_until(lambda: not (producer_threads() or multiprocessing.active_children()))
    assert producer_threads() == []
    assert multiprocessing.active_children() == []


class Logged(Dataset):
    def __init__(self, n):
        self.n, self.fetched, self.lock = n, [], threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.fetched.append(i)
        return torch.tensor([i])


def test_dataloaderx_loads_ahead_of_the_loop_and_no_further_than_its_prefetch():
    data = Logged(40)
    batches = iter(DataLoaderX("cpu", data, batch_size=4, num_workers=0, prefetch=2))
    assert next(batches).flatten().tolist() == [0, 1, 2, 3]
    # While the loop holds batch 0 and asks for nothing, the thread loads batches 1 and 2 into its queue (2 deep)
    # and batch 3, whose put waits for room; batch 4 not until the loop takes one.
    wait_until(lambda: len(data.fetched) >= 16, every=0.01)
    time.sleep(0.3)  # room for a wrong loader to fetch more
    assert data.fetched == list(range(16))
    assert next(batches).flatten().tolist() == [4, 5, 6, 7]
    batches.close()
    wait_until(lambda: not producer_threads())
    assert producer_threads() == []


Pair = collections.namedtuple("Pair", "image label")


class Structured(Dataset):  # what default_collate keeps: a namedtuple, an OrderedDict, strings beside tensors
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Pair(torch.full((2,), float(i)), collections.OrderedDict(id=i, name=f"n{i}"))


def test_dataloaderx_keeps_the_dataloaders_batch_types():
    kwargs = dict(batch_size=4, num_workers=0)
    for plain, prefetched in zip(DataLoader(Structured(), **kwargs), DataLoaderX("cpu", Structured(), **kwargs),
                                 strict=True):
        assert type(prefetched) is Pair and type(prefetched.label) is collections.OrderedDict
        assert torch.equal(prefetched.image, plain.image) and torch.equal(prefetched.label["id"], plain.label["id"])
        assert prefetched.label["name"] == plain.label["name"]


def test_dataloaderx_stops_the_last_iterators_thread_before_the_next_starts():
    # gpu_decode: an epoch cut short by an islice (its micro-batches not a multiple of --accum-steps) leaves its
    # iterator, and the thread making batches on the loader's side stream, alive until the name is rebound: after the
    # next iter() started its own thread on the same stream. The next iter() stops it first.
    made = []

    def on_device(batch):
        made.append(threading.current_thread())
        return batch

    loader = DataLoaderX("cpu", FailsAt(40, bad=-1), batch_size=2, num_workers=0, prefetch=2, on_device=on_device)
    first = iter(loader)
    next(first)
    wait_until(lambda: len(made) >= 3)  # it has made batches ahead
    old = made[0]
    second = iter(loader)  # `first` still referenced here, as an islice would hold it
    assert not old.is_alive() and next(first, None) is None
    assert next(second)[1].tolist() == [0, 1] and made[-1] is not old and len(producer_threads()) == 1
    del first, second
    wait_until(lambda: not producer_threads())


def test_dataloaderx_with_persistent_workers_goes_without_a_garbage_collection():
    # Its default copy must not refer back to the loader: a cycle would keep the loader, and with it its persistent
    # workers, until some later collection (which can run inside a newly forked worker).
    loader = DataLoaderX("cpu", FailsAt(8, bad=-1), batch_size=2, num_workers=1, persistent_workers=True)
    assert len(list(loader)) == 4 and len(multiprocessing.active_children()) == 1
    gone = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert gone() is None
    finally:
        gc.enable()
    wait_until(lambda: not multiprocessing.active_children())
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------------- checkpoints


def test_cpu_copy_is_a_copy_that_later_steps_do_not_change():
    # --async-save in lm_ddp.py: the thread writes this copy while the next steps change the weights and AdamW's
    # moments in place (the state_dicts hold the live tensors). The structure and the numbers come through as they are.
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7, "flags": {"lr": 0.1}}
    copy = cpu_copy(state)
    before = {k: v.clone() for k, v in state["model"].items()}
    optimizer.step()  # in place: state["model"]'s tensors change, the copy's do not
    assert not torch.equal(state["model"]["weight"], before["weight"])
    assert all(torch.equal(copy["model"][k], before[k]) for k in before)
    assert copy["optimizer"]["param_groups"] == state["optimizer"]["param_groups"] and copy["step"] == 7
    assert copy["optimizer"]["state"][0]["exp_avg"].data_ptr() != state["optimizer"]["state"][0]["exp_avg"].data_ptr()
    assert copy["flags"] == {"lr": 0.1}


def test_save_atomic_syncs_the_file_then_its_new_name(tmp_path, monkeypatch):
    # POSIX: a rename lasts a crash once its folder is synced; the file's bytes before the rename points at them.
    synced, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: synced.append(("rename", str(b))) or real_replace(a, b))
    save_atomic({"step": 3}, tmp_path / "latest.pt")
    assert synced == [str(tmp_path / "latest.pt.tmp"), ("rename", str(tmp_path / "latest.pt")), str(tmp_path)]
    assert torch.load(tmp_path / "latest.pt", weights_only=True) == {"step": 3}
    # A file system that cannot open or fsync a folder (some network ones): the save stands, said by no error.
    for fails in ("open", "fsync"):
        real = getattr(os, fails)

        def refuse(target, *args, real=real):
            is_folder = os.path.isdir(target) if isinstance(target, str) else os.path.isdir(f"/proc/self/fd/{target}")
            if is_folder:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(target, *args)

        monkeypatch.setattr(os, fails, refuse)
        save_atomic({"step": 4}, tmp_path / "latest.pt")
        monkeypatch.setattr(os, fails, real)
        assert torch.load(tmp_path / "latest.pt", weights_only=True) == {"step": 4}


def test_save_atomic_keeps_the_previous_file_when_the_disk_fills(tmp_path, monkeypatch):
    path = tmp_path / "latest.pt"
    save_atomic({"epoch": 1}, path)
    real_open = open

    class FillingFile(io.FileIO):  # a disk with 1 kB left: the real torch.save then fails with its own words
        def write(self, data):
            if self.tell() + len(data) > 1024:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    monkeypatch.setattr(checkpoint, "open", lambda file, mode: FillingFile(file, "w") if mode == "wb"
                        else real_open(file, mode), raising=False)
    with pytest.raises(SaveError) as failed:
        save_atomic({"epoch": 2, "weights": torch.zeros(10_000)}, path)
    assert re.fullmatch(rf"cannot write {re.escape(str(path))} \(No space left on device; \d+(\.\d)? [kMG]B free "
                        r"there\): the previous latest\.pt, if any, is whole; free some space, then --resume",
                        str(failed.value)), str(failed.value)
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]  # no temp file left behind


def test_human_sizes():
    assert [human(n) for n in (812 * 2**10, 1.44 * 2**20, 3.2 * 2**30)] == ["812 kB", "1.4 MB", "3.2 GB"]


# ------------------------------------------------------------------------------------------- divergence
def test_the_divergence_check_reads_nothing_from_the_device_per_step(monkeypatch):
    """update() runs every step: it must not bring a value to the host (.item(), .tolist(), float(), bool(), .cpu()),
    which on a GPU would stop the CPU from queueing the next step. Every such read raises here."""
    from common.utils import DivergenceCheck

    check = DivergenceCheck(torch.device("cpu"))
    losses = [torch.tensor(v) for v in (2.0, 1.5, float("nan"), 1.0, float("inf"))]

    def host_read(*args, **kwargs):
        raise AssertionError("a host read in DivergenceCheck.update")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, host_read)
        for step, loss in enumerate(losses, 1):
            check.update(step, loss)
    assert int(check.first_bad) == 3  # the first non-finite loss, kept on the device
    with pytest.raises(Exception) as stopped:
        check.all_reduce_and_check(0, 5)
    assert type(stopped.value).__name__ == "Diverged" and stopped.value.code == 3
    assert "steps 1-5: the training loss stopped being finite at step 3" in str(stopped.value)


def test_fused_sgd_after_a_skipped_first_step_needs_its_momentum_started_at_zero():
    # torch_amp.py and apex_amp.py's torch mode build SGD(fused=True): GradScaler then hands it the inf flag on the
    # device. Its first step() makes the momentum buffers with empty_like before the kernel, which skips an inf step:
    # they keep whatever memory held. The recipes start them at zero, which a plain SGD's first real step equals.
    def train(fused, zeroed):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, fused=fused)
        if zeroed:
            for p in model.parameters():
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(3):
            junk = [torch.full((256, 256), float("nan")) for _ in range(20)]  # freed memory holding NaNs
            del junk
            scaler.scale(model(torch.randn(8, 256)).pow(2).sum()).backward()
            if step == 0:
                model.weight.grad[0, 0] = float("inf")  # an fp16 overflow: GradScaler skips this step
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return model.weight.detach()

    plain = train(fused=False, zeroed=False)
    assert torch.equal(train(fused=True, zeroed=True), plain)
    assert not torch.equal(train(fused=True, zeroed=False), plain)  # without: NaN here (what memory held)
    for recipe, line in [("torch_amp", 'optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)'),
                         ("apex_amp", 'optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)')]:
        assert line in (REPO / "recipes" / f"{recipe}.py").read_text(), recipe


@pytest.mark.parametrize("height, width, scale", [
    (375, 500, (0.08, 1.0)), (30, 40, (0.08, 1.0)), (224, 224, (0.5, 0.5)),
    # no box in 10 draws (every area larger than the image's): the central crop, by each of its three branches
    (100, 20, (2.0, 3.0)), (20, 100, (2.0, 3.0)), (50, 50, (2.0, 3.0))])
def test_crop_box_is_torchvisions_box_from_its_own_generator(height, width, scale):
    """common.data.crop_box (gpu_decode's boxes, drawn in a DataLoader thread beside the step's own draws) draws what
    torchvision's RandomResizedCrop.get_params draws from torch's global generator seeded alike, the fallback too."""
    from common.data import crop_box

    ratio = (3 / 4, 4 / 3)
    for seed in range(20):
        torch.manual_seed(seed)
        theirs = torchvision.transforms.RandomResizedCrop.get_params(torch.empty(3, height, width), scale, ratio)
        after = torch.rand(1)  # and each takes as many draws
        generator = torch.Generator().manual_seed(seed)
        assert crop_box(height, width, scale, ratio, generator) == tuple(theirs)
        assert torch.rand(1, generator=generator) == after
    if scale[0] > 1:
        top, left, h, w = crop_box(height, width, scale, ratio, torch.Generator())
        assert (h, w) == {(100, 20): (27, 20), (20, 100): (20, 27), (50, 50): (50, 50)}[height, width]
        assert (top, left) == ((height - h) // 2, (width - w) // 2)
