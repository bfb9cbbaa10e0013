#!/usr/bin/env bash
# Mutation testing of the core with cargo-mutants (scope, exclusions and the judging tests are
# in .cargo/mutants.toml; counts and the full-run command in docs/properties.md).
#
# The whole scope (490 mutants) takes about 20 min on 2 cores (docs/properties.md), inside CI's
# budget, so CI runs all of it. MUTANTS_DIFF=1 tests only the mutants in code the last commit changed
# (HEAD against its first parent: for a merge into main, the whole merged branch), for a quick
# check. A missed mutant or a timeout fails the script; unviable ones (the mutation does not
# compile) do not. The report is left in target/mutants/mutants.out/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TERM_COLOR=never

version=27.1.0
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants --version "$version"

out=target/mutants
mkdir -p "$out"
# Two mutants at a time: one builds (rustc, mostly one core) while the other's tests run;
# measured 17% faster than one at a time on 2 cores (docs/properties.md, "Mutation testing").
args=(--output "$out" --jobs 2)

if [ "${MUTANTS_DIFF:-0}" != 1 ]; then
    echo "=== cargo mutants: the whole scope"
else
    # A shallow clone has no parent commit: deepen it if a remote is reachable, else run the
    # whole scope rather than silently test nothing.
    if ! git rev-parse --verify --quiet 'HEAD^' >/dev/null; then
        git fetch --quiet --deepen=1 2>/dev/null || true
    fi
    if git rev-parse --verify --quiet 'HEAD^' >/dev/null; then
        git diff 'HEAD^' HEAD >"$out/last-commit.diff"
        echo "=== cargo mutants: code changed by $(git rev-parse --short HEAD) against its parent"
        args+=(--in-diff "$out/last-commit.diff")
    else
        echo "=== cargo mutants: no parent commit to diff against; the whole scope"
    fi
fi

status=0
cargo mutants "${args[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    for kind in missed timeout; do
        if [ -s "$out/mutants.out/$kind.txt" ]; then
            echo "--- $kind mutants:"
            cat "$out/mutants.out/$kind.txt"
        fi
    done
fi
exit "$status"
