"""The ``rlaudit`` command: a root group, one module per subcommand, no math here.

    rlaudit list                       scenarios, backends, invariants
    rlaudit run SCENARIO... | --all    replay, check invariants and goldens, log to MLflow
    rlaudit golden bless|calibrate     regenerate goldens explicitly / propose tolerances
    rlaudit train CONFIG               the reference trainer
    rlaudit record ...                 write a fixed rollout (reference sampler or vLLM)
    rlaudit report                     drift across logged runs (terminal, Markdown, HTML)
    rlaudit fuzz --target X            Hypothesis over a target's stage checks and train_step

Exit codes: 0 ok, 1 a check failed, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading

import rlaudit
from rlaudit.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, RlauditError

#: subcommand -> module (each has add_parser(subparsers) and run(args) -> int)
COMMANDS = {
    "list": "rlaudit.cli.list_cmd",
    "run": "rlaudit.cli.run",
    "golden": "rlaudit.cli.golden",
    "train": "rlaudit.cli.train",
    "record": "rlaudit.cli.record",
    "report": "rlaudit.cli.report",
    "fuzz": "rlaudit.cli.fuzz",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 2, as argparse does, with our prefix
        self.print_usage(sys.stderr)
        print(f"rlaudit: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlaudit", description="Correctness-regression and metric-audit harness "
                     "for LLM RL post-training.")
    parser.add_argument("--version", action="version", version=f"rlaudit {rlaudit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in COMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args))
    except RlauditError as e:
        print(f"rlaudit: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.filename is None or isinstance(e, BrokenPipeError):
            raise  # not about a path: a socket, the reader of stdout leaving (entry's)
        # a path that could not be read or written: the user's to fix, no traceback
        print(f"rlaudit: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("rlaudit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except SystemExit as e:  # argparse: --help, --version, usage errors
        if e.code is not None and not isinstance(e.code, int):
            raise  # a message: sys.exit prints it
        code = e.code or 0
    except BrokenPipeError:
        # the reader left (`rlaudit list | head`): no traceback, and the exit status of a
        # process that SIGPIPE ended (128 + 13), as `yes | head` gives; stdout goes to /dev/null
        # so the interpreter's final flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    leave(code)


def leave(code: int) -> None:
    """Exit with ``code`` as the interpreter would, minus its teardown: what Python does at exit
    that anyone can observe -- join non-daemon threads (and the thread pools' shutdown hooks),
    run the atexit handlers (logging's flush, temporary folders' cleanup, multiprocessing's
    children) and flush stdout/stderr -- then ``os._exit``. Freeing every module and object of a
    process that holds torch, transformers and MLflow takes 0.15-0.2 s, after the last line is
    printed, on every invocation. Where the interpreter lacks either hook: ``sys.exit``."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exitfuncs is None:
        sys.exit(code)
    if code != EXIT_INTERRUPTED:  # after a Ctrl-C, no wait for a stopped replay's thread
        shutdown()
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or the reader left: nothing more to say
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
