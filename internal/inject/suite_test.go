package inject

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/apportion/apportion/internal/testing/testenv"
)

// The suite serves the injector from a controller-runtime webhook server behind a real
// kube-apiserver (envtest), which calls it through the MutatingWebhookConfiguration of
// config/webhook/manifests.yaml — the generated file the installer ships — rewritten by envtest
// to a local URL with a CA of its own. There is no ReplicaSet controller: tests create pods as
// it would.
var (
	cfg       *rest.Config
	k8sClient client.Client
	testEnv   *testenv.Env
	scheme    *runtime.Scheme
	cancel    context.CancelFunc
)

func TestWebhook(t *testing.T) {
	testenv.SkipWithoutAssets(t)
	RegisterFailHandler(Fail)
	RunSpecs(t, "Injection webhook suite")
}

var _ = BeforeSuite(func() {
	logf.SetLogger(zap.New(zap.WriteTo(GinkgoWriter), zap.UseDevMode(true)))
	var err error
	testEnv, err = testenv.Start(testenv.Options{Webhooks: true})
	Expect(err).NotTo(HaveOccurred())
	cfg, k8sClient, scheme = testEnv.Config, testEnv.Client, testEnv.Scheme
	Expect(testEnv.Environment.WebhookInstallOptions.MutatingWebhooks).To(HaveLen(1), "config/webhook/manifests.yaml holds one MutatingWebhookConfiguration")

	wo := &testEnv.Environment.WebhookInstallOptions
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:  scheme,
		Metrics: metricsserver.Options{BindAddress: "0"},
		WebhookServer: webhook.NewServer(webhook.Options{
			Host: wo.LocalServingHost, Port: wo.LocalServingPort, CertDir: wo.LocalServingCertDir,
		}),
	})
	Expect(err).NotTo(HaveOccurred())
	mgr.GetWebhookServer().Register(Path, &webhook.Admission{Handler: &Webhook{
		Reader:  mgr.GetClient(),
		Live:    mgr.GetAPIReader(),
		Config:  testConfig(),
		Decoder: admission.NewDecoder(mgr.GetScheme()),
	}})
	var ctx context.Context
	ctx, cancel = context.WithCancel(context.Background())
	go func() {
		defer GinkgoRecover()
		Expect(mgr.Start(ctx)).To(Succeed())
	}()
	// The server answers TLS once started.
	addr := net.JoinHostPort(wo.LocalServingHost, strconv.Itoa(wo.LocalServingPort))
	Eventually(func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err
	}).WithTimeout(30 * time.Second).Should(Succeed())
	SetDefaultEventuallyTimeout(10 * time.Second)
	SetDefaultEventuallyPollingInterval(20 * time.Millisecond)
})

var _ = AfterSuite(func() {
	if cancel != nil {
		cancel()
	}
	Expect(testEnv.Stop()).To(Succeed())
})
