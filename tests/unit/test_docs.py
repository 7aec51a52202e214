"""The prose stays legible: no unrendered Sphinx roles, a design document a newcomer can navigate."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"

SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`")
HISTORY = re.compile(r"\bissue(?:\s+#?\d+|'s)", re.IGNORECASE)
HEADING = re.compile(r"^(#{1,6}) (.+)$")
LINK = re.compile(r"\]\(#([^)]*)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def headings(lines: list[str]) -> list[tuple[int, str]]:
    """``(level, text)`` of each heading outside code fences."""
    found, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def anchors(found: list[tuple[int, str]]) -> list[str]:
    """Each heading's anchor, numbered as GitHub numbers repeated ones (``-1``, ``-2``) over all levels."""
    seen: dict[str, int] = {}
    out = []
    for _, text in found:
        base = github_anchor(text)
        n = seen.get(base, 0)
        out.append(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def pipeline_files() -> list[Path]:
    return sorted((ROOT / "pipeline").rglob("*.py"))


def test_no_sphinx_roles_in_pipeline():
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in pipeline_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert not hits, f"Sphinx roles nothing renders (write ``X``): {hits}"


def test_github_anchor_rules():
    assert github_anchor("The worker") == "the-worker"
    assert github_anchor("`io_proc`: HTTP, tokens, text") == "io_proc-http-tokens-text"
    assert github_anchor("Penalties and biases (logit_bias)") == "penalties-and-biases-logit_bias"
    assert anchors([(2, "Limits"), (4, "Limits"), (3, "Limits")]) == ["limits", "limits-1", "limits-2"]


def test_design_starts_with_a_contents_list_that_resolves():
    lines = DESIGN.read_text().splitlines()
    found = headings(lines)
    named = list(zip(found, anchors(found)))
    sections = [(text, anchor) for (level, text), anchor in named if level in (2, 3)]
    assert sections and sections[0][0] == "Contents", "docs/design.md's first section must be its contents list"
    start = lines.index("## Contents")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    listed = [t for line in lines[start + 1 : end] for t in LINK.findall(line)]
    assert listed, "the contents list has no links"
    assert [t for t in listed if t not in set(anchors(found))] == [], "contents links without a heading"
    missing = [text for text, anchor in sections[1:] if anchor not in listed]
    assert missing == [], "H2 and H3 headings missing from the contents list"
    assert any(level == 3 for level, _ in found), "the long sections need linkable H3 subsections"


def test_no_issue_history_in_design_or_docstrings():
    hits = [f"docs/design.md:{i}" for i, line in enumerate(DESIGN.read_text().splitlines(), 1) if HISTORY.search(line)]
    for p in pipeline_files():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if HISTORY.search(doc):
                    hits.append(f"{p.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}")
    assert hits == [], f"issue numbers are history, not design: {hits}"


def test_design_links_into_perf_resolve():
    perf = (ROOT / "docs" / "perf" / "README.md").read_text().splitlines()
    known = set(anchors(headings(perf)))
    targets = re.findall(r"\]\(perf/README\.md#([^)]*)\)", DESIGN.read_text())
    assert targets, "design.md points its measurements to docs/perf/README.md"
    assert [t for t in targets if t not in known] == []


def module_map_paths() -> set[str]:
    """The paths design.md's "Module map" names, from its tree's indentation (two spaces a level)."""
    lines = DESIGN.read_text().splitlines()
    start = lines.index("## Module map")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    stack: list[str] = []
    paths = set()
    for line in lines[fence + 1 :]:
        if line.startswith("```"):
            break
        m = re.match(r"^( *)([\w.-]+/?)((?:, [\w.-]+)*)(?:\s|$)", line)
        if not m or len(m.group(1)) > 16:
            continue
        depth = len(m.group(1)) // 2
        del stack[depth:]
        for name in [m.group(2)] + m.group(3).split(", ")[1:]:
            paths.add("/".join(stack + [name.rstrip("/")]))
        if m.group(2).endswith("/"):
            stack.append(m.group(2).rstrip("/"))
    return paths


def test_module_map_names_every_module_and_only_those():
    listed = module_map_paths()
    modules = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "pipeline").rglob("*")
        if p.suffix in (".py", ".cpp") and p.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - listed) == [], "modules missing from docs/design.md's module map"
    stale = sorted(p for p in listed if p.startswith("pipeline/") and not (ROOT / p).exists())
    assert stale == [], "module map entries that no longer exist"


def test_design_sections_cited_in_code_exist():
    known = {text for _, text in headings(DESIGN.read_text().splitlines())}
    cite = re.compile(r'design\.md,\s*((?:"[^"]+"[;,]?\s*(?:and\s+)?)+)')
    missing = []
    for p in pipeline_files() + sorted((ROOT / "pipeline").rglob("*.cpp")):
        text = re.sub(r"\n\s*(?:#|//)?\s*", " ", p.read_text())
        for m in cite.finditer(text):
            missing += [
                f"{p.relative_to(ROOT)}: {name}" for name in re.findall(r'"([^"]+)"', m.group(1)) if name not in known
            ]
    assert missing == [], "docs/design.md sections cited in code that it does not have"
