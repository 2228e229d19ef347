// Package keys is the manager's key material for the push protocol (docs/protocol.md §10):
// SigningKeys keeps the manager's Ed25519 private keys in a Secret of its own namespace,
// KeyRing.Schedule decides which key signs and which are published or withdrawn (computed from
// the keys' creation times, so every replica decides alike), Schedule.TrustData is what the
// trust ConfigMap (api/v1alpha1.TrustConfigMap) holds, and SigningClient is the AgentClient the
// push engine is given: it signs every request (renewals in a batch) and tries the other published
// keys on an unknown-key answer.
//
// The package imports no push engine: the engine, the controllers, the manager's key keeper and
// the test harness use it; the webhook needs only the ConfigMap's name, from api/v1alpha1.
//
//	credentials.go  SigningKeys, KeyRing, Schedule (the key schedule), the Secret's format
//	signing.go      SigningClient
package keys
