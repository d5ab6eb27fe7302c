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


def test_quick_start_installs_the_cpu_torch_where_no_gpu_is_listed(tmp_path):
    """The train line's torch: the CUDA build where ``nvidia-smi -L`` succeeds, PyTorch's CPU index where
    it fails or is missing.  The line's own substitution runs under bash with a stand-in nvidia-smi."""
    import subprocess

    train = _quick_start_commands()[0]
    choice = re.search(r"torch==[0-9.]+ (\$\(nvidia-smi .*?\)) ", train).group(1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"

    def extra_args(smi_status):
        if smi_status is None:
            smi.unlink(missing_ok=True)
        else:
            smi.write_text(f"#!/bin/sh\necho 'GPU 0: NVIDIA H100'\nexit {smi_status}\n")
            smi.chmod(0o755)
        run = subprocess.run(
            ["/bin/bash", "-c", f"echo {choice}"],
            env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        )
        return run.stdout.split()

    cpu = ["--index-url", "https://download.pytorch.org/whl/cpu"]
    assert extra_args(0) == []
    assert extra_args(6) == cpu  # nvidia-smi's status when the driver finds no device
    if not any((pathlib.Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        assert extra_args(None) == cpu


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


def test_readme_quotes_the_built_in_job_s_measured_score():
    """The quick start's "from X to about Y" is the built-in job's measured run (seed 0, the
    default) in bench/results, rounded to two digits."""
    import json

    readme = (ROOT / "README.md").read_text()
    before, after = re.search(
        r"score going from ([0-9.]+)\s+to about ([0-9.]+) with the default seed 0", readme
    ).groups()
    runs = json.loads((ROOT / "bench" / "results" / "lora-learning-cpu.json").read_text())["learning"]["runs"]["full"]
    seed0 = next(run for run in runs if run["seed"] == 0)
    assert float(before) == round(seed0["before"], 3) and float(after) == round(seed0["after"], 2)


def test_the_examples_install_the_peers_as_the_readme_does():
    """Each pinned peer an example's docstring installs (``pip install [--no-deps] name==version``)
    is installed the same way in the README: a plain ``pip install verl==0.9.1`` would downgrade
    transformers and pull dozens of packages."""
    readme = (ROOT / "README.md").read_text()
    pinned = re.compile(r"pip install ((?:--no-deps )?)[^`\n]*?\b([a-z][\w-]*==[\w.]+)")
    in_readme = {pin: flag for flag, pin in pinned.findall(readme)}
    for example in sorted((ROOT / "examples").glob("*.py")):
        for flag, pin in pinned.findall(example.read_text()):
            assert in_readme.get(pin) == flag, (
                f"{example.name}: pip install {flag}{pin}; the README: {in_readme.get(pin)!r}"
            )
