"""The documentation site: its generated pages are current and every page is in the nav."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _docs_pages():
    spec = importlib.util.spec_from_file_location("docs_pages", ROOT / "tools" / "docs_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    for name, make in _docs_pages().PAGES.items():
        page = make()
        # A heading glued to a table's last line is read as a row: its anchor is gone.
        lines, fenced = page.splitlines(), False
        for i, line in enumerate(lines):
            fenced ^= line.startswith("```")
            if (
                not fenced
                and line.startswith("#")
                and i
                and lines[i - 1].strip()
                and not lines[i - 1].startswith("<!--")
            ):
                raise AssertionError(f"docs/{name}:{i + 1}: no blank line before the heading {line!r}")
        assert (ROOT / "docs" / name).read_text() == page, f"docs/{name} is stale: run python tools/docs_pages.py"


def test_options_page_has_the_trainers_table():
    from ppo_fast.trainer.command_line import options_markdown

    assert options_markdown().strip() in (ROOT / "docs" / "trainer-options.md").read_text()


def test_performance_page_reads_every_result_file_and_labels_each_with_its_machine():
    page = (ROOT / "docs" / "performance.md").read_text()
    results = sorted(RESULTS.glob("*.json"))
    for result in results:
        assert f"`bench/results/{result.name}`" in page, result.name
    assert page.count("Measured on ") == len(results)


def _nav_files(nav) -> list[str]:
    files = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(_nav_files(config["nav"])) == pages


def test_the_api_reference_has_each_parameters_type_and_default():
    """Every function of the API reference (docs/ops.md) annotates its parameters (the reference's
    Type column) and documents each in an entry of its own, named as in the signature (so the
    Default column reads the signature's default instead of saying "required")."""
    import importlib
    import inspect
    import re

    problems = []
    for line in (ROOT / "docs" / "ops.md").read_text().splitlines():
        if not line.startswith("::: ppo_fast.ops."):
            continue
        module, _, name = line[4:].strip().rpartition(".")
        fn = getattr(importlib.import_module(module), name)
        params = inspect.signature(fn).parameters.values()
        shown = {("**" if p.kind == p.VAR_KEYWORD else "") + p.name for p in params}
        problems += [f"{name}: {p.name} has no annotation" for p in params if p.annotation is inspect.Parameter.empty]
        args = re.search(r"^Args:\n(.*?)(?:\n\n|\Z)", inspect.getdoc(fn) or "", re.S | re.M)
        entries = re.findall(r"^    (\S[^:]*):", args.group(1), re.M) if args else []
        problems += [
            f"{name}: the entry {e!r} names no one parameter of the signature" for e in entries if e not in shown
        ]
    assert not problems, problems


# docs/extending.md: each section's files, and the registry whose variants they spell out.
_EXTENDING_REGISTRIES = {
    "A policy-loss mode": lambda spec: ([m.op for m in spec.POLICY_LOSS_MODES.values()], False),
    "An advantage method": lambda spec: (list(spec.ADVANTAGE_METHODS), True),
    "A KL estimator": lambda spec: (list(spec.KL_ESTIMATORS), True),
    "A new backend": lambda spec: (list(spec.BACKENDS), True),
    "A rollout engine": lambda spec: (list(spec.ROLLOUT_ENGINES), True),
}


def _extending_sections() -> dict[str, list[str]]:
    """docs/extending.md's sections with the paths they list (``a/b.py``, ``a/<op>.py``)."""
    sections, current = {}, None
    for line in (ROOT / "docs" / "extending.md").read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), [])
        elif current is not None:
            current += [p for p in re.findall(r"`([^` ]+)`", line) if "/" in p and "." in p.rsplit("/", 1)[-1]]
    return sections


def test_the_extending_page_lists_the_files_each_registry_spells_out():
    """Every file of ppo_fast/ and csrc/ that names each variant of a registry (a place a new variant must
    be added) is on that registry's list; every listed file exists (placeholders: one registered example)."""
    from ppo_fast import spec

    sections = _extending_sections()
    assert set(_EXTENDING_REGISTRIES) <= set(sections)
    assert {"A backend for one op", "A trainer option"} <= set(sections)
    example = {"<op>": "policy_loss", "<backend>": "native", "<module>": "rollout_vllm", "<name>": "grpo"}
    for title, paths in sections.items():
        assert paths, title
        for path in paths:
            for placeholder, value in example.items():
                path = path.replace(placeholder, value)
            for one in re.sub(r"\{(\w+),(\w+)\}", r"\1", path), re.sub(r"\{(\w+),(\w+)\}", r"\2", path):
                assert (ROOT / one).exists(), f"docs/extending.md, {title}: {one} does not exist"
    sources = [
        p for top in ("ppo_fast", "csrc") for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".h", ".cpp", ".cu")
    ]
    for title, registry in _EXTENDING_REGISTRIES.items():
        names, quoted = registry(spec)
        spelled = [f'"{name}"' if quoted else name for name in names]
        for source in sources:
            text = source.read_text(errors="ignore")
            if all(name in text for name in spelled):
                where = source.relative_to(ROOT).as_posix()
                assert where in sections[title], f"docs/extending.md, {title}: {where} names every variant; list it"


def test_the_trl_migration_page_names_only_options_that_exist():
    """docs/from-trl.md maps TRL's fields to our flags: each flag it names is one ``ppo-fast train`` takes."""
    import re

    from ppo_fast.trainer import command_line

    _, train_parser = command_line.build_parser()
    known = {option for action in train_parser._actions for option in action.option_strings}
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", (ROOT / "docs" / "from-trl.md").read_text()))
    assert named and not named - known, sorted(named - known)
