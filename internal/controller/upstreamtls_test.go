package controller

import (
	"context"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

var _ = Describe("DownstreamQuota upstreamTLS", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})
	quota := func(name string, t *apportionv1.UpstreamTLS) *apportionv1.DownstreamQuota {
		q := builders.MakeDownstreamQuota(name, ns).Limit(10).Target(apportionv1.KindDeployment, "gateway").Obj()
		q.Spec.UpstreamTLS = t
		return q
	}

	It("defaults minVersion and the CA key, and the agent gets the mounted files' paths", func() {
		Expect(k8sClient.Create(ctx, quota("partner", &apportionv1.UpstreamTLS{
			ServerName:        "api.partner.example",
			CABundle:          &apportionv1.ConfigMapKey{Name: "partner-ca"},
			ClientCertificate: &apportionv1.SecretName{Name: "partner-client"},
		}))).To(Succeed())
		dq, err := getQuota(ctx, ns, "partner")()
		Expect(err).NotTo(HaveOccurred())
		Expect(dq.Spec.UpstreamTLS.MinVersion).To(Equal(apportionv1.TLSVersion12))
		Expect(dq.Spec.UpstreamTLS.CABundle.Key).To(Equal("ca.crt"))
		d := downstreamTemplate(dq)
		Expect(d.TLS).To(Equal(&assignment.UpstreamTLS{
			ServerName: "api.partner.example", MinVersion: "1.2",
			CAFile:   "/var/run/apportion/upstream-tls/partner/ca.crt",
			CertFile: "/var/run/apportion/upstream-tls/partner/tls.crt",
			KeyFile:  "/var/run/apportion/upstream-tls/partner/tls.key",
		}))
		d.Permits, d.SafeDefaultPermits = 5, 2
		a := assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(time.Second), Downstreams: []assignment.Downstream{d}}
		Expect(a.Validate()).To(Succeed())
		Eventually(getQuota(ctx, ns, "partner")).Should(WithTransform(condition(apportionv1.ConditionUpstreamTLSVerified),
			HavePrefix("True: ")))
		// A quota without the block sends none (older agents refuse the field) and has no condition.
		Expect(k8sClient.Create(ctx, quota("plain", nil))).To(Succeed())
		plain, err := getQuota(ctx, ns, "plain")()
		Expect(err).NotTo(HaveOccurred())
		Expect(downstreamTemplate(plain).TLS).To(BeNil())
	})

	It("says loudly that verification is off", func() {
		Expect(k8sClient.Create(ctx, quota("bench", &apportionv1.UpstreamTLS{InsecureSkipVerifyDangerous: true}))).To(Succeed())
		Eventually(getQuota(ctx, ns, "bench")).Should(WithTransform(condition(apportionv1.ConditionUpstreamTLSVerified),
			HavePrefix("False: insecureSkipVerifyDangerous is set")))
		Eventually(eventsFor(ctx, ns, "bench")).Should(ContainElement(HavePrefix("Warning VerificationDisabled: insecureSkipVerifyDangerous is set")))
		dq, err := getQuota(ctx, ns, "bench")()
		Expect(err).NotTo(HaveOccurred())
		Expect(downstreamTemplate(dq).TLS).To(Equal(&assignment.UpstreamTLS{MinVersion: "1.2", InsecureSkipVerify: true}))
	})

	It("refuses what cannot be meant, naming each field", func() {
		q := quota("partner", &apportionv1.UpstreamTLS{ServerName: "x"})
		q.Spec.Upstream = "http://api.partner.example"
		err := k8sClient.Create(ctx, q)
		Expect(err).To(HaveOccurred())
		Expect(err.Error()).To(ContainSubstring("spec.upstreamTLS: Invalid value"))
		Expect(err.Error()).To(ContainSubstring("upstreamTLS applies to an https upstream only"))

		err = k8sClient.Create(ctx, quota("partner", &apportionv1.UpstreamTLS{
			ServerName:        "Partner_API",
			CABundle:          &apportionv1.ConfigMapKey{Name: "Partner CA", Key: "ca/crt"},
			ClientCertificate: &apportionv1.SecretName{Name: "-client"},
			MinVersion:        "1.1",
		}))
		Expect(err).To(HaveOccurred())
		for _, want := range []string{
			`spec.upstreamTLS.minVersion: Unsupported value: "1.1"`,
		} {
			Expect(err.Error()).To(ContainSubstring(want))
		}
		err = k8sClient.Create(ctx, quota("partner", &apportionv1.UpstreamTLS{
			ServerName:        "Partner_API",
			CABundle:          &apportionv1.ConfigMapKey{Name: "Partner CA", Key: "ca/crt"},
			ClientCertificate: &apportionv1.SecretName{Name: "-client"},
		}))
		Expect(err).To(HaveOccurred())
		for _, want := range []string{
			"spec.upstreamTLS.serverName: Invalid value",
			"serverName must be a lower-case DNS name or an IP address",
			"spec.upstreamTLS.caBundle.name: Invalid value",
			"spec.upstreamTLS.caBundle.key: Invalid value",
			"spec.upstreamTLS.clientCertificate.name: Invalid value",
			"name must be a DNS-1123 subdomain",
		} {
			Expect(err.Error()).To(ContainSubstring(want))
		}
		err = k8sClient.Create(ctx, quota("partner", &apportionv1.UpstreamTLS{
			InsecureSkipVerifyDangerous: true,
			CABundle:                    &apportionv1.ConfigMapKey{Name: "partner-ca"},
		}))
		Expect(err).To(HaveOccurred())
		Expect(err.Error()).To(ContainSubstring("spec.upstreamTLS.caBundle: Invalid value"))
		Expect(err.Error()).To(ContainSubstring("caBundle has no use with insecureSkipVerifyDangerous"))
		// An IP address is a server name.
		Expect(k8sClient.Create(ctx, quota("partner", &apportionv1.UpstreamTLS{ServerName: "10.0.0.7"}))).To(Succeed())
	})
})
