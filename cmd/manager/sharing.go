package main

import (
	"flag"
	"fmt"
	"time"

	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/controller"
)

// sharingOptions tune demand-aware sharing (DownstreamQuota spec.sharing.policy DemandAware).
type sharingOptions struct {
	period      time.Duration
	tau         time.Duration
	minInterval time.Duration
}

func (s *sharingOptions) bind(fs *flag.FlagSet) {
	fs.DurationVar(&s.period, "sharing-period", controller.DefaultSharingPeriod, "how often a DemandAware quota's demand is sampled and its shares re-evaluated")
	fs.DurationVar(&s.tau, "demand-tau", controller.DefaultDemandTau, "time constant of the smoothing of each pod's demand")
	fs.DurationVar(&s.minInterval, "sharing-min-interval", demand.DefaultDamping(0).MinInterval, "least time between two damped moves of a DemandAware quota's shares")
}

func (s *sharingOptions) validate() error {
	if s.period < 100*time.Millisecond || s.tau < 0 || s.minInterval < 0 {
		return fmt.Errorf("--sharing-period must be at least 100ms and --demand-tau, --sharing-min-interval not negative, got %s, %s, %s", s.period, s.tau, s.minInterval)
	}
	return nil
}

// damping is demand.DefaultDamping with the flag's minimum interval.
func (s *sharingOptions) damping(budget int64) demand.Damping {
	d := demand.DefaultDamping(budget)
	d.MinInterval = s.minInterval
	return d
}
