#!/usr/bin/env bash
# Set up (or reuse) the virtual environment that scripts/examples.sh and
# scripts/test.sh run in. Safe to run again: each step does only what is missing
# and prints one line saying what it did or reused.
#
#     bash scripts/setup.sh [--lint] [--docs] [--browser] [--fresh]
#
#   --lint     also the lint extra (ruff, mypy)
#   --docs     also the docs extra (Sphinx, myst-nb, furo: scripts/docs.sh)
#   --browser  also what the browser test needs (.ci/browser-deps.sh: Debian's
#              chromium, jupyterlab, playwright); where that cannot be installed
#              (no apt-get, no root or sudo) a line says so and the browser test
#              skips, unless GPUMAGIC_REQUIRE_BROWSER=1 (CI) makes it an error
#   --fresh    empty the environment first and install everything anew (CI)
#
# Environment: GPUMAGIC_VENV (default: .venv in the checkout; a relative path is
# taken from the current folder), GPUMAGIC_PYTHON (the Python 3.10+ that creates
# the environment; default python3).
#
# Steps:
#   1. the environment: `python3 -m venv`; where that python3 already imports
#      torch (and not with --fresh), with --system-site-packages, so that torch
#      is reused, not installed
#   2. torch: kept when the environment imports one; else, where `nvidia-smi -L`
#      lists a GPU, `pip install torch` (PyPI's CUDA build, several GB); else the
#      CPU build of torch 2.13.0 (see install_cpu_torch)
#   3. gpumagic itself, editable, with its test extra (and lint, docs): skipped while
#      pyproject.toml and the checkout are those of the last install
#   4. with --browser: .ci/browser-deps.sh, skipped when all it installs is there
set -euo pipefail

lint=0 docs=0 browser=0 fresh=0
for arg in "$@"; do
    case "$arg" in
        --lint) lint=1 ;;
        --docs) docs=1 ;;
        --browser) browser=1 ;;
        --fresh) fresh=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "setup: unknown option '$arg' (usage: scripts/setup.sh [--lint] [--docs] [--browser] [--fresh])" >&2; exit 2 ;;
    esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/venv.sh
source "$repo/scripts/venv.sh"   # GPUMAGIC_VENV, absolute
venv="$GPUMAGIC_VENV"
cd "$repo"
say() { echo "setup: $*"; }
die() { echo "setup: $*" >&2; exit 1; }
# The environment's name as the user knows it: relative to the checkout when inside it.
shown="${venv#"$repo"/}"

# What pip and .ci/browser-deps.sh print (warnings included) goes to a log in the
# environment; a failure shows the end of that step's part.
log="$venv/setup.log"
log_start() { echo "--- $* ($(date -u +%FT%TZ))" >>"$log"; mark=$(wc -l <"$log"); }
log_tail() { tail -n +"$((mark + 1))" "$log" | tail -n "$1" >&2; }
pip_install() {
    log_start "pip install $*"
    if ! "$vpy" -m pip install "$@" >>"$log" 2>&1; then
        log_tail 40
        die "pip install $* failed; its whole output is in $log"
    fi
}

# --- 1. the virtual environment ------------------------------------------------
vpy="$venv/bin/python"
venv_works() { [[ -x "$vpy" ]] && "$vpy" -m pip --version >/dev/null 2>&1; }

if [[ $fresh -eq 1 ]] || ! venv_works; then
    base="${GPUMAGIC_PYTHON:-python3}"
    command -v "$base" >/dev/null 2>&1 \
        || die "no '$base' on PATH: install Python 3.10 or newer (or set GPUMAGIC_PYTHON to one)"
    if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        die "gpumagic needs Python 3.10 or newer; $base is $("$base" -c 'import platform; print(platform.python_version())'). Install a newer one and run again with GPUMAGIC_PYTHON=python3.X"
    fi
    # Never empty a folder that is not a virtual environment (a mistyped GPUMAGIC_VENV).
    if [[ -d "$venv" && ! -f "$venv/pyvenv.cfg" && -n "$(ls -A "$venv")" ]]; then
        die "$venv exists and is not a virtual environment; set GPUMAGIC_VENV to another folder"
    fi
    why="created"
    [[ -e "$venv" ]] && why="recreated"
    [[ $fresh -eq 1 && -e "$venv" ]] && why="created afresh"
    opts=(--clear)
    # (Not from inside another virtual environment: a new one would not see its packages.
    # Not with --fresh: CI installs everything itself, whatever the machine's Python holds.)
    if [[ $fresh -eq 0 ]] && "$base" -c 'import sys, torch; sys.exit(sys.prefix != sys.base_prefix)' >/dev/null 2>&1; then
        opts+=(--system-site-packages)
        why="$why, with $base's site-packages (its torch is reused)"
    fi
    existed=0
    [[ -e "$venv" ]] && existed=1
    if ! "$base" -m venv "${opts[@]}" "$venv"; then
        [[ $existed -eq 1 ]] || rm -rf -- "$venv"
        die "'$base -m venv' failed (on Debian and Ubuntu: sudo apt-get install python3-venv, or python3.X-venv for your version)"
    fi
    # A current pip: old ones lack what the steps below use; offline, the one venv brought stays.
    "$vpy" -m pip install --upgrade pip >>"$log" 2>&1 || true
    say "venv $shown: $why ($("$vpy" -c 'import platform; print("Python", platform.python_version())'), $("$vpy" -m pip --version | cut -d' ' -f1-2))"
