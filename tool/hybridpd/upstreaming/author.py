"""Who a PR's commits are authored by: the person who submits them.

The committed series carries one neutral project identity (``hybridpd``); a pull
request's commits carry the submitter's, so that their ``Signed-off-by`` (DCO) matches
the author. The submitter is ``--author "Name <email>"``, else the git identity
configured where export-pr runs (``user.name`` / ``user.email`` as git resolves them for
the current user and directory); never the project identity.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridpd import gitops
from hybridpd.errors import HybridpdError, UsageError

_AUTHOR = re.compile(r"(?P<name>[^<>@\s](?:[^<>@]*[^<>@\s])?) <(?P<email>[^<>@\s]+@[^<>@\s]+)>")
_PROJECT = (gitops.IDENTITY_NAME, gitops.IDENTITY_EMAIL)

MISSING = (
    "no author for the PR commits: pass --author \"Name <email>\" (the person who will "
    "submit them) or set git's user.name and user.email"
)


def parse_author(text: str) -> str:
    """``text`` as a git author ``Name <email>``; UsageError (one line) when it is not
    one, or when it is the project's own identity (not a person who can sign off)."""
    match = _AUTHOR.fullmatch(text.strip())
    if not match:
        raise UsageError(
            f"--author {text!r} is not \"Name <email>\" (a name, a space, an e-mail in <>)"
        )
    if (match["name"], match["email"]) == _PROJECT or match["email"] == gitops.IDENTITY_EMAIL:
        raise UsageError(
            f"--author {text!r} is the series' project identity; the PR commits are "
            "authored by the person who submits them"
        )
    return f"{match['name']} <{match['email']}>"


def configured_author(cwd: Path | None = None) -> str | None:
    """The git identity configured for the current user in ``cwd`` (None: unset, or
    the project identity, which is nobody's)."""
    name, email = gitops.user_config("user.name", cwd), gitops.user_config("user.email", cwd)
    if not (name and email):
        return None
    if email == gitops.IDENTITY_EMAIL:
        return None
    try:
        return parse_author(f"{name} <{email}>")
    except UsageError:
        return None


def resolve_author(given: str | None, cwd: Path | None = None) -> str:
    """``given`` (validated), else the configured identity; HybridpdError with one
    line that says what to do when there is neither."""
    if given is not None:
        return parse_author(given)
    found = configured_author(cwd)
    if found is None:
        raise HybridpdError(MISSING)
    return found
