"""The ``deepdpm`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``, and is imported lazily so ``deepdpm --help`` stays fast. Every error a
user can cause (:class:`deepdpm_core.errors.DeepDPMError`, missing files) is one line and
exit code 2, without a traceback, and comes before the command's heavy imports. A command
that writes an output holds its lock while it runs (:mod:`pipeline.io.locks`). Idle OpenMP
and numba threads (the command's and its Ray workers') sleep instead of spinning
(:mod:`deepdpm_core.idle_threads`), unless the environment says otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.metadata
import logging
import os
import sys

# before torch, numpy, scikit-learn or numba load (each reads these once, when loaded):
# idle threads sleep instead of spinning; a value the user has set is kept
from deepdpm_core.idle_threads import NUMBA_PASSIVE, OPENMP_PASSIVE, set_defaults

set_defaults({**OPENMP_PASSIVE, **NUMBA_PASSIVE})

from deepdpm_core.errors import DeepDPMError  # noqa: E402
from pipeline.io.locks import command_lock  # noqa: E402

#: subcommand name -> module implementing it (order = order in ``--help``)
COMMANDS: dict[str, str] = {
    "demo": "pipeline.commands.demo",
    "shards": "pipeline.commands.shards",
    "extract": "pipeline.commands.extract",
    "embed": "pipeline.commands.embed",
    "fit": "pipeline.commands.fit",
    "predict": "pipeline.commands.predict",
    "report": "pipeline.commands.report",
}


def _available() -> dict[str, object]:
    modules = {}
    for name, module in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real missing dependency inside the module
                raise
    return modules


def _version() -> str:
    """The installed distribution's version (a source tree on ``PYTHONPATH`` has none)."""
    try:
        return importlib.metadata.version("deepdpm")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as every other error of the command: one line, exit code 2."""

    def error(self, message: str) -> None:  # argparse's hook; it must not return
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (subcommands that exist in this install)."""
    parser = _Parser(
        prog="deepdpm",
        description="DeepDPM clustering with an unknown number of clusters.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # not required: a bare ``deepdpm`` prints the help (the list of commands) instead
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _available().items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``deepdpm`` with ``argv``; returns the process exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's parser: "deepdpm fit: error: ..."
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # a usage error, as argparse's own: the help on stderr, exit 2
        parser.print_help(sys.stderr)
        return 2
    try:
        with command_lock(args):
            return int(args._run(args) or 0)
    except (DeepDPMError, OSError) as exc:  # bad input, or a path that cannot be read or written
        print(f"deepdpm {args.command}: error: {_printable(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a fit's says how to resume it
        print(f"deepdpm {args.command}: interrupted" + (f" {exc}" if str(exc) else ""),
              file=sys.stderr)
        return INTERRUPTED


def _printable(text: str) -> str:
    """``text`` with control characters (a terminal's escape sequences, copied from the
    data into an error) shown escaped, so an error line is one line and moves no cursor."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


#: the exit code of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130


def script() -> None:
    """The ``deepdpm`` program: :func:`main` on ``sys.argv``, exiting with its code.

    A command stopped by Ctrl-C has already closed what it wrote (a fit: the checkpoint
    that resumes it, its MLflow run, its line naming ``--resume``). It then leaves as soon
    as the exit handlers registered while it ran (Ray's, MLflow's, torch's) have run,
    without the interpreter's teardown of torch, faiss and Ray, which takes about a second.
    """
    code: int | None = None

    def leave_if_interrupted() -> None:  # registered first, so it runs after the others
        if code == INTERRUPTED:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    atexit.register(leave_if_interrupted)
    code = main()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    script()
