# Apportion — see README.md. `make help` lists the targets.

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

# Tools are built from the Go module proxy into a versioned cache outside the clone and linked
# into ./bin (hack/tools.sh); the envtest control plane likewise (hack/envtest-assets.sh).
LOCALBIN ?= $(CURDIR)/bin
CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen
GOLANGCI_LINT ?= $(LOCALBIN)/golangci-lint
KUSTOMIZE ?= $(LOCALBIN)/kustomize
ENVTEST_K8S_VERSION ?= 1.37.2
export ENVTEST_K8S_VERSION

# The module asks for Go 1.27 (go.mod's toolchain line); a machine whose Go defaults to
# GOTOOLCHAIN=local (as Debian-style installs with a go.env may) would refuse it, so the
# go command is allowed to fetch that toolchain from the module proxy.
GOTOOLCHAIN ?= auto
export GOTOOLCHAIN

# Each fuzz target in `make test` runs for a fixed number of executions, never against a
# wall-clock deadline: a deadline can race the fuzz coordinator on a busy machine
# (golang/go#75804) and fail with no finding, while a count only makes a slow machine take
# longer. The counts give each target about 10 s on the 2-core reference machine (measured
# rates in docs/benchmarks.md; halved from 20 s when the cold run went over its 30 minutes). A crash is still a failure, with its input written under
# testdata/fuzz/. Override with e.g. FUZZ_RESPONSE_HEAD=1000000x.
FUZZ_DECODE ?= 200000x
FUZZ_REQUEST_HEAD ?= 150000x
FUZZ_RESPONSE_HEAD ?= 150000x
# The server differential target makes two TCP exchanges per execution: 1,600-3,800 per second
# on the reference machine, so its count is smaller (docs/benchmarks.md).
FUZZ_SERVER_DIFFERENTIAL ?= 30000x
# Minimizing each new interesting input is bounded by a count too (the default is 60 s of wall
# clock per input, which is what made FuzzDecode sit at "0/sec" for minutes on a busy machine).
FUZZ_MINIMIZE ?= 10000x
# FUZZ_WORKERS bounds the fuzzing processes of a target (go test -parallel; empty: one per CPU).
FUZZ_WORKERS ?=
FUZZFLAGS = -run='^$$' -fuzzminimizetime=$(FUZZ_MINIMIZE) $(if $(FUZZ_WORKERS),-parallel=$(FUZZ_WORKERS))

# The release: VERSION is stamped into both binaries (--version) and the images' annotations;
# IMG and AGENT_IMG (registry/name:tag) name the images `make images` builds and
# `make images-push` pushes, and flow into the manifests `make build-installer` renders.
# The defaults are what dist/install.yaml carries.
VERSION ?= v0.1.0
IMG ?= ghcr.io/apportion/manager:$(VERSION)
AGENT_IMG ?= ghcr.io/apportion/agent:$(VERSION)
DEFAULT_IMG := ghcr.io/apportion/manager:v0.1.0
DEFAULT_AGENT_IMG := ghcr.io/apportion/agent:v0.1.0
# GOARCH of the images' linux binaries (one platform per build).
IMAGE_ARCH ?= $(shell go env GOARCH)

# Benchmarks: figures, not pass/fail.
BENCHTIME ?= 1s
# bench-proxy runs its processes (load generator, upstream, each proxy) at this niceness, so
# that on a shared machine they are not queued behind other work (a negative one needs root;
# without it nice warns and runs them at the normal priority).
BENCH_PROXY_NICE ?= -10
# bench-scale runs the control plane, the manager and the simulated agents at this niceness too.
BENCH_SCALE_NICE ?= -10

.PHONY: all
all: build

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z_0-9-]+:.*?##/ { printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development

.PHONY: manifests
manifests: controller-gen ## Generate the CRDs, RBAC and the webhook configuration from the Go markers.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd webhook paths="./..." output:crd:artifacts:config=config/crd/bases output:webhook:artifacts:config=config/webhook

.PHONY: generate
generate: controller-gen ## Generate the DeepCopy methods.
	$(CONTROLLER_GEN) object:headerFile="hack/boilerplate.go.txt" paths="./api/..."

