# Helpers the set-up scripts share; sourced, not run. The sourcing script
# defines die() (its message prefix) first.

# apt_install [--lean] PACKAGE...: installs Debian packages, as root or
# through sudo (the package lists updated once per script run); --lean
# leaves out their Recommends.
apt_install() {
  local flags=(-y -qq) root=()
  if [ "$1" = --lean ]; then
    flags+=(--no-install-recommends)
    shift
  fi
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "missing $*, and not root: install them with apt-get"
    root=(sudo)
  fi
  if [ -z "${apt_updated:-}" ]; then
    "${root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq || die "apt-get update failed"
    apt_updated=1
  fi
  "${root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install "${flags[@]}" "$@" >/dev/null \
    || die "apt-get install $* failed"
}

# pinned_venv DIR MODULE PIN...: a project-local venv at DIR holding exactly
# the pinned packages (wheels only), made again when it is missing, broken
# (MODULE does not import) or was made for other pins.
pinned_venv() {
  local venv="$1" module="$2"
  shift 2
  if [ "$(cat "$venv/.pins" 2>/dev/null)" = "$*" ] \
    && "$venv/bin/python" -c "import $module" 2>/dev/null; then
    return 0
  fi
  echo "${0##*/}: installing $1 into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" || die "cannot create the venv $venv (is python3-venv installed?)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: "$@" \
    || { rm -rf "$venv"; die "pip install of $* failed"; }
  echo "$*" > "$venv/.pins"
}
