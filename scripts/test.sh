#!/usr/bin/env bash
# The whole test suite: set up (or reuse) the environment, then pytest.
#
#     bash scripts/test.sh                          # everything: python -m pytest
#     bash scripts/test.sh --lint                   # ruff and mypy first, then pytest
#     bash scripts/test.sh tests -m "not browser"   # any pytest arguments
#     bash scripts/test.sh --fresh --lint --docs    # a new environment first, the docs built too (.ci/run)
#
# Options before the pytest arguments: --lint (install the lint extra; run
# `python -m ruff check gpumagic tests` and `python -m mypy`, a failure stops the
# run before the tests), --docs (install the docs extra and build the site as
# scripts/docs.sh does, warnings as errors, before the tests), --fresh (empty the
# environment and install everything anew). The first run creates .venv/ (or
# $GPUMAGIC_VENV) with torch, gpumagic's test extra and the browser test's
# Chromium, JupyterLab and Playwright (scripts/setup.sh); later runs reuse it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

lint=0 docs=0
setup_args=(--browser)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --lint) lint=1; setup_args+=(--lint) ;;
        --docs) docs=1; setup_args+=(--docs) ;;
        --fresh) setup_args+=(--fresh) ;;
        *) break ;;
    esac
    shift
done
# shellcheck source=scripts/venv.sh
source "$here/venv.sh"   # GPUMAGIC_VENV, absolute; use_venv

use_venv "${setup_args[@]}"
python -c "import torch, IPython, ipywidgets; print('torch', torch.__version__, '| IPython', IPython.__version__, '| ipywidgets', ipywidgets.__version__)"

if [[ $lint -eq 1 ]]; then
    echo "lint: python -m ruff check gpumagic tests"
    python -m ruff check gpumagic tests
    echo "types: python -m mypy"
    python -m mypy
fi
if [[ $docs -eq 1 ]]; then
    echo "docs: python -m sphinx -W --keep-going -b html docs docs/_build/html"
    start=$SECONDS
    python -m sphinx -W --keep-going -q -b html docs docs/_build/html
    echo "docs: built in $((SECONDS - start)) s"
fi
python -c 'import shlex, sys; print("tests: python -m pytest", shlex.join(sys.argv[1:]))' "$@"
exec python -m pytest "$@"
