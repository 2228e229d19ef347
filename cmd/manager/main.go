// Command manager runs the Apportion controllers: it apportions every DownstreamQuota among the
// pods that share it, pushes each pod's permits and degrade switches to its agent, and reports
// what every pod holds.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/controller"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "manager:", err)
		os.Exit(1)
	}
}

type options struct {
	metricsAddr    string
	probeAddr      string
	leaderElect    bool
	leaderElectNS  string
	maxRuleHorizon time.Duration
}

func parseFlags(args []string) (options, *zap.Options, error) {
	var o options
	fs := flag.NewFlagSet("manager", flag.ContinueOnError)
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", ":8080", "address the metrics endpoint binds to; 0 disables it")
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", ":8081", "address the health probes bind to")
	fs.BoolVar(&o.leaderElect, "leader-elect", false, "run under leader election so that only one manager pushes at a time")
	fs.StringVar(&o.leaderElectNS, "leader-election-namespace", "", "namespace of the leader election Lease (default: the manager's own)")
	fs.DurationVar(&o.maxRuleHorizon, "max-degrade-horizon", 24*time.Hour, "the furthest a DegradeRule's expiresAt may lie in the future")
	zo := &zap.Options{Development: false}
	zo.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return o, nil, err
	}
	if fs.NArg() > 0 {
		return o, nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if o.maxRuleHorizon <= 0 {
		return o, nil, fmt.Errorf("--max-degrade-horizon must be positive, got %s", o.maxRuleHorizon)
	}
	return o, zo, nil
}

func run(args []string) error {
	o, zo, err := parseFlags(args)
	if err != nil {
		return err
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(zo)))

	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(apportionv1.AddToScheme(scheme))

	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsserver.Options{BindAddress: o.metricsAddr},
		HealthProbeBindAddress:  o.probeAddr,
		LeaderElection:          o.leaderElect,
		LeaderElectionID:        "manager.apportion.io",
		LeaderElectionNamespace: o.leaderElectNS,
		// A leader that loses its lease must stop pushing at once: its pushes are fenced by epoch,
		// but there is no reason to keep trying.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return fmt.Errorf("creating manager: %w", err)
	}
	ctx := ctrl.SetupSignalHandler()
	if err := controller.SetupIndexes(ctx, mgr.GetFieldIndexer()); err != nil {
		return fmt.Errorf("indexes: %w", err)
	}
	if err := (&controller.DownstreamQuotaReconciler{
		Client:   mgr.GetClient(),
		Recorder: mgr.GetEventRecorder("apportion-manager"),
		Clock:    clock.RealClock{},
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("DownstreamQuota controller: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("readyz", healthz.Ping); err != nil {
		return err
	}
	ctrl.Log.WithName("setup").Info("starting manager")
	return mgr.Start(ctx)
}
