"""The `attnx` command: `attnx info | check | bench | demo` (also `python -m attnx ...`)."""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = {
    "info": ("attnx.info", "what is built and usable here"),
    "check": ("attnx.check", "every usable backend on every device here against the float64 "
                             "reference; exit status 1 on any failure"),
    "bench": ("attnx.bench", "the benchmark suite: a table, plots and a JSON file of results"),
    "demo": ("attnx.demo", "train a small attention model on generated data and plot its alignments"),
}


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (sizes, counts), refused with argparse's usage error."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {n}")
    return n


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="attnx", description="fused attention kernels for PyTorch")
    parser.add_argument("command", choices=sorted(_COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in _COMMANDS.items()))
    # Each command parses its own options, so `attnx bench --help` shows bench's.
    args, rest = parser.parse_known_args(argv[:1])
    module = importlib.import_module(_COMMANDS[args.command][0])
    return module.main(argv[1:] + rest) or 0


if __name__ == "__main__":
    sys.exit(main())
