// Command manager runs the Apportion controllers: it apportions every DownstreamQuota among the
// pods that share it, pushes each pod's permits and degrade switches to its agent under leases
// (internal/push), and reports what every pod holds.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/KimMachineGun/automemlimit/memlimit"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/discovery"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/metrics/filters"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/controller"
	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/hubsync"
	"github.com/apportion/apportion/internal/inject"
	"github.com/apportion/apportion/internal/keys"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/version"
)

func main() {
	if err := run(os.Args[1:]); errors.Is(err, flag.ErrHelp) {
		return
	} else if err != nil {
		fmt.Fprintln(os.Stderr, "manager:", err)
		os.Exit(1)
	}
}

type options struct {
	metricsAddr      string
	metricsSecure    bool
	probeAddr        string
	pprofAddr        string
	leaderElect      bool
	managerNamespace string
	watchNamespace   string
	maxRuleHorizon   time.Duration
	leaseTTL         time.Duration
	renewEvery       time.Duration
	pushTimeout      time.Duration
	pushWorkers      int
	quotaWorkers     int
	statusWriters    int
	keyRotation      time.Duration
	keyOverlap       time.Duration
	version          bool
	hub              bool
	webhook          webhookOptions
	sharing          sharingOptions // sharing.go
	memory           memoryOptions  // memlimit.go
	inject           inject.Config
}

