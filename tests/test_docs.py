"""The documentation matches the code: doc/CONFIGURATION.md is what `make docs` makes from the
mount options' table, every relative link in README.md and doc/*.md reaches a file and,
where it names one, a heading there, and every path of this repository that the docs, the
docstrings or the comments name exists. In process, no mount."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tierfs.devtools import configuration_doc
from tierfs.mount_helper.config import MOUNT_OPTIONS

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "doc").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
OUTSIDE_CLASSES = {"FileSystemWriter"}  # torch's, named where the route starts


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


def _definitions() -> tuple[dict[str, set[str]], dict[str, set[str]], str]:
    """From tierfs/'s source: each class's members (methods and attributes it assigns), each
    module's top-level names (by module name), and all the source text."""
    classes: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    texts = []
    for path in sorted((ROOT / "tierfs").rglob("*.py")):
        text = path.read_text()
        texts.append(text)
        tree = ast.parse(text)
        names = modules.setdefault(path.stem, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(inner.name)
                    elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                        members.add(inner.attr)
                    elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                        members.add(inner.target.id)
    return classes, modules, "\n".join(texts)


def test_architecture_names_code_that_exists() -> None:
    """The route of one commit in doc/ARCHITECTURE.md names real modules, classes and
    functions, and every module path it lists exists: a rename in the code fails here until
    the page follows it."""
    page = (ROOT / "doc" / "ARCHITECTURE.md").read_text()
    for listed in re.findall(r"^ {4}(tierfs/\S+)", page, re.MULTILINE):
        assert (ROOT / listed).exists(), f"ARCHITECTURE.md lists {listed}, which does not exist"
    route = page[page.index("## The route of one commit"):page.index("## Developer notes")]
    classes, modules, source = _definitions()
    wrong = []
    for token in re.findall(r"`([^`\n]+)`", route):
        if re.fullmatch(r"[\w/]+\.py", token):
            if not (ROOT / "tierfs" / token).exists():
                wrong.append(f"{token}: no such module")
        elif match := re.match(r"([A-Z]\w*)\.(\w+)", token):
            cls, member = match.groups()
            if cls not in OUTSIDE_CLASSES and member not in classes.get(cls, set()):
                wrong.append(f"{token}: no {member} in a class {cls}")
        elif match := re.fullmatch(r"([a-z_]\w*)\.(\w+)", token):
            module, name = match.groups()
            if module in modules and name not in modules[module]:
                wrong.append(f"{token}: no {name} in {module}.py")
        elif re.fullmatch(r"_?[a-z]\w*_\w*", token) and not re.search(rf"\b{token}\b", source):
            wrong.append(f"{token}: not in tierfs/")
    assert not wrong, "; ".join(wrong)


# A path of this repository as prose names it: from its top (tierfs/..., tests/..., doc/...) or
# from inside the package (fs/model/ports.py, mount_helper/daemon/).
REPO_PATH = re.compile(r"(?<![\w./-])((?:tierfs|tests|bench|doc|\.ci|fs|s3tier|replication|cluster|"
                       r"mount_helper|demo|devtools)/(?:[\w.-]+/)*[\w.-]*)")


def named_paths(text: str) -> set[str]:
    return {found.rstrip(".") for found in REPO_PATH.findall(text)}


def test_the_path_check_sees_a_path() -> None:
    assert named_paths("see `fs/model/ports.py`, tests/faults/ and s3tier/x.py.") == {
        "fs/model/ports.py", "tests/faults/", "s3tier/x.py"}
    assert named_paths("a/tierfs/x.py, my_fs/y.py, (doc/<page>.md)") == {"doc/"}


def prose(source: Path) -> str:
    """What a reader reads in `source`: a page whole; of a module, its docstrings and comments
    (its other strings are data: etcd keys, file names made at run time)."""
    text = source.read_text()
    if source.suffix != ".py":
        return text
    parts = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


def test_every_path_named_exists() -> None:
    """A module moved or a folder renamed fails here until the docs, docstrings and comments
    that name it follow (paths written at run time, as .gitignore lists them, count too; a C
    header or source is the kernel's or libfuse's)."""
    ignored = [line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = [*PAGES, *sorted((ROOT / "tierfs").rglob("*.py")),
               *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").glob("*.py"))]
    wrong = []
    for source in sources:
        if source == Path(__file__).resolve():
            continue  # names paths to show what the check sees
        for path in named_paths(prose(source)):
            if not ((ROOT / path).exists() or (ROOT / "tierfs" / path).exists()
                    or path.endswith((".h", ".c"))
                    or any(path.startswith(entry) for entry in ignored)):
                wrong.append(f"{source.relative_to(ROOT)}: {path}")
    assert not wrong, "; ".join(sorted(wrong))
