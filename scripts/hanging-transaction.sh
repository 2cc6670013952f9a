#!/usr/bin/env bash
# scripts/hanging-transaction.sh [CYCLES] [--no-offsets]: whether the local
# Apache Kafka broker leaves a transaction open for good after SIGKILLs during
# commits, with plain librdkafka producers and no Sluice code (see
# scripts/hanging_transaction.py and docs/operations.md, "A transaction the
# broker left open"). Exit status 1 when it does, the broker kept running.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "hanging-transaction: $*" >&2; exit 1; }
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"
"$root/scripts/install-kafka.sh"
venv="$root/.tools/confluent-kafka-venv"
pinned_venv "$venv" confluent_kafka confluent-kafka==2.16.2
exec "$venv/bin/python" -u "$root/scripts/hanging_transaction.py" "$@"
