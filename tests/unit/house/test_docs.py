"""The documentation keeps itself honest: the generated pages match what generates them (the config
reference from `areal-async knobs`, RESULTS.md from the recorded rows), every relative link in the
README and the docs resolves to a file (and its #anchor to a heading there), and the README stays a
short page that starts with the two commands."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():  # the repository root, wherever this file sits in tests/
    ROOT = ROOT.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    return bad


def test_slug_follows_githubs_rule():
    assert slug("Floors: where a change goes") == "floors-where-a-change-goes"
    assert slug("Devices: GPU placement") == "devices-gpu-placement"
    assert slug("Python API") == "python-api" and slug("`cluster.*` keys") == "cluster-keys"


def test_every_relative_link_resolves():
    assert len(PAGES) >= 8, [p.name for p in PAGES]
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\nsee [b](b.md), [top](#top), [gone](#gone), [c](c.md)\n")
    (tmp_path / "b.md").write_text("# B\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert broken_links(tmp_path / "a.md") == ["a.md: #gone (no heading #gone)", "a.md: c.md (no such file)"]
    finally:
        ROOT = old


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    run, tests = blocks[0].strip(), blocks[1].strip()
    assert run == "./scripts/setup.sh && .venv/bin/areal-async run configs/smollm2_math.yaml --run-dir runs/smol"
    assert tests == "./scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert (ROOT / "configs/smollm2_math.yaml").exists() and (ROOT / "scripts/setup.sh").exists()
    assert "`.venv/bin/areal-async run configs/tiny_arith.yaml --run-dir runs/tiny`" in text  # the smoke run
    assert text.index(blocks[0]) < text.index("## ")  # before any section
    assert "has never run" in text or "never run" in text  # the GPU section says what has not run
    assert ".venv/bin/python -m pytest tests/unit -q" in text  # the documented inner loop


def test_configuration_page_is_generated_from_knobs():
    gen = _script("configuration_md")
    pairs = gen.parse_knobs(gen.knobs_text())
    assert dict(pairs)["rollout.max_head_offpolicyness"].startswith("η: trainer step v consumes only samples")
    page = gen.render(pairs, gen.defaults())
    assert "| `cluster.n_trainer_ranks` | `1` |" in page  # the default beside the key
    committed = (ROOT / "docs/configuration.md").read_text()
    assert committed == page, (
        "docs/configuration.md is stale: .venv/bin/python scripts/configuration_md.py > docs/configuration.md"
    )


def test_knobs_lines_that_are_not_key_help_are_refused():
    gen = _script("configuration_md")
    assert gen.parse_knobs("a.b   help text | with a bar\nc  x") == [("a.b", "help text | with a bar"), ("c", "x")]
    with pytest.raises(ValueError, match="line 2"):
        gen.parse_knobs("a.b   fine\n  continued help\n")
    assert "help text \\| with a bar" in gen.render([("a.b", "help text | with a bar")], {"a": {"b": [1]}})


def test_results_page_is_generated_from_the_recorded_rows():
    from benchmarks import results

    files = sorted((ROOT / "benchmarks/results").glob("*.jsonl"))
    rows, readings = results.read_lines(files)
    assert len(rows) > 300 and all(r["commit"] and r["date"] and r["load"] for r in rows)
    committed = (ROOT / "benchmarks/RESULTS.md").read_text()
    assert committed == results.render(rows, readings), (
        "benchmarks/RESULTS.md is stale: python -m benchmarks.results benchmarks/results/*.jsonl"
        " > benchmarks/RESULTS.md"
    )


def test_results_groups_runs_newest_first_with_their_readings(tmp_path):
    from benchmarks import results

    where = {"machine": "2 CPUs", "load": "load 1.0", "unit": "x"}
    lines = [
        {"benchmark": "b", "run": "old", "commit": "aaa", "date": "2026-11-30", "metric": "m", "value": 1.5} | where,
        {"benchmark": "b", "run": "new", "commit": "bbb", "date": "2026-12-01", "metric": "m", "value": 2.25} | where,
        {"benchmark": "b", "run": "old", "reading": "slower"},
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    page = results.render(*results.read_lines([tmp_path / "r.jsonl"]))
    assert page.index("### 2026-12-01: new") < page.index("### 2026-11-30: old") < page.index("*Reading.* slower")
    assert "| m | 2.25 | x |" in page and "Commit `aaa`, 2 CPUs, load 1.0." in page
    (tmp_path / "bad.jsonl").write_text(json.dumps({"benchmark": "b", "metric": "m", "value": 1, "unit": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a recorded line lacks \['run', 'commit'"):
        results.read_lines([tmp_path / "bad.jsonl"])


def test_readme_names_every_command_of_the_cli():
    """A new `areal-async` subcommand cannot go unmentioned: each one appears as `areal-async <cmd>` in the
    README's command list and in docs/running.md."""
    import argparse

    from areal_async.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    commands = sorted(sub.choices)
    assert {"run", "sft", "knobs", "verify"} <= set(commands)
    for page in ("README.md", "docs/running.md"):
        text = (ROOT / page).read_text()
        missing = [c for c in commands if f"areal-async {c} " not in text]
        assert not missing, f"{page} does not name: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    """A page added to docs/ is reachable: the README's documentation list links it."""
    text = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name})" not in text]
    assert not unlinked, f"README.md links no docs/ page named {unlinked}: add it to its Documentation list"


def expand_braces(text: str) -> str:
    """`configs/tiny_{a,b}.yaml` -> `configs/tiny_a.yaml configs/tiny_b.yaml` (one level, as the docs write it)."""
    return re.sub(r"(\S*)\{([^{}]+)\}(\S*)", lambda m: " ".join(m[1] + x + m[3] for x in m[2].split(",")), text)


def test_every_preset_is_in_the_presets_table():
    """A config added to configs/ is documented: docs/running.md's presets table names it."""
    assert expand_braces("`configs/tiny_{a,b}.yaml`") == "`configs/tiny_a.yaml` `configs/tiny_b.yaml`"
    table = expand_braces((ROOT / "docs/running.md").read_text().split("## Presets", 1)[1])
    missing = [p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if f"configs/{p.name}" not in table]
    assert not missing, f"docs/running.md's presets table does not name {missing}"


def test_every_benchmark_is_in_the_benchmarks_table():
    """A benchmark added to benchmarks/ is described: benchmarks/README.md's table has a row for it."""
    text = (ROOT / "benchmarks/README.md").read_text()
    names = [p.stem for p in sorted((ROOT / "benchmarks").glob("*.py")) if p.stem not in ("__init__", "results")]
    names += [p.name for p in sorted((ROOT / "benchmarks").iterdir()) if (p / "__main__.py").exists()]
    missing = [n for n in names if f"| `{n}` |" not in text]
    assert not missing, f"benchmarks/README.md has no row for {missing}"


def test_every_link_of_the_loop_page_names_a_symbol_that_exists():
    """docs/loop.md's file:line links name a function, class or Class.method of the file; a renamed or
    removed one fails here (a moved line does not: `python scripts/loop_links.py` refreshes the numbers)."""
    links = _script("loop_links")
    text = (ROOT / "docs/loop.md").read_text()
    _, gone, _ = links.resolve(text)
    assert len(links.LINK.findall(text)) >= 30 and gone == []
