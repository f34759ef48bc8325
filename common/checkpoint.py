"""Checkpoint loading that fails with one line: a truncated file, a file of another kind, or weights for
another architecture raise CheckpointError naming the file and the mismatch, before anything is written."""

import torch

from common.utils import OneLineError, first_line


class CheckpointError(OneLineError):
    """The file cannot be resumed from; the message names it and says why."""

    code = 2  # bad input, like a bad flag


def load_checkpoint(path, map_location, require=()):
    """torch.load(weights_only=True) onto `map_location` (this rank's device, not the one it was saved
    from). `require`: the keys a checkpoint of this recipe must have."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (PermissionError, FileNotFoundError, IsADirectoryError) as exc:  # the system's own words say it
        raise CheckpointError(f"cannot load {path} ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # truncated (OSError EINVAL from the zip reader), not a zip, pickled objects, OOM
        raise CheckpointError(f"cannot load {path} ({type(exc).__name__}): truncated, or not a checkpoint of "
                              f"these recipes ({first_line(exc)[:200]})") from exc
    missing = [key for key in require if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a checkpoint of this recipe: it has no {missing[:3]} "
                              "(bare weights? start from them with ddp_checkpoint.py --init-from)")
    return ckpt


def load_weights(model, state, path):
    """Strict load that also takes keys saved from a DDP/DataParallel wrapper ("module.conv1.weight")."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        found = [f"{what} {keys[:3]}" for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                         ("wrong shape", wrong)) if keys]
        raise CheckpointError(f"{path} does not fit this --arch: {', '.join(found)}")
    model.load_state_dict(state)
