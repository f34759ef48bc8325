"""Find a usable NVIDIA apex (apex.amp + apex.parallel), or say in one line why there is none.

Four ways to not have it, each with its own fix (docs/apex.md):
- not installed: apex is not on PyPI and builds only from source;
- the unrelated PyPI package: `pip install apex` installs a Pyramid toolkit that has no amp;
- too new: NVIDIA removed apex.amp and apex.parallel in release 25.07 (25.04/25.05 still have them);
- no GPU: apex imports on a CPU-only machine, but amp.initialize refuses CPU parameters and apex DDP
  calls torch.cuda.current_stream(), so on the CPU it counts as unusable.
"""

import contextlib
import importlib
import importlib.util
import io
import os
import sys

from common.utils import first_line

BUILD_HINT = ("install NVIDIA apex 25.04 from source: pip install --no-build-isolation ./vendor/apex-25.04.tar.gz "
              "(docs/apex.md), or use --impl torch")
# Subpackages that only NVIDIA's apex has, with or without amp: tell "too new" from "unrelated".
NVIDIA_ONLY = ("optimizers", "normalization", "contrib", "transformer", "fused_dense", "mlp")


def apex_build():
    """Which apex build this is, for the `impl:` line: 'full' with its compiled extensions (apex_C from --cpp_ext,
    amp_C from --cuda_ext), else 'python-only', which is slow on a GPU: without amp_C, O1/O2 unscale each gradient
    with a host sync per tensor (apex/amp/scaler.py, unscale_python) and O2 copies masters back in a Python loop;
    without apex_C apex DDP flattens buckets in Python. Looked up on disk, not imported."""
    missing = [name for name in ("apex_C", "amp_C") if importlib.util.find_spec(name) is None]
    if not missing:
        return "full"
    return (f"python-only (no {' or '.join(missing)}: a host sync per gradient tensor at O1/O2; for the fused "
            "kernels rebuild with --cpp_ext --cuda_ext, docs/apex.md)")


class ApexUnavailable(Exception):
    """No usable NVIDIA apex; str() is the one-line reason with the fix, .short the reason alone."""

    def __init__(self, short, fix):
        super().__init__(f"{short}; {fix}")
        self.short = short


def _has(spec, name):
    """Whether the package at `spec` has the subpackage or module `name`, looked up on disk: no import."""
    return any(os.path.isdir(os.path.join(folder, name)) or os.path.isfile(os.path.join(folder, f"{name}.py"))
               for folder in spec.submodule_search_locations or ())


def load_apex(cuda):
    """(apex.amp, apex.parallel.DistributedDataParallel, apex) or ApexUnavailable. cuda: whether this process
    will train on a GPU (torch.cuda.is_available())."""
    spec = importlib.util.find_spec("apex")
    if spec is None:
        raise ApexUnavailable("NVIDIA apex is not installed (it is not on PyPI)", BUILD_HINT)
    where, nvidia = spec.origin, any(_has(spec, name) for name in NVIDIA_ONLY)
    if not (_has(spec, "amp") and _has(spec, "parallel")):
        if nvidia:
            raise ApexUnavailable(f"the NVIDIA apex at {where} is too new: apex.amp and apex.parallel were "
                                  "removed in 25.07", "pip uninstall apex, then " + BUILD_HINT)
        raise ApexUnavailable(f"the 'apex' at {where} is the unrelated PyPI package (a Pyramid toolkit, "
                              "no amp)", "pip uninstall apex, then " + BUILD_HINT)
    no_gpu = ApexUnavailable("NVIDIA apex needs a GPU and none is visible (amp.initialize refuses CPU parameters, "
                             "apex DDP uses CUDA streams)", "use --impl torch on the CPU")
    if nvidia and not cuda:  # not even imported: it cannot run here, and its import takes a second
        raise no_gpu
    try:
        # A python-only apex DDP prints its own warning on every rank when it first flattens a bucket (at the wrap,
        # apex/parallel/distributed.py import_flatten_impl): done here, into nothing; the impl: line says it once.
        with contextlib.redirect_stdout(io.StringIO()):
            apex = importlib.import_module("apex")
            amp = importlib.import_module("apex.amp")
            parallel = importlib.import_module("apex.parallel")
            distributed = sys.modules.get("apex.parallel.distributed")
            if hasattr(distributed, "import_flatten_impl"):
                distributed.import_flatten_impl()
    except Exception as exc:  # a broken build fails in its own ways
        raise ApexUnavailable(f"apex is installed but does not import ({type(exc).__name__}: {first_line(exc)})",
                              BUILD_HINT) from exc
    # An apex without NVIDIA's other subpackages is tests/fake_apex, a test double of apex on torch: only it may
    # say that it runs on the CPU.
    if not cuda and not getattr(apex, "RUNS_ON_CPU", False):
        raise no_gpu
    return amp, parallel.DistributedDataParallel, apex
