"""argparse for the tools, its errors one line: `NAME: error: MESSAGE` on stderr and exit 2, not argparse's usage
block above the message (a bad flag should read as one line in a log); and the checks of an output path that run
before a tool's work. Standard library only (picture_output imports matplotlib when it is called)."""

import argparse
import sys
import tempfile
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, name, **kwargs):
        super().__init__(**kwargs)
        self.name = name  # what the message starts with, whatever sys.argv[0] is (a test calls main() in-process)

    def error(self, message):
        print(f"{self.name}: error: {message}", file=sys.stderr)
        sys.exit(2)


def unwritable(folder, make=True):
    """Why no file can be written in `folder`, made here with its parents where missing; None when one can. It makes
    and removes a file there, since permission bits do not tell (root passes every os.access check, a read-only
    mount or /proc does not): a tool checks its output folder so, before its long work, not after it. make=False:
    nothing is made; the nearest folder of the path that exists is probed (the one the missing ones would go in)."""
    folder = Path(folder)
    try:
        if make:
            folder.mkdir(parents=True, exist_ok=True)
        else:
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def unwritable_folder(label, folder, make=True):
    """unwritable(folder, make) as one line's message ("--out x: cannot make or write that folder (why); ..."), or
    None when a file can be written there. label: the flag, or the folder alone for a positional argument."""
    why = unwritable(folder, make)
    return f"{label}: cannot make or write that folder ({why}); pass one you can write" if why else None


def write_failed(flag, path, exc):
    """The one line for a write that failed after the checks before the work (a full disk, a file or a folder made
    at that path since)."""
    return f"{flag} {path}: cannot write it ({exc.strerror or exc}); pass a path you can write"


def save_picture(fig, flag, path, dpi):
    """fig.savefig(path, dpi=dpi) with the path's folder made: None, or write_failed's line."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        return write_failed(flag, path, exc)
    return None


def unwritable_output(*flags_and_paths):
    """The first of (flag, path) pairs whose file cannot be written, as one line's message ("--json x/y.json: cannot
    make or write its folder (why); ..."), None when each can (a path of None is skipped). Nothing is made: the
    tool makes the folder when it writes the file, after its work; this is checked before it."""
    for flag, path in flags_and_paths:
        why = path is not None and unwritable(Path(path).parent, make=False)
        if why:
            return f"{flag} {path}: cannot make or write its folder ({why}); pass a path you can write"
    return None


def picture_output(flag, path):
    """(the file matplotlib's savefig writes for `path`, None), or (None, one line's message) where it can write none
    there: savefig goes by the suffix, so one it has no writer for is refused now, not after the drawing, and a path
    without one gets .png, as savefig itself adds it (its default format), so that the tool names the file it wrote.
    A folder, and a path whose folder cannot be made or written (unwritable_output), are refused too."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    if path.is_dir():  # before the suffix: savefig would write a folder `runs` given as --out to runs.png beside it
        return None, f"{flag} {path} is a folder: pass a file path in it, such as {path / 'plot.png'}"
    if not path.suffix:
        path = path.with_name(path.name.rstrip(".") + ".png")
    if path.suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        return None, (f"{flag} {path}: not a picture matplotlib can write (it goes by the suffix); give a .png, .svg "
                      "or .pdf path (or none: .png)")
    problem = unwritable_output((flag, path))
    return (None, problem) if problem else (path, None)
