"""What tests/test_lm_tp.py, test_lm_pp.py and test_lm_fsdp_tp.py each read or check the same way: the printed
evaluation lines, a model.pt scored in one process, and a recipe's flag check failing with one line."""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import load_recipe, params
from jobs import error_lines

from common.lm import Transformer, read_text, split, val_windows


def step_lines(stdout):
    """{step: {train_loss, val_loss, val_bpb, lr}} of the printed eval lines."""
    return {int(m[1]): {k: float(v) for k, v in re.findall(r"(train_loss|val_loss|val_bpb|lr)=(\S+)", m[0])}
            for m in re.finditer(r"^step=(\d+)/\d+ .*$", stdout, re.M)}


def one_process_val_loss(path, model, seq_len, windows):
    """model.pt loaded strictly into a plain Transformer(**model) and scored on the validation windows in one
    process."""
    net = Transformer(**model)
    net.load_state_dict(params(path), strict=True)
    net.eval()
    x, y = val_windows(split(read_text()[0])[1], seq_len, windows)
    with torch.no_grad():
        return F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum").item() / y.numel()


def check_args_refuses(name, argv, world, line, capsys, monkeypatch):
    """recipes/NAME.py's check_args on `world` processes exits 2 with one error line starting with `line`."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    recipe = load_recipe(name)
    args = recipe.parse_args([*map(str, argv)])
    with pytest.raises(SystemExit) as exc:
        recipe.check_args(args, world)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.strip().splitlines() == error_lines(err), err
    assert len(error_lines(err)) == 1 and error_lines(err)[0].startswith(line), err
