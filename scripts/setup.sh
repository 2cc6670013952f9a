#!/usr/bin/env bash
# Installs what building and testing Sluice needs on a fresh machine, and fails
# loudly when something cannot be installed. Safe to run repeatedly.
#   - system packages for the -sys crates (libclang for RocksDB's bindgen,
#     OpenSSL headers and a C/C++ toolchain for librdkafka)
#   - a Java 17+ runtime and Maven, for the local Apache Kafka broker
#   - openssl, for the TLS test's certificates
#   - the local broker (Apache Kafka, resolved with Maven), see scripts/install-kafka.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "setup: $*" >&2; exit 1; }

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

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
    die "missing ${missing[*]} and not root: install them with apt-get"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq || die "apt-get update failed"
  $sudo apt-get install -y -qq "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
  have_libclang || die "libclang still missing after installing libclang-dev"
  [ "$(java_major)" -ge 17 ] 2>/dev/null || die "Java 17 or newer still missing after installing it"
fi

"$here/install-kafka.sh"
