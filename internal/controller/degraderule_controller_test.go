package controller

import (
	"context"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// fakeSwitches plays the push engine's SwitchApplied: tests set what the pods confirmed; a
// switch it was not told about is confirmed by 0 of 0 pods.
type fakeSwitches struct {
	mu     sync.Mutex
	counts map[string][2]int
}

func (f *fakeSwitches) SwitchApplied(name string) (applied, total int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.counts[name]
	return c[0], c[1]
}

func (f *fakeSwitches) set(name string, applied, total int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.counts[name] = [2]int{applied, total}
}

var (
	switchesApplied = &fakeSwitches{counts: map[string][2]int{}}
	// managerClient reads from the manager's cache, with its field indexes, as the controllers do.
	managerClient client.Client
)

func init() {
	extraControllers = append(extraControllers, func(mgr ctrl.Manager) error {
		managerClient = mgr.GetClient()
		return (&DegradeRuleReconciler{
			Client:     mgr.GetClient(),
			Recorder:   mgr.GetEventRecorder("apportion-manager"),
			Clock:      clock.RealClock{},
			Applied:    switchesApplied,
			MaxHorizon: DefaultMaxDegradeHorizon,
		}).SetupWithManager(mgr)
	})
}

// saleRule is the playbook's rule: recommend answers a static empty list to 10 % of users.
func saleRule(ns, name string, expiresAt time.Time) *apportionv1.DegradeRule {
	return builders.MakeDegradeRule(name, ns, "recommend", expiresAt).
		Static(200, map[string]string{"Content-Type": "application/json"}, "[]").
		Reason("sale: recommend saturated, INC-4711").
		Percent(10, "X-User-Id").
		Obj()
}

func getRule(ctx context.Context, ns, name string) func() (*apportionv1.DegradeRule, error) {
	return func() (*apportionv1.DegradeRule, error) {
		var r apportionv1.DegradeRule
		err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &r)
		return &r, err
	}
}

// phaseOf is "<phase>: <message>" of a status that describes the current generation.
func phaseOf(r *apportionv1.DegradeRule) string {
	if r.Status.ObservedGeneration != r.Generation {
		return ""
	}
	return string(r.Status.Phase) + ": " + r.Status.Message
}

func ruleCondition(t string) func(*apportionv1.DegradeRule) string {
	return func(r *apportionv1.DegradeRule) string {
		c := meta.FindStatusCondition(r.Status.Conditions, t)
		if c == nil || c.ObservedGeneration != r.Generation {
			return ""
		}
		return string(c.Status) + "/" + c.Reason
	}
}

// pushedSwitches is what the DownstreamQuota reconciler would hand the push engine for a quota
// now: its own switchesFor over the manager's cache.
func pushedSwitches(ctx context.Context, ns, quotaName string) []string {
	dq := builders.MakeDownstreamQuota(quotaName, ns).Obj()
	sws, err := (&DownstreamQuotaReconciler{Client: managerClient, Clock: clock.RealClock{}}).switchesFor(ctx, dq)
	Expect(err).NotTo(HaveOccurred())
	names := []string{}
	for _, s := range sws {
		names = append(names, s.Switch.Name)
	}
	return names
}

// eventsFor lists "<type> <reason>: <note>" of the Events regarding one object.
func eventsFor(ctx context.Context, ns, name string) func() []string {
	return func() []string {
		var evs eventsv1.EventList
		Expect(k8sClient.List(ctx, &evs, client.InNamespace(ns))).To(Succeed())
		var out []string
		for _, e := range evs.Items {
			if e.Regarding.Name == name {
				out = append(out, e.Type+" "+e.Reason+": "+e.Note)
			}
		}
		return out
	}
}

