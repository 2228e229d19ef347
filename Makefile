# Apportion — see README.md. `make help` lists the targets.

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

# Tools are built from the Go module proxy into a versioned cache outside the clone and linked
# into ./bin (hack/tools.sh); the envtest control plane likewise (hack/envtest-assets.sh).
LOCALBIN ?= $(CURDIR)/bin
CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen
GOLANGCI_LINT ?= $(LOCALBIN)/golangci-lint
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
# longer. The counts give each target about 20 s on the 2-core reference machine (measured
# rates in docs/benchmarks.md). A crash is still a failure, with its input written under
# testdata/fuzz/. Override with e.g. FUZZ_RESPONSE_HEAD=1000000x.
FUZZ_DECODE ?= 150000x
FUZZ_REQUEST_HEAD ?= 250000x
FUZZ_RESPONSE_HEAD ?= 250000x
# The server differential target makes two TCP exchanges per execution: 1,600-2,600 per second
# on the busy reference machine, so its count was chosen for that (docs/benchmarks.md).
FUZZ_SERVER_DIFFERENTIAL ?= 60000x
# Benchmarks: figures, not pass/fail.
BENCHTIME ?= 1s
# bench-proxy runs its processes (load generator, upstream, each proxy) at this niceness, so
# that on a shared machine they are not queued behind other work (a negative one needs root;
# without it nice warns and runs them at the normal priority).
BENCH_PROXY_NICE ?= -10

.PHONY: all
all: build

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z_0-9-]+:.*?##/ { printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development

.PHONY: manifests
manifests: controller-gen ## Generate the CRDs and RBAC from the Go markers.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd paths="./..." output:crd:artifacts:config=config/crd/bases

.PHONY: generate
generate: controller-gen ## Generate the DeepCopy methods.
	$(CONTROLLER_GEN) object:headerFile="hack/boilerplate.go.txt" paths="./api/..."

.PHONY: verify
verify: manifests generate ## Fail when generated files (CRDs, RBAC, deepcopy) are stale.
	@if [ -n "$$(git status --porcelain -- config/crd config/rbac api)" ]; then \
		git --no-pager diff -- config/crd config/rbac api; git status --short -- config/crd config/rbac api; \
		echo "generated files are stale: run 'make manifests generate' and commit the result" >&2; exit 1; fi

.PHONY: fmt
fmt: ## Run gofmt; fails when a file was not formatted.
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:" $$out >&2; exit 1; fi

.PHONY: vet
vet: ## Run go vet.
	go vet ./...

.PHONY: lint
lint: golangci-lint ## Run golangci-lint.
	$(GOLANGCI_LINT) run ./...

.PHONY: envtest
envtest: ## Build kube-apiserver, etcd and kubectl for envtest (cached outside the clone).
	@hack/envtest-assets.sh >/dev/null

##@ Test

.PHONY: test
test: verify fmt vet lint ## The whole suite: checks, unit, envtest, agent integration, short e2e, bounded fuzz.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go test -race -count=1 ./...
	$(MAKE) fuzz

.PHONY: fuzz
fuzz: ## Bounded fuzzing by execution count (part of `make test`; the seed corpora run as plain tests in go test ./...).
	go test -run='^$$' -fuzz='^FuzzDecode$$' -fuzztime=$(FUZZ_DECODE) ./internal/assignment/
	go test -run='^$$' -fuzz='^FuzzRequestHead$$' -fuzztime=$(FUZZ_REQUEST_HEAD) ./internal/agent/proxy/
	go test -run='^$$' -fuzz='^FuzzResponseHead$$' -fuzztime=$(FUZZ_RESPONSE_HEAD) ./internal/agent/proxy/
	go test -run='^$$' -fuzz='^FuzzServerDifferential$$' -fuzztime=$(FUZZ_SERVER_DIFFERENTIAL) ./internal/agent/proxy/

.PHONY: test-e2e
test-e2e: ## The full end-to-end suite (real API server, manager and agents on loopback).
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" E2E_FULL=1 go test -count=1 -timeout=30m -v ./test/e2e/

.PHONY: bench
bench: ## Benchmarks that print figures (semaphore, proxy overhead, CPU, apportioning).
	go test -run='^$$' -bench=. -benchmem -benchtime=$(BENCHTIME) ./internal/... ./cmd/agent/

.PHONY: bench-proxy
bench-proxy: ## The agent beside HAProxy and nginx (installed from the distribution's packages): added latency, CPU, closed-loop rate.
	hack/install-proxies.sh
	go build -o $(LOCALBIN)/agent ./cmd/agent
	go build -o $(LOCALBIN)/benchproxy ./hack/benchproxy
	nice -n $(BENCH_PROXY_NICE) taskset -c 0 $(LOCALBIN)/benchproxy -agent $(LOCALBIN)/agent $(BENCH_PROXY_FLAGS)

.PHONY: bench-convergence
bench-convergence: ## Time from an HPA change to every agent's ack, at 10 and 100 agents.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go test -run='^$$' -bench=Convergence -benchtime=1x -timeout=20m ./test/e2e/

##@ Build

.PHONY: build
build: ## Build bin/manager and bin/agent.
	go build -o $(LOCALBIN)/manager ./cmd/manager
	go build -o $(LOCALBIN)/agent ./cmd/agent

.PHONY: run
run: manifests ## Run the manager against the cluster of the current kubeconfig.
	go run ./cmd/manager

.PHONY: demo
demo: ## The main job on an embedded local control plane: scale a workload and watch its permits.
	KUBEBUILDER_ASSETS="$$(hack/envtest-assets.sh)" go run ./hack/demo

.PHONY: build-installer
build-installer: manifests ## Render the whole installation to dist/install.yaml.
	@mkdir -p dist
	"$$(hack/envtest-assets.sh)/kubectl" kustomize config/default > dist/install.yaml
	@echo "wrote dist/install.yaml"

##@ Tools

.PHONY: controller-gen
controller-gen: ## Install controller-gen into ./bin.
	@hack/tools.sh controller-gen >/dev/null

.PHONY: golangci-lint
golangci-lint: ## Install golangci-lint into ./bin.
	@hack/tools.sh golangci-lint >/dev/null
