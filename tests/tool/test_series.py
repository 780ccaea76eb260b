from __future__ import annotations

from pathlib import Path

import pytest
from hybridpd.errors import SeriesError, UnknownPinError
from hybridpd.series.model import load, locate

SHA = "0" * 64
VALID = f'''
schema = 1
package = "proj"
upstream_git = "file:///x.git"
default_pin = "1.0"

[[pins]]
version = "1.0"
tag = "v1.0"
sdist = "proj-1.0.tar.gz"
sha256 = "{SHA}"

[[pins]]
version = "2.0"
tag = "v2.0"
sdist = "proj-2.0.tar.gz"
sha256 = "{SHA}"

[[patches]]
id = "first"
title = "t"
why = "w"
design = "d"
upstream = "example/proj#1"
removal = "r"
[patches.pins."1.0"]
state = "carried"
[patches.pins."2.0"]
state = "upstream"
release = "1.5"

[[patches]]
id = "second"
title = "t"
why = "w"
design = "d"
upstream = "example/proj#2"
removal = "r"
[patches.pins."1.0"]
state = "carried"
[patches.pins."2.0"]
state = "carried"
'''

pytestmark = pytest.mark.usefixtures("isolated")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "patches" / "series.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_load_keeps_record_order_and_states(tmp_path: Path) -> None:
    series = load(write(tmp_path, VALID))
    one, two = series.pins
    assert [p.id for p in series.patches] == ["first", "second"]
    assert [p.id for p in series.carried(one)] == ["first", "second"]
    assert [p.id for p in series.carried(two)] == ["second"]
    assert series.state(two, "first").release == "1.5"
    assert series.patch_path(one, "first") == tmp_path / "patches" / "1.0" / "first.patch"


def test_a_dropped_patch_is_not_carried_and_keeps_its_evidence(tmp_path: Path) -> None:
    text = VALID.replace(
        '[patches.pins."2.0"]\nstate = "carried"',
        '[patches.pins."2.0"]\nstate = "dropped"',
    ).replace('upstream = "example/proj#2"', 'upstream = "example/proj#2"\ndropped = "Dead code."')
    series = load(write(tmp_path, text))
    one, two = series.pins
    assert [p.id for p in series.carried(one)] == ["first", "second"]
    assert series.carried(two) == []
    assert series.state(two, "second").state == "dropped"
    assert series.state(two, "second").release is None
    assert series.patch("second").dropped == "Dead code."
    assert series.patch("first").dropped is None


def test_pin_accepts_v_prefix_and_lists_known_pins(tmp_path: Path) -> None:
    series = load(write(tmp_path, VALID))
    assert series.pin("v2.0").version == "2.0"
    with pytest.raises(UnknownPinError, match=r"3\.0 is not a pinned version \(pins: 1\.0, 2\.0; `hybridpd --series patches/series\.toml pin add 3\.0`"):
        series.pin("3.0")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('why = "w"\n', 'why = ""\n', 'patches\\[0\\] \\(id "first"\\): field "why" is missing'),
        ('id = "second"', 'id = "Second_"', 'field "id" must match'),
        ('id = "second"', 'id = "first"', 'duplicate "id"'),
        (
            'state = "carried"\n[patches.pins."2.0"]\nstate = "carried"',
            'state = "carried"',
            'pins."2.0" is missing',
        ),
        (
            '[patches.pins."2.0"]\nstate = "carried"',
            '[patches.pins."2.0"]\nstate = "carried"\n[patches.pins."9.9"]\nstate = "carried"',
            'pins."9.9" is not a pinned version',
        ),
        ('state = "upstream"', 'state = "gone"', "state must be one of carried, upstream, dropped"),
        (
            '[patches.pins."2.0"]\nstate = "carried"',
            '[patches.pins."2.0"]\nstate = "dropped"',
            'patches\\[1\\] \\(id "second"\\): field "dropped" is required when a pin drops',
        ),
        ('removal = "r"\n[patches.pins."1.0"]\nstate = "carried"\n[patches.pins."2.0"]\nstate = "carried"',
         'removal = "r"\ndropped = "x"\n[patches.pins."1.0"]\nstate = "carried"\n'
         '[patches.pins."2.0"]\nstate = "carried"',
         'field "dropped" is set but no pin drops the patch'),
        ('release = "1.5"\n', "", "release is required for an upstream patch"),
        (
            '[patches.pins."2.0"]\nstate = "carried"',
            '[patches.pins."2.0"]\nstate = "carried"\nrelease = "1.9"',
            'pins."2.0".release is only for an upstream patch',
        ),
        ('default_pin = "1.0"', 'default_pin = "0.1"', '"default_pin" 0.1 is not a pin'),
        (f'sha256 = "{SHA}"', 'sha256 = "abc"', 'field "sha256" must be 64'),
        ("schema = 1", "schema = 2", 'field "schema" must be 1'),
    ],
)
def test_invalid_series_names_the_field(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in VALID
    with pytest.raises(SeriesError, match=message):
        load(write(tmp_path, VALID.replace(old, new, 1)))


def test_locate_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, VALID)
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    assert locate(cwd=nested) == path
    assert locate(tmp_path) == path
    assert locate(path) == path
    other = write(tmp_path / "other", VALID)
    monkeypatch.setenv("HYBRIDPD_SERIES", str(other))
    assert locate(cwd=nested) == other
    with pytest.raises(SeriesError, match="no series file"):
        locate(tmp_path / "missing")


