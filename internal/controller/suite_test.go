package controller

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// The suite runs the controllers against a real kube-apiserver and etcd (envtest). There is no
// kubelet, deployment or HPA controller: tests write HPA status and create pods themselves, which
// is exactly the control they need to play scale events.
var (
	cfg       *rest.Config
	k8sClient client.Client
	testEnv   *envtest.Environment
	scheme    = runtime.NewScheme()
	cancel    context.CancelFunc
)

func TestControllers(t *testing.T) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: run `make test`, which builds kube-apiserver and etcd (hack/envtest-assets.sh)")
	}
	RegisterFailHandler(Fail)
	RunSpecs(t, "Controller Suite")
}

var _ = BeforeSuite(func() {
	logf.SetLogger(zap.New(zap.WriteTo(GinkgoWriter), zap.UseDevMode(true)))
	Expect(clientgoscheme.AddToScheme(scheme)).To(Succeed())
	Expect(apportionv1.AddToScheme(scheme)).To(Succeed())

	testEnv = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "..", "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
	}
	var err error
	cfg, err = testEnv.Start()
	Expect(err).NotTo(HaveOccurred())

	k8sClient, err = client.New(cfg, client.Options{Scheme: scheme})
	Expect(err).NotTo(HaveOccurred())

	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: scheme, Metrics: metricsserver.Options{BindAddress: "0"}})
	Expect(err).NotTo(HaveOccurred())
	var ctx context.Context
	ctx, cancel = context.WithCancel(context.Background())
	Expect(SetupIndexes(ctx, mgr.GetFieldIndexer())).To(Succeed())
	Expect((&DownstreamQuotaReconciler{
		Client:   mgr.GetClient(),
		Recorder: mgr.GetEventRecorder("apportion-manager"),
		Clock:    clock.RealClock{},
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
	if testEnv != nil {
		Expect(testEnv.Stop()).To(Succeed())
	}
})