else
    say "venv $shown: reused ($("$vpy" -c 'import platform; print("Python", platform.python_version())'))"
fi

# --- 2. torch that fits the machine ---------------------------------------------
torch_version() {
    "$vpy" -c 'import importlib.util as u, importlib.metadata as m
print(m.version("torch") if u.find_spec("torch") else "")' 2>/dev/null || true
}

# The CPU build. PyPI's Linux torch wheels are CUDA builds (several GB with their
# nvidia-* packages), so on a machine with internet access the CPU wheel comes
# from PyTorch's CPU index, added as an extra index: `torch==2.13.0` then matches
# both PyPI's 2.13.0 and the index's 2.13.0+cpu, and pip takes 2.13.0+cpu (a
# local version label sorts after the plain version); the other packages still
# come from the indexes pip is configured with. Where pip's configuration already
# offers a CPU wheel on local disk (find-links, as on offline build machines and
# CI), a plain pinned install takes it, and the extra index, which such a machine
# cannot reach, is left out: pip would retry it for torch and each of torch's
# dependencies, slowly and noisily, before falling back. The check asks pip to
# resolve torch from find-links alone (--no-index), which reads no index.
install_cpu_torch() {
    local pin="torch==2.13.0" probe
    probe="$("$vpy" -m pip install --dry-run --no-deps --no-index "$pin" 2>/dev/null || true)"
    if grep -q 'Would install torch-2\.13\.0+cpu' <<<"$probe"; then
        say "torch: installing the CPU build, $pin+cpu, from the wheel pip's configuration finds on this disk"
        pip_install "$pin"
    else
        say "torch: installing the CPU build, $pin+cpu (about 200 MB; from download.pytorch.org/whl/cpu)"
        pip_install "$pin" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
}

have="$(torch_version)"
if [[ -n "$have" ]]; then
    where="in $shown"
    "$vpy" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("torch").origin.startswith(sys.prefix))' \
        2>/dev/null || where="from the system Python's site-packages"
    say "torch: reused $have ($where)"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    say "torch: nvidia-smi lists a GPU: installing PyPI's torch, the CUDA build (a download of several GB) ..."
    pip_install torch
else
    install_cpu_torch
fi
[[ -n "$have" ]] || say "torch: installed $(torch_version)"

# --- 3. gpumagic, editable, with the test (and lint, docs) extras ------------------
stamp="$venv/.gpumagic-setup"
sum="$(sha256sum pyproject.toml | cut -d' ' -f1)"
extras=(test)
[[ $lint -eq 1 ]] && extras+=(lint)
[[ $docs -eq 1 ]] && extras+=(docs)
missing=()
for extra in "${extras[@]}"; do
    grep -qxF "$extra $sum $repo" "$stamp" 2>/dev/null || missing+=("$extra")
done
if [[ ${#missing[@]} -eq 0 ]] && "$vpy" -c 'import importlib.metadata as m; m.version("gpumagic")' 2>/dev/null; then
    say "gpumagic[$(IFS=,; echo "${extras[*]}")]: reused (pyproject.toml unchanged since it was installed)"
else
    spec=".[$(IFS=,; echo "${extras[*]}")]"
    pip_install -e "$spec"
    # One line per extra: the pyproject.toml and checkout it was installed from.
    { grep -vE "^($(IFS='|'; echo "${extras[*]}")) " "$stamp" 2>/dev/null | grep -F " $sum $repo" || true
      for extra in "${extras[@]}"; do echo "$extra $sum $repo"; done; } >"$stamp.new"
    mv -f "$stamp.new" "$stamp"
    say "gpumagic[$(IFS=,; echo "${extras[*]}")]: installed (pip install -e '$spec')"
fi

# --- 4. the browser test's Chromium, JupyterLab and Playwright ------------------
if [[ $browser -eq 1 ]]; then
    if [[ -x /usr/bin/chromium ]] \
        && "$vpy" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("jupyterlab", "playwright", "ipywidgets", "jupyterlab_widgets")))'; then
        say "browser: reused /usr/bin/chromium, jupyterlab and playwright"
    else
        say "browser: installing what is missing (.ci/browser-deps.sh: Debian's chromium, jupyterlab, playwright) ..."
        # Its output goes to the log, unless sudo may have to ask for a password.
        quiet=0
        if [[ -x /usr/bin/chromium || "$(id -u)" -eq 0 ]] || sudo -n true 2>/dev/null; then quiet=1; fi
        log_start .ci/browser-deps.sh
        if [[ $quiet -eq 1 ]] && bash .ci/browser-deps.sh "$vpy" >>"$log" 2>&1; then
            say "browser: installed ($(tail -n 2 "$log" | head -n 1 | cut -d' ' -f1-2), $(tail -n 1 "$log"))"
        elif [[ $quiet -eq 0 ]] && bash .ci/browser-deps.sh "$vpy"; then
            say "browser: installed"
        elif [[ "${GPUMAGIC_REQUIRE_BROWSER:-0}" == 1 ]]; then
            [[ $quiet -eq 0 ]] || log_tail 20
            die "browser: .ci/browser-deps.sh failed (its output: $log)"
        else
            [[ $quiet -eq 0 ]] || log_tail 20
            say "browser: could not install it (its output: $log); the browser test will skip"
        fi
    fi
fi
