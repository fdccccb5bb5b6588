"""The ``safetrain`` command line: ``demo``, ``report``, ``inspect`` and ``check-config``.

Every error path prints one clear line to stderr and exits non-zero: 2 for bad input (a bad
config, a missing file, an unknown command, an unreadable snapshot), 1 for a run that failed.
The library only logs to the ``safetrain`` logger; this module is where that logger gets a
handler (compact lines on stderr that do not break a progress bar) and where results are printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Optional, Sequence

from ..errors import SafetrainError, TrainingInterrupted

__all__ = ["main"]

_EPILOG = """examples:
  safetrain demo                                   train with injected faults, see each caught and fixed
  safetrain demo --out runs/demo recovery.max_retries=8
  safetrain report runs/demo                       table of what happened, and report.png
  safetrain inspect runs/a/snapshots/snapshot-0000000100.safetensors
  safetrain inspect runs/a/snapshots
  safetrain check-config configs/default.yaml
  safetrain check-config configs/lenient.yaml recovery.max_retries=8 log.dir=runs/a

exit codes: 0 ok, 1 the run was aborted by the recovery policy, 2 bad input, 130 Ctrl-C, 143 SIGTERM
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
    demo = sub.add_parser(
        "demo",
        help="train a small model with injected faults (NaN rows, log(0), LR x1000, a loss spike) and recover",
        description="Train a small MLP on synthetic data while injecting faults; safetrain catches and recovers "
        "from each. Prints each detection as it happens, then a summary with the accuracy beside the same run "
        "without faults, and writes a run directory with the journal and report.png.",
        epilog="example:\n  safetrain demo --out runs/demo snapshot.every=50",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--config", metavar="FILE", help="YAML config file (default: safetrain's defaults)")
    demo.add_argument("--out", metavar="DIR", help="run directory (default: log.dir, else runs/demo-<timestamp>)")
    demo.add_argument("--epochs", type=int, default=None, metavar="N", help="epochs (default 6)")
    demo.add_argument("--seed", type=int, default=0, metavar="N", help="seed of data, weights and shuffle (default 0)")
    demo.add_argument("--no-clean", action="store_true", help="skip the reference run without faults")
    demo.add_argument("-v", "--verbose", action="store_true", help="also show routine events (snapshots)")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. recovery.max_retries=5")
    demo.set_defaults(func=_demo)
    rep = sub.add_parser(
        "report",
        help="summarize a run directory: events by kind and action, the counters, and report.png",
        description="Read RUN_DIR/events.jsonl and metrics.csv; print the events by kind and action with the "
        "first step of each and the summary counters, and write RUN_DIR/report.png (needs matplotlib). "
        "Lines it cannot use (not JSON, a field of the wrong type) are skipped and named; exit code 0 when the "
        "journal could be read, 2 when RUN_DIR or its journal is missing or unreadable.",
        epilog="example:\n  safetrain report runs/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the log.dir of a run)")
    rep.add_argument("--no-plot", action="store_true", help="print the table only")
    rep.set_defaults(func=_report)
    ins = sub.add_parser(
        "inspect",
        help="describe a snapshot file (step, size, checksums, finiteness, optimizer) or list a directory's",
        description="Read a safetensors snapshot fully (no code runs) and say what it holds and whether it is sound. "
        "For a directory, list its snapshots newest first with their step and whether each verifies. "
        "Exit code 1 when it reads but is not sound (a checksum mismatch or NaN/Inf in the state; for a directory: "
        "any snapshot), 2 when it cannot be read as a snapshot (or the directory holds none).",
        epilog="examples:\n  safetrain inspect runs/a/snapshots/snapshot-0000000100.safetensors\n"
        "  safetrain inspect runs/a/snapshots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ins.add_argument(
        "path",
        metavar="PATH",
        help="a snapshot-*.safetensors file, a sharded (FSDP2) step-* snapshot directory, or a directory of "
        "either (listed newest first)",
    )
    ins.set_defaults(func=_inspect)
    exp = sub.add_parser(
        "export",
        help="write one consolidated model file (safetensors) from a sharded FSDP2 snapshot",
        description="Gather every rank's model shards of a sharded snapshot into one safetensors file, keyed "
        "by the model's parameter names, that loads into the unsharded model (no process group needed).",
    )
    exp.add_argument("snapshot", metavar="SNAPSHOT", help="a step-* snapshot directory, or the snapshot directory")
    exp.add_argument("out", metavar="OUT", help="the safetensors file to write")
    exp.set_defaults(func=_export)
    check = sub.add_parser(
        "check-config",
        help="validate a YAML config (with KEY=VALUE overrides) and print the resolved result",
        description="Validate a config file and overrides; print the resolved config, or the error and exit 2. "
        "An override that sets a key already set by an earlier one wins, with a note above the config.",
    )
    check.add_argument("file", help="YAML config file, e.g. configs/default.yaml")
    check.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. recovery.max_retries=5"
    )
    check.set_defaults(func=_check_config)
    return parser


def _export(args: argparse.Namespace) -> int:
    from ..distributed.export import export_model

    tensors = export_model(args.snapshot, args.out)
    sys.stdout.write(f"wrote {args.out}: {len(tensors)} tensors, {sum(t.numel() for t in tensors.values())} values\n")
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from ..config import load_config, to_yaml
    from ..config.overrides import override_notes

    cfg = load_config(args.file, args.overrides)
    for note in override_notes(args.overrides):  # as YAML comments, so the output still loads
        sys.stdout.write(f"# note: {note}\n")
    sys.stdout.write(to_yaml(cfg))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoSize, demo_config, format_summary, run_demo

    if args.epochs is not None and args.epochs < 1:
        raise _UsageError(f"--epochs: got {args.epochs}; expected a positive number of epochs")
    cfg = demo_config(args.config, args.overrides, args.out)
    size = DemoSize(seed=args.seed, **({"epochs": args.epochs} if args.epochs else {}))
    sys.stderr.write(f"safetrain demo: training with injected faults; run directory {cfg.log.dir}\n")
    with _logging(cfg.log.level, args.verbose):
        demo = run_demo(cfg, size, clean=not args.no_clean)
    sys.stdout.write(format_summary(demo) + "\n")
    return 1 if demo.result is not None and demo.result.aborted else 0


def _report(args: argparse.Namespace) -> int:
    from ..rundir import ReportError, read_run
    from .report import format_report

    run = read_run(args.run_dir)
    sys.stdout.write(format_report(run) + "\n")
    if not args.no_plot:
        from .plot import plot_run

        try:
            png = plot_run(run)
        except ReportError as exc:
            sys.stderr.write(f"safetrain report: note: {exc}\n")
        else:
            sys.stdout.write(f"wrote {png}\n")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ..errors import SnapshotError
    from ..snapshot import format_directory, format_inspection, inspect_directory, inspect_snapshot

    if os.path.isdir(args.path):
        from ..distributed.inspection import inspect_sharded, inspect_sharded_directory, is_sharded

        if os.path.isfile(os.path.join(args.path, "rank-0.json")) or os.path.isfile(
            os.path.join(args.path, "safetrain.json")
        ):  # one sharded (FSDP2) snapshot directory
            info = inspect_sharded(args.path)
            sys.stdout.write(format_inspection(info) + "\n")
            return 0 if info["all_finite"] else 1
        rows = inspect_sharded_directory(args.path) if is_sharded(args.path) else inspect_directory(args.path)
        sys.stdout.write(format_directory(args.path, rows) + "\n")
        return 0 if all(row["ok"] for row in rows) else 1
    try:
        info = inspect_snapshot(args.path)
    except SnapshotError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:  # anything else a damaged file can raise
        raise SnapshotError(f"{args.path}: not a readable safetrain snapshot ({type(exc).__name__}: {exc})") from None
    sys.stdout.write(format_inspection(info) + "\n")
    return 0 if info.get("checksum_ok", True) and info.get("all_finite", True) else 1


class _UsageError(SafetrainError):
    """A bad command-line value that argparse cannot check by itself."""


class _Handler(logging.StreamHandler):
    """Writes through ``tqdm.write`` so that a progress bar on stderr is redrawn below the line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _logging:
    """Context manager: the ``safetrain`` logger prints compact lines to stderr; routine snapshots
    hidden unless verbose."""

    def __init__(self, level: str, verbose: bool) -> None:
        self.handler = _Handler(sys.stderr)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
        if not verbose:
            self.handler.addFilter(lambda r: r.levelno > logging.INFO or ": snapshot of step" not in r.getMessage())
        self.logger, self.level = logging.getLogger("safetrain"), level

    def __enter__(self) -> "_logging":
        self.saved = (self.logger.level, self.logger.propagate)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except TrainingInterrupted as exc:  # a signal fit caught and stopped on (Ctrl-C: a KeyboardInterrupt too)
        sys.stderr.write(f"safetrain {args.command}: interrupted: {_one_line(exc)}\n")
        return 128 + int(exc.signal or 2)
    except SafetrainError as exc:
        sys.stderr.write(f"safetrain {args.command}: error: {_one_line(exc)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"safetrain {args.command}: interrupted\n")
        return 130
    except BrokenPipeError:  # `safetrain report DIR | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _one_line(exc: BaseException) -> str:
    """The error on one printable line (a message may quote a file's content: escaped)."""
    from ..rundir.records import one_line

    return one_line(str(exc)) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