func parseFlags(args []string) (options, *zap.Options, error) {
	var o options
	fs := flag.NewFlagSet("manager", flag.ContinueOnError)
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", ":8443", "address the metrics endpoint binds to; 0 disables it")
	fs.BoolVar(&o.metricsSecure, "metrics-secure", true,
		"serve metrics over HTTPS and only to callers the API server authenticates and authorizes (get on the /metrics non-resource URL); false serves plain HTTP to anyone")
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", ":8081", "address the health probes bind to; 0 disables them")
	fs.StringVar(&o.pprofAddr, "pprof-bind-address", "", "address net/http/pprof binds to (e.g. 127.0.0.1:6060), for profiling; empty disables it")
	fs.BoolVar(&o.leaderElect, "leader-elect", false, "run under leader election so that only one manager pushes at a time")
	fs.StringVar(&o.managerNamespace, "manager-namespace", envOr("POD_NAMESPACE", "apportion-system"),
		"namespace of the manager's own objects: leader election Lease, epoch ConfigMap, signing key Secret, webhook certificate Secret")
	fs.StringVar(&o.watchNamespace, "namespace", "", "watch only this namespace (default: all)")
	fs.DurationVar(&o.maxRuleHorizon, "max-degrade-horizon", controller.DefaultMaxDegradeHorizon, "the furthest a DegradeRule's expiresAt may lie in the future")
	fs.DurationVar(&o.leaseTTL, "lease-ttl", push.DefaultLeaseTTL, "how long an agent keeps its permits without renewal")
	fs.DurationVar(&o.renewEvery, "renew-every", push.DefaultRenewEvery, "how often every agent's lease is renewed")
	fs.DurationVar(&o.pushTimeout, "push-timeout", push.DefaultPushTimeout, "bound on one control request to an agent")
	fs.IntVar(&o.pushWorkers, "push-workers", push.DefaultWorkers, "control requests in flight at once")
	fs.IntVar(&o.quotaWorkers, "quota-workers", controller.DefaultQuotaWorkers, "DownstreamQuotas reconciled at once (a quota is never reconciled twice at once)")
	fs.IntVar(&o.statusWriters, "status-writers", controller.DefaultStatusWriters,
		"DownstreamQuota status writes in flight at once; a reconcile hands its status over and never waits for the write (one write per quota at a time, the latest status wins)")
	fs.DurationVar(&o.keyRotation, "key-rotation-interval", 7*24*time.Hour, "how often a new signing key is made; 0 never")
	fs.DurationVar(&o.keyOverlap, "key-overlap", keys.DefaultKeyOverlap, "how long a new key is published before it signs, and the old one stays published after")
	fs.BoolVar(&o.version, "version", false, "print the version and exit")
	fs.BoolVar(&o.hub, "hub", false,
		"also run the hub role: keep every GlobalQuota's allocation and publish its member clusters' slices (docs/protocol.md §16)")
	o.webhook.bind(fs)
	o.sharing.bind(fs)
	o.memory.bind(fs)
	zo := &zap.Options{}
	zo.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return o, nil, err
	}
	if o.version {
		return o, zo, nil
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
	if err := o.sharing.validate(); err != nil {
		errs = append(errs, err)
	}
	if err := o.memory.validate(); err != nil {
		errs = append(errs, err)
	}
	if o.quotaWorkers < 1 {
		errs = append(errs, fmt.Errorf("--quota-workers must be at least 1, got %d", o.quotaWorkers))
	}
	if o.statusWriters < 1 {
		errs = append(errs, fmt.Errorf("--status-writers must be at least 1, got %d", o.statusWriters))
	}
	if o.pushWorkers < 1 {
		errs = append(errs, fmt.Errorf("--push-workers must be at least 1, got %d", o.pushWorkers))
	}
	if o.keyOverlap < keys.MinKeyOverlap {
		errs = append(errs, fmt.Errorf("--key-overlap must be at least %s (the kubelet refreshes a ConfigMap volume within about a minute, the agent re-reads it every 30s), got %s", keys.MinKeyOverlap, o.keyOverlap))
	}
	if o.keyRotation < 0 || (o.keyRotation > 0 && o.keyRotation <= 2*o.keyOverlap) {
		errs = append(errs, fmt.Errorf("--key-rotation-interval must be 0 or longer than twice --key-overlap (%s), so that at most two keys are published, got %s", o.keyOverlap, o.keyRotation))
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

// memberReaction is the part of a member's drain bound that is the manager's own: from a lease
// that ended or a grant read to the engine planning on the new limit.
const memberReaction = 2 * time.Second

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
	if o.version {
		fmt.Println(version.String("manager"))
		return nil
	}
	ctrl.SetLogger(zap.New(zap.UseFlagOptions(zo)))
	setupLog := ctrl.Log.WithName("setup")

	// Before the caches fill: the collector keeps the heap under the soft limit from the start.
	soft := decideSoftLimit(o.memory, os.Getenv("GOMEMLIMIT"), memlimit.FromCgroup)
	if soft.Err != nil {
		setupLog.Error(soft.Err, "no soft memory limit set: reading the container's memory limit failed")
	}
	setupLog.Info("soft memory limit", "limit", formatSoftLimit(applySoftLimit(soft)), "from", soft.From)

	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(apportionv1.AddToScheme(scheme))

	metricsOpts := metricsserver.Options{BindAddress: o.metricsAddr}
	if o.metricsSecure {
		// kubebuilder v4's default: TLS (a self-signed certificate unless one is mounted) and a
		// TokenReview + SubjectAccessReview per scrape, so the ClusterRole metrics-reader decides
		// who may read the ledger's figures (config/rbac/metrics_*.yaml).
		metricsOpts.SecureServing = true
		metricsOpts.FilterProvider = filters.WithAuthenticationAndAuthorization
	}
	mopts := ctrl.Options{
		Scheme:                  scheme,
		Metrics:                 metricsOpts,
		HealthProbeBindAddress:  o.probeAddr,
		PprofBindAddress:        o.pprofAddr,
		LeaderElection:          o.leaderElect,
		LeaderElectionID:        "manager.apportion.io",
		LeaderElectionNamespace: o.managerNamespace,
		// A leader that loses its lease stops at once; its pushes would be fenced by epoch anyway.
		LeaderElectionReleaseOnCancel: true,
	}
	// The cache keeps of every Pod, workload, HPA and Namespace only the fields the manager reads,
	// and no object's managed fields: at thousands of pods the cache is most of the live heap.
	mopts.Cache = controller.CacheOptions()
	if o.webhook.port > 0 {
		mopts.WebhookServer = o.webhook.webhookServer()
	}
	if o.watchNamespace != "" {
		mopts.Cache.DefaultNamespaces = map[string]cache.Config{o.watchNamespace: {}}
	}
	mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), mopts)
	if err != nil {
		return fmt.Errorf("creating manager: %w", err)
	}
	ctx := ctrl.SetupSignalHandler()

	// The signing keys: Ed25519, private halves only in a Secret of the manager's namespace. The
	// key keeper (leader only) runs the rotation schedule and publishes the public halves, which
	// the trust reconciler keeps as a ConfigMap in every namespace with agents.
	signingKeys := &keys.SigningKeys{Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Namespace: o.managerNamespace}
	ring, err := signingKeys.Ensure(ctx)
	if err != nil {
		return fmt.Errorf("signing keys: %w", err)
	}
	sched, _ := ring.Schedule(time.Now(), o.keyOverlap)
	// One kept-alive connection per agent (a renewal every few seconds), on the agent's lean
	// HTTP/1.1 client: an idle connection costs no goroutine (http.Transport keeps two, 20,000
	// at 10,000 agents), is checked with one peek before it is reused (a dead agent's is not),
	// and a push's timeout is its connection's deadline. An agent's answer heads are small;
	// one larger is refused before it costs much (assignment.MaxAnswerHeadBytes).
	agentHTTP := h1.NewClient()
	agentHTTP.SetMaxIdlePerHost(1)
	agentHTTP.SetMaxResponseHeaderBytes(assignment.MaxAnswerHeadBytes)
	signer := keys.NewSigningClient(h1.HTTPClient{C: agentHTTP}, sched)
	trustChanges := make(chan event.GenericEvent, 1)
	keeper := &keyKeeper{keys: signingKeys, signer: signer, overlap: o.keyOverlap, rotation: o.keyRotation,
		tick: min(o.keyOverlap/4, time.Minute), clock: clock.RealClock{}, log: ctrl.Log.WithName("keys"), changes: trustChanges}
	if err := mgr.Add(keeper); err != nil {
		return err
	}

	// The engine's changes refresh both kinds' status; each controller reads its own channel.
	recorder := mgr.GetEventRecorder("apportion-manager")
	quotaChanges := make(chan event.GenericEvent, 1024)
	ruleChanges := make(chan event.GenericEvent, 1024)
	// The epoch counter, read from the API server (never the cache): the engine takes its epoch
	// from it, and it alone decides whether an agent's newer epoch fences the engine — an
	// agent's word is not enough (docs/protocol.md §9).
	epochs := &push.ConfigMapEpoch{Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Namespace: o.managerNamespace}
	engine, err := push.New(push.Options{
		Client:      signer,
		Epoch:       epochs,
		Record:      epochs,
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
		OnEvent: func(ev push.Event) {
			dq := &apportionv1.DownstreamQuota{}
			dq.SetNamespace(ev.Quota.Namespace)
			dq.SetName(ev.Quota.Name)
			dq.SetUID(ev.UID)
			typ := corev1.EventTypeNormal
			if ev.Warning {
				typ = corev1.EventTypeWarning
			}
			recorder.Eventf(dq, nil, typ, ev.Reason, "Push", "%s", ev.Message)
		},
	})
	if err != nil {
		return fmt.Errorf("push engine: %w", err)
	}
	if err := mgr.Add(engine); err != nil {
		return err
	}
	if err := controller.SetupIndexes(ctx, mgr.GetFieldIndexer()); err != nil {
		return fmt.Errorf("indexes: %w", err)
	}
	// A member cluster's slices of GlobalQuotas (docs/protocol.md §16): a Member per quota with
	// spec.global, reaching the hub through the Secret it names in the manager's namespace.
	globalChanges := make(chan event.GenericEvent, 1024)
	members := &hubsync.Members{
		Local: mgr.GetClient(), Secrets: mgr.GetAPIReader(), Namespace: o.managerNamespace, Scheme: scheme,
		Clock: clock.RealClock{}, Engine: engine, Changes: globalChanges,
		// The engine's lease window, plus the manager's reaction (a Member's notice, a reconcile).
		Window: o.leaseTTL + o.pushTimeout + push.DefaultAcceptGrace + memberReaction,
	}
	if err := mgr.Add(members); err != nil {
		return err
	}
	if err := (&controller.DownstreamQuotaReconciler{
		Client:        mgr.GetClient(),
		Recorder:      recorder,
		Pusher:        engine,
		Clock:         clock.RealClock{},
		Changes:       quotaChanges,
		Globals:       members,
		GlobalChanges: globalChanges,
		Workers:       o.quotaWorkers,

		StatusWriters: o.statusWriters,
		Registry:      metrics.Registry,

		SharingPeriod: o.sharing.period,
		DemandTau:     o.sharing.tau,
		Damping:       o.sharing.damping,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("DownstreamQuota controller: %w", err)
	}
	// The trust ConfigMap has one name (apportionv1.TrustConfigMap), which the injected pods mount,
	// the manager's RBAC names and the admission policy guards: it is not a flag.
	if err := (&controller.TrustReconciler{
		Client: mgr.GetClient(), Recorder: recorder, Data: keeper.trustData, Changes: trustChanges,
		Namespace: o.watchNamespace,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("trust controller: %w", err)
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
	if o.hub {
		if err := (&hubsync.HubReconciler{
			Client: mgr.GetClient(), Live: mgr.GetAPIReader(), Clock: clock.RealClock{}, Damping: o.sharing.damping,
		}).SetupWithManager(mgr); err != nil {
			return fmt.Errorf("GlobalQuota controller: %w", err)
		}
	}
	if err := mgr.AddHealthzCheck("healthz", healthz.Ping); err != nil {
		return err
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
	// Too old a cluster fails elsewhere (pods refused, the trust guard missing); say so here.
	if dc, err := discovery.NewDiscoveryClientForConfig(mgr.GetConfig()); err != nil {
		setupLog.Error(err, "cannot check the Kubernetes version")
	} else if info, err := dc.ServerVersion(); err != nil {
		setupLog.Error(err, "cannot check the Kubernetes version")
	} else if err := checkServerVersion(info); err != nil {
		setupLog.Error(err, "unsupported Kubernetes version", "version", info.GitVersion, "minimum", minKubernetes)
	} else {
		setupLog.Info("Kubernetes version", "version", info.GitVersion, "minimum", minKubernetes)
	}
	setupLog.Info("starting manager", "managerNamespace", o.managerNamespace, "leaseTTL", o.leaseTTL, "renewEvery", o.renewEvery)
	return mgr.Start(ctx)
}
