#!/usr/bin/env bash
# Checks the Helm chart helm/sluice (see scripts/check_helm.py): lint, render,
# Kubernetes schema validation and the rendered sluice.toml, for the default
# values and every helm/sluice/ci/*.yaml. Needs no cluster and no helm binary:
# the tools come from PyPI into a project-local venv (.tools/helm-venv):
#   helm-python-sdk      Helm's Go SDK (lint, values schema, template engine)
#   kubernetes-validate  the Kubernetes API's JSON schemas, per version
# and promtool (scripts/install-promtool.sh) for the alert rules.
# Dependencies are pinned too, so a release upstream cannot change the verdict.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.tools/helm-venv"
pins=(
  helm-python-sdk==0.2.2
  kubernetes-validate==1.37.0
  attrs==26.1.0
  importlib_resources==7.1.0
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  packaging==26.4
  PyYAML==6.0.4
  referencing==0.37.0
  rpds-py==2026.9.1
  typing_extensions==4.16.0
)

die() { echo "check-helm: $*" >&2; exit 1; }
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"

command -v python3 >/dev/null || die "python3 not found (3.11 or later is needed)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "python3 is $(python3 -V 2>&1 | cut -d' ' -f2); 3.11 or later is needed (tomllib)"

pinned_venv "$venv" "helm_python, kubernetes_validate" "${pins[@]}"

# promtool checks and unit-tests the chart's alert rules.
SLUICE_PROMTOOL="$("$root/scripts/install-promtool.sh")" || die "promtool is missing (see above)"
export SLUICE_PROMTOOL
exec "$venv/bin/python" "$root/scripts/check_helm.py" "$root/helm/sluice"
