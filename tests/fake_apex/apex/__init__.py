"""TEST DOUBLE of NVIDIA apex, not apex. The real apex cannot be installed here (it is not on PyPI and
builds only on a CUDA machine), so the tests put this folder on PYTHONPATH to exercise the recipes'
apex code path. It implements, on plain torch, only the API surface the recipes call, and appends
each call to the file named by $FAKE_APEX_LOG so a test can check the order of calls.
"""

import os


def log(event):
    path = os.environ.get("FAKE_APEX_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {event}\n")
