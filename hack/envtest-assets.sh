#!/usr/bin/env bash
# Builds the control-plane binaries that controller-runtime's envtest needs
# (kube-apiserver, etcd, kubectl) from source via the Go module proxy, and
# prints the directory holding them:
#
#   export KUBEBUILDER_ASSETS="$(hack/envtest-assets.sh)"
#
# Why build instead of `setup-envtest use`: setup-envtest downloads release
# tarballs from GitHub / storage.googleapis.com, which are not reachable from
# every environment we run in, while the Go module proxy is.
#
# Output goes into the very directory setup-envtest itself would use
#   ${XDG_DATA_HOME:-$HOME/.local/share}/kubebuilder-envtest/k8s/<ver>-<os>-<arch>
# so both tools share one cache and envtest's BinaryAssetsDirectory lookup
# finds it. The directory is keyed by the Kubernetes version only (that is
# setup-envtest's layout); the etcd version is checked per binary instead.
#
# The binaries do not depend on the Go toolchain the project itself uses (its
# go.mod's `toolchain` line): they are built with whatever toolchain their own
# modules ask for, so a change of the project's toolchain rebuilds nothing here.
#
# Idempotent: if every binary already exists and reports the wanted version,
# nothing is built and the script returns in about a second. A cold build
# takes a few minutes (kube-apiserver dominates); the shared GOMODCACHE and
# GOCACHE make rebuilds after a version bump much faster.
#
# With --cluster it builds instead what the end-to-end suite's cluster mode
# runs around the API server (test/e2e/README.md) and prints a search path
# (two directories joined by ':') holding them:
#
#   export E2E_CLUSTER_ASSETS="$(hack/envtest-assets.sh --cluster)"
#
#   kube-controller-manager, kube-scheduler  from k8s.io/kubernetes at
#       ENVTEST_K8S_VERSION, built like kube-apiserver (same throwaway module,
#       same version stamping), into
#       ${XDG_DATA_HOME:-$HOME/.local/share}/kubebuilder-envtest/apportion-cluster/k8s-<ver>-<os>-<arch>
#   kwok  (the fake-node controller, sigs.k8s.io/kwok/cmd/kwok at KWOK_VERSION)
#       into .../apportion-cluster/kwok-<ver>-k8s-<k8s ver>-<os>-<arch>
#
# They sit beside, not inside, setup-envtest's directory, so adding them never
# rebuilds or rewrites the kube-apiserver/etcd assets. kwok is built against
# the Kubernetes client libraries of ENVTEST_K8S_VERSION (its k8s.io/* staging
# requirements raised to that version, everything else as kwok asks): the
# client then matches the API server it plays nodes for, and its compile
# shares the Go build cache with kube-controller-manager's -- about 2 MB of
# Go source of its own instead of about 35 MB with the client libraries kwok
# was released with, which keeps a cold `make test` within its budget. Hence
# its key holds both versions: a Kubernetes bump rebuilds it (quickly).
# Same rules as above: idempotent (about a second when present), built only
# from the Go module proxy, a directory appears complete or not at all.
#
# With --node it provides instead what the real-node lane (`make test-node`,
# test/node) runs around the API server, and prints the kubelet's directory:
#
#   export NODE_ASSETS="$(hack/envtest-assets.sh --node)"
#
#   kubelet  from k8s.io/kubernetes at ENVTEST_K8S_VERSION, built like
#       kube-apiserver (same throwaway module, same version stamping), into
#       ${XDG_DATA_HOME:-$HOME/.local/share}/kubebuilder-envtest/apportion-node/k8s-<ver>-<os>-<arch>
#   containerd, runc, containernetworking-plugins, iptables  Debian's packages,
#       installed with apt-get when missing (as hack/chromium.sh installs
#       chromium; needs root or passwordless sudo): a runtime and CNI plugins
#       built and signed by the distribution, at the paths the lane expects
#       (/usr/bin/containerd, /usr/sbin/runc, /usr/lib/cni).
#
# Same rules: idempotent (about a second when present), the kubelet built only
# from the Go module proxy, its directory appears complete or not at all.
#
# Environment:
#   ENVTEST_K8S_VERSION  Kubernetes version to build (default 1.37.2)
#   ETCD_VERSION         etcd version to build (default 3.6.16)
#   KWOK_VERSION         kwok version to build with --cluster (default 0.8.0)
#   XDG_DATA_HOME        base of the output directory (see above)
#
# stdout carries only the assets directory (or, with --cluster, the search
# path); all progress/logging goes to stderr. To force a rebuild, delete the
# printed directory.
set -euo pipefail

