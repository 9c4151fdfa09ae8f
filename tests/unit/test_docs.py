"""The documentation stays true: the recipe reference matches the schema, links resolve, the README
stays a landing page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from finetune.recipe.reference import REGENERATE, heading_anchor, reference_markdown

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 250

# [text](target) outside code; images too. Targets with a scheme (https:, mailto:) are not files.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_reference_is_current():
    current = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    assert current == reference_markdown(), (
        f"docs/reference.md does not match the recipe schema; regenerate it: {REGENERATE}"
    )


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def _anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them (repeats get -1, -2, ...)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    found: set[str] = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        anchor = base = heading_anchor(title)
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}"
        found.add(anchor)
    return found


def test_relative_links_resolve():
    """Every relative link in README.md and docs/ names a file that exists, and a #section of a
    Markdown page names one of its headings."""
    assert len(PAGES) > 5, "README.md and docs/*.md"
    broken = []
    for page in PAGES:
        for target in _links(page) + [f"{page.name}{a}" for a in _same_page_links(page)]:
            path, _, anchor = target.partition("#")
            file = page.parent / path
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _same_page_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if t.startswith("#")]


def test_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and move detail to docs/"
    )


class _Entry(BaseModel):
    path: str = Field(description="Where the rows are.")


class _Text(_Entry):
    """Raw text."""

    type: Literal["text"] = Field(description="The format.")
    field_text: str = Field("text", description="Column with the text.")


class _Pairs(_Entry):
    type: Literal["pairs"] = Field(description="The format.")
    field_chosen: str = Field("chosen", description="Preferred answer.")


class _Data(BaseModel):
    datasets: list[Annotated[_Text | _Pairs, Field(discriminator="type")]] = Field(
        min_length=1, description="Training data."
    )
    test_datasets: list[Annotated[_Text | _Pairs, Field(discriminator="type")]] = Field(
        default_factory=list, description="Eval data."
    )
    sequence_len: int = Field(2048, ge=2, description="Longest sample.")


class _Recipe(BaseModel):
    data: _Data = Field(description="The data.")


def test_reference_of_a_discriminated_union():
    """A union on `type` (the shape dataset entries take) gives the shared fields once, then one table
    per type with its own fields; a second field of the same union links to the first."""
    page = reference_markdown(_Recipe)
    assert "| `sequence_len` | int >= 2 | `2048` | Longest sample. |" in page
    assert "| `datasets` | list of entries (below), at least 1 | required | Training data. |" in page
    shared = page.split("### data.datasets[]", 1)[1].split("####", 1)[0]
    assert "chosen by `type`" in shared and "| `type` | 'text' or 'pairs' | required |" in shared
    assert "| `path` | str | required | Where the rows are. |" in shared
    text = page.split("#### data.datasets[] type: text", 1)[1].split("####", 1)[0]
    assert "Raw text." in text and "`field_text`" in text and "`field_chosen`" not in text
    assert "`field_chosen`" in page.split("#### data.datasets[] type: pairs", 1)[1]
    assert "(#datadatasets-type-pairs)" in page
    assert "### data.test_datasets[]\n\nThe same as [data.datasets[]](#datadatasets)." in page


def _contributing_layers() -> list[set[str]]:
    """The layer table of docs/CONTRIBUTING.md ("How the code is laid out"): per row, the package
    names of its `packages` column (`finetune.x` or `x`, each in backticks)."""
    text = (REPO / "docs" / "CONTRIBUTING.md").read_text(encoding="utf-8")
    table = text.split("| layer | packages |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    return [
        {name.removeprefix("finetune.") for name in re.findall(r"`([\w.]+)`", row.split("|")[2])}
        for row in rows
    ]


def test_contributing_layer_table_is_the_import_tests_layers():
    from tests.unit.test_import_graph import LAYERS

    assert _contributing_layers() == [set(names) for names in LAYERS]


def test_contributing_names_each_packages_wings_in_the_import_tests_order():
    """A package with wings (the import test's INNER_LAYERS) names them in its row of the layer table,
    top to bottom, as `wing/`."""
    from tests.unit.test_import_graph import INNER_LAYERS

    text = (REPO / "docs" / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for package, wings in INNER_LAYERS.items():
        row = next(
            line for line in text.splitlines() if re.match(rf"\| \d+ \| `finetune\.{package}` \|", line)
        )
        named = [w for w in re.findall(r"`(\w+)/`", row) if any(w in names for names in wings)]
        assert named == [name for names in wings for name in names], (package, named)


def test_no_module_is_over_800_lines():
    """CONTRIBUTING's house rule: a module that grows past 800 lines is split along a seam."""
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / "finetune").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 800
    }
    assert not long, f"modules over 800 lines (split them along a seam): {long}"
