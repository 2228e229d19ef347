#!/usr/bin/env bash
# Installs the project's Go tools at pinned versions and links them into
# ./bin of this repository (bin/ is not meant to be committed).
#
#   hack/tools.sh                               # all tools
#   hack/tools.sh controller-gen golangci-lint  # just these
#   hack/tools.sh kustomize                     # the renderer of make build-installer
#
# Each tool is built once per version and Go toolchain with
# `go install <pkg>@<version>` (from the Go module proxy) into a cache outside
# the clone, shared by all clones and worktrees:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/apportion/tools/<name>-<version>-<go>/<name>
# and ./bin/<name> is a symlink to it. <go> is the toolchain the project's
# go.mod selects (its `toolchain` line, fetched by GOTOOLCHAIN=auto): the
# linters and controller-gen load our packages with go/types, which refuses a
# module whose go line is newer than the toolchain the tool was built with, so
# a toolchain change must rebuild them. Bumping a version below therefore just
# builds a new cache entry and repoints the link; switching back is instant.
# A second run with nothing to do takes well under a second.
#
# Versions can be overridden from the environment, e.g.
#   GOLANGCI_LINT_VERSION=v2.14.0 hack/tools.sh golangci-lint
set -euo pipefail

CONTROLLER_TOOLS_VERSION="${CONTROLLER_TOOLS_VERSION:-v0.23.0}"
GOLANGCI_LINT_VERSION="${GOLANGCI_LINT_VERSION:-v2.15.0}"
# v5.8.3 needs a kube-openapi pseudo-version the module proxy does not serve (403).
KUSTOMIZE_VERSION="${KUSTOMIZE_VERSION:-v5.8.2}"

ALL_TOOLS=(controller-gen golangci-lint kustomize)

# tool_spec <name>: prints "<package> <version>" for a known tool.
tool_spec() {
  case "$1" in
    controller-gen) echo "sigs.k8s.io/controller-tools/cmd/controller-gen ${CONTROLLER_TOOLS_VERSION}" ;;
    golangci-lint)  echo "github.com/golangci/golangci-lint/v2/cmd/golangci-lint ${GOLANGCI_LINT_VERSION}" ;;
    # kustomize renders config/ into dist/ (make build-installer); built from its own Go
    # module like the others, so rendering never needs the control plane's kubectl.
    kustomize)      echo "sigs.k8s.io/kustomize/kustomize/v5 ${KUSTOMIZE_VERSION}" ;;
    *) return 1 ;;
  esac
}

log() { printf 'tools: %s\n' "$*" >&2; }

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  echo "Known tools: ${ALL_TOOLS[*]}" >&2
  exit 0
fi

STEP="startup"
TMP=""
HEARTBEAT_PID=""
on_exit() {
  local rc=$?
  if [[ -n "${HEARTBEAT_PID}" ]]; then kill "${HEARTBEAT_PID}" 2>/dev/null || true; fi
  [[ -n "${TMP}" && -d "${TMP}" ]] && rm -rf "${TMP}"
  if (( rc != 0 )); then
    log "FAILED during step: ${STEP} (exit code ${rc})"
  fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

command -v go >/dev/null || { log "go not found in PATH"; exit 1; }

# Run "$@" while printing a "still working" line every 20s, so a long build
# (golangci-lint takes a couple of minutes cold) visibly makes progress.
with_heartbeat() {
  local label="$1"; shift
  local start; start=$(date +%s)
  (
    sleeper=""
    trap '[[ -n "${sleeper}" ]] && kill "${sleeper}" 2>/dev/null; exit 0' TERM
    while kill -0 "$$" 2>/dev/null; do   # quit if the script itself died
      sleep 20 & sleeper=$!
      wait "${sleeper}"
      log "... still ${label} ($(( $(date +%s) - start ))s)"
    done
  ) &
  HEARTBEAT_PID=$!
  local rc=0
  "$@" || rc=$?
  kill "${HEARTBEAT_PID}" 2>/dev/null || true
  wait "${HEARTBEAT_PID}" 2>/dev/null || true
  HEARTBEAT_PID=""
  return "${rc}"
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="${REPO_ROOT}/bin"
CACHE_DIR="${XDG_CACHE_HOME:-${HOME}/.cache}/apportion/tools"

# `go install pkg@version` ignores the current module, but be explicit that a
# go.work or GOFLAGS=-mod=... of the surrounding checkout must not interfere.
# Static binaries: the tools need no cgo and then run anywhere.
export GOWORK=off CGO_ENABLED=0
# This machine's Go may default to GOTOOLCHAIN=local (its go.env); the project's
# go.mod names the toolchain it needs, and auto lets the go command fetch it.
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"

# The toolchain the project's go.mod selects; every tool is built with exactly
# that one, and the cache is keyed by it.
STEP="resolving the project's Go toolchain"
GO_VERSION="$(cd "${REPO_ROOT}" && go env GOVERSION)"
[[ "${GO_VERSION}" == go* ]] || { log "could not resolve the Go toolchain (got '${GO_VERSION}')"; exit 1; }

tools=("$@")
(( ${#tools[@]} )) || tools=("${ALL_TOOLS[@]}")

# Validate all names before building anything.
STEP="checking arguments"
for name in "${tools[@]}"; do
  tool_spec "${name}" >/dev/null || { log "unknown tool '${name}' (known: ${ALL_TOOLS[*]})"; exit 2; }
done

mkdir -p "${BIN_DIR}" "${CACHE_DIR}"

for name in "${tools[@]}"; do
  read -r pkg version < <(tool_spec "${name}")
  dest_dir="${CACHE_DIR}/${name}-${version}-${GO_VERSION}"
  dest="${dest_dir}/${name}"

  if [[ -x "${dest}" ]]; then
    log "${name} ${version} (${GO_VERSION}): cached"
  else
    STEP="building ${pkg}@${version}"
    log "${name} ${version}: building ${pkg}@${version} with ${GO_VERSION} (first time only) ..."
    start=$(date +%s)
    # Build into a scratch dir next to the destination, then rename: an
    # interrupted build never leaves a truncated binary at the cached path.
    TMP=$(mktemp -d "${CACHE_DIR}/.tmp-${name}.XXXXXX")
    with_heartbeat "building ${name}" \
      env GOBIN="${TMP}" GOTOOLCHAIN="${GO_VERSION}" go install -trimpath -ldflags "-s -w" "${pkg}@${version}"
    mkdir -p "${dest_dir}"
    mv -f "${TMP}/${name}" "${dest}"
    rm -rf "${TMP}"; TMP=""
    log "${name} ${version}: built in $(( $(date +%s) - start ))s"
  fi

  # Repoint bin/<name> atomically (new symlink + rename over the old one;
  # rename(2) replaces the old symlink itself, it does not follow it).
  STEP="linking ${BIN_DIR}/${name}"
  link="${BIN_DIR}/${name}"
  if [[ "$(readlink "${link}" 2>/dev/null || true)" != "${dest}" ]]; then
    ln -sfn "${dest}" "${link}.tmp.$$"
    mv -f "${link}.tmp.$$" "${link}"
    log "${name}: bin/${name} -> ${dest}"
  fi
done