ENVTEST_K8S_VERSION="${ENVTEST_K8S_VERSION:-1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-0.8.0}"
KWOK_VERSION="${KWOK_VERSION#v}"

# Accept both "1.37.2" and "v1.37.2".
K8S_VERSION="${ENVTEST_K8S_VERSION#v}"
ETCD_VERSION="${ETCD_VERSION#v}"
# The staging repos (k8s.io/api, k8s.io/client-go, ...) are tagged v0.X.Y for
# Kubernetes v1.X.Y.
STAGING_VERSION="v0.${K8S_VERSION#*.}"

CLUSTER=0 NODE=0
case "${1:-}" in
  -h|--help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 0 ;;
  --cluster) CLUSTER=1 ;;
  --node) NODE=1 ;;
  "") ;;
  *) echo "envtest-assets: unknown argument ${1} (try --help)" >&2; exit 2 ;;
esac

# Keep the real stdout on fd 3 for the final result and send everything else
# (including the go tool's own chatter) to stderr.
exec 3>&1 1>&2

log() { printf 'envtest-assets: %s\n' "$*" >&2; }

STEP="startup"
WORK=""          # scratch dir for the throwaway Go modules
STAGE=""         # new assets dir, renamed into place when complete
HEARTBEAT_PID=""
on_exit() {
  local rc=$?
  if [[ -n "${HEARTBEAT_PID}" ]]; then kill "${HEARTBEAT_PID}" 2>/dev/null || true; fi
  if [[ -n "${WORK}" && -d "${WORK}" ]]; then rm -rf "${WORK}"; fi
  if [[ -n "${STAGE}" && -d "${STAGE}" ]]; then rm -rf "${STAGE}"; fi
  if (( rc != 0 )); then
    log "FAILED during step: ${STEP} (exit code ${rc})"
  fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

command -v go >/dev/null || { echo "envtest-assets: go not found in PATH" >&2; exit 1; }
# This machine's Go may default to GOTOOLCHAIN=local (its go.env); let the go
# command fetch a newer toolchain where a module asks for one.
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"

# Run "$@" while printing a "still working" line every 20s, so long silent
# steps (module downloads, the kube-apiserver link) visibly make progress.
with_heartbeat() {
  local label="$1"; shift
  local start; start=$(date +%s)
  # The ticker closes fd 3 (our stdout) and fd 9 (the lock), kills its own
  # sleep when stopped and quits if the script dies, so no stray process keeps
  # `$(hack/envtest-assets.sh)` waiting or the lock held.
  (
    exec 3>&- 9>&-
    sleeper=""
    trap '[[ -n "${sleeper}" ]] && kill "${sleeper}" 2>/dev/null; exit 0' TERM
    while kill -0 "$$" 2>/dev/null; do
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
  (( rc == 0 )) && log "${label}: done in $(( $(date +%s) - start ))s"
  return "${rc}"
}

# go_quiet <args>: run the go command, dropping the hundreds of
# "go: added/upgraded <module>" lines `go get` prints (the "go: downloading"
# lines stay: they are the useful progress). sed always succeeds, so with
# pipefail the exit status is go's.
go_quiet() {
  go "$@" 2>&1 | sed -e '/^go: \(added\|upgraded\) /d' >&2
}

# Prints the body of every `<verb>` directive of a go.mod file, one entry per
# line, for both the single-line form and the `<verb> ( ... )` block form.
modfile_entries() {
  local file="$1" verb="$2"
  awk -v verb="${verb}" '
    { sub(/\/\/.*/, "") }                                   # strip comments
    inblock && /^[[:space:]]*\)/ { inblock = 0; next }
    inblock { gsub(/^[[:space:]]+|[[:space:]]+$/, ""); if ($0 != "") print; next }
    $1 == verb && $2 == "(" { inblock = 1; next }
    $1 == verb { sub("^[[:space:]]*" verb "[[:space:]]+", ""); gsub(/[[:space:]]+$/, ""); print }
  ' "${file}"
}

# check_version <binary> <expected substring> <args...>: true if the binary
# exists, runs, and its version output mentions the expected version.
check_version() {
  local bin="$1" want="$2"; shift 2
  [[ -x "${bin}" ]] || return 1
  local out
  out=$("${bin}" "$@" 2>&1) || return 1
  grep -qF -- "${want}" <<<"${out}"
}

export GOOS GOARCH
GOOS=$(go env GOOS)
GOARCH=$(go env GOARCH)
# Static, small binaries; the throwaway modules must not pick up a go.work
# from an enclosing directory.
export CGO_ENABLED=0 GOWORK=off

ENVTEST_ROOT="${XDG_DATA_HOME:-${HOME}/.local/share}/kubebuilder-envtest"
ASSETS_DIR="${ENVTEST_ROOT}/k8s/${K8S_VERSION}-${GOOS}-${GOARCH}"

have_k8s() {
  check_version "$1/kube-apiserver" "Kubernetes v${K8S_VERSION}" --version &&
    check_version "$1/kubectl" "Client Version: v${K8S_VERSION}" version --client
}
have_etcd() {
  check_version "$1/etcd" "etcd Version: ${ETCD_VERSION}" --version
}

LDFLAGS_BASE="-s -w"

# build_k8s <outdir> <cmd>...: builds the named commands of k8s.io/kubernetes
# (e.g. kube-apiserver) at K8S_VERSION into <outdir>.
build_k8s() {
  local out="$1"; shift
  local -a cmds=("$@") pkgs=() gets=()
  local c
  for c in "${cmds[@]}"; do
    pkgs+=("k8s.io/kubernetes/cmd/${c}")
    gets+=("k8s.io/kubernetes/cmd/${c}@v${K8S_VERSION}")
  done
  local mod="${WORK}/k8s"
  mkdir -p "${mod}"
  cd "${mod}"

  STEP="downloading k8s.io/kubernetes@v${K8S_VERSION} (module metadata)"
  log "resolving k8s.io/kubernetes@v${K8S_VERSION}"
  local info gomod_file info_file
  # On failure `go mod download -json` reports the error inside the JSON.
  info=$(go mod download -json "k8s.io/kubernetes@v${K8S_VERSION}") || { log "${info}"; return 1; }
  gomod_file=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")
  info_file=$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")
  [[ -f "${gomod_file}" ]] || { log "could not locate go.mod of k8s.io/kubernetes@v${K8S_VERSION}"; return 1; }

  # k8s.io/kubernetes requires its staging modules (k8s.io/api, client-go,
  # apiserver, ...) at the placeholder version v0.0.0 and replaces them with
  # ./staging/src/k8s.io/<name>. Replace directives of a dependency are
  # ignored, and the module zip does not contain staging/ (nested modules are
  # excluded), so we must provide equivalent replaces pointing at the
  # published v0.X.Y modules. Mirror the list from its go.mod rather than
  # hard-coding it, since it changes between releases.
  STEP="deriving replace directives from ${gomod_file}"
  local -a edits=("-require=k8s.io/kubernetes@v${K8S_VERSION}")
  local line n=0
  while IFS= read -r line; do
    local -a f
    read -r -a f <<<"${line}"
    if (( ${#f[@]} == 3 )) && [[ "${f[1]}" == "=>" && "${f[2]}" == "./staging/src/${f[0]}" ]]; then
      edits+=("-replace=${f[0]}=${f[0]}@${STAGING_VERSION}")
    elif (( ${#f[@]} == 4 )) && [[ "${f[1]}" == "=>" && "${f[2]}" != .* ]]; then
      edits+=("-replace=${f[0]}=${f[2]}@${f[3]}")          # old => new ver
    elif (( ${#f[@]} == 5 )) && [[ "${f[2]}" == "=>" && "${f[3]}" != .* ]]; then
      edits+=("-replace=${f[0]}@${f[1]}=${f[3]}@${f[4]}")  # old ver => new ver
    else
      log "unsupported replace directive in k8s.io/kubernetes go.mod: ${line}"
      return 1
    fi
    n=$((n + 1))
  done < <(modfile_entries "${gomod_file}" replace)
  (( n > 0 )) || { log "found no replace directives in ${gomod_file}; parsing failed?"; return 1; }
  log "mirroring ${n} replace directives (staging modules -> ${STAGING_VERSION})"
  # Same GODEBUG defaults as the upstream build (e.g. `godebug default=go1.26`).
  while IFS= read -r line; do
    edits+=("-godebug=${line}")
  done < <(modfile_entries "${gomod_file}" godebug)

  STEP="creating throwaway module for k8s.io/kubernetes"
  go mod init apportion.local/envtest-k8s
  go mod edit "${edits[@]}"

  STEP="downloading dependencies of ${cmds[*]}"
  with_heartbeat "downloading ${cmds[*]} dependencies" go_quiet get "${gets[@]}"

  # Version stamping, as kubernetes' hack/lib/version.sh does; without it the
  # binaries report v0.0.0-master. buildDate is the release's commit time, so
  # the output is reproducible.
  local build_date minor
  build_date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "${info_file}")
  minor="${K8S_VERSION#*.}"; minor="${minor%%.*}"
  local -a ld=()
  local kv pkg
  for kv in "gitVersion=v${K8S_VERSION}" "gitMajor=${K8S_VERSION%%.*}" "gitMinor=${minor}" "buildDate=${build_date:-1970-01-01T00:00:00Z}"; do
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
      ld+=("-X ${pkg}.${kv}")
    done
  done

  STEP="building ${cmds[*]} v${K8S_VERSION}"
  with_heartbeat "building ${cmds[*]} (takes a few minutes)" \
    go build -trimpath -ldflags "${LDFLAGS_BASE} ${ld[*]}" -o "${out}/" "${pkgs[@]}"
}

# build_etcd <outdir>
build_etcd() {
  local out="$1"
  local mod="${WORK}/etcd"
  mkdir -p "${mod}"
  cd "${mod}"

  # go.etcd.io/etcd/v3 (the repo root, home of etcd's real main) carries
  # replace directives, so `go install ...@version` refuses it. Its main is
  # just etcdmain.Main(os.Args); reproduce that in a throwaway module.
  STEP="creating throwaway module for etcd"
  go mod init apportion.local/envtest-etcd
  cat >main.go <<'EOF'
// Command etcd is etcd's own main, built from the published server module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF

  STEP="downloading go.etcd.io/etcd/server/v3@v${ETCD_VERSION}"
  with_heartbeat "downloading etcd dependencies" \
    go_quiet get "go.etcd.io/etcd/server/v3/etcdmain@v${ETCD_VERSION}"

  STEP="building etcd v${ETCD_VERSION}"
  with_heartbeat "building etcd" \
    go build -trimpath -ldflags "${LDFLAGS_BASE}" -o "${out}/etcd" .
}

# build_kwok <outdir>: kwok's controller binary from its module at
# KWOK_VERSION, in a throwaway module that raises the k8s.io staging modules
# kwok requires (k8s.io/<name> at a v0.X.Y release) to STAGING_VERSION.
build_kwok() {
  local out="$1"
  local mod="${WORK}/kwok"
  mkdir -p "${mod}"
  cd "${mod}"
  STEP="downloading sigs.k8s.io/kwok@v${KWOK_VERSION} (module metadata)"
  local info gomod_file
  info=$(go mod download -json "sigs.k8s.io/kwok@v${KWOK_VERSION}") || { log "${info}"; return 1; }
  gomod_file=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"${info}")
  [[ -f "${gomod_file}" ]] || { log "could not locate go.mod of sigs.k8s.io/kwok@v${KWOK_VERSION}"; return 1; }
  local -a gets=("sigs.k8s.io/kwok/cmd/kwok@v${KWOK_VERSION}")
  local line
  while IFS= read -r line; do
    local -a f
    read -r -a f <<<"${line}"
    if [[ "${f[0]}" == k8s.io/* && "${f[1]}" =~ ^v0\.[0-9]+\.[0-9]+$ ]]; then
      gets+=("${f[0]}@${STAGING_VERSION}")
    fi
  done < <(modfile_entries "${gomod_file}" require)
  (( ${#gets[@]} > 1 )) || { log "found no k8s.io staging requirements in ${gomod_file}; parsing failed?"; return 1; }
  log "building kwok against ${STAGING_VERSION} of $(( ${#gets[@]} - 1 )) k8s.io modules"
  STEP="creating throwaway module for kwok"
  go mod init apportion.local/envtest-kwok
  STEP="downloading dependencies of kwok"
  with_heartbeat "downloading kwok dependencies" go_quiet get "${gets[@]}"
  STEP="building sigs.k8s.io/kwok/cmd/kwok@v${KWOK_VERSION}"
  with_heartbeat "building kwok v${KWOK_VERSION}" \
    go build -trimpath -ldflags "${LDFLAGS_BASE}" -o "${out}/" sigs.k8s.io/kwok/cmd/kwok
}

# lock: serialise concurrent runs (e.g. parallel make targets) so they don't
# build twice or race on the final rename. Holding the lock, any leftover
# staging dir is from a killed run.
lock() {
  mkdir -p "${ENVTEST_ROOT}"
  command -v flock >/dev/null || return 0
  exec 9>"${ENVTEST_ROOT}/.apportion-envtest.lock"
  STEP="waiting for lock ${ENVTEST_ROOT}/.apportion-envtest.lock"
  flock 9
  chmod -R u+w "${ENVTEST_ROOT}"/.tmp-* 2>/dev/null || true
  rm -rf "${ENVTEST_ROOT}"/.tmp-*
}

# new_stage <name>: a fresh staging dir, assembled next to the final one (same
# filesystem, so the final rename is atomic) but outside k8s/, where
# setup-envtest would otherwise try to interpret it as a version.
new_stage() {
  STAGE=$(mktemp -d "${ENVTEST_ROOT}/.tmp-$1.XXXXXX")
  [[ -n "${WORK}" ]] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/apportion-envtest-build.XXXXXX")
}

# install_stage <dir>: swap the complete STAGE into place as <dir>. A rename is
# atomic, so readers see either the old directory, nothing, or the complete new
# one -- never a half built one.
install_stage() {
  local dir="$1"
  STEP="installing into ${dir}"
  chmod 0755 "${STAGE}"
  mkdir -p "$(dirname "${dir}")"
  if [[ -e "${dir}" ]]; then
    local old="${STAGE}.old"
    # setup-envtest leaves its downloads read-only, and moving a directory to
    # another parent needs write permission on the directory itself.
    chmod u+w "${dir}"
    mv "${dir}" "${old}"
    mv "${STAGE}" "${dir}"
    chmod -R u+w "${old}"
    rm -rf "${old}"
  else
    mv "${STAGE}" "${dir}"
  fi
  STAGE=""
  log "installed: $(du -sh "${dir}" | cut -f1) in ${dir}"
}

if (( CLUSTER )); then
  CLUSTER_ROOT="${ENVTEST_ROOT}/apportion-cluster"
  LOOPS_DIR="${CLUSTER_ROOT}/k8s-${K8S_VERSION}-${GOOS}-${GOARCH}"
  KWOK_DIR="${CLUSTER_ROOT}/kwok-${KWOK_VERSION}-k8s-${K8S_VERSION}-${GOOS}-${GOARCH}"
  have_loops() {
    check_version "$1/kube-controller-manager" "Kubernetes v${K8S_VERSION}" --version &&
      check_version "$1/kube-scheduler" "Kubernetes v${K8S_VERSION}" --version
  }
  have_kwok() {
    check_version "$1/kwok" "${KWOK_VERSION}" --version
  }
  STEP="checking ${CLUSTER_ROOT}"
  if ! { have_loops "${LOOPS_DIR}" && have_kwok "${KWOK_DIR}"; }; then
    lock
    if ! have_loops "${LOOPS_DIR}"; then
      new_stage "loops-${K8S_VERSION}-${GOOS}-${GOARCH}"
      build_k8s "${STAGE}" kube-controller-manager kube-scheduler
      cd /
      have_loops "${STAGE}" || { log "kube-controller-manager/kube-scheduler in ${STAGE} do not report v${K8S_VERSION}"; exit 1; }
      install_stage "${LOOPS_DIR}"
      rm -rf "${WORK}/k8s"
    fi
    if ! have_kwok "${KWOK_DIR}"; then
      new_stage "kwok-${KWOK_VERSION}-k8s-${K8S_VERSION}-${GOOS}-${GOARCH}"
      build_kwok "${STAGE}"
      cd /
      have_kwok "${STAGE}" || { log "kwok in ${STAGE} does not report v${KWOK_VERSION}"; exit 1; }
      install_stage "${KWOK_DIR}"
    fi
  else
    log "up to date: kube-controller-manager/kube-scheduler v${K8S_VERSION}, kwok v${KWOK_VERSION}"
  fi
  echo "${LOOPS_DIR}:${KWOK_DIR}" >&3
  exit 0
fi

if (( NODE )); then
  NODE_DIR="${ENVTEST_ROOT}/apportion-node/k8s-${K8S_VERSION}-${GOOS}-${GOARCH}"
  DEBIAN_PACKAGES=(containerd runc containernetworking-plugins iptables)
  have_kubelet() {
    check_version "$1/kubelet" "Kubernetes v${K8S_VERSION}" --version
  }
  have_debian() {
    [[ -x /usr/bin/containerd && -x /usr/bin/ctr && -x /usr/sbin/runc && -x /usr/sbin/iptables &&
       -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]]
  }
  STEP="checking ${NODE_DIR}"
  if ! { have_kubelet "${NODE_DIR}" && have_debian; }; then
    lock
    if ! have_debian; then
      STEP="installing Debian packages ${DEBIAN_PACKAGES[*]}"
      SUDO=""
      if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || { log "${DEBIAN_PACKAGES[*]} are missing and installing them needs root"; exit 1; }
        SUDO="sudo -n"
      fi
      command -v apt-get >/dev/null || { log "${DEBIAN_PACKAGES[*]} are missing and there is no apt-get to install them"; exit 1; }
      log "installing Debian's ${DEBIAN_PACKAGES[*]} (apt-get update; apt-get install -y)"
      export DEBIAN_FRONTEND=noninteractive
      $SUDO apt-get update -qq
      # --no-install-recommends: no docker.io or cri-tools come along. Debian
      # starts containerd as a service on install where systemd runs; the lane
      # never uses that instance (its own has its own root, state and socket).
      $SUDO apt-get install -y -qq --no-install-recommends "${DEBIAN_PACKAGES[@]}" >/dev/null
      have_debian || { log "containerd/ctr/runc/iptables/CNI plugins still missing after apt-get install"; exit 1; }
    fi
    if ! have_kubelet "${NODE_DIR}"; then
      new_stage "node-${K8S_VERSION}-${GOOS}-${GOARCH}"
      build_k8s "${STAGE}" kubelet
      cd /
      have_kubelet "${STAGE}" || { log "kubelet in ${STAGE} does not report v${K8S_VERSION}"; exit 1; }
      install_stage "${NODE_DIR}"
    fi
  else
    log "up to date: kubelet v${K8S_VERSION}, Debian's ${DEBIAN_PACKAGES[*]}"
  fi
  echo "${NODE_DIR}" >&3
  exit 0
fi

# Fast path: everything present and at the right version.
STEP="checking ${ASSETS_DIR}"
if have_k8s "${ASSETS_DIR}" && have_etcd "${ASSETS_DIR}"; then
  log "up to date: kube-apiserver/kubectl v${K8S_VERSION}, etcd v${ETCD_VERSION}"
  echo "${ASSETS_DIR}" >&3
  exit 0
fi

lock
# Another run may have finished the job while we waited.
if have_k8s "${ASSETS_DIR}" && have_etcd "${ASSETS_DIR}"; then
  log "up to date (built by a concurrent run)"
  echo "${ASSETS_DIR}" >&3
  exit 0
fi

new_stage "${K8S_VERSION}-${GOOS}-${GOARCH}"

# Reuse binaries that are already fine (e.g. only ETCD_VERSION changed).
BUILD_K8S=1 BUILD_ETCD=1
if have_k8s "${ASSETS_DIR}"; then
  BUILD_K8S=0; cp -p "${ASSETS_DIR}/kube-apiserver" "${ASSETS_DIR}/kubectl" "${STAGE}/"
fi
if have_etcd "${ASSETS_DIR}"; then
  BUILD_ETCD=0; cp -p "${ASSETS_DIR}/etcd" "${STAGE}/"
fi

if (( BUILD_ETCD )); then build_etcd "${STAGE}"; fi
if (( BUILD_K8S )); then build_k8s "${STAGE}" kube-apiserver kubectl; fi
cd /

STEP="verifying built binaries"
have_k8s "${STAGE}" || { log "kube-apiserver/kubectl in ${STAGE} do not report v${K8S_VERSION}"; exit 1; }
have_etcd "${STAGE}" || { log "etcd in ${STAGE} does not report ${ETCD_VERSION}"; exit 1; }

install_stage "${ASSETS_DIR}"
echo "${ASSETS_DIR}" >&3
