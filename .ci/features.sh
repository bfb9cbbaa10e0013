#!/usr/bin/env bash
# Default features serve embedders: a dependent that writes `prefill-router = "..."` in its
# Cargo.toml gets the library and its tokio runtime, and none of the CLI, the simulator, the mock
# engines, tokio's test clock, tracing-subscriber, the HTTP frontend's axum (feature `http`),
# rustls (feature `tls`), kube and k8s-openapi (feature `kubernetes`), tokenizers and minijinja
# (feature `model-tokenizer`), zeromq (feature `engine`) or the fuzz support (`arbitrary`). The CLI, the simulator and the mocks
# are the tools package (`tools/`), the fuzz support the testkit package (`testkit/`); the library
# depends on neither. This reads the feature graph of a default (non-dev) build from
# `cargo tree -e features` and fails if any of them shows up. It also proves the detector bites:
# the tools package's build must show them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
forbidden='tokio feature "test-util"|^tracing-subscriber |^arbitrary |^axum |^rustls |^kube |^k8s-openapi |^hyper |^hyper-util |^tokenizers |^minijinja |^zeromq '

# -e normal,build: what a dependent compiles (dev-dependencies are the package's own tests').
# The crates come from the plain tree, tokio's enabled features from the tree inverted on it.
tree() {
    local package="${1:-prefill-router}"
    shift || true
    cargo tree -p "$package" -e normal,build,features --prefix none "$@"
    cargo tree -p "$package" -e normal,build,features --prefix none -i tokio "$@"
}

found="$(tree prefill-router | grep -E "$forbidden" | sort -u || true)"
if [ -n "$found" ]; then
    echo "features: a default build of the library pulls in what embedders must not get:"
    echo "$found"
    exit 1
fi
tools="$(tree prefill-router-tools)"
for crate in '^tracing-subscriber ' '^axum ' '^rustls ' '^tokenizers ' '^minijinja ' 'tokio feature "test-util"'; do
    if ! grep -qE "$crate" <<<"$tools"; then
        echo "features: the detector is blind to $crate: the tools package's build should show it"
        exit 1
    fi
done
for crate in '^hyper-util ' '^zeromq '; do
    if ! tree prefill-router --features engine | grep -qE "$crate"; then
        echo "features: the detector is blind to $crate: the engine build should show it"
        exit 1
    fi
done
if ! tree prefill-router --features tls | grep -qE '^rustls '; then
    echo "features: the detector is blind to rustls: the tls build should show it"
    exit 1
fi
kubernetes="$(tree prefill-router --features kubernetes)"
if ! grep -qE '^kube ' <<<"$kubernetes"; then
    echo "features: the detector is blind to kube: the kubernetes build should show it"
    exit 1
fi
# The kubernetes backend builds with a C compiler alone: rustls on ring, no aws-lc-rs or OpenSSL.
if grep -qE '^(aws-lc-rs|aws-lc-sys|openssl-sys) ' <<<"$kubernetes"; then
    echo "features: the kubernetes build pulls in aws-lc-rs or OpenSSL (cmake, system libraries)"
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
# The model tokenizer builds with a Rust toolchain alone: no onig (C), no esaxx's C++ (`cpp`, for
# training; tokenizers always depends on esaxx-rs), no hf-hub downloads and their TLS stacks.
if grep -qE '^(onig|onig_sys|hf-hub|reqwest|ureq|openssl-sys) |^esaxx-rs feature "cpp"' <<<"$tools"; then
    echo "features: the model-tokenizer build pulls in onig, esaxx, hf-hub or an HTTP client stack"
    exit 1
fi
echo "features: a default build of the library has no test-util, tracing-subscriber, axum, rustls, kube, tokenizers, minijinja or arbitrary; the model has no tokio"
