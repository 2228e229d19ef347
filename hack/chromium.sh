#!/usr/bin/env bash
# Installs Debian's `chromium` package when it is missing and prints the path of the browser,
# for the report-rendering test (hack/demo/report) and for screenshots of the demo's report:
#
#   CHROMIUM="$(hack/chromium.sh)"
#
# Why Debian's package: it is built and signed by the distribution and reachable through apt
# wherever the machine has a package mirror, while Chrome-for-Testing and chromedp's headless
# shell are prebuilt downloads from hosts not every environment reaches.
#
# Idempotent: when the browser is already installed it returns at once and installs nothing.
# Concurrent callers (parallel test binaries) wait on one lock instead of racing apt/dpkg.
# Installing needs root (or passwordless sudo).
#
# Environment:
#   CHROMIUM  a browser to use instead (its path is checked and printed; nothing is installed)
#
# stdout carries only the browser's path; progress goes to stderr.
set -euo pipefail

exec 3>&1 1>&2
log() { printf 'chromium.sh: %s\n' "$*" >&2; }

found() {
  "$1" --version >/dev/null 2>&1 || return 1
  printf '%s\n' "$1" >&3
}

if [[ -n "${CHROMIUM:-}" ]]; then
  found "$CHROMIUM" || { log "CHROMIUM=$CHROMIUM does not run"; exit 1; }
  exit 0
fi

BIN=/usr/bin/chromium
found "$BIN" && exit 0

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "chromium is missing and installing it needs root"; exit 1; }
  SUDO="sudo -n"
fi

LOCK="${XDG_CACHE_HOME:-$HOME/.cache}/apportion/chromium.lock"
mkdir -p "$(dirname "$LOCK")"
exec 9>"$LOCK"
flock 9
# Another caller may have installed it while this one waited.
found "$BIN" && exit 0

log "installing Debian's chromium package (apt-get update; apt-get install -y chromium)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
found "$BIN" || { log "$BIN does not run after installing"; exit 1; }
