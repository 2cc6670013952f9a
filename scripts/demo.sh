#!/usr/bin/env bash
# `make demo`: the main job on a fresh local broker and the simulated provider.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"$root/scripts/setup.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
cargo build --release --bin sluice
name="demo-$$"
bootstrap="$("$root/scripts/broker.sh" start "$name")"
trap '"$root/scripts/broker.sh" stop "$name"' EXIT
echo "demo: broker at $bootstrap"
"$CARGO_TARGET_DIR/release/sluice" demo --bootstrap "$bootstrap" "$@"
