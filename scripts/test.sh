#!/usr/bin/env bash
# `make test`: installs what is missing, builds once (release profile, shared with
# the benchmarks), starts a fresh local broker, runs every test against it, stops it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"$root/scripts/setup.sh"
"$root/scripts/check-helm.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"

echo "test: building (release profile, target dir $CARGO_TARGET_DIR)"
cargo build --release --workspace --all-targets

name="test-$$"
trap '"$root/scripts/broker.sh" stop "$name"; "$root/scripts/tls-broker.sh" stop "$name"' EXIT
bootstrap="$("$root/scripts/broker.sh" start "$name")"
echo "test: broker at $bootstrap"
export SLUICE_TEST_BOOTSTRAP="$bootstrap"
# A second broker reachable only over TLS (through stunnel): "BOOTSTRAP CA OTHER_CA".
SLUICE_TEST_TLS="$("$root/scripts/tls-broker.sh" start "$name")"
echo "test: TLS broker at ${SLUICE_TEST_TLS%% *}"
export SLUICE_TEST_TLS
export RUST_BACKTRACE=1
cargo test --release --workspace --lib --bins --tests -- --test-threads="${SLUICE_TEST_THREADS:-3}" "$@"
