#!/usr/bin/env bash
# Default features serve embedders: a dependent that writes `prefill-router = "..."` in its
# Cargo.toml gets the library and its tokio runtime, and none of the CLI, the simulator,
# tokio's test clock, tracing-subscriber, the HTTP frontend's axum (feature `http`), rustls (feature `tls`) or the fuzz support (`arbitrary`: only the testkit
# package, `testkit/`, depends on it, and the library never depends on the testkit). This reads the feature graph of a
# default (non-dev) build from `cargo tree -e features` and fails if any of them shows up.
# It also proves the detector bites: the `cli` build must show them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
forbidden='tokio feature "test-util"|^tracing-subscriber |^arbitrary |^axum |^rustls '

# -e normal,build: what a dependent compiles (dev-dependencies are the package's own tests').
# The crates come from the plain tree, tokio's enabled features from the tree inverted on it.
tree() {
    cargo tree -p prefill-router -e normal,build,features --prefix none "$@"
    cargo tree -p prefill-router -e normal,build,features --prefix none -i tokio "$@"
}

found="$(tree | grep -E "$forbidden" | sort -u || true)"
if [ -n "$found" ]; then
    echo "features: a default build of the library pulls in what embedders must not get:"
    echo "$found"
    exit 1
fi
if ! tree --features cli | grep -qE "$forbidden"; then
    echo "features: the detector is blind: the cli build should show tracing-subscriber and test-util"
    exit 1
fi
if ! tree --features cli | grep -q 'tokio feature "test-util"'; then
    echo "features: the detector is blind to tokio's test-util"
    exit 1
fi
if ! tree --features tls | grep -qE '^rustls '; then
    echo "features: the detector is blind to rustls: the tls build should show it"
    exit 1
fi
if ! cargo tree -p prefill-router-testkit -e normal --prefix none | grep -qE '^arbitrary '; then
    echo "features: the detector is blind to arbitrary: the testkit package should show it"
    exit 1
fi
# The model checks a pure machine: it must not compile the tokio runtime.
if cargo tree -p prefill-router-model -e normal,build --prefix none | grep -qE '^tokio '; then
    echo "features: the model crate compiles tokio; it should depend on the library without its runtime"
    exit 1
fi
echo "features: a default build of the library has no test-util, tracing-subscriber, axum, rustls or arbitrary; the model has no tokio"