var _ = Describe("DegradeRule", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})
	recommendQuota := func() *apportionv1.DownstreamQuota {
		return builders.MakeDownstreamQuota("recommend", ns).Limit(200).Target(apportionv1.KindDeployment, "storefront").Obj()
	}

	It("is Pending until every affected pod confirmed it, then Active, and is pushed meanwhile", func() {
		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		switchesApplied.set(ns+"/sale", 0, 3)
		Expect(k8sClient.Create(ctx, saleRule(ns, "sale", time.Now().Add(2*time.Hour)))).To(Succeed())

		Eventually(getRule(ctx, ns, "sale")).Should(SatisfyAll(
			WithTransform(phaseOf, Equal("Pending: 0 of 3 affected pods confirmed it")),
			HaveField("Status.PodsApplied", BeEquivalentTo(0)),
			HaveField("Status.PodsTotal", BeEquivalentTo(3)),
			HaveField("Status.Scope", "10% by X-User-Id"),
			WithTransform(ruleCondition("Valid"), Equal("True/Valid")),
			WithTransform(ruleCondition("Ready"), Equal("False/Pending")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(Equal([]string{ns + "/sale"}))

		switchesApplied.set(ns+"/sale", 2, 3)
		Eventually(getRule(ctx, ns, "sale")).Should(HaveField("Status.PodsApplied", BeEquivalentTo(2)))
		switchesApplied.set(ns+"/sale", 3, 3)
		Eventually(getRule(ctx, ns, "sale")).Should(SatisfyAll(
			WithTransform(phaseOf, HavePrefix("Active: in force until ")),
			HaveField("Status.PodsApplied", BeEquivalentTo(3)),
			HaveField("Status.ActiveSince", Not(BeNil())),
			WithTransform(ruleCondition("Ready"), Equal("True/Active")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(Equal([]string{ns + "/sale"}))
	})

	It("goes Active → Expired at its expiry with an Event, stays on record, and comes back when the expiry is moved", func() {
		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		switchesApplied.set(ns+"/flash", 3, 3)
		// expiresAt has a resolution of one second: this is 2 to 3 seconds ahead.
		expires := time.Now().Add(3 * time.Second).Truncate(time.Second)
		Expect(k8sClient.Create(ctx, saleRule(ns, "flash", expires))).To(Succeed())

		Eventually(getRule(ctx, ns, "flash")).Should(WithTransform(phaseOf, HavePrefix("Active: ")))
		Expect(time.Now()).To(BeTemporally("<", expires), "the rule must be Active before it expires")
		Expect(pushedSwitches(ctx, ns, "recommend")).To(ConsistOf(ns + "/flash"))

		Eventually(getRule(ctx, ns, "flash"), 5*time.Second).Should(SatisfyAll(
			WithTransform(phaseOf, HavePrefix("Expired: expired at "+expires.UTC().Format(time.RFC3339)+"; kept as an audit record")),
			WithTransform(ruleCondition("Ready"), Equal("False/Expired")),
			WithTransform(ruleCondition("Valid"), Equal("True/Valid")),
			HaveField("Status.ActiveSince", Not(BeNil())),
		))
		Expect(time.Now()).To(BeTemporally(">=", expires))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(BeEmpty())
		Eventually(eventsFor(ctx, ns, "flash")).Should(ContainElement(
			"Normal Expired: expired at " + expires.UTC().Format(time.RFC3339) + "; kept as an audit record until deleted (set a future expiresAt to apply it again)"))

		// The audit record stays.
		Consistently(getRule(ctx, ns, "flash"), time.Second, 100*time.Millisecond).Should(WithTransform(phaseOf, HavePrefix("Expired: ")))

		// A new expiry switches it on again.
		r, err := getRule(ctx, ns, "flash")()
		Expect(err).NotTo(HaveOccurred())
		r.Spec.ExpiresAt = metav1.NewTime(time.Now().Add(time.Hour))
		Expect(k8sClient.Update(ctx, r)).To(Succeed())
		Eventually(getRule(ctx, ns, "flash")).Should(SatisfyAll(
			HaveField("Status.ObservedGeneration", BeEquivalentTo(2)),
			WithTransform(phaseOf, HavePrefix("Active: ")),
			WithTransform(ruleCondition("Ready"), Equal("True/Active")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(ConsistOf(ns + "/flash"))
		Eventually(eventsFor(ctx, ns, "flash")).Should(ContainElement(HavePrefix("Normal Activated: degrading recommend for 10% by X-User-Id")))
	})

	It("keeps a switched-off rule Inactive and never pushes it, until it is switched on", func() {
		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		r := saleRule(ns, "standby", time.Now().Add(time.Hour))
		r.Spec.Active = ptr.To(false)
		Expect(k8sClient.Create(ctx, r)).To(Succeed())
		Eventually(getRule(ctx, ns, "standby")).Should(SatisfyAll(
			WithTransform(phaseOf, HavePrefix("Inactive: switched off (spec.active is false)")),
			WithTransform(ruleCondition("Ready"), Equal("False/Inactive")),
			WithTransform(ruleCondition("Valid"), Equal("True/Valid")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(BeEmpty())

		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(r), r)).To(Succeed())
		r.Spec.Active = ptr.To(true)
		Expect(k8sClient.Update(ctx, r)).To(Succeed())
		Eventually(getRule(ctx, ns, "standby")).Should(WithTransform(phaseOf, HavePrefix("Active: ")))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(ConsistOf(ns + "/standby"))
	})

	It("marks a rule created with its expiry already past Invalid and never pushes it", func() {
		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		past := time.Now().Add(-time.Minute).Truncate(time.Second)
		Expect(k8sClient.Create(ctx, saleRule(ns, "late", past))).To(Succeed())
		// From the moment it exists, before and after the controller judged it.
		Expect(pushedSwitches(ctx, ns, "recommend")).To(BeEmpty())
		Eventually(getRule(ctx, ns, "late")).Should(SatisfyAll(
			WithTransform(phaseOf, Equal("Invalid: expiresAt "+past.UTC().Format(time.RFC3339)+
				" was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it")),
			WithTransform(ruleCondition("Valid"), Equal("False/ExpiryPast")),
			WithTransform(ruleCondition("Ready"), Equal("False/Invalid")),
		))
		Consistently(func() []string { return pushedSwitches(ctx, ns, "recommend") }, time.Second, 50*time.Millisecond).Should(BeEmpty())
		Eventually(eventsFor(ctx, ns, "late")).Should(ContainElement(HavePrefix("Warning Invalid: expiresAt ")))
	})

	It("marks a rule that expires beyond the manager's horizon Invalid and never pushes it", func() {
		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		Expect(k8sClient.Create(ctx, saleRule(ns, "forever", time.Now().Add(25*time.Hour)))).To(Succeed())
		Expect(pushedSwitches(ctx, ns, "recommend")).To(BeEmpty())
		Eventually(getRule(ctx, ns, "forever")).Should(SatisfyAll(
			WithTransform(phaseOf, SatisfyAll(
				HavePrefix("Invalid: expiresAt "),
				ContainSubstring("beyond the manager's maximum horizon of 24h (--max-degrade-horizon); set an earlier expiresAt"))),
			WithTransform(ruleCondition("Valid"), Equal("False/BeyondHorizon")),
		))
		Consistently(func() []string { return pushedSwitches(ctx, ns, "recommend") }, 500*time.Millisecond, 50*time.Millisecond).Should(BeEmpty())
	})

	It("reports a rule for a missing DownstreamQuota and applies it once the quota is created", func() {
		Expect(k8sClient.Create(ctx, saleRule(ns, "early", time.Now().Add(time.Hour)))).To(Succeed())
		Eventually(getRule(ctx, ns, "early")).Should(SatisfyAll(
			WithTransform(phaseOf, Equal(`Invalid: DownstreamQuota "recommend" does not exist in namespace "`+ns+`"; the rule is not pushed until it does`)),
			WithTransform(ruleCondition("Valid"), Equal("False/DownstreamNotFound")),
		))

		Expect(k8sClient.Create(ctx, recommendQuota())).To(Succeed())
		Eventually(getRule(ctx, ns, "early")).Should(SatisfyAll(
			WithTransform(phaseOf, HavePrefix("Active: ")),
			WithTransform(ruleCondition("Valid"), Equal("True/Valid")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(ConsistOf(ns + "/early"))

		// And Invalid again when the quota goes away.
		Expect(k8sClient.Delete(ctx, recommendQuota())).To(Succeed())
		Eventually(getRule(ctx, ns, "early")).Should(WithTransform(ruleCondition("Valid"), Equal("False/DownstreamNotFound")))
	})

	It("marks a rule whose target is not one of the quota's Invalid, and valid once the quota lists it", func() {
		dq := recommendQuota()
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())
		r := saleRule(ns, "checkout-only", time.Now().Add(time.Hour))
		r.Spec.Target = &apportionv1.DegradeTarget{Kind: "Deployment", Name: "checkout"}
		Expect(k8sClient.Create(ctx, r)).To(Succeed())
		Eventually(getRule(ctx, ns, "checkout-only")).Should(SatisfyAll(
			WithTransform(phaseOf, Equal(`Invalid: Deployment/checkout is not a target of DownstreamQuota "recommend" (its targets: Deployment/storefront)`)),
			WithTransform(ruleCondition("Valid"), Equal("False/TargetNotFound")),
		))
		Expect(pushedSwitches(ctx, ns, "recommend")).To(BeEmpty())

		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(dq), dq)).To(Succeed())
		dq.Spec.Targets = append(dq.Spec.Targets, apportionv1.Target{Kind: "Deployment", Name: "checkout"})
		Expect(k8sClient.Update(ctx, dq)).To(Succeed())
		Eventually(getRule(ctx, ns, "checkout-only")).Should(WithTransform(phaseOf, HavePrefix("Active: ")))
	})
})

var _ = Describe("DegradeRule admission", func() {
	ctx := context.Background()
	var ns string
	BeforeEach(func() { ns = newNamespace(ctx) })

	// asMap is a valid rule as the unstructured content kubectl would send, so that tests can
	// leave fields out or set values a Go client would omit (percent: 0).
	asMap := func() map[string]any {
		r := saleRule(ns, "r", time.Now().Add(time.Hour))
		r.SetGroupVersionKind(apportionv1.GroupVersion.WithKind("DegradeRule"))
		m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(r)
		Expect(err).NotTo(HaveOccurred())
		delete(m, "status")
		return m
	}

	It("accepts the playbook's rule and fills the defaults", func() {
		r := saleRule(ns, "r", time.Now().Add(time.Hour))
		Expect(k8sClient.Create(ctx, r)).To(Succeed())
		Expect(r.Spec.Active).To(Equal(ptr.To(true)))
		Expect(r.Spec.Action.Static.Status).To(BeEquivalentTo(200))
	})

	DescribeTable("rejects with the field path",
		func(mutate func(spec map[string]any), path, msg string) {
			m := asMap()
			mutate(m["spec"].(map[string]any))
			err := k8sClient.Create(ctx, &unstructured.Unstructured{Object: m})
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(SatisfyAll(ContainSubstring(path), ContainSubstring(msg)))
		},
		Entry("missing reason", func(s map[string]any) { delete(s, "reason") }, "spec.reason", "Required value"),
		Entry("empty reason", func(s map[string]any) { s["reason"] = "" }, "spec.reason", "at least 1 chars long"),
		Entry("missing expiresAt", func(s map[string]any) { delete(s, "expiresAt") }, "spec.expiresAt", "Required value"),
		Entry("percent 0", func(s map[string]any) { s["scope"].(map[string]any)["percent"] = int64(0) },
			"spec.scope.percent", "should be greater than or equal to 1"),
		Entry("percent 101", func(s map[string]any) { s["scope"].(map[string]any)["percent"] = int64(101) },
			"spec.scope.percent", "should be less than or equal to 100"),
		Entry("percent below 100 without keyHeader", func(s map[string]any) { delete(s["scope"].(map[string]any), "keyHeader") },
			"spec.scope.keyHeader", "scope.keyHeader is required when scope.percent is below 100"),
		Entry("keyHeader that is no header name", func(s map[string]any) { s["scope"].(map[string]any)["keyHeader"] = "X User" },
			"spec.scope.keyHeader", "should match"),
		Entry("Static without static", func(s map[string]any) { delete(s["action"].(map[string]any), "static") },
			"spec.action", "static is required when action is Static"),
		Entry("Static with an interim status", func(s map[string]any) {
			s["action"].(map[string]any)["static"].(map[string]any)["status"] = int64(101)
		}, "spec.action.static.status", "should be greater than or equal to 200"),
		Entry("Static 204 with a body", func(s map[string]any) {
			st := s["action"].(map[string]any)["static"].(map[string]any)
			st["status"], st["body"] = int64(204), "x"
		}, "spec.action.static", "a static answer with status 204 or 304 has no body"),
		Entry("unknown action", func(s map[string]any) { s["action"].(map[string]any)["action"] = "Retry" },
			"spec.action.action", "Unsupported value"),
		Entry("missing downstream", func(s map[string]any) { delete(s, "downstream") }, "spec.downstream", "Required value"),
		Entry("unknown method", func(s map[string]any) { s["scope"].(map[string]any)["methods"] = []any{"BREW"} },
			"spec.scope.methods[0]", "Unsupported value"),
	)
})
