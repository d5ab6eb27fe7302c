"""MkDocs hook: the committed benchmark plots (bench/results/*.png) served as bench-results/<name>.png."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"bench-results/{png.name}", abs_src_path=str(png)))
    return files
