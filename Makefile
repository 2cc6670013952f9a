# The two commands a newcomer needs: `make demo` and `make test`.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/sluice/target

.PHONY: demo test setup lint fmt bench-engine bench-llm bench-batching bench-usage bench-peer bench-gateway bench-overload test-helm fuzz-topology

demo:
	scripts/demo.sh

test:
	scripts/test.sh

setup:
	scripts/setup.sh

# The Helm chart: lint, render, Kubernetes schemas, sluice.toml (no cluster needed).
test-helm:
	scripts/check-helm.sh

# The topology-shape property test at length: CASES random shapes (default
# 20000) from SEED (default: the time), exactly-once and at-least-once.
fuzz-topology:
	scripts/fuzz-topology.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all

bench-engine:
	scripts/bench.sh engine

bench-llm:
	scripts/bench.sh llm

bench-batching:
	scripts/bench.sh batching

bench-usage:
	scripts/bench.sh usage

bench-gateway:
	scripts/bench.sh gateway

bench-overload:
	scripts/bench.sh overload

# Sluice against Kafka Streams (benches/peers/kafka-streams, built with Maven).
bench-peer:
	scripts/bench.sh peer