def test_the_committed_default_pin_is_the_newest_ported_pin() -> None:
    from packaging.version import Version

    series = load(Path(__file__).parents[2] / "patches" / "series.toml")
    newest = max((p for p in series.pins if p.ported), key=lambda p: Version(p.version))
    assert series.default_pin == newest.version


def test_an_unported_default_pin_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    series = load(path)
    unported = path.read_text() + (
        '\n[[pins]]\nversion = "9.0"\ntag = "v9.0"\nsdist = "x-9.0.tar.gz"\n'
        'sha256 = "' + "0" * 64 + '"\nported = false\n'
    )
    path.write_text(unported.replace(f'default_pin = "{series.default_pin}"', 'default_pin = "9.0"'))
    with pytest.raises(SeriesError, match='"default_pin" 9.0 is not ported'):
        load(path)


def test_a_relative_series_path_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    # check runs git in temporary trees, where a relative patch path would not open.
    path = write(tmp_path, VALID)
    monkeypatch.chdir(tmp_path)
    relative = path.relative_to(tmp_path)
    assert locate(relative) == path
    assert locate(relative.parent) == path


def test_locate_falls_back_to_the_source_checkout(tmp_path: Path) -> None:
    assert locate(cwd=tmp_path) == Path(__file__).parents[2] / "patches" / "series.toml"


def test_a_project_tested_inside_another_ones_pin(tmp_path: Path) -> None:
    """LMCache's series: a display name, cache slugs that cannot collide with vLLM's
    versions, and a [test] table naming its patch tests and the vLLM pin they run in."""
    text = VALID.replace('package = "proj"', 'package = "proj"\nname = "Proj"') + """
[test]
patch_tests = "../tests/proj_patches"
host = { series = "../vllm/series.toml", pin = "0.32.0" }
"""
    (tmp_path / "p").mkdir()
    series = load(write(tmp_path / "p", text))
    assert series.project == "Proj"
    assert series.slug(series.pin("1.0")) == "proj-1.0"
    assert series.tests.patch_tests == (tmp_path / "p" / "tests" / "proj_patches").resolve()
    assert series.tests.host_series == (tmp_path / "p" / "vllm" / "series.toml").resolve()
    assert series.tests.host_pin == "0.32.0"


def test_vllm_keeps_its_defaults(tmp_path: Path) -> None:
    series = load(write(tmp_path, VALID.replace('package = "proj"', 'package = "vllm"')))
    assert series.project == "vllm"
    assert series.slug(series.pin("1.0")) == "1.0"  # the cache paths vLLM pins always had
    assert series.tests.patch_tests == tmp_path / "tests" / "patches"
    assert series.tests.host_series is None


def test_the_committed_lmcache_series_runs_in_a_ported_vllm_pin() -> None:
    root = Path(__file__).resolve().parents[2]
    lmcache = load(root / "patches" / "lmcache" / "series.toml")
    assert (lmcache.package, lmcache.project) == ("lmcache", "LMCache")
    assert lmcache.tests.patch_tests == root / "tests" / "lmcache_patches"
    assert (lmcache.tests.patch_tests / "conftest.py").is_file()
    host = load(lmcache.tests.host_series)
    assert host.package == "vllm" and host.pin(lmcache.tests.host_pin).ported


