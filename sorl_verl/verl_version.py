"""The verl releases sorl-verl supports, written once: the ``verl`` requirement in
pyproject.toml's ``dependencies``, read here from the installed package's metadata (from the source
tree's pyproject.toml when sorl-verl is not installed).

``SUPPORTED_VERL_RANGE`` is that specifier (``>=0.9.1,<0.10``), ``SUPPORTED_VERL`` the same as a
``SpecifierSet``, ``TESTED_VERL`` its lower bound: the release the recipe, the CPU path and CI run.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

DISTRIBUTION = "sorl-verl"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirements() -> list[str]:
    try:
        return list(metadata.requires(DISTRIBUTION) or [])
    except metadata.PackageNotFoundError:
        import tomllib  # Python 3.11+; an installed sorl-verl needs no pyproject.toml

        return list(tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"])


def declared_range(requirements: list[str] | None = None) -> str:
    """The specifier of the unconditional ``verl`` requirement, lower bound first."""
    specs = [
        req.specifier
        for req in map(Requirement, _requirements() if requirements is None else requirements)
        if req.name == "verl" and req.marker is None
    ]
    if len(specs) != 1 or not specs[0]:
        raise RuntimeError(f"{DISTRIBUTION}: expected one versioned verl requirement in its dependencies, got {specs}")
    return ",".join(sorted(map(str, specs[0]), key=lambda s: (not s.startswith(">"), s)))


SUPPORTED_VERL_RANGE = declared_range()
SUPPORTED_VERL = SpecifierSet(SUPPORTED_VERL_RANGE)
TESTED_VERL = next(s.version for s in SUPPORTED_VERL if s.operator == ">=")
