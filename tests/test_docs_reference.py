"""The documentation cannot drift from the code: every config key, CLI command and option, metric and event
kind is in the generated reference, every failure cause has a troubleshooting entry, and every link between
pages (and from the README into docs/) leads to a page and a heading that exist. No network, no MkDocs build:
`make docs` builds the site itself with --strict."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import click
import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
assert _spec is not None and _spec.loader is not None
gen_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_reference)


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return gen_reference.pages()


@pytest.fixture(scope="module")
def site(generated) -> dict[str, str]:
    """Every page of the site, written and generated, by its path under docs/."""
    pages = {str(path.relative_to(DOCS)): path.read_text() for path in DOCS.rglob("*.md")}
    overlap = set(pages) & set(generated)
    assert not overlap, f"generated pages also written by hand: {overlap}"
    return pages | generated


def _fields_of(model, prefix=""):
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        yield prefix + name
        inner = gen_reference._is_model(field.annotation)
        if inner is not None:
            yield from _fields_of(inner, f"{prefix}{name}.")


def test_every_config_key_is_in_the_reference(generated):
    from agent.config import AgentConfig
    from daemon.config import ClusterConfig

    for model, page in ((ClusterConfig, "reference/cluster-file.md"), (AgentConfig, "reference/agent-file.md")):
        text = generated[page]
        missing = [key for key in _fields_of(model) if f"| `{key}` |" not in text]
        assert not missing, f"{page} lacks {missing}"


def test_field_notes_name_keys_that_exist():
    from agent.config import AgentConfig
    from daemon.config import ClusterConfig

    keys = set(_fields_of(ClusterConfig)) | set(_fields_of(AgentConfig))
    assert not set(gen_reference.FIELD_NOTES) - keys


def test_every_key_has_a_meaning(generated):
    """A key without a comment in its model (and none in FIELD_NOTES) would show an empty row."""
    for page in ("reference/cluster-file.md", "reference/agent-file.md"):
        empty = [line.split("|")[1].strip() for line in generated[page].splitlines()
                 if line.startswith("| `") and "| section |" not in line and line.rstrip().endswith("|  |")]
        assert not empty, f"{page}: keys without a meaning: {empty} (comment them in their model)"


def test_every_command_and_option_is_in_the_reference(generated):
    from agent.main import cli as agent_cli
    from daemon.cli.trainerctl import cli as trainerctl_cli
    from daemon.cli.trainerd_main import cli as trainerd_cli

    for program, root in (("trainerd", trainerd_cli), ("trainerctl", trainerctl_cli),
                          ("trainerd-agent", agent_cli)):
        text = generated[f"reference/{program}.md"]
        for path, command in gen_reference.commands(root, program):
            assert f"## `{path}`" in text, f"{path} is not in the reference"
            section = text.split(f"## `{path}`", 1)[1].split("\n## ", 1)[0]
            for param in command.params:
                if isinstance(param, click.Option):
                    for opt in param.opts:
                        assert f"`{opt}`" in section, f"{path} {opt} is not in the reference"


def test_every_metric_is_in_the_reference(generated):
    from prometheus_client import REGISTRY

    import daemon.app  # noqa: F401

    names = set()
    for collector in list(REGISTRY._collector_to_names):
        for name in REGISTRY._collector_to_names[collector]:
            if name.startswith("trainerd_") and not name.endswith(("_bucket", "_count", "_sum", "_created")):
                names.add(name)
    names = {name for name in names if f"{name}_total" not in names}  # a counter is registered under both
    assert names, "no trainerd_ metric registered"
    missing = [name for name in sorted(names) if f"`{name}`" not in generated["reference/metrics.md"]]
    assert not missing


def _event_kinds_in_code() -> dict[str, str]:
    """{kind: where} for every event kind the coordinator's code appends: the `EventKind` members named by the
    first argument of `<...events>.append(...)`, the second of `CommitRecord(...)`, or the local variable
    either names (`EventLog.append` takes only an EventKind: mypy keeps string literals out)."""
    from daemon.events import EventKind

    found: dict[str, str] = {}
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assigned: dict[str, list[ast.AST]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    assigned.setdefault(node.targets[0].id, []).append(node.value)
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                func, arg = node.func, None
                if (isinstance(func, ast.Attribute) and func.attr == "append" and isinstance(func.value, ast.Attribute)
                        and "events" in func.value.attr and node.args):
                    arg = node.args[0]
                elif isinstance(func, ast.Name) and func.id == "CommitRecord" and len(node.args) >= 2:
                    arg = node.args[1]
                if arg is None:
                    continue
                # action.event, a CommitRecord's, names no member: it is found at the CommitRecord.
                sources = assigned.get(arg.id, []) if isinstance(arg, ast.Name) else [arg]
                for source in sources:
                    for named in ast.walk(source):
                        if (isinstance(named, ast.Attribute) and isinstance(named.value, ast.Name)
                                and named.value.id == "EventKind"):
                            kind = getattr(EventKind, named.attr, named.attr)
                            found.setdefault(str(kind), f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_event_kinds_are_one_list(generated):
    from daemon.events import EventKind

    in_code = _event_kinds_in_code()
    listed = {kind.value for kind in EventKind}
    unlisted = {kind: where for kind, where in in_code.items() if kind not in listed}
    assert not unlisted, f"event kinds appended but not in daemon.events.EventKind: {unlisted}"
    assert not listed - set(in_code), f"EventKind members no code appends: {listed - set(in_code)}"
    for kind in listed:
        assert f"| `{kind}` |" in generated["reference/events.md"]


def test_every_failure_cause_has_a_troubleshooting_entry():
    from daemon.job.state import FailureCause

    text = (DOCS / "troubleshooting.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    missing = [cause.value for cause in FailureCause if not any(f"`{cause.value}`" in h for h in headings)]
    assert not missing, f"troubleshooting.md has no heading for {missing}"


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _anchors(text: str) -> set[str]:
    text = _FENCE.sub("", text)
    anchors = set(re.findall(r"\{#([\w-]+)\}", text))
    seen: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*(\{#[\w-]+\})?\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "")
        slug = slugify(title, "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}_{count}")
    return anchors


def _links(text: str) -> list[str]:
    return [target for target in _LINK.findall(_FENCE.sub("", text))
            if not re.match(r"[a-z]+:", target)]


def test_links_between_pages_lead_somewhere(site):
    dead = []
    for page, text in site.items():
        for target in _links(text):
            path, _, anchor = target.partition("#")
            resolved = page if not path else str((Path(page).parent / path).as_posix())
            resolved = str(Path(resolved).as_posix())
            parts: list[str] = []
            for part in resolved.split("/"):
                if part == "..":
                    if not parts:
                        parts = ["<outside docs>"]
                        break
                    parts.pop()
                elif part not in ("", "."):
                    parts.append(part)
            resolved = "/".join(parts)
            if resolved not in site:
                dead.append(f"{page}: {target} (no page {resolved})")
            elif anchor and anchor not in _anchors(site[resolved]):
                dead.append(f"{page}: {target} (no heading #{anchor} in {resolved})")
    assert not dead, "\n".join(dead)


def test_readme_is_a_front_door(site):
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    assert "make demo" in text and "make test" in text
    dead = []
    for target in _links(text):
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            dead.append(target)
        elif anchor and path.startswith("docs/") and anchor not in _anchors(site[path.removeprefix("docs/")]):
            dead.append(target)
    assert not dead, f"README links that lead nowhere: {dead}"


def test_nothing_cites_a_design_outside_the_repository():
    pattern = r"\.\./shared|shared" + "/DESIGN"  # split, or this file would match itself
    tracked = subprocess.run(["git", "grep", "-l", "-I", "-E", pattern], cwd=ROOT,
                             capture_output=True, text=True)
    assert tracked.returncode in (0, 1), tracked.stderr
    assert tracked.stdout.strip() == "", f"files citing a design outside the repository: {tracked.stdout.split()}"


def test_measurements_stay_on_the_benchmarks_page():
    """The guide says what the system does; figures and how they were measured belong on benchmarks.md."""
    offending = [str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")
                 if path.name != "benchmarks.md" and re.search(r"\bMeasured\b", path.read_text())]
    assert not offending, f"measurements outside docs/benchmarks.md: {offending}"
    assert not re.search(r"\bMeasured\b", (ROOT / "README.md").read_text())


def test_yaml_examples_in_the_docs_are_valid(site):
    """Every YAML example parses, and every cluster-file example (top-level `cluster` or `job`) is accepted
    by the cluster file's model: an example cannot teach a key that no longer exists."""
    import yaml

    from daemon.config import ClusterConfig

    blocks = [(page, block) for page, text in site.items()
              for block in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)]
    blocks += [("README.md", block) for block in
               re.findall(r"^```yaml\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)]
    assert blocks
    checked = 0
    for page, block in blocks:
        data = yaml.safe_load(block)
        assert isinstance(data, dict), f"{page}: a YAML example that is no mapping"
        if data and set(data) <= {"cluster", "job"}:
            ClusterConfig.model_validate(data)
            checked += 1
    assert checked >= 5
