#!/usr/bin/env bash
# The property test over topology shapes and crash points
# (topology/tests/shapes.rs), at length: CASES random shapes from SEED, under
# both guarantees. No broker needed. A failure names its seed:
# SLUICE_SHAPES_SEED=<seed> SLUICE_SHAPES_CASES=1 reruns that case.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
seed="${SEED:-$(date +%s)}"
cases="${CASES:-20000}"
echo "fuzz-topology: ${cases} shapes from seed ${seed}"
SLUICE_SHAPES_SEED="$seed" SLUICE_SHAPES_CASES="$cases" \
  cargo test --release -p sluice-topology --test shapes -- --test-threads=2