def test_fixes_lost_on_a_release_that_predates_their_upstream_fix() -> None:
    """The one rule port and pin add share: a pin's upstream records are only good for
    a target at or after the release each names (an unreadable one counts as after)."""
    from pathlib import Path

    from hybridpd.series.model import load

    series = load(Path(__file__).resolve().parents[2] / "patches" / "series.toml")
    # 0.32.0 records coordinator-consumer-skips-mamba-hit upstream since 0.28.0, and
    # multi-connector-hma since 0.21.0, the others since 0.23.0.
    assert series.fixes_lost_on("0.32.0", "0.33.0") == []
    assert series.fixes_lost_on("0.32.0", "0.28.0") == []
    assert series.fixes_lost_on("0.32.0", "0.27.0") == ["coordinator-consumer-skips-mamba-hit"]
    assert series.fixes_lost_on("0.32.0", "v0.22.1") == [
        "scheduler-mamba-external-kv", "nixl-mamba-prefix-cache-read",
        "coordinator-consumer-skips-mamba-hit"]
    assert series.fixes_lost_on("0.20.2", "0.19.0") == []  # it records nothing upstream
    import pytest

    from hybridpd.errors import SeriesError

    with pytest.raises(SeriesError, match="not a release version"):
        series.fixes_lost_on("0.32.0", "main")


RISK = '''
[[risks]]
id = "lost-state"
says = """
A request resumes
without its state."""
when = { connectors = ["NixlConnector"], max_num_batched_tokens_at_least_blocks = 2 }
links = ["example/proj#7"]
unless = "the server runs with --safe"
fixed_by = "second"
'''


def test_risk_records_name_their_conditions_links_and_fix(tmp_path: Path) -> None:
    series = load(write(tmp_path, VALID + RISK))
    [risk] = series.risks
    assert risk.says == "A request resumes without its state."
    assert risk.when == {"connectors": ["NixlConnector"],
                         "max_num_batched_tokens_at_least_blocks": 2}
    assert risk.links == ("example/proj#7",) and risk.fixed_by == "second"
    assert risk.url(risk.links[0]) == "https://github.com/example/proj/issues/7"
    assert load(write(tmp_path, VALID)).risks == ()


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('fixed_by = "second"', 'fixed_by = "third"', '"fixed_by" \'third\' is not a patch'),
        ('links = ["example/proj#7"]', 'links = ["proj#7"]', 'field "links" must be a list'),
        ('links = ["example/proj#7"]', 'links = "example/proj#7"', 'field "links" must be a list'),
        ('connectors = ["NixlConnector"]', 'gpus = 2', "when.gpus: not one of connectors"),
        ('connectors = ["NixlConnector"]', 'connectors = []', "when.connectors must be"),
        ("at_least_blocks = 2", "at_least_blocks = 0", "when.max_num_batched_tokens_at_"),
        ('when = { connectors = ["NixlConnector"], max_num_batched_tokens_at_least_blocks = 2 }',
         "when = {}", 'field "when" must be a table of at least one of'),
        ('when = { connectors', 'when = { mamba_cache_mode = ["aligned"], connectors',
         "when.mamba_cache_mode must be"),
        ('unless = "the', 'until = "the', r"unknown field\(s\) until"),
        ('id = "lost-state"', 'id = "Lost"', 'field "id" must match'),
    ],
)
def test_invalid_risk_records_name_the_field(tmp_path: Path, old: str, new: str,
                                             message: str) -> None:
    assert old in RISK
    with pytest.raises(SeriesError, match=message):
        load(write(tmp_path, VALID + RISK.replace(old, new, 1)))
    with pytest.raises(SeriesError, match='duplicate "id"'):
        load(write(tmp_path, VALID + RISK + RISK))


def test_the_committed_risks_name_patches_and_links_of_their_series() -> None:
    """Both committed series load with their [[risks]] (the parser checks each
    fixed_by and link), and the issue's examples are there."""
    root = Path(__file__).resolve().parents[2]
    vllm = load(root / "patches" / "series.toml")
    lmcache = load(root / "patches" / "lmcache" / "series.toml")
    assert "vllm-project/vllm#53912" in {l for r in vllm.risks for l in r.links}
    null_slot = next(r for r in lmcache.risks if r.fixed_by == "null-recurrent-slot-not-stored")
    assert null_slot.when["max_num_batched_tokens_at_least_blocks"] == 2
