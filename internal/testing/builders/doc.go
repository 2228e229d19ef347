// Package builders makes the API objects tests create — DownstreamQuota, DegradeRule, Deployment,
// StatefulSet, HorizontalPodAutoscaler, Pod, Namespace — and the agent's per-downstream wire
// template, in kueue's wrapper style:
//
//	dq := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
//
// Make* starts from the smallest object the API server admits (names, a selector that matches
// the template, an upstream URL, one container); each method sets one thing and returns the
// wrapper; Obj returns a deep copy, so one wrapper can stamp out several objects. Every test
// that creates these objects — the controller and webhook envtest suites, the push engine's
// tests and the end-to-end harness — builds them here, so a change to the API changes one file.
//
// It is for tests only: nothing outside _test.go files and test/ imports it.
package builders
