# shellcheck shell=bash
# Sourced by the scripts here: GPUMAGIC_VENV as an absolute path, exported. A relative
# GPUMAGIC_VENV is taken from the folder the script was run in; the default is .venv in
# the checkout.
if [[ -n "${GPUMAGIC_VENV:-}" ]]; then
    GPUMAGIC_VENV="$(realpath -m -- "$GPUMAGIC_VENV")"
else
    GPUMAGIC_VENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
fi
export GPUMAGIC_VENV
