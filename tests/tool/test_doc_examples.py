"""Every `hybridpd …` example in README.md and docs/*.md parses with the CLI's own click
parser: no stale option, subcommand or choice, no missing argument. Nothing is run."""

from __future__ import annotations

import dataclasses
import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from hybridpd.cli.main import main
from hybridpd.cli.options import State
from hybridpd.errors import HybridpdError
from hybridpd.series.model import Pin, Series

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    text: str
    args: tuple[str, ...]


def _is_hybridpd(word: str) -> bool:
    """``hybridpd``, or the console script by path (``.venv/bin/hybridpd``)."""
    return word == "hybridpd" or word.endswith("/bin/hybridpd")


def _commands(text: str) -> list[list[str]]:
    """The hybridpd invocations of one shell line: split at ``&&``, ``;`` and ``|``,
    without a leading ``$ ``, env-var assignments or a trailing comment; the command word
    may be a path (``.venv/bin/hybridpd``). Returns the argument lists."""
    text = re.sub(r"^\s*\$\s+", "", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True  # `#` still starts a comment between words
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: not a shell line
        return []
    found, segment = [], []
    for token in [*tokens, ";"]:
        if token and set(token) <= set(";&|"):
            while segment and _ENV.match(segment[0]):
                segment.pop(0)
            if segment and _is_hybridpd(segment[0]):
                found.append(segment[1:])
            segment = []
        else:
            segment.append(token)
    return found


def extract(markdown: str, name: str = "-") -> list[Example]:
    """Examples from fenced code blocks (backslash-continued lines joined) and from
    inline code spans whose command word is hybridpd."""
    examples: list[Example] = []
    lines = markdown.splitlines()
    fenced = False
    prose: list[tuple[int, str]] = []

    def spans() -> None:
        text = "\n".join(line for _, line in prose)
        for match in _SPAN.finditer(text):
            start = prose[0][0] + text.count("\n", 0, match.start())
            code = match.group(1).replace("\\|", "|").replace("\n", " ").strip()
            if _is_hybridpd(code.split(" ", 1)[0]):
                examples.extend(Example(f"{name}:{start}", code, tuple(args))
                                for args in _commands(code))
        prose.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            if not fenced:
                spans()
            fenced = not fenced
            i += 1
            continue
        if not fenced:
            if line.strip():
                prose.append((i + 1, line))
            else:
                spans()
            i += 1
            continue
        start, logical = i + 1, line
        while logical.endswith("\\") and i + 1 < len(lines):
            i += 1
            logical = logical[:-1] + " " + lines[i].strip()
        examples.extend(Example(f"{name}:{start}", logical.strip(), tuple(args))
                        for args in _commands(logical))
        i += 1
    spans()
    return examples


def _all_examples() -> list[Example]:
    return [e for path in DOCS
            for e in extract(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]


def _rest(ctx: click.Context) -> list[str]:
    """What a group's context left for its subcommand (click 8.2 made
    ``protected_args`` private)."""
    protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
    return [*protected, *ctx.args]


#: Releases the docs add with ``hybridpd pin add V`` (and then port): the examples that
#: follow name them as pins.
ADDED_PINS = sorted({m.group(1) for path in DOCS
                     for m in re.finditer(r"hybridpd (?:--series \S+ )?pin add v?([\d.]+)",
                                          path.read_text(encoding="utf-8"))})


class _DocsState(State):
    """The CLI's state, its series holding the pins the docs add as well."""

    @functools.cached_property
    def series(self) -> Series:
        series = super().series
        known = {pin.version for pin in series.pins}
        added = tuple(Pin(v, f"v{v}", f"vllm-{v}.tar.gz", "0" * 64)
                      for v in ADDED_PINS if v not in known)
        return dataclasses.replace(series, pins=series.pins + added)


def check(args: list[str]) -> None:
    """Parse ``hybridpd ARGS`` as click would, down to the leaf command's own parameters,
    without invoking anything. Raises click's error for a stale example. A command named
    with nothing after it (``hybridpd bench``, ``hybridpd explain``) is a reference to the
    command, not an example: it must exist, its required options are not asked for."""
    command: click.Command = main
    name, parent = "hybridpd", None
    while True:
        if not args:
            return
        try:
            ctx = command.make_context(name, list(args), parent=parent,
                                       resilient_parsing=False)
        except click.exceptions.Exit as done:  # --help, --version
            assert done.exit_code == 0
            return
        except HybridpdError as exc:  # a --pin that is no pin of the series
            raise click.UsageError(exc.message) from None
        if not isinstance(command, click.Group):
            return
        if parent is None:
            # What the group's callback does before a command runs: the series the
            # command's --pin is resolved in (the repository's, or --series).
            ctx.obj = _DocsState(ctx.params.get("series_path"))
        rest = _rest(ctx)
        if not rest:
            return  # `hybridpd` alone, or with global options only
        name, sub, args = command.resolve_command(ctx, rest)
        command, parent = sub, ctx


@pytest.fixture(autouse=True)
def _placeholder_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Examples name paths that do not exist here (DIR, /path/to/venv/bin/python), so
    only click.Path's existence check is turned off; every other check stands, and a path
    that exists (run from the repository root: patches/lmcache) is still checked for its
    kind (file or directory)."""
    monkeypatch.chdir(ROOT)

    def walk(command: click.Command) -> None:
        for param in command.params:
            if isinstance(param.type, click.Path):
                monkeypatch.setattr(param.type, "exists", False)
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(main)


EXAMPLES = _all_examples()


def test_the_docs_have_examples() -> None:
    """Guards against an extractor that silently finds nothing."""
    assert len(EXAMPLES) >= 30
    assert sum(e.where.startswith("README.md:") for e in EXAMPLES) >= 5


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.where)
def test_example_parses(example: Example) -> None:
    try:
        check(list(example.args))
    except click.ClickException as exc:
        pytest.fail(f"{example.where}: `{example.text}`: {exc.format_message()}")


@pytest.mark.parametrize("args", [
    ["apply", "--dir", "DIR", "--no-such-option"],  # a made-up option on a real command
    ["no-such-command", "--pin", "0.32.0"],  # a made-up subcommand
    ["bench", "no-such-command"],  # a made-up subcommand of a nested group
    ["e2e", "--pin", "0.32.0", "--device", "tpu"],  # a bad choice
    ["checkout", "0.32.0"],  # a missing required option (--dir)
    ["export-pr", "--all"],  # a missing required option (--to)
    ["bench", "replay", "--pin", "0.32.0", "--num-prompts", "N"],  # not an integer
])
def test_a_stale_example_fails(args: list[str]) -> None:
    with pytest.raises(click.ClickException):
        check(args)


def test_extract() -> None:
    markdown = "\n".join([
        "Run `hybridpd list --pin 0.32.0` or",
        "`hybridpd --series patches/lmcache",
        "test`; not `hybridpd.e2e.qwen35` nor `pip install hybridpd`.",
        "",
        "```bash",
        "# a comment line",
        "$ HYBRIDPD_DEBUG=1 hybridpd e2e --pin 0.32.0 \\",
        "    --tiny  # trailing comment",
        "python3 -m venv .venv && .venv/bin/hybridpd install",
        "explain: output lines are not commands",
        "```",
    ])
    assert [(e.where, e.args) for e in extract(markdown, "x.md")] == [
        ("x.md:1", ("list", "--pin", "0.32.0")),
        ("x.md:2", ("--series", "patches/lmcache", "test")),
        ("x.md:7", ("e2e", "--pin", "0.32.0", "--tiny")),
        ("x.md:9", ("install",)),
    ]


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a
    repeated one numbered."""
    found: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def test_relative_links_resolve() -> None:
    """Links between README and docs reach a file that exists and, for a page, an anchor
    it has."""
    broken = []
    for path in DOCS:
        for match in _LINK.finditer(path.read_text(encoding="utf-8")):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" \
                    and anchor not in _anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{path.relative_to(ROOT)}: {target}: no such anchor")
    assert broken == []
