"""Dependencies point one way (docs/concepts/architecture.md): the coordinator, the agent and trainerctl run on hosts without
MindSpore and must never import it; they share contracts with workers through proto/, never through the
worker runtime; and proto/ stays pure (no pydantic, no YAML)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import daemon.app, daemon.cli.trainerd_main, daemon.cli.trainerctl, agent.main
daemon.cli.trainerctl._register_subcommands()
loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'mindspore')
print(','.join(loaded))
"""

PROTO_PROBE = """
import importlib, pkgutil, sys
import proto
for module in pkgutil.iter_modules(proto.__path__):
    importlib.import_module(f"proto.{module.name}")
loaded = sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'yaml'})
print(','.join(loaded))
"""

WORKER_RUNTIME = ("trainer.runtime", "trainer.progress_channel")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` names in an import statement: `from a import b` counts as `a` and `a.b`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_coordinator_agent_and_cli_do_not_import_mindspore() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"MindSpore modules loaded: {result.stdout.strip()}"


def test_coordinator_and_agent_do_not_import_the_worker_runtime() -> None:
    """What they share with workers (progress datagrams, exit codes, worker files) lives in proto/."""
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for package in ("daemon", "agent")
        for path in sorted((REPO / package).rglob("*.py"))
        for name in imported_modules(path)
        if within(name, WORKER_RUNTIME)
    }
    assert not found, f"imports of the worker runtime: {sorted(found)}"


def test_proto_imports_neither_pydantic_nor_yaml() -> None:
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted((REPO / "proto").rglob("*.py"))
        for name in imported_modules(path)
        if within(name, ("pydantic", "yaml"))
    }
    assert not found, f"proto/ imports: {sorted(found)}"
    result = subprocess.run([sys.executable, "-c", PROTO_PROBE], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing proto/ loaded: {result.stdout.strip()}"


def test_the_agent_does_not_import_the_coordinator() -> None:
    """What both need (certificate identities, TLS files, the wire) lives in common/ and proto/."""
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted((REPO / "agent").rglob("*.py"))
        for name in imported_modules(path)
        if within(name, ("daemon",))
    }
    assert not found, f"agent imports of daemon: {sorted(found)}"


SHARING_PACKAGES = ("daemon", "agent", "trainer", "proto", "common")


def test_no_public_class_name_means_two_things_in_two_packages() -> None:
    """A name read in a traceback, a review or a grep says which thing it is: a public class is defined in
    one of the top-level packages only (the coordinator's failure cause is not the agent's root cause)."""
    defined: dict[str, set[str]] = {}
    for package in SHARING_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated: their classes are the services' names in trainerd.proto (Coordinator)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    defined.setdefault(node.name, set()).add(f"{path.relative_to(REPO)}")
    shared = {name: sorted(paths) for name, paths in defined.items()
              if len({path.split("/")[0] for path in paths}) > 1}
    assert not shared, f"public class names defined in more than one package: {shared}"


def test_only_the_snapshots_package_imports_its_modules() -> None:
    """agent/snapshots/ has one public face, its __init__.py: the rest of the tree imports `agent.snapshots`,
    never a module in it (tests may, to reach what they test)."""
    import agent.snapshots

    package = REPO / "agent" / "snapshots"
    public = {f"agent.snapshots.{name}" for name in agent.snapshots.__all__}
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for top in ("agent", "bench", "common", "daemon", "docs", "proto", "scripts", "trainer")
        for path in sorted((REPO / top).rglob("*.py"))
        if not path.is_relative_to(package)
        for name in imported_modules(path)
        if name.startswith("agent.snapshots.") and name not in public
    }
    assert not found, f"imports of agent.snapshots' modules: {sorted(found)}"
