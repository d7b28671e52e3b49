"""Write constraints.txt: the exact versions of the tested environment, restricted to what mmtok pulls in.

    .venv/bin/python benchmarks/freeze_constraints.py [--extras test] [--out constraints.txt]

pyproject.toml declares ranges (what mmtok works with); constraints.txt pins the one set the tests passed
with, for `pip install -c constraints.txt -e '.[test]'` (quick start, .ci/run). Run this with the Python of
a venv where the tests pass: it walks mmtok's requirements (read from pyproject.toml, not from the possibly
stale metadata of an editable install) and, recursively, those of every installed distribution they name,
with markers evaluated for this interpreter and platform, and writes `name==version` for each. Packages
installed by hand (linters, a torchaudio) are not in the walk and not in the file.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent


def applies(requirement: Requirement, extra: str) -> bool:
    """Whether `requirement` is part of its distribution's base set (extra "") or of `extra`."""
    if requirement.marker is None:
        return extra == ""
    if extra and requirement.marker.evaluate({"extra": ""}):
        return False  # a base requirement with an environment marker: counted with the base set
    return requirement.marker.evaluate({"extra": extra})


def walk(root: str, root_requirements: list[str], extras: list[str]) -> dict[str, metadata.Distribution]:
    """Installed distributions reachable from `root`'s requirements (base set and `extras`), by canonical name."""
    found: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(root), extra) for extra in ["", *extras]]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in done:
            continue
        done.add((name, extra))
        if name == canonicalize_name(root):
            requirements = root_requirements
        else:
            try:
                found[name] = found.get(name) or metadata.distribution(name)
            except metadata.PackageNotFoundError:
                sys.exit(f"freeze_constraints: {name} is required but not installed in {sys.prefix}")
            requirements = found[name].requires or []
        for text in requirements:
            requirement = Requirement(text)
            if applies(requirement, extra):
                target = canonicalize_name(requirement.name)
                todo += [(target, "")] + [(target, sub) for sub in requirement.extras]
    return found


def root_requirements(pyproject: dict) -> list[str]:
    """pyproject.toml's requirements as metadata writes them: extras become `; extra == "..."` markers."""
    project = pyproject["project"]
    texts = list(project.get("dependencies", []))
    for extra, requirements in project.get("optional-dependencies", {}).items():
        for text in requirements:
            requirement = Requirement(text)
            marker = f'extra == "{extra}"'
            if requirement.marker is not None:
                marker = f"({requirement.marker}) and {marker}"
            requirement.marker = None
            texts.append(f"{requirement}; {marker}")
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extras", default="test", help="comma-separated extras to include (default test)")
    parser.add_argument("--out", type=Path, default=REPO / "constraints.txt")
    args = parser.parse_args()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))
    root = pyproject["project"]["name"]
    extras = [e for e in args.extras.split(",") if e]
    found = walk(root, root_requirements(pyproject), extras)
    lines = sorted((f"{dist.metadata['Name']}=={dist.version}" for dist in found.values()), key=str.lower)
    header = [
        f"# The exact set {root}[{','.join(extras)}] was tested with (Python {sys.version.split()[0]}, "
        f"{sys.platform}). Use: pip install -c constraints.txt -e '.[{','.join(extras)}]'",
        "# pyproject.toml declares the supported ranges; docs/install.md says when to use which.",
        "# Regenerate from a venv whose tests pass: .venv/bin/python benchmarks/freeze_constraints.py",
    ]
    args.out.write_text("\n".join(header + lines) + "\n", "utf-8")
    print(f"freeze_constraints: {len(lines)} pins -> {args.out}")


if __name__ == "__main__":
    main()
