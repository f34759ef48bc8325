"""A TEST DOUBLE of the GPU count, for the checks a recipe makes before it touches a GPU (tests/test_launch.py).

Python imports this module at start-up when tests/fake_gpus is on PYTHONPATH. With FAKE_CUDA_DEVICE_COUNT=N,
torch.cuda.device_count() returns N; nothing else of torch.cuda is faked, so a recipe that goes on to use a GPU
fails at once: only what a recipe decides from the count alone (ddp_spawn.py --model-parallel on an odd count) can
be tested with it. The real function has the same name and no required argument (torch/cuda/__init__.py).
"""

import os

if os.environ.get("FAKE_CUDA_DEVICE_COUNT"):
    import torch.cuda

    _count = int(os.environ["FAKE_CUDA_DEVICE_COUNT"])
    torch.cuda.device_count = lambda: _count
