// Package push is the manager's push engine: it delivers every pod's permits and degrade
// switches to the pod's agent over the agent's control API, and keeps, per DownstreamQuota, a
// ledger of what every pod may be using, so that the permits live pods hold never sum above the
// quota's limit — during scale-out, scale-in, manager restarts and lost connectivity. The
// protocol, its timeouts and the argument for why the sum holds are in docs/protocol.md.
//
// Use: build an Engine with New (an AgentClient such as a SigningClient, an EpochSource such as
// ConfigMapEpoch), add it to the manager (it is a leader-election Runnable), and have the
// DownstreamQuota controller call SetQuota / DeleteQuota and read Report, and the DegradeRule
// controller read SwitchApplied. Options.OnChange tells the controllers when a quota's Report
// changed. SigningKeys manages the Secret with the manager's Ed25519 signing keys (its own namespace only).
//
// Structure: core (core.go, ledger.go, planner.go) is a deterministic state machine without
// I/O, goroutines or clock reads; Engine (engine.go) runs it under one mutex with a bounded
// worker pool, a timer-driven scheduler and a notifier, and never holds the mutex during I/O.
package push
