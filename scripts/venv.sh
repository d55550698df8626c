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

_gpumagic_scripts="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# use_venv [SETUP_ARGS...]: set up (or reuse) the environment (scripts/setup.sh), go to the
# checkout's root, and use the environment as `source $GPUMAGIC_VENV/bin/activate` would:
# subprocesses that run `python` get this one.
use_venv() {
    bash "$_gpumagic_scripts/setup.sh" "$@"
    cd "$(dirname "$_gpumagic_scripts")"
    export VIRTUAL_ENV="$GPUMAGIC_VENV" PATH="$GPUMAGIC_VENV/bin:$PATH"
    unset PYTHONHOME
}
