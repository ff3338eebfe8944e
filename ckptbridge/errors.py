"""Error types for ckptbridge.

Every error a user can cause is a :class:`CkptBridgeError` whose message is one line:
what went wrong, where (file, key) and what to do about it. Each class has its own
process exit code so that scripts can tell failures apart (see ``docs/reliability.md``).
"""

from __future__ import annotations


class CkptBridgeError(Exception):
    """Base class: a user-facing failure with a one-line message."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class InputNotFoundError(CkptBridgeError):
    """A source path, file or directory does not exist or is not what was expected."""

    exit_code = 3


class CorruptFileError(CkptBridgeError):
    """A file exists but its bytes are not a valid file of its format."""

    exit_code = 4


class UnsupportedError(CkptBridgeError):
    """A valid input that ckptbridge does not handle (model type, feature, file kind)."""

    exit_code = 5


class MismatchError(CkptBridgeError):
    """Tensors and configuration disagree: a missing or extra tensor, a wrong shape or dtype."""

    exit_code = 6


class OutputError(CkptBridgeError):
    """The destination cannot be written: it exists, lies inside the source, or is not writable."""

    exit_code = 7


class ConfigError(CkptBridgeError):
    """A configuration file or option is missing or invalid."""

    exit_code = 8


EXIT_CODES = {
    cls.__name__: cls.exit_code
    for cls in (
        CkptBridgeError,
        InputNotFoundError,
        CorruptFileError,
        UnsupportedError,
        MismatchError,
        OutputError,
        ConfigError,
    )
}

# what every verb's --help says of them
EXIT_CODES_HELP = ("Exit codes: 0 ok, 2 usage, 3 input not found, 4 corrupt file, 5 unsupported, 6 mismatch, 7 output, "
                   "8 config, 1 internal.")
