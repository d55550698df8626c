#!/usr/bin/env bash
# Install what the JupyterLab browser test needs on a fresh Debian machine:
# Debian's chromium (driven by Playwright through executable_path, so no
# Playwright-managed browser download is ever needed), and the Python packages
# jupyterlab and playwright.
#
# Usage: .ci/browser-deps.sh [VENV_OR_PYTHON]
#   VENV_OR_PYTHON: a virtual environment folder or a python executable;
#   default: the python on PATH. Safe to run again: it installs only what is missing.
set -euo pipefail

target="${1:-}"
if [[ -z "$target" ]]; then
    py="$(command -v python3 || command -v python)"
elif [[ -d "$target" ]]; then
    py="$target/bin/python"
else
    py="$target"
fi
[[ -x "$py" ]] || { echo "browser-deps: no python at $py" >&2; exit 2; }

if [[ ! -x /usr/bin/chromium ]]; then
    sudo=""
    [[ "$(id -u)" -eq 0 ]] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -q
    $sudo apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi

if ! "$py" -c 'import jupyterlab, playwright, ipywidgets, jupyterlab_widgets' 2>/dev/null; then
    "$py" -m pip install -q "jupyterlab>=4" "playwright>=1.40" "ipywidgets>=8" "jupyterlab_widgets>=3"
fi

/usr/bin/chromium --version
"$py" -c 'import jupyterlab, playwright; from importlib.metadata import version as v; print("jupyterlab", jupyterlab.__version__, "playwright", v("playwright"))'
