// Package promreg registers Prometheus collectors that another component may have registered
// already on the same registry (two push engines, two status writers): the second gets the
// first's collector and so shares its series, instead of failing.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c on reg, or returns the collector of the same type already registered
// under its descriptors. Any other refusal (another type under the name, inconsistent labels)
// is returned with c.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing, nil
			}
		}
		return c, err
	}
	return c, nil
}
