# Checks that the README works as the project's front door: it starts with the two commands that
# .ci/run and a fresh machine depend on, every link in it and in the docs leads somewhere, its
# measured figures are the ones in docs/results/, and its examples name functions, commands and
# files that exist (its plan and replay one-liners are run).
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.M)
CODE_SPAN = re.compile(r"`([^`]+)`")


def _markdown_files():
    for path in sorted(ROOT.rglob("*.md")):
        rel = path.relative_to(ROOT)
        if not any(p in SKIP_DIRS or p.startswith("build") or p.startswith(".")
                   for p in rel.parts[:-1]):
            yield path


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code(text):
    return FENCE.sub("", text)


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = FENCE.search(text)
    assert first_block, "README.md has no code block"
    assert text.index(first_block.group(0)) < text.index("\n## "), \
        "the two commands must come before the first section"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["./scripts/run_main.sh", "./scripts/test.sh"]
    for command in commands:
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command} is not executable"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec ./scripts/test.sh" in ci.splitlines(), ".ci/run must run the README's test command"
    for script in ("run_main.sh", "test.sh"):
        assert "./scripts/setup.sh" in (ROOT / "scripts" / script).read_text(), \
            f"scripts/{script} must do its own set-up on a fresh machine"


def test_every_link_in_the_docs_resolves():
    bad = []
    files = list(_markdown_files())
    assert README in files and ROOT / "docs" / "usage.md" in files
    for doc in files:
        for target in LINK.findall(_without_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md":
                if anchor not in {_slug(h) for h in HEADING.findall(_without_code(dest.read_text()))}:
                    bad.append(f"{where}: no heading with that anchor")
    assert not bad, "\n".join(bad)


def _cells(line: str) -> list[str]:
    """A markdown table row's cells, stripped of spaces and bold marks."""
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


def _results_table():
    text = README.read_text()
    section = text[text.index("## Results"):]
    rows = []
    for line in section.splitlines():
        cells = _cells(line)
        if len(cells) == 4 and all(re.fullmatch(r"0\.[0-9]{3}", c) for c in cells[1:]):
            rows.append(cells)
    return section, rows


def test_results_table_figures_are_the_measured_ones():
    section, rows = _results_table()
    assert len(rows) == 3, "three workloads, each with three allocators' utilization"
    header = next(line for line in section.splitlines() if line.startswith("| workload |"))
    allocators = _cells(header)[1:]
    # The measured ratios of peak reserved to peak allocated: the results page's table of the
    # three allocators on the three workloads, by (workload, allocator).
    source = (ROOT / "docs" / "results" / "h200-training.md").read_text()
    table = source[source.index("## Three allocators on three workloads"):]
    measured = {}
    for line in table.splitlines():
        cells = _cells(line)
        if len(cells) >= 3 and re.fullmatch(r"1\.[0-9]{4}", cells[2]):
            measured.setdefault((cells[0], cells[1]), cells[2])
    for workload, *utilizations in rows:
        for allocator, utilization in zip(allocators, utilizations):
            ratio = measured.get((workload.replace("gradient ", ""), allocator))
            assert ratio is not None, f"{workload}, {allocator}: not in h200-training.md's table"
            # Utilization is peak allocated / peak reserved: the ratio's reciprocal.
            assert utilization == f"{1 / float(ratio):.3f}", (workload, allocator, ratio)


def test_every_figure_in_the_readme_is_in_the_results_it_links():
    text = README.read_text()
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(text) if t.startswith("docs/results/")}
    results = "\n".join(p.read_text() for p in linked if p.is_file() and p.suffix == ".md")
    prose = CODE_SPAN.sub("", _without_code(text))
    prose = re.sub(r"\d{4}-\d{2}-\d{2}", "", prose)  # dates
    figures = re.findall(r"\d+(?:[.,]\d+)+|\d+ min \d+ s", prose)
    assert len(figures) > 20, "the figure pattern no longer matches the README"
    missing = sorted({f for f in figures if f not in results})
    assert not missing, f"figures in README.md found in no docs/results/ page it links: {missing}"


