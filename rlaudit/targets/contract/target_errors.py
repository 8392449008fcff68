"""A target's own code failing while rlaudit loads it, as one line for an InputError.

Importing ``--target MODULE:ATTR`` runs the target's module, and ``ATTR()`` its ``__init__``:
code rlaudit does not own. A syntax error, an exception or a ``SystemExit`` there means the
target cannot be audited at all, like a module that does not exist: bad input (exit 2) naming
``--target`` and what failed, never a traceback through rlaudit or a silent exit.
(A stage that fails once loaded is a finding instead: the check that called it reports it.)
"""

from __future__ import annotations

from rlaudit.errors import InputError

#: the longest excerpt of the target's own message kept in the one line
MAX_DETAIL = 300

#: what a target's import or construction may raise that rlaudit reports (KeyboardInterrupt
#: is the user's and still stops the run)
TARGET_FAILURES = (Exception, SystemExit)


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (file and line for a SyntaxError), shortened."""
    if isinstance(e, SyntaxError):
        text = f"{e.msg} ({e.filename}, line {e.lineno})"
    elif isinstance(e, SystemExit):
        text = f"exit code {e.code!r}"
    else:
        lines = str(e).strip().splitlines()
        text = lines[0] if lines else ""
    if len(text) > MAX_DETAIL:
        text = text[:MAX_DETAIL - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def target_error(doing: str, spec: str, e: BaseException) -> InputError:
    """The InputError for target ``spec`` failing while rlaudit was ``doing`` something."""
    return InputError(f"{spec}: {doing} raised {one_line(e)}", key="--target")
