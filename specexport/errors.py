"""Errors a user can act on. The CLI prints them as one line (with a traceback under -v)."""


class SpecexportError(Exception):
    """A user-facing error: bad config, bad input, a missing file. Printed without a traceback."""


class MissingDependency(SpecexportError):
    """An optional package is not installed; the message names the pip extra that brings it."""


class ParityError(SpecexportError):
    """An exported artifact does not match its PyTorch reference within tolerance (exit code 2)."""


def shown(value) -> str:
    """A key or path as the user wrote it, quoted when printing it plainly would break a one-line error."""
    text = str(value)
    return text if text.isprintable() and text.strip() == text and text else repr(value)


class KernelsUnavailable(SpecexportError):
    """specexport's CPU kernels could not be built or loaded here; the message says why (plugins/cpu)."""
