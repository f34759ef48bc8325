"""The error branches of common/ that no recipe run takes, run here in-process, each on the real thing it guards
(torch.save, torchvision's CIFAR-100, the RecordIO reader, a real gloo process group), and each recipe's start-up
checks (check_args, which every rank runs before any collective). docs/gpu_only_lines.md lists what no CPU test
runs; these were CPU lines in that list."""

import argparse
import errno
import importlib
import os
import struct
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO, load_recipe, run_script, spawn_gloo
from torch.utils.data import TensorDataset

from common import apex_compat, checkpoint, data, lm, loader, recordio, utils
from common.apex_compat import ApexUnavailable, load_apex
from common.checkpoint import (
    CheckpointError,
    check_epochs_left,
    check_same_run,
    load_checkpoint,
    load_weights,
    save_atomic,
)
from common.comm_hooks import PowerSGDByParameter
from common.data import (
    DataError,
    NameFailingSamples,
    SyntheticImages,
    build_datasets,
    check_full_batch,
    exclusive_lock,
)
from common.loader import DataLoaderX
from common.recordio import (
    IndexedRecordReader,
    IRHeader,
    MXFaceDataset,
    RecordIOError,
    RecordWriter,
    encode_record,
    pack,
)


# --------------------------------------------------------------------------------- checkpoints
class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def test_save_atomic_lets_an_error_that_is_not_the_disks_through_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic({"epoch": 1}, path)
    with pytest.raises(RuntimeError, match="refuses to be pickled"):  # torch.save's own error, not a SaveError
        save_atomic({"epoch": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=True) == {"epoch": 1} and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert checkpoint._free(tmp_path / "no" / "such" / "folder" / "x.pt") == "unknown"  # the free space, if it can


def test_load_checkpoint_names_a_missing_file_and_one_of_another_recipe(tmp_path):
    with pytest.raises(CheckpointError, match=r"^cannot load \S+/absent\.pt \(FileNotFoundError: .*No such file"):
        load_checkpoint(tmp_path / "absent.pt", "cpu")
    torch.save({"model": {}}, tmp_path / "weights.pt")
    with pytest.raises(CheckpointError) as why:
        load_checkpoint(tmp_path / "weights.pt", "cpu", require=("model", "optimizer", "epoch"))
    assert str(why.value).endswith("is not a checkpoint of this recipe: it has no ['optimizer', 'epoch'] (bare "
                                   "weights? start from them with ddp_checkpoint.py --init-from)")
    assert why.value.code == 2


def test_a_finished_checkpoint_leaves_nothing_to_resume():
    check_epochs_left("ckpt.pt", 2, 3)  # one epoch left: goes on
    with pytest.raises(CheckpointError, match=r"^ckpt\.pt already finished all 3 epochs; nothing to resume$") as why:
        check_epochs_left("ckpt.pt", 3, 3)
    assert why.value.code == 2 and not why.value.all_ranks  # the same on every rank: said once per node


def test_a_resume_names_each_flag_that_would_change_the_run(capsys):
    """check_same_run: the flags that shape the run, each one that differs named; --lr only at the same batch (its
    default follows the batch, which follows the GPU count; the optimizer's saved rate goes on there, said in a line);
    flags it does not list (the workers, the out-dir) may change."""
    saved = {"arch": "tiny", "epochs": 2, "seed": 0, "lr": 0.1, "batch_size": 128, "workers": 3, "amp_dtype": "fp32"}
    args = argparse.Namespace(**{**saved, "workers": 1})
    check_same_run("l.pt", saved, args)
    assert capsys.readouterr().out == ""
    with pytest.raises(CheckpointError) as why:
        check_same_run("l.pt", saved, argparse.Namespace(**{**saved, "seed": 7, "lr": 0.4, "amp_dtype": "bf16"}))
    assert str(why.value) == "l.pt was trained with --seed 0 (this run: 7), --lr 0.1 (this run: 0.4), --amp-dtype " \
                             "fp32 (this run: bf16); resume with the same flags" and why.value.code == 2 \
                             and not why.value.all_ranks
    check_same_run("l.pt", saved, argparse.Namespace(**{**saved, "lr": 0.0984375, "batch_size": 126}))  # on 3 GPUs
    assert capsys.readouterr().out == ("resume: l.pt was trained at --batch-size 128 --lr 0.1: its learning rate "
                                       "schedule goes on (this run's --lr 0.0984375 at --batch-size 126 is not used)\n")
    del saved["amp_dtype"]  # a recipe without the flag (ddp_checkpoint's args)
    check_same_run("l.pt", saved, argparse.Namespace(**{**saved, "amp_dtype": "bf16"}))


def test_load_weights_takes_a_wrappers_keys_and_a_model_with_a_submodule_named_module(tmp_path):
    class Wrapped(torch.nn.Module):  # a model of the user's own whose submodule is called `module`
        def __init__(self):
            super().__init__()
            self.module, self.head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)

    model = Wrapped()
    load_weights(model, model.state_dict(), "own.pt")  # its own keys, "module.weight" among them
    plain = torch.nn.Linear(3, 2)
    load_weights(plain, {f"module.{k}": v for k, v in plain.state_dict().items()}, "ddp.pt")  # a DDP wrapper's
    outer = torch.nn.Module()  # every key of its own starts "module.": a DDP wrapper's start "module.module."
    outer.module = torch.nn.Linear(3, 2)
    load_weights(outer, {f"module.{k}": v for k, v in outer.state_dict().items()}, "ddp_outer.pt")
    with pytest.raises(CheckpointError, match=r"^other\.pt does not fit this model \(its --arch, and the classes and "
                                              r"--image-size of its data\): wrong shape \['weight'\]$"):
        load_weights(plain, torch.nn.Linear(4, 2).state_dict(), "other.pt")


