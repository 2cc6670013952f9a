#!/usr/bin/env bash
# Installs what building and testing Sluice needs on a fresh machine, and fails
# loudly when something cannot be installed. Safe to run repeatedly.
#   - system packages for the -sys crates (libclang for RocksDB's bindgen,
#     OpenSSL headers and a C/C++ toolchain for librdkafka)
#   - stunnel4 and openssl, for the TLS test (the broker behind a TLS proxy)
#   - the local Kafka-protocol broker (tansu), see scripts/install-tansu.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "setup: $*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (https://rustup.rs)"
command -v python3 >/dev/null || die "python3 not found (needed to fetch the broker wheel)"

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
# The TLS test runs the broker behind stunnel, with certificates made by openssl.
command -v stunnel4 >/dev/null || command -v stunnel >/dev/null || missing+=(stunnel4)
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
fi

"$here/install-tansu.sh"
