"""One process of tests/warm.py's spawn(), forked from the warm server: fn(rank, *args) as torch.multiprocessing's
spawn runs it in a process of its own (torch/multiprocessing/spawn.py's _wrap): an exception's traceback goes to the
error file and the process exits 1; KeyboardInterrupt ends it quietly.

argv: PAYLOAD RANK ERROR_FILE. PAYLOAD holds two pickles: (the parent's authkey, its sys.path), read first so that
the second, (fn, args), unpickles as in the parent: fn's module imports, a Manager's proxies connect."""

import multiprocessing
import pickle
import sys
import traceback


def main():
    payload, rank, error_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(payload, "rb") as f:
        authkey, path = pickle.load(f)
        multiprocessing.current_process().authkey = authkey
        sys.path[:] = path
        fn, args = pickle.load(f)
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        pass
    except Exception:
        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


if __name__ == "__main__":
    main()