# --------------------------------------------------------------------------------------- data
def test_a_plain_for_loop_over_a_named_dataset_stops_at_its_end():
    images = SyntheticImages(5, image_size=4, split="val")
    named = NameFailingSamples(images, "val")
    assert [label for _, label in named] == [label for _, label in images]  # IndexError past the end ends the loop
    with pytest.raises(IndexError):
        named[5]


def test_a_folder_that_cannot_be_locked_is_used_unlocked_after_a_warning(tmp_path, monkeypatch, capsys):
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(data.fcntl, "flock", no_locks)  # NFS mounted without its lock service fails flock() so
    ran = []
    with exclusive_lock(tmp_path / "cifar"):
        ran.append(True)
    assert ran and capsys.readouterr().err == (
        f"warning: cannot lock {tmp_path / 'cifar' / '.download.lock'} (No locks available): nodes sharing this "
        "folder may download into it at once; download once on one node first\n")


def test_the_data_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=rf"^no CIFAR-100 in '{tmp_path}' \(Dataset not found or corrupted.*\); run "
                                        "once online to download it$"):
        build_datasets("cifar100", str(tmp_path), 32)  # torchvision's own check of the folder
    with pytest.raises(DataError, match=r"^unknown dataset 'imagenet'; use synthetic, cifar100 or imagefolder$"):
        build_datasets("imagenet", str(tmp_path))
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    # Tests run as root here, which reads any folder: the permission check is given a folder it may not read.
    monkeypatch.setattr(data.os, "access", lambda path, mode: not str(path).endswith("train"))
    with pytest.raises(DataError, match=rf"^cannot read '{tmp_path}/train' \(permissions\); expected ROOT/train/"):
        build_datasets("imagefolder", str(tmp_path), 16)
    assert issubclass(DataError, utils.OneLineError) and DataError.code == 2 and DataError.all_ranks


def test_a_training_set_without_one_full_batch_is_refused():
    check_full_batch(1, 126, 126)
    with pytest.raises(DataError, match=r"^125 training samples make no full batch of 126; lower --batch-size$") as why:
        check_full_batch(0, 125, 126)
    assert why.value.code == 2 and not why.value.all_ranks  # every rank counts the same steps: said once per node


