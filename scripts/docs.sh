#!/usr/bin/env bash
# The documentation site: set up (or reuse) the environment with the docs extra,
# then build docs/ into docs/_build/html with every warning an error.
#
#     bash scripts/docs.sh            # build (a page whose sources did not change is not rebuilt)
#     bash scripts/docs.sh --clean    # from scratch: docs/_build emptied first, every page run again
#     bash scripts/docs.sh --fresh    # a new environment first
#
# The how-to pages' {code-cell} blocks run at build time on the CPU, one fresh
# kernel per page (about a minute in all on two cores); their outputs are kept
# in docs/_build/.jupyter_cache, so a page runs again only when its code changes
# (--clean runs every page again, as after a change to gpumagic itself).
# The example notebooks are shown with the outputs stored in them. Exits non-zero
# on any warning, a failing cell included.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

setup_args=(--docs)
clean=0
for arg in "$@"; do
    case "$arg" in
        --fresh) setup_args+=(--fresh) ;;
        --clean) clean=1 ;;
        *) echo "docs: unknown option '$arg' (usage: scripts/docs.sh [--clean] [--fresh])" >&2; exit 2 ;;
    esac
done
# shellcheck source=scripts/venv.sh
source "$here/venv.sh"   # GPUMAGIC_VENV, absolute; use_venv

use_venv "${setup_args[@]}"
[[ $clean -eq 0 ]] || rm -rf docs/_build
echo "docs: python -m sphinx -W --keep-going -b html docs docs/_build/html"
start=$SECONDS
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "docs: built in $((SECONDS - start)) s; open docs/_build/html/index.html"
