#!/bin/bash
# The peers bench-peers compares us with, from PyPI, into DIR/venv (kept between runs):
# the SGLang gateway `smg` 1.13.0 and vLLM's router `vllm-router` 0.1.17 (both Rust routers
# with a Python launcher; neither needs a GPU or vLLM itself).
# Usage: peers.sh [DIR]   DIR defaults to /var/tmp/prefill-router-peers.
set -euo pipefail
DIR=${1:-/var/tmp/prefill-router-peers}
mkdir -p "$DIR"
if [ -x "$DIR/venv/bin/smg" ] && [ -x "$DIR/venv/bin/vllm-router" ]; then
    echo "peers: already installed in $DIR"
    exit 0
fi
python3 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install -q smg==1.13.0 vllm-router==0.1.17
echo "peers: installed smg 1.13.0 and vllm-router 0.1.17 in $DIR"
