#!/usr/bin/env bash
# `make bench-<area>`: builds in release mode, starts a fresh local Apache Kafka broker, runs
# the benchmark (one process run, ratios measured side by side), stops the broker.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
area="${1:?usage: bench.sh engine|llm|batching|usage|peer|gateway|overload}"
die() { echo "bench: $*" >&2; exit 1; }
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"
"$root/scripts/setup.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
if [ "$area" = peer ]; then
  # The Kafka Streams peer (benches/peers/kafka-streams): compiled, with its
  # runtime jars beside it, by Maven from Maven Central (checksums verified).
  peer="$root/benches/peers/kafka-streams"
  rm -rf "$peer/target"
  mvn -B -q --strict-checksums -f "$peer/pom.xml" compile dependency:copy-dependencies \
    || { echo "bench: Maven could not build the Kafka Streams peer" >&2; exit 1; }
  export SLUICE_BENCH_KSTREAMS_CP="$peer/target/classes:$peer/target/libs/*"
fi
if [ "$area" = gateway ] && ! command -v wrk >/dev/null; then
  # The gateway's load generator: Debian's wrk (a C event loop per thread),
  # so the load takes less of the cores the gateway runs on.
  apt_install wrk
fi
cargo build --release --bench "$area"
name="bench-$$"
bootstrap="$("$root/scripts/broker.sh" start "$name")"
trap '"$root/scripts/broker.sh" stop "$name"' EXIT
export SLUICE_BENCH_BOOTSTRAP="$bootstrap"
SLUICE_BENCH_BROKER_PID="$(cat "$root/.tools/run/$name/pid")"
export SLUICE_BENCH_BROKER_PID
echo "bench: broker (Apache Kafka $(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$root/scripts/kafka/pom.xml")) at $bootstrap; machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
cargo bench --bench "$area" 2>&1
