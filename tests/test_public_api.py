"""Each package's ``__all__`` lists exactly the public names its ``__init__`` defines or
re-exports: nothing public is left out, nothing listed is missing, nothing is listed twice."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

PACKAGES = [
    "slipstream.format",
    "slipstream.protocol",
    "slipstream.streams",
    "slipstream.storage",
    "slipstream.cluster",
    "slipstream.broker",
    "slipstream.client",
    "slipstream.cli",
    "slipstream.spark",
    "slipstream.devservers",
    "slipstream",
]


def public_names(package: ModuleType) -> set[str]:
    """Names without a leading underscore, less subpackages and submodules bound by the import
    system as a side effect of importing them (a module bound under another name counts)."""
    names = set()
    for name, value in vars(package).items():
        if name.startswith("_"):
            continue
        if isinstance(value, ModuleType) and value.__name__ == f"{package.__name__}.{name}":
            continue
        names.add(name)
    return names


@pytest.mark.parametrize("package_name", PACKAGES)
def test_all_lists_exactly_the_public_names(package_name: str) -> None:
    package = importlib.import_module(package_name)
    listed = list(package.__all__)
    assert len(listed) == len(set(listed)), "a name is listed twice"
    assert [name for name in listed if not hasattr(package, name)] == []
    assert set(listed) - {name for name in listed if name.startswith("__")} == public_names(package)