# ----------------------------------------------------------------------------------- recordio
def test_recordio_refuses_what_dmlc_cannot_hold_or_would_read_wrong(tmp_path, monkeypatch):
    monkeypatch.setattr(recordio, "MAX_RECORD_BYTES", 16)  # 2**29 bytes for real: half a GB to build
    with pytest.raises(ValueError, match="^record of 17 bytes: RecordIO records must be smaller than 2"):
        encode_record(bytes(17))
    monkeypatch.undo()
    with RecordWriter(tmp_path / "a.idx", tmp_path / "a.rec") as writer:
        writer.write_idx(0, b"first")
        with pytest.raises(ValueError, match=r"a\.idx: key 0 written twice$"):
            writer.write_idx(0, b"again")
    # A record holding the aligned magic is split in two chunks (first, last); make the last one a whole record's.
    split = bytearray(encode_record(b"head" + recordio._MAGIC_BYTES + b"tail"))
    first_length = struct.unpack_from("<I", split, 4)[0] & recordio._LENGTH_MASK
    second = 8 + first_length
    assert struct.unpack_from("<I", split, second + 4)[0] >> 29 == 3  # the last part
    struct.pack_into("<I", split, second + 4, 4)  # cflag 0 (whole), 4 bytes
    (tmp_path / "b.rec").write_bytes(bytes(split))
    (tmp_path / "b.idx").write_text("\n7\t0\n\n")  # blank lines are skipped, as mxnet skips them
    with IndexedRecordReader(tmp_path / "b.idx", tmp_path / "b.rec") as reader:  # closed on leaving the block
        assert reader.keys.tolist() == [7]
        with pytest.raises(RecordIOError, match=r"b\.rec: key 7: multi-part record broken: the chunk at offset 12 "
                                                r"has cflag 0, expected a middle \(2\) or last \(3\) part$"):
            reader.read_idx(7)
    assert reader._fd is None


def test_mx_face_dataset_names_a_record_that_is_no_image_and_a_reader_it_lacks(tmp_path, monkeypatch):
    with RecordWriter(tmp_path / "train.idx", tmp_path / "train.rec") as writer:
        writer.write_idx(1, pack(IRHeader(0, 3.0, 1, 0), b"not an image"))
    faces = MXFaceDataset(tmp_path)  # no header record 0: every key is an image
    with pytest.raises(RecordIOError, match=r"train\.rec: key 1: payload is not a readable image \(cannot identify"):
        faces[0]
    with pytest.raises(ValueError, match="^reader must be 'python' or 'mxnet', not 'pil'$"):
        MXFaceDataset(tmp_path, reader="pil")
    monkeypatch.setitem(sys.modules, "mxnet", None)  # as where mxnet is not installed: its import fails
    with pytest.raises(RecordIOError, match=r"^MXFaceDataset\(reader='mxnet'\): mxnet does not import "
                                            r"\(ModuleNotFoundError: "):
        MXFaceDataset(tmp_path, reader="mxnet")


# ----------------------------------------------------------------------------------- loader
class Slow(TensorDataset):
    def __getitem__(self, index):
        time.sleep(1.3)  # longer than DataLoaderX's 1 s wait for the next batch
        return super().__getitem__(index)


def test_dataloaderx_waits_for_a_slow_batch_and_stops_after_close(monkeypatch):
    batches = iter(DataLoaderX("cpu", Slow(torch.arange(2.0)), batch_size=1))
    assert iter(batches) is batches
    assert next(batches)[0].tolist() == [0.0]  # waited past one 1 s timeout, still there
    batches.close()
    with pytest.raises(StopIteration):
        next(batches)
    # A producer that ended without its end marker (it cannot, short of a bug): an error, not a hang.
    monkeypatch.setattr(loader, "_produce", lambda *args: None)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="^DataLoaderX: the prefetch thread ended without a batch or an error$"):
        next(iter(DataLoaderX("cpu", TensorDataset(torch.arange(4.0)), batch_size=2)))
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------------ utils
def test_result_line_writes_a_non_finite_value_as_null():
    assert utils.result_line(loss=float("nan"), values=[1.0, float("inf")]) == \
        'RESULT {"loss": null, "values": [1.0, null]}'


