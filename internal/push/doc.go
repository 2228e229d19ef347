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
// timer-driven scheduler and a notifier, and never holds the mutex during I/O, and reads time
// only from Options.Clock, but for socket deadlines (socketDeadline, deadline.go). core composes
// parts, each a type with its invariants in its doc comment:
//
//	ledger     what every pod may be using (held, counted) and the grants that keep Σ counted ≤
//	           limit (regrant): docs/protocol.md §11's theorem
//	scheduler  which request goes next and when: due, band, the timer heap, the renewal grid,
//	           backoff, and the fair ready queue (readyQueue)
//	claims     answers claiming a newer epoch, until the epoch record decides (§9)
//	reports    Report, changes for OnChange, Events, SwitchApplied counts
//	marks      the quotas to replan and the pods to rebuild at the next flush
//
// core itself keeps the records (quotas, pods) and the flow a change takes: intake → replan →
// content → schedule → request → agent state → replan. The files follow it:
//
//	types.go       the API the controllers use: DesiredQuota, DesiredPod, Report, Holding, Event
//	options.go     Options, AgentClient, EpochSource and their defaults
//	engine.go      Engine: the Runnable that drives core (mutex, workers, timers, notifier)
//	deadline.go    socketDeadline (real time, for sockets only) and the request's context
//	core.go        core: its parts, records and flush loop; marks
//	intake.go      SetQuota / DeleteQuota → desired state; pods leaving every quota
//	ledger.go      ledger, and its records (quotaState, entry, podState, version); held, the
//	               bound of what a pod may be using (docs/protocol.md, "Why Σ ≤ limit holds")
//	replan.go      ledger → planner: targets, who may be raised, regrant, replan, rebalance done
//	planner.go     plan: the pure function that decides one quota's grants
//	content.go     a pod's Assignment built from its quotas' grants, downstreams and switches
//	schedule.go    scheduler: which request a pod needs next, when and in which band; timers, the
//	               renewal grid, backoff
//	fairqueue.go   readyQueue: ready pods by namespace (flow) and band, served fairly, with bounds
//	               on the workers one namespace and the unproven pods may hold
//	requests.go    a request's lifecycle: startWork reserves, finishWork applies the outcome;
//	               startRenewals starts the renewals ready together, to be signed in one batch
//	agentstate.go  reading an agent's State: holdings, restarts (carry), forgotten generations
//	claims.go      claims: an answer claiming a newer epoch is never believed alone; the epoch
//	               record decides (fenced, or the pod misbehaves and is treated as unreachable)
//	report.go      reports: Report, change detection for OnChange, Events, SwitchApplied counts
//	metrics.go     the engine's Prometheus metrics
//	epoch.go       ConfigMapEpoch, the fencing epoch counter and the record that decides fencing
//
// The key material (the signing keys, their schedule, keys.SigningClient) is package
// internal/keys.
package push
