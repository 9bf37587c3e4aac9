"""The installed versions of k3's dependencies lie inside the bounds pyproject.toml declares.

A fresh install resolves the newest release inside each bound; the suite is only known to pass inside them, so a
machine whose packages drifted outside (an older environment, a manual upgrade) fails here by name instead of
somewhere deep in a kernel test."""

import os
import re
from importlib import metadata

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
packaging_req = pytest.importorskip("packaging.requirements")

PYPROJECT = os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml")
KEY = {"torch", "triton", "fla-core", "fastapi", "tokenizers"}  # whose versions have changed k3's behaviour


def _requirements():
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return [packaging_req.Requirement(r) for r in reqs]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_key_libraries_are_bounded_above_and_below():
    bounded = {_norm(r.name): r.specifier for r in _requirements()}
    for name in KEY:
        ops = {s.operator for s in bounded[name]}
        assert ">=" in ops and "<" in ops, f"{name} must have a tested lower and upper bound, has '{bounded[name]}'"


@pytest.mark.parametrize("req", _requirements(), ids=lambda r: r.name)
def test_installed_version_is_inside_the_declared_bounds(req):
    if req.marker is not None and not req.marker.evaluate():
        pytest.skip(f"{req.name} is not used on this platform")
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        if _norm(req.name) in KEY - {"fla-core", "triton"}:
            pytest.fail(f"{req.name} is a core dependency and is not installed")
        pytest.skip(f"{req.name} is not installed (an optional extra)")
    local = version.split("+")[0]  # torch's "2.13.0+cpu": the local label does not change the release
    assert req.specifier.contains(local, prereleases=True), (
        f"{req.name} {version} is installed, outside the tested bounds '{req.specifier}' in pyproject.toml: "
        f"install a version inside them, or run the suite with the new version and widen the bound")
