#!/usr/bin/env bash
# Keeps the shared target directory from filling the disk: every build of a
# changed crate links new test binaries (~0.5 GB each here) beside the old ones,
# and cargo never removes those. Deletes the executables under release/deps and
# release/examples that the current build of the workspace does not produce
# (nor hard-links), and incremental caches untouched for two days. Anything
# removed by mistake is only rebuilt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$HOME/.cache/sluice/target}"
[ -d "$target/release/deps" ] || exit 0
cargo build --release --workspace --all-targets --message-format=json 2>/dev/null \
  | python3 -c '
import json, os, stat, sys
release = os.path.join(sys.argv[1], "release")
keep = set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        st = os.stat(m["executable"])
        keep.add((st.st_dev, st.st_ino))
if not keep:
    sys.exit("prune-target: the build listed no executables; nothing removed")
freed = 0
for sub in ("deps", "examples"):
    d = os.path.join(release, sub)
    if not os.path.isdir(d):
        continue
    for name in os.listdir(d):
        if "." in name:
            continue
        path = os.path.join(d, name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXUSR:
            continue
        if (st.st_dev, st.st_ino) in keep:
            continue
        freed += st.st_size
        os.remove(path)
        try:
            os.remove(path + ".d")
        except FileNotFoundError:
            pass
print(f"prune-target: removed {freed >> 20} MiB of stale executables")
' "$target"
find "$target/release/incremental" -mindepth 1 -maxdepth 1 -type d -mtime +2 -exec rm -rf {} + 2>/dev/null || true