def _code(path):
    text = path.read_text()
    return "\n".join(FENCE.findall(text) + CODE_SPAN.findall(_without_code(text)))


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_python_names_in_the_examples_exist(doc):
    import vramledger
    code = _code(ROOT / doc)
    names = set(re.findall(r"\bvramledger\.([a-z_]+)\(", code))
    assert {"install", "region", "pause", "resume"} <= names
    missing = sorted(n for n in names if not callable(getattr(vramledger, n, None)))
    assert not missing, f"{doc} calls vramledger functions that do not exist: {missing}"
    torch = pytest.importorskip("torch")
    for dotted in set(re.findall(r"\btorch\.((?:cuda|multiprocessing)(?:\.\w+)+)", code)):
        obj = torch
        for part in dotted.split("."):
            assert hasattr(obj, part), f"{doc}: torch.{dotted} does not exist"
            obj = getattr(obj, part)


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_commands_in_the_examples_exist(doc):
    from vramledger import cli
    known = set(cli._parser()._subparsers._group_actions[0].choices)
    used = set(re.findall(r"\bvramledger (?!-)([a-z]+)\b", _code(ROOT / doc)))
    assert {"replay", "plan"} <= used
    assert not used - known, f"{doc} names commands the CLI lacks: {sorted(used - known)}"
    for path in re.findall(r"\btraces/[\w./-]+", _code(ROOT / doc)):
        assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


def _readme_commands(prefix):
    return [shlex.split(c) for c in CODE_SPAN.findall(_without_code(README.read_text()))
            if c.startswith(prefix) and "..." not in c]


@pytest.mark.parametrize("command", _readme_commands("vramledger replay traces/"), ids=" ".join)
def test_readme_replay_commands_run(command):
    pytest.importorskip("vramledger._core", reason="the replay needs the built _core module")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VRAMLEDGER_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    proc = subprocess.run([sys.executable, "-m", "vramledger", *command[1:], "--json"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["peak_reserved_bytes"] > 0


@pytest.mark.parametrize("command", _readme_commands("vramledger plan "), ids=" ".join)
def test_readme_plan_commands_run(command, tmp_path):
    args = [str(ROOT / a) if a.startswith("traces/") else a for a in command[1:]]
    env = {k: v for k, v in os.environ.items() if k != "VRAMLEDGER_CONF"}
    proc = subprocess.run([sys.executable, "-m", "vramledger", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if "--out" in args:
        written = tmp_path / args[args.index("--out") + 1]
        assert '"vramledger_plan": 1' in written.read_text()
    if "--fit" in args:
        assert re.search(r"largest micro-batch", proc.stdout, re.I), proc.stdout


def test_capacity_figures_are_the_measured_ones():
    """The README's capacity table holds the results doc's limits, vramledger's last."""
    table = (ROOT / "docs" / "results" / "capacity-h200.md").read_text()
    limits = {}  # (workload, cap GiB, allocator) -> (largest batch, largest seq)
    for line in table.splitlines():
        cells = [c.strip().replace("*", "") for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.match(r"\d+ \(", cells[3]):
            limits[cells[0], cells[1], cells[2]] = (cells[3].split()[0], cells[5].split()[0])
    allocators = ("torch native", "torch expandable", "vramledger")
    names = {"GPT-2-medium": "GPT-2-medium", "Llama-1B": "Llama-1B",
             "Llama-1B + checkpointing": "Llama-1B + ckpt",
             "Llama-1B LoRA r16 + checkpointing": "Llama-1B LoRA r16 + ckpt"}
    rows = 0
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].endswith(" GiB") or " / " not in cells[2]:
            continue
        workload, cap = names[cells[0].split(" (")[0]], cells[1].removesuffix(" GiB")
        for column, cell in enumerate(cells[2:]):
            assert cell.replace("*", "") == " / ".join(
                limits[workload, cap, a][column] for a in allocators), (workload, cap, cell)
            assert cell.endswith("**") and cell.count("**") == 2, cell  # vramledger's in bold
        rows += 1
    assert rows == 8
