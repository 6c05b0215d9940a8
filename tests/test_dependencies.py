"""Declared dependencies are honest: each runtime one is imported by the package, each third-party import of the
package is declared, and constraints.txt (what setup.sh installs and CI runs) pins a version inside every declared
range, the version this environment actually has."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Import names of distributions whose import name differs from the distribution's (a tuple: several).
IMPORT_NAMES: dict[str, str | tuple[str, ...]] = {
    "opentelemetry-api": ("opentelemetry", "opentelemetry.trace", "opentelemetry.metrics", "opentelemetry.context",
                          "opentelemetry.util"),
    "nvidia-ml-py": "pynvml", "grpcio": "grpc", "googleapis-common-protos": "google.rpc", "protobuf": "google.protobuf",
    "cupti-python": "cupti", "opentelemetry-sdk": "opentelemetry.sdk", "opentelemetry-proto": "opentelemetry.proto",
    "opentelemetry-exporter-otlp-proto-common": "opentelemetry.exporter.otlp.proto.common",
    "opentelemetry-exporter-otlp-proto-grpc": "opentelemetry.exporter.otlp.proto.grpc",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http",
}
# Imported by the package and installed by the system, not by pip (bcc comes with the distribution's python3-bpfcc).
SYSTEM = {"bcc"}


def _import_names(dist: str) -> tuple[str, ...]:
    names = IMPORT_NAMES.get(dist, dist.replace("-", "_"))
    return names if isinstance(names, tuple) else (names,)


def _requirements(extra: str | None = None) -> list[Requirement]:
    lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _package_imports(testing: bool = False) -> set[str]:
    """Every absolute import in the installed package's modules (dotted, as written): those of the tool, or with
    ``testing`` those of gputrace.testing (helpers for tests and benchmarks, which may use the dev extra)."""
    names: set[str] = set()
    for folder in ("gputrace", "daemon", "probes", "exporters", "viewer"):
        for path in (ROOT / folder).rglob("*.py"):
            top = path.relative_to(ROOT / folder).parts[0]
            if folder == "gputrace" and top in {"daemon", "probes", "exporters", "viewer"}:
                continue  # the links to the top-level folders: read once, there
            if (folder == "gputrace" and top == "testing") != testing:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
    return names


def _third_party(imports: set[str]) -> set[str]:
    return {n for n in imports
            if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] not in {"gputrace", "__future__"}}


def test_every_runtime_dependency_is_imported_by_the_package() -> None:
    """gputrace.testing counts: its Perfetto checker (python -m gputrace.testing.perfetto_check) is documented for
    users, and needs the perfetto package's protos."""
    imports = _package_imports() | _package_imports(testing=True)
    for req in _requirements():
        names = _import_names(req.name)
        assert any(i == n or i.startswith(n + ".") for i in imports for n in names), \
            f"{req.name} is declared in pyproject.toml but the package never imports {' or '.join(names)}"


def _imports_declared(imports: set[str], requirements: list[Requirement]) -> None:
    declared = {n for r in requirements for n in _import_names(r.name)}
    for name in sorted(_third_party(imports)):
        ok = name.split(".")[0] in SYSTEM or name in declared or any(
            name.startswith(d + ".") for d in declared if d != "opentelemetry")  # the API's root is not all of it
        assert ok, f"the package imports {name}, which no dependency in pyproject.toml declares"


def test_every_third_party_import_is_declared() -> None:
    _imports_declared(_package_imports(), [*_requirements(), *_requirements("gpu")])
    _imports_declared(_package_imports(testing=True), [*_requirements(), *_requirements("dev")])


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
            assert m, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def test_constraints_pin_every_declared_dependency_inside_its_range() -> None:
    pins = _pins()
    for req in [*_requirements(), *_requirements("dev"), *_requirements("gpu")]:
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt pins no version of {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}"


def test_this_environment_runs_the_pinned_versions() -> None:
    """What CI tests is what constraints.txt says (setup.sh installs with -c constraints.txt)."""
    for name, version in _pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            continue  # a pin of something only another platform pulls in
        assert have == version, f"{name} {have} is installed; constraints.txt pins {version} (run ./setup.sh)"
