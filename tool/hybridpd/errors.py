"""Errors hybridpd reports to its user.

Every expected failure of the library is a :class:`HybridpdError` with a one-line
message; the library knows nothing of the command line. The CLI's one handler
(:class:`hybridpd.cli.jsonout.JsonGroup`) prints ``Error: <message>`` and exits with the
error's code: 1 for a failed operation or check, 2 for bad usage (:class:`UsageError`,
or click's own for what click parses), 130 when interrupted.
"""

from __future__ import annotations


class HybridpdError(Exception):
    """Base class: an expected failure, reported without a traceback (exit 1)."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def format_message(self) -> str:
        return self.message

    def __str__(self) -> str:
        return self.message


class UsageError(HybridpdError):
    """Options that do not go together, or values the library cannot use (exit 2, as
    click's own usage errors)."""

    exit_code = 2


class Interrupted(HybridpdError):
    """Ctrl-C or SIGTERM stopped the operation, after its own cleanup (exit 130:
    128 + SIGINT, as shells report it)."""

    exit_code = 130


class GitError(HybridpdError):
    """A git command failed in a way the caller did not anticipate."""


class SeriesError(HybridpdError):
    """``series.toml`` is missing, malformed or inconsistent."""


class UnknownPinError(HybridpdError):
    """A version that ``series.toml`` does not pin."""


class PackageIndexError(HybridpdError):
    """A release file could not be found on, or fetched from, a package index."""


class ChecksumError(HybridpdError):
    """A downloaded file does not have the sha256 that ``series.toml`` records."""


class CheckoutError(HybridpdError):
    """A source tree could not be created."""


class DirtyTreeError(HybridpdError):
    """A checkout has uncommitted or untracked changes."""


class PatchCommitError(HybridpdError):
    """A checkout's commits after the pin tag do not match the patch series."""


class ApplyError(HybridpdError):
    """The patch series does not apply; the checkout was left as it was."""


class ExportError(HybridpdError):
    """A checkout's commits cannot be exported as the patch series."""


class CheckFailed(HybridpdError):
    """``hybridpd check`` found problems."""


class DoctorFailed(HybridpdError):
    """``hybridpd doctor`` found something this machine cannot do at all."""


class LocalFileError(HybridpdError):
    """A local file or directory (a checkout, the cache) could not be read or written.

    Kept apart from :class:`PackageIndexError`: the fix is on this machine (a path,
    permissions, free space), not on the network.
    """

    @classmethod
    def from_os_error(cls, exc: OSError) -> LocalFileError:
        names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
        where = " -> ".join(names) or "a local file"
        return cls(f"local file system: {where}: {exc.strerror or exc}")
