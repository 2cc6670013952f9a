#!/usr/bin/env bash
# `make bench-<area>`: builds in release mode, starts a fresh local Apache Kafka broker, runs
# the benchmark (one process run, ratios measured side by side), stops the broker.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
area="${1:?usage: bench.sh engine|llm|batching|usage}"
"$root/scripts/setup.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
cargo build --release --bench "$area"
name="bench-$$"
bootstrap="$("$root/scripts/broker.sh" start "$name")"
trap '"$root/scripts/broker.sh" stop "$name"' EXIT
export SLUICE_BENCH_BOOTSTRAP="$bootstrap"
SLUICE_BENCH_BROKER_PID="$(cat "$root/.tools/run/$name/pid")"
export SLUICE_BENCH_BROKER_PID
echo "bench: broker (Apache Kafka $(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$root/scripts/kafka/pom.xml")) at $bootstrap; machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
cargo bench --bench "$area" 2>&1
