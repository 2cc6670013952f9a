#!/usr/bin/env bash
# Installs the pinned Apache Kafka broker (kafka_2.13 and its runtime
# dependencies, scripts/kafka/pom.xml) into .tools/kafka-<version>/libs with
# Maven, which verifies every artifact's checksum. Reused when present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pom="$root/scripts/kafka/pom.xml"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")"
[ -n "$version" ] || { echo "install-kafka: no kafka.version in $pom" >&2; exit 1; }
home="$root/.tools/kafka-$version"
stamp="$home/installed"

# Reused when the same pom was installed before.
if [ -f "$stamp" ] && cmp -s "$stamp" "$pom"; then
  exit 0
fi

command -v mvn >/dev/null || { echo "install-kafka: mvn not found; run scripts/setup.sh" >&2; exit 1; }
command -v java >/dev/null || { echo "install-kafka: java not found; run scripts/setup.sh" >&2; exit 1; }
echo "install-kafka: resolving Apache Kafka $version with Maven into $home"
rm -rf "$home"
mkdir -p "$home/libs"
# --strict-checksums: a download whose checksum does not match fails the build.
mvn -B -q --strict-checksums -f "$pom" dependency:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$home/libs" \
  || { echo "install-kafka: Maven could not resolve Apache Kafka $version" >&2; rm -rf "$home"; exit 1; }
[ -f "$home/libs/kafka_2.13-$version.jar" ] \
  || { echo "install-kafka: kafka_2.13-$version.jar missing after resolution" >&2; exit 1; }
cp "$pom" "$stamp"
echo "install-kafka: Apache Kafka $version installed ($(ls "$home/libs" | wc -l) jars)"