.PHONY: verify
verify: manifests generate ## Fail when generated files (CRDs, RBAC, webhook configuration, deepcopy, dist/install*.yaml) are stale.
	@$(MAKE) --no-print-directory build-installer IMG=$(DEFAULT_IMG) AGENT_IMG=$(DEFAULT_AGENT_IMG) >/dev/null
	@if [ -n "$$(git status --porcelain -- config/crd config/rbac config/webhook/manifests.yaml api dist)" ]; then \
		git --no-pager diff -- config/crd config/rbac config/webhook/manifests.yaml api dist; git status --short -- config/crd config/rbac config/webhook/manifests.yaml api dist; \
		echo "generated files are stale: run 'make manifests generate build-installer' and commit the result" >&2; exit 1; fi

# Go modules of their own (their dependencies would fight the main module's): the chart test.
SUBMODULES := hack/charttest

.PHONY: fmt
fmt: ## Run gofmt; fails when a file was not formatted.
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:" $$out >&2; exit 1; fi

# vet and golangci-lint compile every dependency for its type information (lint through
# `go list -export`). With -race (GOFLAGS for lint) that is the very compile `go test -race` needs
# next, so in `make test` the dependency graph is compiled in two configurations -- this one, and
# the static one of the images (see test) -- instead of three: a cold run saves minutes.
.PHONY: vet vet-main vet-submodules
vet: vet-main vet-submodules ## Run go vet.
vet-main:
	go vet -race ./...
vet-submodules:
	for m in $(SUBMODULES); do (cd $$m && GOWORK=off go vet -race ./...); done

.PHONY: lint
lint: golangci-lint ## Run golangci-lint (waits for another run in progress instead of failing).
	GOFLAGS="-race $$GOFLAGS" $(GOLANGCI_LINT) run --allow-serial-runners ./...
	for m in $(SUBMODULES); do (cd $$m && GOWORK=off GOFLAGS="-race $$GOFLAGS" $(GOLANGCI_LINT) run --allow-serial-runners --config $(CURDIR)/.golangci.yml ./...); done

.PHONY: chromium
chromium: ## Install Debian's chromium (the demo report's rendering test) when missing.
	@hack/chromium.sh >/dev/null

.PHONY: envtest
envtest: ## Build kube-apiserver, etcd and kubectl for envtest, and kube-controller-manager, kube-scheduler and kwok for the e2e cluster mode (cached outside the clone).
	@hack/envtest-assets.sh >/dev/null
	@hack/envtest-assets.sh --cluster >/dev/null

##@ Test

# `make test` first starts the cached builds its tests need -- the envtest control plane, the
# cluster mode's binaries, the real node's kubelet and Debian packages (hack/envtest-assets.sh)
# and Debian's chromium (hack/chromium.sh) -- in
# the background, so that on a fresh machine their downloads and long single-threaded links
# overlap the checks' compiles instead of following them; the test step then asks the same
# scripts for the paths, which waits on their locks until the builds are done (and reports a
# failure itself, with the script's own message). Progress of the background builds:
# $(PREPARE_LOG). Nothing is started when everything is cached (each script answers in a second).
PREPARE_LOG ?= $(LOCALBIN)/test-prepare.log

# Before the tests, the binaries are compiled as the images build them (static: CGO_ENABLED=0,
# -trimpath; nothing is written but the build cache): the images' test, the end-to-end harness
# and the agent's integration test then only link, instead of compiling the same dependencies
# at once in two test processes of a cold run.
#
# Then two lanes run at once (make -j2, each lane's output printed whole when it ends):
# test-go, the main module's tests, with the short end-to-end suite named first (TEST_FIRST) so
# that go test builds and starts it first -- about 6 minutes, mostly waiting on its processes,
# beside the other packages' tests -- and test-beside, one step after another on the CPU that
# suite leaves idle: lint, the submodules' vet and tests, the bounded fuzzing with one worker per
# target, and last the short real-node lane (test-node-short, mostly waiting on its kubelet).
# On a cold run that takes lint and fuzz off the path the suite waits on.
TEST_FIRST ?= ./test/e2e/

