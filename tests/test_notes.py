"""Every ``Note [name]`` cited in the code is defined once (STYLE.md: a Note block for each subtle
invariant, cited where it matters): no note defined twice, no citation of a note that does not
exist (a renamed or deleted one), no citation naming a module that does not hold the note."""

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ("adaptive_eager", "fuser", "neff_cache")
_NOTE = re.compile(r"Note \[([^\]]+)\]")
_IN_MODULE = re.compile(r"Note \[([^\]]+)\]\s+in\s+``?([A-Za-z_][\w.]*)``?")


def _definition(line: str, following: str, name: str) -> bool:
    """A note is defined by a line that is its title alone, followed by its text (a ``~~~``
    underline, or comment lines); ``# Note [name]: ...`` at a line of code cites it."""
    text = line.strip().lstrip("#").strip().strip('"').strip()
    if text != f"Note [{name}]":
        return False
    nxt = following.strip()
    if line.lstrip().startswith("#"):  # a comment block: its text follows in comments
        return nxt.startswith("~~~") or nxt.lstrip("#").strip().startswith("~~~") or (
            nxt.startswith("#") and nxt.lstrip("#").strip() != "")
    return nxt != ""  # in a docstring: its text follows


def _scan():
    defs, cites = collections.defaultdict(list), []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for i, line in enumerate(lines):
                following = lines[i + 1] if i + 1 < len(lines) else ""
                for m in _NOTE.finditer(line):
                    if _definition(line, following, m.group(1)):
                        defs[m.group(1)].append((module, i + 1))
                for m in _IN_MODULE.finditer(line):
                    cites.append((m.group(1), m.group(2), module, i + 1))
                for m in _NOTE.finditer(line):
                    cites.append((m.group(1), None, module, i + 1))
    return defs, cites


def test_each_note_is_defined_once():
    defs, _ = _scan()
    twice = {name: where for name, where in defs.items() if len(where) > 1}
    assert not twice, twice


def test_every_cited_note_exists_where_the_citation_says():
    defs, cites = _scan()
    missing, elsewhere = [], []
    for name, module, at, line in cites:
        if name not in defs:
            missing.append(f"{at}:{line} cites Note [{name}], which is defined nowhere")
        elif module is not None:
            home = defs[name][0][0]
            if not (home == module or home.endswith("." + module.lstrip("."))):
                elsewhere.append(f"{at}:{line} cites Note [{name}] in {module}; it is in {home}")
    assert not missing, "\n".join(missing)
    assert not elsewhere, "\n".join(elsewhere)
