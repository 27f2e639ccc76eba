"""The project's error hierarchy.

    CDCError                 root: everything pgcdc raises on purpose
    ├── TransientError       may succeed if retried (network blip, broker leader change)
    └── TerminalError        retrying cannot help (bad configuration, missing privilege)

Errors raised by the libraries we use are translated once, at the boundary where we call them, with
``raise ... from exc`` so the original stays attached. Messages are short, lowercase, name the object
they concern and say how to fix the problem.
"""

from __future__ import annotations


class CDCError(Exception):
    """Root of every error pgcdc raises on purpose."""


class TransientError(CDCError):
    """A fault that retrying, with backoff, may get past."""


class TerminalError(CDCError):
    """A fault that retrying cannot fix: the operator has to act."""
