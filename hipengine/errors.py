"""User-facing errors.

Every failure a user can cause (bad file, unsupported model, bad request, missing GPU) is raised as a
HipEngineError subclass. The CLI prints ``error: <message>`` as one line and exits non-zero; the server
maps them to HTTP statuses. Anything else escaping is a bug in hipengine.
"""


class HipEngineError(Exception):
    """Base class: a one-line, user-actionable message (what, where, what to do)."""

    exit_code = 2


class ModelError(HipEngineError):
    """Model files missing, truncated or inconsistent with their config."""


class UnsupportedError(HipEngineError):
    """An architecture, quantization type or option hipengine does not support."""


class RequestError(HipEngineError):
    """Invalid request: sampling values out of range, prompt longer than the context, empty input."""


class DeviceError(HipEngineError):
    """GPU missing, out of memory, compile failure, kernel timeout or vendor-call failure."""

    exit_code = 3


def run_script(main) -> None:
    """``sys.exit(main())`` for the scripts in scripts/: a HipEngineError (no GPU, a bad option) becomes the
    CLI's one line and exit code instead of a traceback."""
    import sys

    try:
        sys.exit(main())
    except HipEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
