package controller

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/apportion/apportion/internal/testing/testenv"
)

// The suite runs the controllers against a real kube-apiserver and etcd (envtest). There is no
// kubelet, deployment or HPA controller: tests write HPA status and create pods themselves, which
// is exactly the control they need to play scale events.
var (
	cfg       *rest.Config
	k8sClient client.Client
	testEnv   *testenv.Env
	scheme    *runtime.Scheme
	cancel    context.CancelFunc
)

func TestControllers(t *testing.T) {
	testenv.SkipWithoutAssets(t)
	RegisterFailHandler(Fail)
	RunSpecs(t, "Controller Suite")
}

var _ = BeforeSuite(func() {
	logf.SetLogger(zap.New(zap.WriteTo(GinkgoWriter), zap.UseDevMode(true)))
	var err error
	testEnv, err = testenv.Start(testenv.Options{})
	Expect(err).NotTo(HaveOccurred())
	cfg, k8sClient, scheme = testEnv.Config, testEnv.Client, testEnv.Scheme

	// The manager's own cache (stripped objects), so that the controllers run here on what they
	// get in production.
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: scheme, Metrics: metricsserver.Options{BindAddress: "0"}, Cache: CacheOptions()})
	Expect(err).NotTo(HaveOccurred())
	var ctx context.Context
	ctx, cancel = context.WithCancel(context.Background())
	Expect(SetupIndexes(ctx, mgr.GetFieldIndexer())).To(Succeed())
	// The suite's reconciler hands its statuses to a StatusWriter, as the manager's does;
	// reconcilers made by a test and called directly write them themselves.
	Expect((&DownstreamQuotaReconciler{
		Client:        mgr.GetClient(),
		Recorder:      mgr.GetEventRecorder("apportion-manager"),
		Clock:         clock.RealClock{},
		StatusWriters: 4,
	}).SetupWithManager(mgr)).To(Succeed())
	for _, setup := range extraControllers {
		Expect(setup(mgr)).To(Succeed())
	}
	go func() {
		defer GinkgoRecover()
		Expect(mgr.Start(ctx)).To(Succeed())
	}()
	SetDefaultEventuallyTimeout(10 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
})

// extraControllers lets other files of the suite register their reconcilers.
var extraControllers []func(ctrl.Manager) error

var _ = AfterSuite(func() {
	if cancel != nil {
		cancel()
	}
	Expect(testEnv.Stop()).To(Succeed())
})
