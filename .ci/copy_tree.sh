#!/usr/bin/env bash
# Copy the working tree (tracked files + untracked, not ignored ones) into DEST, leaving out
# the folder SKIP (a venv inside the repo, even if .gitignore does not list it).  The CI
# scripts that build ppo_fast against another torch build in such a copy: the main venv's
# editable install keeps its extension (ppo_fast/_C*.so) in the source tree.
#
#   bash .ci/copy_tree.sh DEST [SKIP]      (from anywhere; paths absolute)
set -euo pipefail
DEST=$1
SKIP=${2:-}
cd "$(dirname "$0")/.."
ROOT=$PWD
rm -rf "$DEST"
mkdir -p "$DEST"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    exclude=()
    rel=${SKIP#"$ROOT"/}
    [ -n "$SKIP" ] && [ "$rel" != "$SKIP" ] && exclude=(":(exclude)$rel")
    git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- . "${exclude[@]}" |
        while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
        tar --null -T - -cf - | tar -xf - -C "$DEST"
else  # not a git checkout: copy all but venvs, build outputs and caches
    tar --exclude='./.venv*' --exclude='./build' --exclude='./dist' --exclude='*.so' \
        --exclude='*.egg-info' --exclude='__pycache__' --exclude='./.git' -cf - . | tar -xf - -C "$DEST"
fi
[ -f "$DEST/setup.py" ] || { echo "copy of the tree into $DEST failed" >&2; exit 1; }