def _rank_with_its_stderr_in(folder, rank, port):
    """One of two gloo ranks, whose stderr goes to folder/RANK.err from here on."""
    err = os.open(f"{folder}/{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)  # everything the rank prints on stderr from here on, its Python and C++ alike, into a file
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def _die_worker(folder, rank, port, results):
    _rank_with_its_stderr_in(folder, rank, port)
    dist.barrier()  # both reach die() together: rank 0 says it and exits, rank 1 waits its grace quietly
    utils.die("the same verdict on every rank")


def test_die_says_a_shared_error_once_and_the_other_ranks_wait_quietly(tmp_path):
    with pytest.raises(mp.ProcessExitedException) as ended:
        spawn_gloo(partial(_die_worker, tmp_path))  # each rank's stderr into a file of its own
    assert ended.value.exit_code == 2 and ended.value.error_index == 0  # rank 0 left first; rank 1 was still waiting
    err = "".join(path.read_text() for path in sorted(tmp_path.glob("*.err")))
    assert err.count("error: the same verdict on every rank\n") == 1 and "[rank" not in err, err


def _quiet_die_worker(folder, rank, port, results):
    _rank_with_its_stderr_in(folder, rank, port)
    if rank == 1:  # alone: rank 0 goes on (it would say the same verdict when it got there)
        utils.DIE_GRACE_SECONDS = 0.2
        utils.die("a verdict rank 0 says")  # leaves with os._exit
    dist.destroy_process_group()


def test_die_on_another_rank_waits_its_grace_then_leaves_without_a_word(tmp_path):
    # A shared error (all_ranks=False) met first by rank 1: it waits DIE_GRACE_SECONDS for rank 0 to say it, then
    # leaves with the code, having printed nothing.
    with pytest.raises(mp.ProcessExitedException) as ended:
        spawn_gloo(partial(_quiet_die_worker, tmp_path))
    assert (ended.value.exit_code, ended.value.error_index) == (2, 1)
    assert (tmp_path / "1.err").read_text() == ""


CTRL_C_WITH_A_GROUP = """
import torch.distributed as dist
from common.utils import one_line_errors

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
with one_line_errors():
    raise KeyboardInterrupt  # as it reaches main() where the recipe's own SIGINT handler is not installed
"""


def test_small_error_lines_and_exits(tmp_path):
    # DETAIL's mismatch text without the ranks' fingerprints: its first line, no invented detail.
    assert utils.mismatch_line("Detected mismatch between collectives on ranks.\nmore") == (
        "the ranks called different collectives (Detected mismatch between collectives on ranks.)")
    assert utils._own_stack(RuntimeError("never raised")) == []  # no traceback: no frames of this rank to show
    # Ctrl-C with a process group up: exit 130 quietly, through os._exit (a normal exit can abort in the group's
    # destructors).
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_WITH_A_GROUP)
    proc = run_script([script], env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "")
    with pytest.raises(ValueError, match="keys P and Q by parameter: batch_tensors_with_same_shape=False"):
        PowerSGDByParameter(torch.nn.Linear(2, 2), matrix_approximation_rank=1, batch_tensors_with_same_shape=True)


def test_a_text_that_is_empty_or_a_default_corpus_this_python_lacks_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "blank.txt").write_text(" \n\n")
    with pytest.raises(lm.TextError, match=f"^--text {tmp_path / 'blank.txt'}: empty$"):
        lm.read_text(tmp_path / "blank.txt")
    files, version, size, digest = lm.corpus_files()
    monkeypatch.setattr(lm, "corpus_files", lambda: ([*files[:2], tmp_path / "gone.py", tmp_path / "gone2.py"],
                                                     version, size, digest))
    with pytest.raises(lm.TextError) as why:
        lm.read_text(None)
    assert str(why.value) == (f"the default corpus needs {tmp_path / 'gone.py'} (and 1 more), which this Python does "
                              f"not have (listed in {lm.CORPUS_LIST.name} from Python {version}); pass --text FILE|DIR")


