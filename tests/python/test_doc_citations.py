# Checks that every citation of a doc section (a file name ending in .md, a comma, the heading in
# quotes) names a heading that exists, so comments and docs cannot point at sections that moved.
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "traces"}
SUFFIXES = {".cc", ".h", ".cu", ".py", ".md", ".sh", ".cmake", ".txt", ".toml", ".pyi"}
# A citation may wrap over comment lines: `expandable-segments.md,\n// "Heading"`.
COMMENT_PREFIX = re.compile(r"\n[ \t]*(?://+|#+|\*)?[ \t]*")
CITATION = re.compile(r"([A-Za-z0-9_-]+\.md),\s+\"([^\"]+)\"")
HEADING = re.compile(r"^#+\s+(?:[0-9.]+\s+)?(.*?)\s*$")
# A rule in a list (`- **Divide out the process's own speed.** ...`) is cited like a heading.
RULE = re.compile(r"^\s*[-*]\s+\*\*(.+?)\.?\*\*")


def _source_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.startswith("build") for part in rel.parts[:-1]):
            continue
        if path.is_file() and path.suffix in SUFFIXES:
            yield path


def _anchors(doc):
    anchors = set()
    for line in doc.read_text().splitlines():
        if m := HEADING.match(line) or RULE.match(line):
            anchors.add(m.group(1))
    return anchors


def _cites(doc, heading):
    # A citation may shorten a heading to its start: "Two failures" for "Two failures in a row".
    return doc.exists() and any(a == heading or a.startswith(heading) for a in _anchors(doc))


def _citations():
    for path in _source_files():
        text = COMMENT_PREFIX.sub(" ", path.read_text(errors="replace"))
        for m in CITATION.finditer(text):
            yield path.relative_to(ROOT), m.group(1), m.group(2)


def test_citations_exist():
    found = list(_citations())
    assert found, "no citations found: the pattern no longer matches the tree"


def test_every_cited_heading_exists():
    bad = []
    for where, doc_name, heading in _citations():
        # A citation names a design note, a sibling of the citing file, or a results page
        # (a measured figure the code uses).
        places = [DESIGN / doc_name, (ROOT / where).parent / doc_name,
                  ROOT / "docs" / "results" / doc_name]
        if not any(_cites(doc, heading) for doc in places):
            bad.append(f'{where}: no {doc_name} with the heading "{heading}"')
    assert not bad, "\n".join(sorted(set(bad)))


# A test file named by its path under tests/, or one test in it (the path, "::", its name).
TEST_REFERENCE = re.compile(r"\btests/[A-Za-z0-9_/.-]+\.(?:py|cc|h)(?:::[A-Za-z_0-9]+)?")


def test_every_named_test_file_and_test_exists():
    found, bad = 0, []
    for path in _source_files():
        for ref in set(TEST_REFERENCE.findall(path.read_text(errors="replace"))):
            found += 1
            file, _, test = ref.partition("::")
            where = f"{path.relative_to(ROOT)}: {ref}"
            if not (ROOT / file).is_file():
                bad.append(f"{where}: no such file")
            elif test and not re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M):
                bad.append(f"{where}: no such test in {file}")
    assert found, "no test references found: the pattern no longer matches the tree"
    assert not bad, "\n".join(sorted(bad))
