#!/usr/bin/env bash
# Source coverage of the lifecycle machine reached by the machine_inputs seed corpus (not a CI
# step; see docs/fuzzing.md). Prints the region coverage of every function of Machine<u8>.
#
# Needs LLVM coverage tools that read the profiles of this toolchain's LLVM: rustup's
# llvm-tools component if you have it, else Debian's llvm-19 (`apt-get install llvm-19`), which
# reads rustc 1.95's (LLVM 22) raw profiles and coverage maps.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target="${1:-machine_inputs}"
profdata="$(command -v llvm-profdata-19 || command -v llvm-profdata || true)"
llvmcov="$(command -v llvm-cov-19 || command -v /usr/lib/llvm-19/bin/llvm-cov || command -v llvm-cov || true)"
if [[ -z "$profdata" || -z "$llvmcov" ]]; then
    echo "need llvm-profdata and llvm-cov (apt-get install llvm-19)" >&2
    exit 2
fi
rm -rf "fuzz/coverage/$target"
# cargo-fuzz runs the corpus with an instrumented build, then looks for rustup's llvm-profdata
# to merge the raw profiles; without llvm-tools that last step fails, so merge here instead.
cargo fuzz coverage --sanitizer none "$target" "fuzz/corpus/$target" >/dev/null 2>&1 || true
shopt -s nullglob
raw=(fuzz/coverage/"$target"/raw/*.profraw)
if ((${#raw[@]} == 0)); then
    echo "no raw profiles: cargo fuzz coverage failed" >&2
    exit 1
fi
"$profdata" merge -sparse "${raw[@]}" -o "fuzz/coverage/$target/coverage.profdata"
host="$(rustc -vV | sed -n 's/^host: //p')"
bin="target/$host/coverage/$host/release/$target"
"$llvmcov" report "$bin" -instr-profile="fuzz/coverage/$target/coverage.profdata" \
    -show-functions "$PWD/src/lifecycle.rs" "$PWD/src/lifecycle/actions.rs" |
    awk '/MachinehE|ActionshE|ActionsIntoIterhE|RetryPolicy/ {printf "%8s %7s %8s  %s\n", $2, $3, $4, $1}' |
    c++filt | sed -E 's/prefill_router\[[0-9a-f]+\]:://g; s/core\[[0-9a-f]+\]:://g' |
    awk 'BEGIN {printf "%8s %7s %8s  %s\n", "regions", "missed", "cover", "function"} {print}'
echo
echo "regions never entered inside executed lines of src/lifecycle.rs (marked ^0):"
"$llvmcov" show "$bin" -instr-profile="fuzz/coverage/$target/coverage.profdata" \
    -show-regions -show-instantiations=false "$PWD/src/lifecycle.rs" | grep -B4 '\^0' || true
