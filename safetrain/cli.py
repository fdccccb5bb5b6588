"""The ``safetrain`` command line: ``check-config`` (and, as they land, ``demo``, ``report``, ``inspect``).

Every error path prints one clear line to stderr and exits non-zero: 2 for bad input (a bad
config, a missing file, an unknown command), 1 for a run that failed.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from .errors import SafetrainError

__all__ = ["main"]

_EPILOG = """examples:
  safetrain check-config configs/default.yaml
  safetrain check-config configs/lenient.yaml recovery.max_retries=8 log.dir=runs/a
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="safetrain",
        description="Training that survives numerical failure: detect, explain, recover.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    check = sub.add_parser(
        "check-config",
        help="validate a YAML config (with KEY=VALUE overrides) and print the resolved result",
        description="Validate a config file and overrides; print the resolved config, or the error and exit 2.",
    )
    check.add_argument("file", help="YAML config file, e.g. configs/default.yaml")
    check.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. recovery.max_retries=5")
    check.set_defaults(func=_check_config)
    return parser


def _check_config(args: argparse.Namespace) -> int:
    from .config import load_config, to_yaml

    cfg = load_config(args.file, args.overrides)
    sys.stdout.write(to_yaml(cfg))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except SafetrainError as exc:
        sys.stderr.write(f"safetrain {args.command}: error: {exc}\n")
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
