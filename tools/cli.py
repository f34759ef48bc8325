"""argparse for the tools, its errors one line: `NAME: error: MESSAGE` on stderr and exit 2, not argparse's usage
block above the message (a bad flag should read as one line in a log). Standard library only."""

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, name, **kwargs):
        super().__init__(**kwargs)
        self.name = name  # what the message starts with, whatever sys.argv[0] is (a test calls main() in-process)

    def error(self, message):
        print(f"{self.name}: error: {message}", file=sys.stderr)
        sys.exit(2)
