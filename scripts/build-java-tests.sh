#!/usr/bin/env bash
# Builds the Java side of the interop test (tests/java: kafka-clients and
# Jackson from Maven Central, checksums verified) into tests/java/target, once
# per machine: reused while it is newer than its sources. Prints the classpath.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/tests/java"
stamp="$dir/target/.built"
command -v mvn >/dev/null || { echo "build-java-tests: mvn not found (scripts/setup.sh installs it)" >&2; exit 1; }
command -v java >/dev/null || { echo "build-java-tests: java not found (scripts/setup.sh installs it)" >&2; exit 1; }
if [ ! -f "$stamp" ] || [ -n "$(find "$dir/pom.xml" "$dir/src" -newer "$stamp" -print -quit)" ]; then
  rm -rf "$dir/target"
  mvn -B -q --strict-checksums -f "$dir/pom.xml" compile dependency:copy-dependencies >&2 \
    || { echo "build-java-tests: Maven could not build tests/java" >&2; exit 1; }
  touch "$stamp"
fi
echo "$dir/target/classes:$dir/target/libs/*"