.PHONY: test-prepare
test-prepare:
	@mkdir -p $(LOCALBIN); : >$(PREPARE_LOG)
	@{ hack/chromium.sh >/dev/null 2>>$(PREPARE_LOG) & } ; \
	{ { hack/envtest-assets.sh && hack/envtest-assets.sh --cluster && hack/envtest-assets.sh --node; } >/dev/null 2>>$(PREPARE_LOG) & }

.PHONY: test
test: test-prepare verify fmt vet-main ## The whole suite: checks, unit, envtest, agent integration, images, installer, chart, demo report in Chromium, short e2e, lint, bounded fuzz, the short real-node lane (needs root).
	CGO_ENABLED=0 go build -trimpath ./cmd/...
	$(MAKE) --no-print-directory -j2 --output-sync=target test-go test-beside

.PHONY: test-go test-beside
test-go:
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" CHROMIUM="$$(hack/chromium.sh)" go test -race -count=1 $(TEST_FIRST) ./...
test-beside: lint vet-submodules
	for m in $(SUBMODULES); do (cd $$m && GOWORK=off go test -race -count=1 ./...); done
	$(MAKE) --no-print-directory fuzz FUZZ_WORKERS=1
	$(MAKE) --no-print-directory test-node-short

.PHONY: fuzz
fuzz: ## Bounded fuzzing by execution count (part of `make test`; the seed corpora run as plain tests in go test ./...).
	go test $(FUZZFLAGS) -fuzz='^FuzzDecode$$' -fuzztime=$(FUZZ_DECODE) ./internal/assignment/
	go test $(FUZZFLAGS) -fuzz='^FuzzRequestHead$$' -fuzztime=$(FUZZ_REQUEST_HEAD) ./internal/h1/
	go test $(FUZZFLAGS) -fuzz='^FuzzResponseHead$$' -fuzztime=$(FUZZ_RESPONSE_HEAD) ./internal/h1/
	go test $(FUZZFLAGS) -fuzz='^FuzzServerDifferential$$' -fuzztime=$(FUZZ_SERVER_DIFFERENTIAL) ./internal/h1/

.PHONY: test-e2e
test-e2e: ## The full end-to-end suite (real API server, manager and agents on loopback).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" E2E_FULL=1 go test -count=1 -timeout=30m -v ./test/e2e/

# The short real-node lane, the last step of `make test` (docs/benchmarks.md, "A real node"): on a
# real kubelet and containerd, install -> inject -> scale step -> failover -> uninstall. It fetches
# the node's assets itself (hack/envtest-assets.sh --node, started in the background by
# test-prepare); on a machine that cannot run a node (not root, no overlayfs, no writable cgroups,
# no network namespaces, an asset missing) it fails and names each thing missing.
.PHONY: test-node-short
test-node-short:
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" APPORTION_NODE=1 APPORTION_NODE_LANE=short go test -count=1 -timeout=30m -run='^TestNode$$' ./test/node/

# make chaos: the randomized scenario RUNS times, seeds SEED, SEED+1, ... (default: from the
# time), each for CHAOS_RUN, niced (CHAOS_NICE); each run's record is checked offline, a failed
# run's schedule and record are saved under CHAOS_OUT (the path and the seed are printed). A run
# is bounded (its schedule within CHAOS_RUN + 2 min); go test's timeout allows 3 min per run.
RUNS ?= 200
SEED ?=
CHAOS_RUN ?= 20s
CHAOS_OUT ?= $(or $(TMPDIR),/tmp)/apportion-chaos
CHAOS_NICE ?= 10

.PHONY: chaos
chaos: ## The randomized chaos scenario RUNS=n times from SEED (checked offline; failures saved under CHAOS_OUT).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CHAOS_RUNS=$(RUNS) E2E_CHAOS_SEED=$(SEED) E2E_CHAOS_RUN=$(CHAOS_RUN) E2E_CHAOS_OUT=$(CHAOS_OUT) \
	  nice -n $(CHAOS_NICE) go test -count=1 -timeout=$$(( $(RUNS) * 3 + 10 ))m -run='^TestChaos$$' -v ./test/e2e/

