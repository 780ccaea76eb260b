"""The conventions of the project a PR goes to (vLLM, LMCache): what PR.md says that
depends on it, and whether hybridpd's e2e reports measure it."""

from __future__ import annotations

import dataclasses

from hybridpd.series.model import Series


@dataclasses.dataclass(frozen=True)
class Upstream:
    """What PR.md says that depends on the project the PR goes to: the rules its
    contributing guide sets, its test plan beyond the added tests, and whether
    hybridpd's e2e reports measure it."""

    name: str
    #: The project's name in PR.md, linked to its repository where that is set.
    link: str
    #: A subject prefix its commit messages use (what ``--keep-non-patch`` keeps).
    prefix: str
    #: Quoted notes to the submitter after the DCO one.
    notes: tuple[str, ...]
    #: The "AI assistance" section.
    ai: str
    #: Whether the test plan carries vLLM's GPU plan and PR.md cites ``hybridpd e2e``
    #: reports (runs of vLLM's series).
    vllm_e2e: bool
    #: The Results section when no measurement is cited.
    no_results: str


#: The AI-assistance section's checklist: what the submitter confirms by ticking it
#: (a PR text states no human review it cannot know happened).
CHECKLIST = (
    "- [ ] I reviewed every changed line and can defend the change\n"
    "- [ ] I ran the test plan above and the results match this description\n"
    "- [ ] The `Assisted-by:` trailer names the tool and model that assisted"
)


VLLM = Upstream(
    name="vLLM",
    link="vLLM",
    prefix="[Core]",
    notes=(
        "> **AI attribution:** each commit ends with an `Assisted-by:` trailer placeholder; "
        "name the assisting tool there (or use `Co-authored-by:`, as vLLM's contributing "
        "guide shows) and tick \"AI assistance was used\" in the PR template.",
        "> **Before submitting:** a person must review every changed line, run the test "
        "plan below (GPU plan included) and be able to defend the change; vLLM does not "
        "accept pure agent PRs. Delete these quoted notes from the PR text.",
    ),
    ai=(
        "AI assistance was used to prepare this change, its tests and this description "
        "(vLLM's contributing guide, \"AI Assisted Contributions\"); the commits carry "
        "an `Assisted-by:` trailer. Before submitting, the submitter ticks:\n\n"
        + CHECKLIST
    ),
    vllm_e2e=True,
    no_results=(
        "No GPU measurement of this change is committed in the hybridpd repository "
        "yet, so this PR states none. Run the GPU plan above on `main` and on this "
        "branch and paste `vllm bench serve`'s summaries here."
    ),
)

LMCACHE = Upstream(
    name="LMCache",
    link="[LMCache](https://github.com/LMCache/LMCache)",
    prefix="[MP]",
    notes=(
        "> **Base branch:** LMCache takes pull requests against `dev` (its contributing "
        "guide); these commits apply to the release named above: rebase them onto `dev` "
        "and run the test plan there before opening the PR.",
        "> **AI attribution:** each commit ends with an `Assisted-by:` trailer placeholder; "
        "name the assisting tool there (or use `Co-authored-by:`). LMCache's contributing "
        "guide sets no attribution rule; the \"AI assistance\" section below discloses it.",
        "> **Before submitting:** a person must review every changed line, run the test "
        "plan below and be able to defend the change. Delete these quoted notes from the "
        "PR text.",
    ),
    ai=(
        "AI assistance was used to prepare this change, its tests and this description; "
        "the commits carry an `Assisted-by:` trailer. Before submitting, the submitter "
        "ticks:\n\n" + CHECKLIST
    ),
    vllm_e2e=False,
    no_results=(
        "No end-to-end measurement of this change is committed in the hybridpd "
        "repository as a report (its e2e serves vLLM through `LMCacheMPConnector` and "
        "an `lmcache server`, `hybridpd e2e --connector lmcache+nixl`, but no such run "
        "is committed), so this PR states no numbers; the Why section says what was "
        "observed. Besides the tests above, "
        "hybridpd's patch tests run a vLLM release's own KV cache allocation and layer "
        "binding against a real `lmcache server` (`tests/lmcache_patches/` in hybridpd): "
        "red on the stock release, green with its series."
    ),
)


def upstream_of(series: Series) -> Upstream:
    """The conventions of ``series``' project: LMCache's for its series, else vLLM's
    (the project hybridpd was made for, and the tool tests' fixture project)."""
    return LMCACHE if series.package == "lmcache" else VLLM
