// Command manager runs the Apportion controllers: it apportions every DownstreamQuota among the
// pods that share it, pushes each pod's permits and degrade switches to its agent under leases
// (internal/push), and reports what every pod holds.
package main

import (
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/controller"
	"github.com/apportion/apportion/internal/inject"
	"github.com/apportion/apportion/internal/push"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "manager:", err)
		os.Exit(1)
	}
}

type options struct {
	metricsAddr      string
	probeAddr        string
	leaderElect      bool
	managerNamespace string
	watchNamespace   string
	maxRuleHorizon   time.Duration
	leaseTTL         time.Duration
	renewEvery       time.Duration
	pushTimeout      time.Duration
	pushWorkers      int
	keyRotation      time.Duration
	webhook          webhookOptions
	inject           inject.Config
}

func parseFlags(args []string) (options, *zap.Options, error) {
	var o options
	fs := flag.NewFlagSet("manager", flag.ContinueOnError)
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", ":8080", "address the metrics endpoint binds to; 0 disables it")
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", ":8081", "address the health probes bind to; 0 disables them")
	fs.BoolVar(&o.leaderElect, "leader-elect", false, "run under leader election so that only one manager pushes at a time")
	fs.StringVar(&o.managerNamespace, "manager-namespace", envOr("POD_NAMESPACE", "apportion-system"),
		"namespace of the manager's own objects: leader election Lease, epoch ConfigMap, agent key Secret, webhook certificate Secret")
	fs.StringVar(&o.watchNamespace, "namespace", "", "watch only this namespace (default: all)")
	fs.DurationVar(&o.maxRuleHorizon, "max-degrade-horizon", controller.DefaultMaxDegradeHorizon, "the furthest a DegradeRule's expiresAt may lie in the future")
	fs.DurationVar(&o.leaseTTL, "lease-ttl", push.DefaultLeaseTTL, "how long an agent keeps its permits without renewal")
	fs.DurationVar(&o.renewEvery, "renew-every", push.DefaultRenewEvery, "how often every agent's lease is renewed")
	fs.DurationVar(&o.pushTimeout, "push-timeout", push.DefaultPushTimeout, "bound on one control request to an agent")
	fs.IntVar(&o.pushWorkers, "push-workers", push.DefaultWorkers, "control requests in flight at once")
	fs.DurationVar(&o.keyRotation, "key-rotation-interval", 7*24*time.Hour, "how often the agents' HMAC key is rotated; 0 never")
	o.webhook.bind(fs)
	zo := &zap.Options{}
	zo.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return o, nil, err
	}
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments: %v", fs.Args()))
	}
	if o.maxRuleHorizon <= 0 {
		errs = append(errs, fmt.Errorf("--max-degrade-horizon must be positive, got %s", o.maxRuleHorizon))
	}
	if o.leaseTTL < 100*time.Millisecond || o.leaseTTL > 10*time.Minute {
		errs = append(errs, fmt.Errorf("--lease-ttl must be between 100ms and 10m, got %s", o.leaseTTL))
	}
	if o.pushTimeout <= 0 || o.renewEvery <= 0 || o.renewEvery+o.pushTimeout >= o.leaseTTL {
		errs = append(errs, fmt.Errorf("--renew-every (%s) + --push-timeout (%s) must be positive and below --lease-ttl (%s), so a renewal can be retried before the lease passes",
			o.renewEvery, o.pushTimeout, o.leaseTTL))
	}
	if o.pushWorkers < 1 {
		errs = append(errs, fmt.Errorf("--push-workers must be at least 1, got %d", o.pushWorkers))
	}
	if o.keyRotation < 0 || (o.keyRotation > 0 && o.keyRotation < 10*time.Minute) {
		errs = append(errs, fmt.Errorf("--key-rotation-interval must be 0 or at least 10m (agents reload keys within minutes), got %s", o.keyRotation))
	}
	if o.managerNamespace == "" {
		errs = append(errs, errors.New("--manager-namespace must not be empty"))
	}
	var err error
	if o.inject, err = o.webhook.injectConfig(); err != nil {
		errs = append(errs, err)
	}
	return o, zo, errors.Join(errs...)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(args []string) error {
	o, zo, err := parseFlags(args)
	if err != nil {
		return err
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(zo)))
	setupLog := ctrl.Log.WithName("setup")

	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(apportionv1.AddToScheme(scheme))

	mopts := ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsserver.Options{BindAddress: o.metricsAddr},
		HealthProbeBindAddress:  o.probeAddr,
		LeaderElection:          o.leaderElect,
		LeaderElectionID:        "manager.apportion.io",
		LeaderElectionNamespace: o.managerNamespace,
		// A leader that loses its lease stops at once; its pushes would be fenced by epoch anyway.
		LeaderElectionReleaseOnCancel: true,
	}
	if o.webhook.port > 0 {
		mopts.WebhookServer = o.webhook.webhookServer()
	}
	if o.watchNamespace != "" {
		mopts.Cache = cache.Options{DefaultNamespaces: map[string]cache.Config{o.watchNamespace: {}}}
	}
	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), mopts)
	if err != nil {
		return fmt.Errorf("creating manager: %w", err)
	}
	ctx := ctrl.SetupSignalHandler()

	// The agents' HMAC keys: created on first start, replicated into every namespace with a
	// DownstreamQuota (a pod mounts Secrets of its own namespace only), rotated periodically.
	keys := &push.AgentKeys{Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Namespace: o.managerNamespace}
	ks, err := keys.Ensure(ctx)
	if err != nil {
		return fmt.Errorf("agent keys: %w", err)
	}
	signer := push.NewSigningClient(&http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: 2, IdleConnTimeout: 90 * time.Second, ForceAttemptHTTP2: false,
	}}, ks)
	replicator := newKeyReplicator(keys, ks)

	// The engine's changes refresh both kinds' status; each controller reads its own channel.
	quotaChanges := make(chan event.GenericEvent, 1024)
	ruleChanges := make(chan event.GenericEvent, 1024)
	engine, err := push.New(push.Options{
		Client:      signer,
		Epoch:       &push.ConfigMapEpoch{Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Namespace: o.managerNamespace},
		LeaseTTL:    o.leaseTTL,
		RenewEvery:  o.renewEvery,
		PushTimeout: o.pushTimeout,
		Workers:     o.pushWorkers,
		Logger:      ctrl.Log.WithName("push"),
		Registry:    metrics.Registry,
		OnChange: func(k types.NamespacedName) {
			ev := event.GenericEvent{Object: &apportionv1.DownstreamQuota{}}
			ev.Object.SetNamespace(k.Namespace)
			ev.Object.SetName(k.Name)
			quotaChanges <- ev
			ruleChanges <- ev
		},
	})
	if err != nil {
		return fmt.Errorf("push engine: %w", err)
	}
	if err := mgr.Add(engine); err != nil {
		return err
	}
	if o.keyRotation > 0 {
		if err := mgr.Add(&keyRotator{keys: keys, every: o.keyRotation, signer: signer, replicator: replicator}); err != nil {
			return err
		}
	}

	if err := controller.SetupIndexes(ctx, mgr.GetFieldIndexer()); err != nil {
		return fmt.Errorf("indexes: %w", err)
	}
	recorder := mgr.GetEventRecorder("apportion-manager")
	if err := (&controller.DownstreamQuotaReconciler{
		Client:        mgr.GetClient(),
		Recorder:      recorder,
		Pusher:        engine,
		Clock:         clock.RealClock{},
		Changes:       quotaChanges,
		KeyReplicator: replicator.ensure,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("DownstreamQuota controller: %w", err)
	}
	if err := (&controller.DegradeRuleReconciler{
		Client:     mgr.GetClient(),
		Recorder:   recorder,
		Clock:      clock.RealClock{},
		Applied:    engine,
		MaxHorizon: o.maxRuleHorizon,
		Changes:    ruleChanges,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("DegradeRule controller: %w", err)
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return err
	}
	// Namespaces labelled for injection get the agents' keys before their first injected pod.
	if err := (&controller.InjectionNamespaceReconciler{
		Client:      mgr.GetClient(),
		EnsureTrust: replicator.ensure,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("injection namespace controller: %w", err)
	}
	ready := healthz.Ping
	if o.webhook.port > 0 {
		// A replica is ready — gets admission calls through the webhook Service — only once its
		// webhook serves.
		if ready, err = setupWebhook(ctx, mgr, o, o.inject); err != nil {
			return err
		}
	}
	if err := mgr.AddReadyzCheck("readyz", ready); err != nil {
		return err
	}
	setupLog.Info("starting manager", "managerNamespace", o.managerNamespace, "leaseTTL", o.leaseTTL, "renewEvery", o.renewEvery)
	return mgr.Start(ctx)
}
