"""Exit statuses and the one-line handling of Ctrl-C and SIGTERM shared by every command (standard library only).

``guarded(prog, body, *args)`` runs a command's body so that Ctrl-C (KeyboardInterrupt) anywhere inside it prints
``PROG: interrupted`` and returns 130, and SIGTERM prints ``PROG: terminated`` and returns 143, with no traceback.
``exit_codes`` and ``INTERRUPTED`` / ``TERMINATED`` make the epilogs of the commands' help.
"""

from __future__ import annotations

import signal
import sys

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


class Terminated(SystemExit):
    """SIGTERM, raised in the main thread wherever it is, as Ctrl-C raises KeyboardInterrupt: every ``finally``
    and context manager on the way out runs (a run's output directory is put back as it was). A SystemExit
    with status 143, so ``except Exception`` does not swallow it and, uncaught, it ends the process quietly."""

    def __init__(self):
        super().__init__(EXIT_TERMINATED)


def exit_codes(*codes: tuple[int, str]) -> str:
    """An epilog listing a command's exit codes, one line each."""
    return "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in codes)


INTERRUPTED = (EXIT_INTERRUPTED, "interrupted (Ctrl-C): one line, no traceback")
TERMINATED = (EXIT_TERMINATED, "terminated (SIGTERM): one line, no traceback")


def _raise_terminated(signum, frame):
    raise Terminated()


def stopped(prog: str, exc: BaseException) -> int:
    """Report an interruption (KeyboardInterrupt, with what it says, e.g. what a run kept) or a SIGTERM as one
    line on stderr; returns the exit status, 130 or 143. Further Ctrl-Cs are ignored while the line is written."""
    previous = _set_signal(signal.SIGINT, signal.SIG_IGN)
    try:
        what = "terminated" if isinstance(exc, Terminated) else "interrupted"
        detail = "" if isinstance(exc, Terminated) else str(exc)
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print(f"{prog}: {what}" + (f"; {detail}" if detail else ""), file=sys.stderr, flush=True)
    finally:
        _set_signal(signal.SIGINT, previous)
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def _set_signal(signum, handler):
    """Install ``handler``; returns the previous one (None where signals cannot be set: not the main thread)."""
    if handler is None:
        return None
    try:
        return signal.signal(signum, handler)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        return None


def guarded(prog: str, body, *args) -> int:
    """``body(*args)`` as a command: Ctrl-C (KeyboardInterrupt) and SIGTERM anywhere inside it become one line and
    exit status 130 / 143 (``stopped``). SIGTERM's handler is this process's only while ``body`` runs."""
    previous = _set_signal(signal.SIGTERM, _raise_terminated)
    try:
        return body(*args)
    except (KeyboardInterrupt, Terminated) as exc:
        return stopped(prog, exc)
    finally:
        _set_signal(signal.SIGTERM, previous)
