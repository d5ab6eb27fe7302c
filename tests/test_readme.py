"""The README: at most 300 lines, its two commands the ones CI runs, its API example runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.S)
    return [
        line.strip() for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")
    ]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    train, test = commands
    assert train.endswith("ppo-fast train")
    assert test.endswith("-m pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines


def test_readme_api_examples_run():
    """The API section's snippets, in order, in one namespace (each continues the one before)."""
    section = (ROOT / "README.md").read_text().split("## API", 1)[1].split("\n## ", 1)[0]
    names = {}
    for i, example in enumerate(re.findall(r"```python\n(.*?)```", section, flags=re.S)):
        exec(compile(example, f"README.md API example {i + 1}", "exec"), names)
    assert i >= 1 and "loss" in names


def test_readme_is_short_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    assert links and all((ROOT / link).is_file() for link in links), links
