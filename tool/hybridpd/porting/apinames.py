"""The upstream API a patch calls that a port's target release does not have yet.

A patch written on a newer release often calls methods upstream added there (on v0.32.0,
``get_loaded_kv_cache_group_ids``). Ported to an older release, git shows conflict
markers or applies cleanly, and either way nothing says that the code calls a method the
target does not define: the port stops, or the tests fail with an AttributeError. This
module answers from the port repository's two release commits:

- the names the patch's added lines call as attributes (``.name(``), less the methods
  the patch adds, plus the methods it rewrites (a ``def`` it removes and adds back);
- of those, the ones the source release defines (``def name``) and the target release
  does not, anywhere under ``vllm/``.

The check reads definitions, not imports: a name the target defines under another
spelling is reported, which is what the person resolving the port must look at.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridpd import gitops

_CALL = re.compile(r"\.([A-Za-z_]\w*)\(")
_DEF = re.compile(r"^\s*def ([A-Za-z_]\w*)\(")


def _added_lines(patch_text: str) -> list[str]:
    return [
        line[1:] for line in patch_text.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def _removed_defs(patch_text: str) -> set[str]:
    return {
        m.group(1) for line in patch_text.splitlines()
        if line.startswith("-") and not line.startswith("---")
        if (m := _DEF.match(line[1:]))
    }


def used_names(patch_text: str) -> tuple[set[str], set[str]]:
    """(names the added lines call as attributes, names they define)."""
    added = _added_lines(patch_text)
    called = {name for line in added for name in _CALL.findall(line)}
    defined = {m.group(1) for line in added if (m := _DEF.match(line))}
    return called, defined


def _defines(repo: Path, rev: str, names: set[str]) -> set[str]:
    """The ``names`` that ``rev`` defines (``def name(``) in a Python file under vllm/."""
    if not names:
        return set()
    pattern = r"def (" + "|".join(sorted(re.escape(n) for n in names)) + r")\("
    found = gitops.run(repo, "grep", "-h", "-o", "-E", pattern, rev, "--", "vllm/*.py")
    return {m.group(1) for m in re.finditer(pattern, found.stdout)} if found.ok else set()


def missing(repo: Path, patch: Path, source_rev: str, target_rev: str) -> tuple[str, ...]:
    """Names the patch calls or overrides that ``source_rev`` defines and ``target_rev``
    does not (sorted)."""
    text = patch.read_text(errors="replace")
    called, defined = used_names(text)
    # A method the patch adds is its own; one it replaces (removed, then added back with
    # another signature) is upstream's and must exist in the target too.
    rewritten = defined & _removed_defs(text)
    wanted = (called - (defined - rewritten)) | rewritten
    at_source = _defines(repo, source_rev, wanted)
    return tuple(sorted(at_source - _defines(repo, target_rev, at_source)))
