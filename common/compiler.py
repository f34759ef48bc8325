"""What torch.compile needs from this machine to build its kernels, checked before training (harness.check_compiler).

On the CPU inductor writes C++ and compiles it (g++, or $CXX). On a GPU its kernels go through Triton, which compiles
its kernel launcher from C that includes Python.h ($CC, gcc or clang, and Python's headers: triton/runtime/build.py),
and Triton itself builds only for GPUs of compute capability 7.0 or newer.
Without them the first step fails inside inductor, with a traceback on every rank. Local."""

import os
import shutil
import sysconfig


def missing_compiler(device):
    """Why torch.compile cannot build kernels for `device` here (one line), or None."""
    import torch._dynamo.config  # imported by DDP anyway

    if torch._dynamo.config.disable:  # torch.compile returns the module as it was: every step would run eager
        return "torch.compile is switched off in this environment (TORCH_COMPILE_DISABLE=1): unset it to compile"
    if device.type == "cpu":
        from torch._inductor import cpp_builder  # here: inductor's import is not free, and only ddp_compile needs it
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler:
            return ("torch.compile on the CPU needs a C++ compiler and none works here: install g++ (apt install g++) "
                    "or point CXX at one")
        return None
    from torch.utils._triton import has_triton  # inductor's own test: Triton installed, and a GPU it builds for

    if not has_triton():  # else GPUTooOldForTriton or TritonMissing at the first step, a traceback on every rank
        try:
            major, minor = torch.cuda.get_device_capability(device)
            gpu = (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}; Triton needs 7.0 or "
                   "newer)")
        except (RuntimeError, AssertionError):  # no usable CUDA: no GPU to name
            gpu = "this GPU (Triton needs compute capability 7.0 or newer)"
        return (f"torch.compile on a GPU needs Triton, which is not installed here or does not build for {gpu}: "
                "install triton, or run without --compile")
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):  # where Triton looks, in order
        return ("torch.compile on a GPU needs a C compiler for Triton's kernel launcher and none is here: install "
                "gcc (apt install gcc) or point CC at one")
    scheme = sysconfig.get_default_scheme()  # Triton's include folder (for Debian's posix_local: its prefix's)
    headers = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not os.path.isfile(os.path.join(headers, "Python.h")):
        return (f"torch.compile on a GPU needs Python's C headers for Triton's kernel launcher, and {headers} has "
                "no Python.h: install them (apt install python3-dev, or your Python's -dev package)")
    return None
