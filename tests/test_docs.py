"""The documentation matches the code: doc/CONFIGURATION.md is what `make docs` makes from the
mount options' table, and every relative link in README.md and doc/*.md reaches a file and,
where it names one, a heading there. In process, no mount."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tierfs.devtools import configuration_doc
from tierfs.mount_helper.config import MOUNT_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "doc").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    slugs: set[str] = set()
    for line in CODE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slugs.add(re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-"))
    slugs.update(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text()))
    return slugs


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text())
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, mailto: ...


def test_configuration_doc_is_generated_from_the_option_table() -> None:
    written = (ROOT / "doc" / "CONFIGURATION.md").read_text()
    assert written == configuration_doc.render(), (
        "doc/CONFIGURATION.md is out of date: run `make docs`")


def test_every_mount_option_is_documented() -> None:
    text = configuration_doc.render()
    for option in [*(o.name for o in MOUNT_OPTIONS), "config"]:
        assert re.search(rf"^\| `--{option}[ `]", text, re.MULTILINE), option


def test_every_command_is_documented() -> None:
    text = configuration_doc.render()
    for command in ("mount", "umount", "flush", "status", "commit", "prefetch", "verify",
                    "demo"):
        assert f"### tierfs {command}\n" in text, command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
