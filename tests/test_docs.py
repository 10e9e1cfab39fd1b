"""The documentation's contract with the code.

- docs/API.md has a heading for every public name of ``rlx_jax`` and ``rlx_jax.ops``, its
  signatures name the parameters the code takes, and its table of Graph builders lists
  every public method of ``Graph``;
- README.md stays short (at most 200 lines), shows the two commands CI runs, and its
  links into the repository resolve;
- no committed text file (outside benchmarks/results, which holds measured tables)
  carries work-log text: work-period, call, run or results-section numbers, dates,
  machine paths or team process. Comments state what the code does and why; the
  history lives in git.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import types
from pathlib import Path

import pytest

import rlx_jax
import rlx_jax.ops
import rlx_jax.parallel

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "API.md"
README = ROOT / "README.md"

# The two commands .ci/run executes; README shows them verbatim.
README_COMMANDS = ('pip install ".[train,test]" && rlx-jax train', "pytest -n auto")

# Work-log patterns (case-insensitive). Each is written so that its own source text
# does not match it, so this file can be scanned like any other.
WORKLOG_PATTERNS = {
    "work-period number": r"\bsessions? [0-9]",
    "results-file section number": r"\bsections? [0-9]+",
    "call number": r"\bcalls? [0-9]+\b",
    # a run number (possibly with a letter suffix) or a list of them; not prose such as
    # "runs N.NNx faster" or "mode 7 runs 6's kernel"
    "run number": r"\brun [0-9]+[a-wyz]?(?![0-9a-z.%])|\bruns [0-9]+(?:-[0-9]+| and [0-9]+)",
    # a date, also inside a name (a file called ..._YYYY-MM-DD.txt)
    "date": r"(?<![0-9])20[0-9]{2}-[01][0-9]-[0-3][0-9](?![0-9])",
    "machine path": r"/wor[k]/",
    "team process": r"\bother\s+engineers\b|\bengineers'|\bhard\s+deadline\b|\bdevice\s+tool\b",
    "time of day narrative": r"\btonight\b|\b(?:last|the|late)\s+night\b",
}
# Measured tables keep their provenance; they are data, not prose about the code.
WORKLOG_EXEMPT_DIRS = ("benchmarks/results/",)


def _public_names(module: types.ModuleType) -> set[str]:
    """``__all__`` plus any other public attribute defined inside rlx_jax (so a name
    exported without an ``__all__`` entry is still caught); submodules and imported
    helpers (``annotations``, ``importlib``) are not API."""
    names = set(getattr(module, "__all__", ()))
    for name in dir(module):
        if name.startswith("_") or name in names:
            continue
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            continue
        if getattr(obj, "__module__", "").startswith("rlx_jax"):
            names.add(name)
    return names


def _api_headings() -> list[str]:
    return [line for line in API_MD.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


@pytest.mark.parametrize("module", [rlx_jax, rlx_jax.ops], ids=["rlx_jax", "rlx_jax.ops"])
def test_every_public_name_has_an_api_heading(module):
    headings = _api_headings()
    missing = sorted(
        name
        for name in _public_names(module)
        if not any(re.search(r"`" + re.escape(name) + r"[`( ]", h) for h in headings)
    )
    assert not missing, f"public names of {module.__name__} without a heading in docs/API.md: {missing}"


def test_public_name_discovery_sees_the_known_names():
    # Guards the test above against an empty name set (it would then pass vacuously).
    assert {"Graph", "to_jax", "grad_with_loss", "kernel_info"} <= _public_names(rlx_jax)
    assert {"rms_norm", "attention", "softmax_cross_entropy"} <= _public_names(rlx_jax.ops)
    assert "annotations" not in _public_names(rlx_jax.ops)


def _split_top_level(params: str) -> list[str]:
    """``"a, b=(1, 2), *, c"`` -> ``["a", "b=(1, 2)", "*", "c"]``: commas inside brackets
    and quotes belong to a default."""
    parts, depth, quote, current = [], 0, None, ""
    for ch in params:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _documented_params(params: str) -> list[str]:
    """Parameter names (``*`` for the keyword-only marker) of a signature as written in the
    docs: ``x: int = 1`` -> ``x``, ``*args`` kept."""
    return [re.split(r"\s*[:=]", p, maxsplit=1)[0].strip() for p in _split_top_level(params)]


def _code_params(fn) -> list[str]:
    """The parameter names of ``fn`` written as ``_documented_params`` reads the docs."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name)
    return out


def test_param_name_reading():
    assert _documented_params('a, b=(1, 2), *, c: int = 3, d="x, y"') == ["a", "b", "*", "c", "d"]
    assert _code_params(lambda a, b=(1, 2), *, c=3: None) == ["a", "b", "*", "c"]


# a heading that elides parameters ("...") documents them in its text
_HEADING_SIGNATURE = re.compile(r"`([A-Za-z_]\w*)\(([^`]*?)\)(?: -> [^`]*)?`")


def test_api_signatures_name_the_code_parameters():
    # each "## `module`" section documents that module's names
    sections = {f"## `{m.__name__}`": m for m in (rlx_jax, rlx_jax.ops, rlx_jax.parallel)}
    module, wrong, checked = None, [], 0
    for heading in _api_headings():
        if heading.startswith("## "):
            module = sections.get(heading.strip())
            continue
        for name, params in _HEADING_SIGNATURE.findall(heading):
            fn = getattr(module, name, None)
            if fn is None or "..." in params:
                continue
            checked += 1
            documented, code = _documented_params(params), _code_params(fn)
            if documented != code:
                wrong.append(f"{name}: docs/API.md {documented}, code {code}")
    assert checked > 50, f"only {checked} signatures read: the heading pattern no longer matches"
    assert not wrong, "docs/API.md signatures that differ from the code:\n" + "\n".join(wrong)


