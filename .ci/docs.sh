#!/usr/bin/env bash
# The documentation site: builds docs/ with MkDocs (Material theme, mkdocstrings' API reference)
# in strict mode, so a broken link, a missing anchor, a page outside the nav or an API entry
# that does not resolve fails CI.  Its own venv ($1, default .venv-docs) with the docs packages
# only: mkdocstrings reads the docstrings from the source (griffe, no import), so neither torch
# nor the compiled extension is needed.  The generated pages (docs/trainer-options.md,
# docs/performance.md) are checked to be current by tests/test_docs.py in the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-docs}"
[ -x "$VENV/bin/mkdocs" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --site-dir "${SITE_DIR:-site}"