# ----------------------------------------------------------------------------------- apex
def test_an_apex_that_does_not_import_is_one_line_with_the_build_command(tmp_path, monkeypatch):
    for name in ("amp", "parallel", "optimizers"):  # NVIDIA's layout; its amp fails as a build for another CUDA does
        (tmp_path / "apex" / name).mkdir(parents=True)
        (tmp_path / "apex" / name / "__init__.py").write_text("")
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "amp" / "__init__.py").write_text("raise ImportError('libcudart.so.11.0: cannot open')")
    before = {n: m for n, m in sys.modules.items() if n == "apex" or n.startswith("apex.")}
    for name in before:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(ApexUnavailable) as why:
            load_apex(cuda=True)
    finally:  # the broken apex leaves this process; the real one (if it was imported) comes back
        for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
            del sys.modules[name]
        sys.modules.update(before)
    assert str(why.value) == ("apex is installed but does not import (ImportError: libcudart.so.11.0: cannot open); "
                              f"{apex_compat.BUILD_HINT}")


def test_a_gpu_triton_cannot_build_for_is_named_before_the_first_step(monkeypatch):
    # A P100 or a GTX 10xx (compute capability 6.x), or no triton: inductor's GPUTooOldForTriton or TritonMissing at
    # the first step, a traceback on every rank; harness.check_compiler says it in one line instead.
    import torch.utils._triton

    from common.compiler import missing_compiler

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (6, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla P100-PCIE-16GB")
    assert missing_compiler(torch.device("cuda", 0)) == (
        "torch.compile on a GPU needs Triton, which is not installed here or does not build for Tesla P100-PCIE-16GB "
        "(compute capability 6.0; Triton needs 7.0 or newer): install triton, or run without --compile")


# ------------------------------------------------------------------------- recipes' start-up
@pytest.mark.parametrize(("recipe", "flags", "line"), [
    ("torch_amp", ["--accum-steps", "0"], "error: --accum-steps 0 must be >= 1"),
    ("torch_amp", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("apex_amp", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("fsdp", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("fsdp", ["--resume", "/tmp"],
     "[rank 0] error: --resume /tmp is a folder: give the latest.pt beside it (OUT_DIR/checkpoint/latest.pt), which "
     "names its shards"),
    ("ddp_checkpoint", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("ddp_checkpoint", ["--init-from", "/no/model.pt"], "[rank 0] error: --init-from /no/model.pt: no such file"),
    ("ddp_comm_hooks", ["--init-from", "/no/model.pt"], "[rank 0] error: --init-from /no/model.pt: no such file"),
    ("ddp_comm_hooks", ["--powersgd-rank", "0"],
     "error: --powersgd-rank must be >= 1 and --powersgd-start >= 2 (DDP settles its buckets after step 1)"),
    ("ddp_zero", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("gpu_decode", ["--resume", "/no/such.pt"], "[rank 0] error: --resume /no/such.pt: no such file"),
    ("ddp_compile", ["--bucket-cap-mb", "0.5"],
     "error: --bucket-cap-mb 0.5 must be >= 1 under torch.compile (DDPOptimizer's first bucket is 1 MB)"),
    ("ddp_spawn", ["--model-parallel", "--arch", "resnet18"],
     "error: --model-parallel splits the tiny CNN (features | fc); use --arch tiny, or split your model likewise"),
    ("mx_face_prefetch", ["--rec", "/no/faces"],
     "[rank 0] error: --rec /no/faces: no such folder (expected train.rec + train.idx there, or --rec synthetic)"),
])
def test_each_recipe_refuses_a_bad_flag_before_any_collective(recipe, flags, line, capsys):
    module = load_recipe(recipe)
    with pytest.raises(SystemExit) as leaving:
        module.check_args(module.parse_args(flags), 1)
    assert leaving.value.code == 2 and capsys.readouterr().err == f"{line}\n"


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (REPO / "recipes").glob("*.py")))
def test_a_mistyped_flag_prints_argparse_s_usage_on_each_node_s_local_rank_0_alone(recipe, monkeypatch, capsys):
    # Every rank parses the command line: a typo on 8 GPUs printed 8 usage blocks. Local rank 0 prints argparse's
    # usage and error; another rank goes to die() (nothing printed, exit 2 after its grace) and --help prints nothing.
    module = load_recipe(recipe)
    monkeypatch.setattr(utils, "DIE_GRACE_SECONDS", 0)
    monkeypatch.setenv("WORLD_SIZE", "3")
    for local_rank, printed in (("1", ""), ("0", "usage: ")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as leaving:
            module.parse_args(["--no-such-flag"])
        out, err = capsys.readouterr()
        assert leaving.value.code == 2 and out == "" and err.startswith(printed), (local_rank, err)
        assert err.count("usage:") == (local_rank == "0") and err.count("unrecognized arguments") == err.count("usage:")
        with pytest.raises(SystemExit) as leaving:
            module.parse_args(["--help"])
        assert leaving.value.code == 0 and capsys.readouterr().out.count("usage:") == (local_rank == "0")


# ------------------------------------------------------------------------------ tools' bad input
def refused(argv, line, code=2):
    """`python ARGV` in a new interpreter: `line` alone on stderr, nothing on stdout, exit `code` (no traceback)."""
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, "", f"{line}\n")


@pytest.mark.parametrize(("out", "line"), [
    ("/proc/x/p.png", "--out /proc/x/p.png: cannot make or write its folder (No such file or directory); pass a path "
     "you can write"),
    ("{tmp}/file/p.png", "--out {tmp}/file/p.png: cannot make or write its folder (Not a directory); pass a path you "
     "can write"),
    ("{tmp}/p.txt", "--out {tmp}/p.txt: not a picture matplotlib can write (it goes by the suffix); give a .png, .svg "
     "or .pdf path (or none: .png)"),
    ("{tmp}", "--out {tmp} is a folder: pass a file path in it, such as {tmp}/plot.png"),  # was written to {tmp}.png
], ids=["no-folder", "parent-is-a-file", "no-such-format", "a-folder"])
def test_plot_tb_refuses_an_out_it_cannot_write_before_reading_the_events(tmp_path, out, line):
    # Each was a traceback after the events were read and drawn (FileNotFoundError, FileExistsError, ValueError).
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as writer:
        writer.add_scalar("train/lr", 0.1, 1)
    (tmp_path / "file").write_text("a file, not a folder")
    refused(["tools/plot_tb.py", tmp_path / "tb", "--out", out.format(tmp=tmp_path)],
            "error: " + line.format(tmp=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "tb"]  # nothing written


@pytest.mark.parametrize(("args", "line"), [
    (["--export", "/proc/x"], "--export /proc/x: cannot make or write that folder (No such file or directory)"),
    (["--export", "{tmp}/file/digits"], "--export {tmp}/file/digits: cannot make or write that folder (Not a "
     "directory)"),
    (["--out", "{tmp}/file/out"], "--out {tmp}/file/out: cannot make or write that folder (Not a directory)"),
    (["--data", "{tmp}/file/data", "--out", "{tmp}/out"], "--data {tmp}/file/data: cannot make or write that folder "
     "(Not a directory)"),
], ids=["export-no-folder", "export-parent-is-a-file", "out-parent-is-a-file", "data-parent-is-a-file"])
def test_real_data_refuses_a_folder_it_cannot_write_before_any_image(tmp_path, args, line):
    # Each was a traceback from mkdir: at start-up (--out), or after the digits were loaded (--export, --data).
    (tmp_path / "file").write_text("a file, not a folder")
    refused(["tools/real_data.py", *(a.format(tmp=tmp_path) for a in args)],
            f"real_data: error: {line.format(tmp=tmp_path)}; pass one you can write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
