"""Maps the `rlfleet` namespace across its five source roots (metadata is in pyproject.toml).

Each root holds a PEP 420 portion (`core/rlfleet/api`, `operator/rlfleet/operator`, ...);
setuptools' own discovery cannot map one namespace spread over several roots.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

SOURCE_ROOTS = ("core", "operator", "trainer", "rollout", "weightsync")

package_dir: dict[str, str] = {}
for root in SOURCE_ROOTS:
    for package in find_namespace_packages(root, include=["rlfleet.*"]):
        package_dir[package] = str(Path(root, *package.split(".")))

setup(
    packages=sorted(package_dir), package_dir=package_dir, package_data={"": ["*.yaml", "*.jsonl"]}
)
