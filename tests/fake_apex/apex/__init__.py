"""TEST DOUBLE of NVIDIA apex, not apex. Real apex runs only on CUDA, so the tests put this folder on
PYTHONPATH to exercise the recipes' apex code path on the CPU. It implements, on plain torch, only the API
surface the recipes call, behaves like apex 25.04 where the recipes depend on it (tests/test_apex.py's contract
test checks that against the real apex), and appends each call to the file named by $FAKE_APEX_LOG so a test
can check the order of calls.

Like real apex it refuses CPU parameters, unless FAKE_APEX_ON_CPU=1: then it declares RUNS_ON_CPU, which
common/apex_compat.py honours (real apex never declares it), and stands in for apex on a GPU.
"""

import os

RUNS_ON_CPU = os.environ.get("FAKE_APEX_ON_CPU") == "1"


def log(event):
    path = os.environ.get("FAKE_APEX_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event}\n")
