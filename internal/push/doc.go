// Package push is the manager's push engine: it delivers every pod's permits and degrade
// switches to the pod's agent over the agent's control API, and keeps, per DownstreamQuota, a
// ledger of what every pod may be using, so that the permits live pods hold never sum above the
// quota's limit — during scale-out, scale-in, manager restarts and lost connectivity. The
// protocol, its timeouts and the argument for why the sum holds are in docs/protocol.md.
//
// Use: build an Engine with New (an AgentClient such as keys.SigningClient, an EpochSource such
// as ConfigMapEpoch), add it to the manager (it is a leader-election Runnable), and have the
// DownstreamQuota controller call SetQuota / DeleteQuota and read Report, and the DegradeRule
// controller read SwitchApplied. Options.OnChange tells the controllers when a quota's Report
// changed. The key material (the signing keys, their schedule, the signing client) is package
// internal/keys; the epoch record stays here: it is the fencing half of the protocol (§9), not
// key material, and the engine and the controller read it as the engine's EpochSource.
//
// Structure: core is a deterministic state machine without I/O, goroutines or clock reads (every
// method takes now); Engine (engine.go) runs it under one mutex with a bounded worker pool, a
// timer-driven scheduler and a notifier, and never holds the mutex during I/O. A change flows
// intake → replan → content → schedule → request → agent state → replan, and the files follow it:
//
//	types.go       the API the controllers use: DesiredQuota, DesiredPod, Report, Holding, Event
//	options.go     Options, AgentClient, EpochSource and their defaults
//	engine.go      Engine: the Runnable that drives core (mutex, workers, timers, notifier)
//	core.go        core's state and its flush loop (mark quotas to replan, pods to rebuild)
//	intake.go      SetQuota / DeleteQuota → desired state; pods leaving every quota
//	ledger.go      the ledger's records (quotaState, entry, podState, version) and held, the
//	               bound of what a pod may be using (docs/protocol.md, "Why Σ ≤ limit holds")
//	replan.go      ledger → planner glue: targets, who may be raised, replan, rebalance done
//	planner.go     plan: the pure function that decides one quota's grants
//	content.go     a pod's Assignment built from its quotas' grants, downstreams and switches
//	schedule.go    which request a pod needs next, when and in which band; timers, the renewal grid, backoff
//	fairqueue.go   readyQueue: ready pods by namespace (flow) and band, served fairly, with bounds
//	               on the workers one namespace and the unproven pods may hold
//	requests.go    a request's lifecycle: startWork reserves, finishWork applies the outcome;
//	               startRenewals starts the renewals ready together, to be signed in one batch
//	agentstate.go  reading an agent's State: holdings, restarts (carry), forgotten generations
//	claims.go      an answer claiming a newer epoch: never believed alone; the epoch record
//	               decides (fenced, or the pod misbehaves and is treated as unreachable)
//	report.go      Report, change detection for OnChange, Events, SwitchApplied counts
//	metrics.go     the engine's Prometheus metrics
//	epoch.go       ConfigMapEpoch, the fencing epoch counter and the record that decides fencing
package push