# make soak (not part of `make test`): TestClusterSoak on the cluster mode for SOAK_DURATION
# (default 60m, at least 5m) from SOAK_SEED (default: from the time), SOAK_RATE calls/s open loop,
# niced (SOAK_NICE); the per-window table is also written to SOAK_OUT.
SOAK_DURATION ?= 60m
SOAK_SEED ?=
SOAK_RATE ?= 120
SOAK_OUT ?= $(or $(TMPDIR),/tmp)/apportion-soak.txt
SOAK_NICE ?= 10
# go test's bound on the whole run (the soak, the cluster's start and the checks).
SOAK_TIMEOUT ?= 2h

.PHONY: soak
soak: ## The soak (not in `make test`): cluster mode, two quotas, open-loop load, a seeded fault schedule; per-window table, slope test.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" \
	  E2E_SOAK=1 E2E_SOAK_DURATION=$(SOAK_DURATION) E2E_SOAK_SEED=$(SOAK_SEED) E2E_SOAK_RATE=$(SOAK_RATE) E2E_SOAK_OUT=$(SOAK_OUT) \
	  nice -n $(SOAK_NICE) go test -count=1 -timeout=$(SOAK_TIMEOUT) -run='^TestClusterSoak$$' -v ./test/e2e/

.PHONY: test-node
test-node: ## The whole real-node lane (`make test` runs its short form): a kubelet, containerd and a bridge pod network in a network namespace of its own; walks docs/install.md on it, then the Helm chart. Needs root.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" NODE_ASSETS="$$(hack/envtest-assets.sh --node)" APPORTION_NODE=1 go test -count=1 -timeout=30m -v ./test/node/

.PHONY: node-up
node-up: ## A real node for a walk by hand (docs/install.md, "A local node"): up with dist/images imported, held until Ctrl-C, then removed. Needs root.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_CLUSTER_ASSETS="$$(hack/envtest-assets.sh --cluster)" NODE_ASSETS="$$(hack/envtest-assets.sh --node)" APPORTION_NODE=1 APPORTION_NODE_LANE=hold go test -count=1 -timeout=0 -v -run='^TestNode$$' ./test/node/

.PHONY: bench
bench: ## Benchmarks that print figures (semaphore, proxy overhead, CPU, apportioning, webhook admission).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go test -run='^$$' -bench=. -benchmem -benchtime=$(BENCHTIME) ./internal/... ./cmd/agent/

.PHONY: bench-proxy
bench-proxy: ## The agent beside HAProxy and nginx (installed from the distribution's packages): added latency, CPU, closed-loop rate.
	hack/install-proxies.sh
	go build -o $(LOCALBIN)/agent ./cmd/agent
	go build -o $(LOCALBIN)/benchproxy ./hack/benchproxy
	nice -n $(BENCH_PROXY_NICE) taskset -c 0 $(LOCALBIN)/benchproxy -agent $(LOCALBIN)/agent $(BENCH_PROXY_FLAGS)

.PHONY: bench-convergence
bench-convergence: ## Time from an HPA change to every agent's ack, at 10 and 100 agents.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go test -run='^$$' -bench=Convergence -benchtime=1x -timeout=20m ./test/e2e/

.PHONY: bench-scale
bench-scale: ## One manager, many pods and quotas (simulated agents): convergence, RSS, CPU, API and push rates; SCALE_CONFIGS=100x1,1000x100,10000x1000.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go test -c -o $(LOCALBIN)/scale.test ./test/scale/
	cd test/scale && KUBEBUILDER_ASSETS="$$(../../hack/envtest-assets.sh)" nice -n $(BENCH_SCALE_NICE) $(LOCALBIN)/scale.test -test.run='^$$' -test.bench=Scale -test.benchtime=1x -test.timeout=120m -test.v

