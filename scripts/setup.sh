#!/usr/bin/env bash
# Installs what building and testing Sluice needs on a fresh machine, and fails
# loudly when something cannot be installed. Safe to run repeatedly.
#   - system packages for the -sys crates (libclang for RocksDB's bindgen,
#     OpenSSL headers and a C/C++ toolchain for librdkafka)
#   - a Java 17+ runtime and Maven, for the local Apache Kafka broker
#   - openssl, for the TLS test's certificates
#   - Go, to build promtool for the chart's alert rules (scripts/install-promtool.sh)
#   - the local broker (Apache Kafka, resolved with Maven), see scripts/install-kafka.sh
#   - for the gateway's tests (tests/gateway_api.rs): Debian's chromium (headless,
#     drives the page at /) and schemathesis (checks the gateway against
#     docs/gateway-openapi.yaml) in a project-local venv, .tools/schemathesis-venv
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "setup: $*" >&2; exit 1; }
# shellcheck source=scripts/lib.sh
. "$here/lib.sh"

command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (https://rustup.rs)"
command -v python3 >/dev/null || die "python3 not found (the broker script uses it)"

# The library bindgen loads is libclang.so or libclang-<version>.so; libclang-cpp
# (often present without it) is a different library and does not count.
have_libclang() {
  local dir
  for dir in /usr/lib/llvm-*/lib /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 \
    ${LIBCLANG_PATH:-}; do
    compgen -G "$dir/libclang.so*" >/dev/null && return 0
    compgen -G "$dir/libclang-[0-9]*.so*" >/dev/null && return 0
  done
  return 1
}

missing=()
have_libclang || missing+=(libclang-dev)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
command -v pkg-config >/dev/null || missing+=(pkg-config)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
# The broker runs on Java 17 or newer and is resolved with Maven; the TLS
# test's certificates are made by openssl.
java_major() {
  java -XshowSettings:properties -version 2>&1 \
    | sed -n 's/^ *java.specification.version = \([0-9]*\).*/\1/p'
}
if ! command -v java >/dev/null || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
  missing+=(openjdk-17-jre-headless)
fi
command -v mvn >/dev/null || missing+=(maven)
command -v openssl >/dev/null || missing+=(openssl)
# promtool (the chart's alert rules) is built with Go: scripts/install-promtool.sh.
command -v go >/dev/null || missing+=(golang-go)
# The venv of schemathesis needs venv and ensurepip (Debian's python3-venv).
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# Installed without their Recommends: chromium's (printing, audio, a desktop's
# services) are several hundred megabytes a headless browser does not use.
lean=()
command -v chromium >/dev/null || lean+=(chromium)

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  apt_install "${missing[@]}"
  have_libclang || die "libclang still missing after installing libclang-dev"
  [ "$(java_major)" -ge 17 ] 2>/dev/null || die "Java 17 or newer still missing after installing it"
fi
if [ "${#lean[@]}" -gt 0 ]; then
  echo "setup: installing system packages without their Recommends: ${lean[*]}"
  apt_install --lean "${lean[@]}"
  command -v chromium >/dev/null || die "chromium still missing after installing it"
fi

# schemathesis for tests/gateway_api.rs, with its dependencies pinned too: a
# release upstream (hypothesis's above all) would change the requests a fixed
# seed generates. Reinstalled when missing, broken, or made for other pins.
st_venv="$(cd "$here/.." && pwd)/.tools/schemathesis-venv"
st_pins=(
  schemathesis==4.32.5
  anyio==4.16.0
  certifi==2026.10.19.post1
  charset-normalizer==3.5.3
  click==8.5.1
  graphql-core==3.3.2
  harfile==0.6.0
  hypothesis==6.170.27
  hypothesis-graphql==0.13.5
  idna==3.20
  iniconfig==2.3.1
  jsonschema-rs==0.60.3
  markdown-it-py==4.3.0
  MarkupSafe==3.0.4
  mdurl==0.1.2
  packaging==26.4
  pluggy==1.7.0
  Pygments==2.21.0
  pyrate-limiter==4.6.0
  pytest==9.2.0
  PyYAML==6.0.4
  requests==2.34.2
  rich==15.0.0
  sortedcontainers==2.4.0
  typing_extensions==4.16.0
  urllib3==2.8.0
  Werkzeug==3.1.9
)
pinned_venv "$st_venv" schemathesis "${st_pins[@]}"

"$here/install-kafka.sh"