def _builder_rows() -> dict[str, str]:
    """{method: documented parameters} of the table under "## Graph builders"."""
    section = API_MD.read_text(encoding="utf-8").split("\n## Graph builders\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([A-Za-z_]\w*)\((.*?)\)(?: -> [^`]*)?` \|", section,
                                                          re.MULTILINE)}


def test_graph_builders_table_lists_every_public_method():
    rows = _builder_rows()
    public = {name for name in dir(rlx_jax.Graph) if not name.startswith("_")}
    missing, extra = sorted(public - set(rows)), sorted(set(rows) - public)
    assert not missing, f"public Graph methods missing from docs/API.md's builders table: {missing}"
    assert not extra, f"builders table rows for methods Graph does not have: {extra}"
    wrong = []
    for name, params in sorted(rows.items()):
        documented, code = _documented_params(params), _code_params(getattr(rlx_jax.Graph, name))
        if documented != code:
            wrong.append(f"{name}: docs/API.md {documented}, code {code}")
    assert not wrong, "builder rows whose parameters differ from the code:\n" + "\n".join(wrong)


def test_readme_is_short_and_shows_the_ci_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it at most 200 (details go in docs/)"
    stripped = {line.strip() for line in lines}
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()}
    for command in README_COMMANDS:
        assert command in stripped, f"README.md must show the command {command!r} on its own line"
        assert command in ci, f".ci/run must run README's command {command!r} on its own line"


def test_readme_and_docs_links_resolve():
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


# A repository path written in the docs' text: under a top-level folder, ending in a file
# name with an extension. Placeholders (`<family>`, `*`, `foo`) are templates, not paths.
_DOC_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|tests|rlx_jax|ffi|docs|tools|notebooks|examples)/[\w./-]*"
                       r"\.(?:py|md|txt|json|cuh|cu|cc|h|sh|ipynb|toml))(?![\w])")


def _path_mentions(text: str) -> list[str]:
    return [m for m in _DOC_PATH.findall(text) if "foo" not in m.rsplit("/", 1)[-1]]


def test_path_mentions_detector():
    text = ("see `benchmarks/results/e2e_step_h200.txt`, ffi/cuda/attention_wgmma.cuh and "
            "`rlx_jax/vjp_rules/<family>.py`, ffi/cpu/*.cc or tests/test_foo.py")
    assert _path_mentions(text) == ["benchmarks/results/e2e_step_h200.txt", "ffi/cuda/attention_wgmma.cuh"]


def test_paths_named_in_readme_and_docs_exist():
    missing = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            missing += [f"{doc.relative_to(ROOT)}:{lineno}: {p}" for p in _path_mentions(line)
                        if not (ROOT / p).exists()]
    assert not missing, "files named in the docs that the repository does not have:\n" + "\n".join(missing)


def _committed_text_files() -> list[Path]:
    """Tracked files when this is a git checkout, else every file outside hidden and
    build folders; binary files (a NUL byte or not UTF-8) are skipped by the caller."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        skip = {"build", "__pycache__", "node_modules"}
        return [
            p
            for p in ROOT.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts[:-1])
        ]


def _worklog_hits(text: str) -> list[tuple[int, str, str]]:
    hits = []
    compiled = {label: re.compile(p, re.IGNORECASE) for label, p in WORKLOG_PATTERNS.items()}
    for lineno, line in enumerate(text.splitlines(), 1):
        for label, pattern in compiled.items():
            if pattern.search(line):
                hits.append((lineno, label, line.strip()))
    return hits


def test_worklog_patterns_catch_what_they_should():
    # The detector itself: each kind of work-log text is caught, plain code is not.
    # (assembled from pieces so that this file's own text stays clean)
    caught = [
        "// measured in sess" + "ion 36 (results sect" + "ion 64)",
        "# cal" + "l 5 of the second one",
        "// the default before ru" + "n 14",
        "// ru" + "n 13F's A/B",
        "(ru" + "ns 4 and 5 of the results)",
        "# 2026" + "-11-22: the kernel replaced",
        "(`results/data_parallel_2026" + "-11-22.txt`)",
        "see /wor" + "k/shared/docs",
        "Other engin" + "eers edit the same tree",
        "hard dead" + "line 01:15",
        "lent through the device" + " tool",
    ]
    clean = [
        "session = rlx_jax.Session('cpu')  # compiles once",
        "for run in range(3):",
        "// one block per tile: the last wave leaves half the SMs idle",
        "fwd+bwd runs 1.07x XLA; the kernel runs 3x faster; mode 7 runs 6's kernel",
    ]
    assert all(_worklog_hits(line) for line in caught), [line for line in caught if not _worklog_hits(line)]
    assert not any(_worklog_hits(line) for line in clean)


def test_no_worklog_text_in_committed_files():
    offenders = []
    for path in _committed_text_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(WORKLOG_EXEMPT_DIRS) or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{rel}:{n}: [{label}] {line[:120]}" for n, label, line in _worklog_hits(text)]
    assert not offenders, (
        f"{len(offenders)} work-log line(s); say what the code does and why, not when or by whom:\n"
        + "\n".join(offenders)
    )