# bench-hub (issue 33): one hub API server and the manager with --hub, N member clusters × G
# GlobalQuotas of simulated members (the real hubsync.Member each); HUB_CONFIGS=3x1,10x10 (larger by hand),
# HUB_IDLE, HUB_LEASE (test/hubscale). Niced as bench-scale.
.PHONY: bench-hub
bench-hub: ## The hub's cost: first grants, demand shifts, API requests by verb, writes per member per minute idle (goal 0); HUB_CONFIGS=3x1,10x10.
	go test -c -o $(LOCALBIN)/hubscale.test ./test/hubscale/
	cd test/hubscale && KUBEBUILDER_ASSETS="$$(../../hack/envtest-assets.sh)" nice -n $(BENCH_SCALE_NICE) $(LOCALBIN)/hubscale.test -test.run='^$$' -test.bench=Hub -test.benchtime=1x -test.timeout=60m -test.v

##@ Build

.PHONY: build
build: ## Build bin/manager and bin/agent.
	go build -ldflags "-X github.com/apportion/apportion/internal/version.Version=$(VERSION)" -o $(LOCALBIN)/manager ./cmd/manager
	go build -ldflags "-X github.com/apportion/apportion/internal/version.Version=$(VERSION)" -o $(LOCALBIN)/agent ./cmd/agent

.PHONY: images
images: ## Build the manager and agent images without a daemon: dist/images/{manager,agent}.tar and dist/images/oci.
	go run ./hack/images build -out dist/images -version $(VERSION) -arch $(IMAGE_ARCH) -manager $(IMG) -agent $(AGENT_IMG)

.PHONY: images-push
images-push: images ## Push both images to IMG and AGENT_IMG (credentials from ~/.docker/config.json).
	go run ./hack/images push -layout dist/images/oci

.PHONY: run
run: manifests ## Run the manager against the cluster of the current kubeconfig.
	go run ./cmd/manager

.PHONY: demo
demo: ## The 429 storm without and with Apportion (real manager and agents); writes dist/demo/report.html and CSVs.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go run ./hack/demo

.PHONY: build-installer
build-installer: manifests kustomize ## Render the installation with IMG and AGENT_IMG: dist/install.yaml (cert-controller), dist/install-certmanager.yaml and dist/install-hub.yaml (a hub cluster).
	@mkdir -p dist
	$(call render,config/default,dist/install.yaml)
	$(call render,config/certmanager,dist/install-certmanager.yaml)
	$(call render,config/hub,dist/install-hub.yaml)
	@# The chart carries the same CRDs (Helm installs crds/ before the templates).
	@for f in config/crd/bases/apportion.io_*.yaml; do n=$${f##*/apportion.io_}; cp "$$f" "dist/chart/crds/$${n%.yaml}.apportion.io.yaml"; done
	@hack/chart-rbac.sh dist/install.yaml apportion-system > dist/chart/templates/rbac.yaml
	@hack/chart-rbac.sh dist/install-hub.yaml apportion-system hub > dist/chart/templates/hub.yaml

# render(kustomization dir, output file): kustomize build of the dir through a throw-away
# overlay that sets the two images, so IMG/AGENT_IMG never edit a committed kustomization.
define render
	@rm -rf dist/.render && mkdir -p dist/.render && cd dist/.render && \
	  $(KUSTOMIZE) create --resources ../../$(1) && \
	  $(KUSTOMIZE) edit set image ghcr.io/apportion/manager=$(IMG) ghcr.io/apportion/agent=$(AGENT_IMG) && \
	  $(KUSTOMIZE) build . > ../../$(2).tmp
	@mv -f $(2).tmp $(2) && rm -rf dist/.render
	@echo "wrote $(2) (manager $(IMG), agent $(AGENT_IMG))"
endef

##@ Tools

.PHONY: controller-gen
controller-gen: ## Install controller-gen into ./bin.
	@hack/tools.sh controller-gen >/dev/null

.PHONY: golangci-lint
golangci-lint: ## Install golangci-lint into ./bin.
	@hack/tools.sh golangci-lint >/dev/null

.PHONY: kustomize
kustomize: ## Install kustomize into ./bin.
	@hack/tools.sh kustomize >/dev/null
