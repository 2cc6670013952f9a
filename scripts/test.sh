#!/usr/bin/env bash
# `make test`: installs what is missing, builds once (release profile, shared with
# the benchmarks), starts one fresh local Apache Kafka broker (with TLS and
# SASL_SSL listeners besides the plain one), runs every test against it, stops it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS
"$root/scripts/setup.sh"
"$root/scripts/check-helm.sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"

echo "test: building (release profile, target dir $CARGO_TARGET_DIR)"
cargo build --release --workspace --all-targets

# The Java clients of tests/java_interop.rs (built once per machine).
SLUICE_TEST_JAVA_CP="$("$root/scripts/build-java-tests.sh")"
export SLUICE_TEST_JAVA_CP

name="test-$$"
trap '"$root/scripts/broker.sh" stop "$name"; echo "test: wall time $((SECONDS - started)) s"' EXIT
bootstrap="$("$root/scripts/broker.sh" start "$name" --tls)"
echo "test: broker (Apache Kafka) at $bootstrap"
export SLUICE_TEST_BOOTSTRAP="$bootstrap"
# The same broker's SSL and SASL_SSL listeners:
# "SSL_BOOTSTRAP SASL_SSL_BOOTSTRAP CA OTHER_CA USER PASSWORD".
SLUICE_TEST_TLS="$("$root/scripts/broker.sh" tls "$name")"
export SLUICE_TEST_TLS
export RUST_BACKTRACE=1
"$root/scripts/prune-target.sh"

# Two lanes side by side against the one broker: suites that mostly wait (slow
# simulated calls, restarts, a broker of their own, forwarded queries) beside
# those that mostly compute; each lane runs its suites one after another, and
# every line of output is tagged with its lane.
waiting=(rolling llm broker_faults dlq queries tls java_interop)
busy=()
for f in tests/*.rs topology/tests/*.rs state/tests/*.rs; do
  [ -e "$f" ] || continue
  t="$(basename "$f" .rs)"
  [[ " ${waiting[*]} " == *" $t "* ]] || busy+=("$t")
done
lane() {
  local tag="$1" threads="$2"
  shift 2
  cargo test --release --no-fail-fast --workspace "$@" -- --test-threads="$threads" 2>&1 \
    | sed -u "s/^/[$tag] /"
  return "${PIPESTATUS[0]}"
}
if [ "$#" -gt 0 ]; then
  # Arguments given (a filter, test flags): one lane runs every suite with them.
  cargo test --release --no-fail-fast --workspace --lib --bins --tests -- \
    --test-threads="${SLUICE_TEST_THREADS:-3}" "$@"
  exit
fi
# shellcheck disable=SC2046 # one --test flag per suite
lane busy "${SLUICE_TEST_THREADS:-3}" --lib --bins $(printf -- '--test %s ' "${busy[@]}") &
busy_lane=$!
# shellcheck disable=SC2046
lane wait 3 $(printf -- '--test %s ' "${waiting[@]}") &
wait_lane=$!
rc=0
wait "$busy_lane" || rc=$?
wait "$wait_lane" || rc=$?
exit "$rc"

