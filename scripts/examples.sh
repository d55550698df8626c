#!/usr/bin/env bash
# The main job: set up (or reuse) the environment, then run every example
# notebook headless, top to bottom, each in a fresh kernel, printing what ran.
#
#     bash scripts/examples.sh                           # examples/0*.ipynb
#     bash scripts/examples.sh examples/01_tour.ipynb    # just these
#     bash scripts/examples.sh --fresh                   # a new environment first
#
# The first run creates .venv/ (or $GPUMAGIC_VENV) with torch and gpumagic's test
# extra (scripts/setup.sh); later runs reuse it. The executed copies, with every
# output, land beside the notebooks as examples/*.executed.ipynb (gitignored).
# Exits non-zero if a cell raised in any notebook.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

setup_args=()
while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in
        --fresh) setup_args+=(--fresh) ;;
        *) echo "examples: unknown option '$1' (usage: scripts/examples.sh [--fresh] [NOTEBOOK...])" >&2; exit 2 ;;
    esac
    shift
done
# shellcheck source=scripts/venv.sh
source "$here/venv.sh"   # GPUMAGIC_VENV, absolute

# Notebook paths given relative to the folder this was run in.
notebooks=()
for nb in "$@"; do notebooks+=("$(realpath -m --relative-base="$(dirname "$here")" -- "$nb")"); done

bash "$here/setup.sh" "${setup_args[@]}"
cd "$(dirname "$here")"
if [[ ${#notebooks[@]} -eq 0 ]]; then
    for nb in examples/0*.ipynb; do
        [[ "$nb" == *.executed.ipynb ]] || notebooks+=("$nb")
    done
fi
echo "examples: running ${#notebooks[@]} notebook(s) headless with $GPUMAGIC_VENV/bin/python"
PYTHON="$GPUMAGIC_VENV/bin/python" exec bash "$here/run_tour.sh" "${notebooks[@]}"
