#!/usr/bin/env bash
# Prints the path of promtool (Prometheus's rule checker and rule unit-test
# runner), building it once per machine from the Go module proxy into
# $HOME/.cache/sluice/tools (outside the clone, like the build cache). Used by
# scripts/check_helm.py for the chart's alert rules. Needs Go (the module's
# go directive fetches a newer toolchain when the installed one is older).
set -euo pipefail
version=v0.316.0 # Prometheus 3.x (the module's tags are v0.3xx for 3.x)
dir="${SLUICE_TOOLS_DIR:-$HOME/.cache/sluice/tools}/promtool-$version"
bin="$dir/promtool"
die() { echo "install-promtool: $*" >&2; exit 1; }
if [ ! -x "$bin" ] || ! "$bin" --version >/dev/null 2>&1; then
  command -v go >/dev/null || die "go not found (scripts/setup.sh installs golang-go)"
  echo "install-promtool: building promtool $version (once per machine, a few minutes)" >&2
  mkdir -p "$dir"
  GOBIN="$dir" GOTOOLCHAIN="${GOTOOLCHAIN:-auto}" \
    go install "github.com/prometheus/prometheus/cmd/promtool@$version" >&2 \
    || die "go install github.com/prometheus/prometheus/cmd/promtool@$version failed"
  "$bin" --version >/dev/null 2>&1 || die "$bin does not run"
fi
echo "$bin"
