package controller

import (
	"context"
	"fmt"
	"math/rand"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/randfill"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/inject"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/targets"
	"github.com/apportion/apportion/internal/testing/builders"
)

// The cache's transforms (cache.go) must keep every field a reader of the cache uses. The test
// builds random worlds — a namespace, two workloads, HPAs and pods, every field filled with
// random values and the fields the readers care about drawn from small sets, so that matches and
// mismatches both occur — and runs every reader of the stripped kinds on the world as the API
// server returns it and on the world as the cache keeps it: each reading must be the same. The
// random values in the fields the transforms drop make a reader that starts to read one of
// them see a difference. TestStripFieldsAreRead checks the converse for each field kept: without
// it some reading differs, so the comparison can fail and the field is not kept for nothing.

const stripSeeds = 300

func TestStripKeepsWhatReadersRead(t *testing.T) {
	for seed := range int64(stripSeeds) {
		orig := randomWorld(seed)
		want, got := orig.read(t), orig.strip(nil).read(t)
		if !reflect.DeepEqual(want, got) {
			d := cmp.Diff(want, got, cmp.Exporter(func(reflect.Type) bool { return true }))
			t.Fatalf("seed %d: the readers see the stripped world differently (-original +stripped):\n%s", seed, d)
		}
	}
}

// TestStripFieldsAreRead removes each field the transforms keep, one at a time, from the
// stripped world: some reading must differ from the original's.
func TestStripFieldsAreRead(t *testing.T) {
	for name, breaker := range map[string]func(client.Object){
		"pod metadata.name":              pod(func(p *corev1.Pod) { p.Name = "" }),
		"pod metadata.namespace":         pod(func(p *corev1.Pod) { p.Namespace = "" }),
		"pod metadata.uid":               pod(func(p *corev1.Pod) { p.UID = "" }),
		"pod metadata.creationTimestamp": pod(func(p *corev1.Pod) { p.CreationTimestamp = metav1.Time{} }),
		"pod metadata.deletionTimestamp": pod(func(p *corev1.Pod) { p.DeletionTimestamp = nil }),
		"pod metadata.labels":            pod(func(p *corev1.Pod) { p.Labels = nil }),
		"pod agent-port annotation":      pod(func(p *corev1.Pod) { p.Annotations = nil }),
		"pod container ports":            pod(func(p *corev1.Pod) { forContainers(p, func(c *corev1.Container) { c.Ports = nil }) }),
		"pod container name":             pod(func(p *corev1.Pod) { forContainers(p, func(c *corev1.Container) { c.Name = "" }) }),
		"pod container command":          pod(func(p *corev1.Pod) { forContainers(p, func(c *corev1.Container) { c.Command = nil }) }),
		"pod container args":             pod(func(p *corev1.Pod) { forContainers(p, func(c *corev1.Container) { c.Args = nil }) }),
		"pod init container restartPolicy": pod(func(p *corev1.Pod) {
			for i := range p.Spec.InitContainers {
				p.Spec.InitContainers[i].RestartPolicy = nil
			}
		}),
		"pod status.phase":                pod(func(p *corev1.Pod) { p.Status.Phase = "" }),
		"pod status.podIP":                pod(func(p *corev1.Pod) { p.Status.PodIP = "" }),
		"deployment metadata.generation":  deployment(func(d *appsv1.Deployment) { d.Generation = 0 }),
		"deployment deletionTimestamp":    deployment(func(d *appsv1.Deployment) { d.DeletionTimestamp = nil }),
		"deployment spec.replicas":        deployment(func(d *appsv1.Deployment) { d.Spec.Replicas = nil }),
		"deployment spec.selector":        deployment(func(d *appsv1.Deployment) { d.Spec.Selector = nil }),
		"statefulset metadata.generation": statefulSet(func(s *appsv1.StatefulSet) { s.Generation = 0 }),
		"statefulset deletionTimestamp":   statefulSet(func(s *appsv1.StatefulSet) { s.DeletionTimestamp = nil }),
		"statefulset spec.replicas":       statefulSet(func(s *appsv1.StatefulSet) { s.Spec.Replicas = nil }),
		"statefulset spec.selector":       statefulSet(func(s *appsv1.StatefulSet) { s.Spec.Selector = nil }),
		"hpa metadata.name":               hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) { h.Name = "" }),
		"hpa metadata.creationTimestamp":  hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) { h.CreationTimestamp = metav1.Time{} }),
		"hpa spec.scaleTargetRef": hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) {
			h.Spec.ScaleTargetRef = autoscalingv2.CrossVersionObjectReference{}
		}),
		"hpa spec.maxReplicas":       hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) { h.Spec.MaxReplicas = 0 }),
		"hpa status.desiredReplicas": hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) { h.Status.DesiredReplicas = 0 }),
		"hpa status.currentReplicas": hpa(func(h *autoscalingv2.HorizontalPodAutoscaler) { h.Status.CurrentReplicas = 0 }),
		"namespace injection label":  namespace(func(ns *corev1.Namespace) { ns.Labels = nil }),
	} {
		t.Run(name, func(t *testing.T) {
			for seed := range int64(stripSeeds) {
				orig := randomWorld(seed)
				if !reflect.DeepEqual(orig.read(t), orig.strip(breaker).read(t)) {
					return
				}
			}
			t.Fatalf("no reading changed without %s in %d random worlds: either no reader uses it (then strip it) or the worlds never exercise it", name, stripSeeds)
		})
	}
}

func TestStripIsIdempotentAndLeavesOtherKinds(t *testing.T) {
	for seed := range int64(stripSeeds) {
		w := randomWorld(seed)
		for _, o := range w.objects() {
			once := mustStrip(t, o)
			twice := mustStrip(t, once)
			if !reflect.DeepEqual(once, twice) {
				d := cmp.Diff(once, twice, cmp.Exporter(func(reflect.Type) bool { return true }))
				t.Fatalf("seed %d: stripping a stripped %T changed it:\n%s", seed, o, d)
			}
		}
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "x", Annotations: map[string]string{"a": "b"}}}
	for _, f := range []func(any) (any, error){StripPod, StripWorkload, StripHPA, StripNamespace} {
		if out, err := f(cm); err != nil || out != any(cm) {
			t.Fatalf("a ConfigMap was not passed through unchanged: %v, %v", out, err)
		}
	}
}

// TestCacheOptionsStripTheWatchedKinds checks that the manager's cache uses the transforms.
func TestCacheOptionsStripTheWatchedKinds(t *testing.T) {
	opts := CacheOptions()
	want := map[reflect.Type]func(any) (any, error){
		reflect.TypeFor[*corev1.Pod]():                            StripPod,
		reflect.TypeFor[*appsv1.Deployment]():                     StripWorkload,
		reflect.TypeFor[*appsv1.StatefulSet]():                    StripWorkload,
		reflect.TypeFor[*autoscalingv2.HorizontalPodAutoscaler](): StripHPA,
		reflect.TypeFor[*corev1.Namespace]():                      StripNamespace,
	}
	for o, bo := range opts.ByObject {
		f, ok := want[reflect.TypeOf(o)]
		if !ok {
			continue
		}
		delete(want, reflect.TypeOf(o))
		if bo.Transform == nil || reflect.ValueOf(bo.Transform).Pointer() != reflect.ValueOf(f).Pointer() {
			t.Errorf("%T is cached with the wrong transform", o)
		}
	}
	if len(want) > 0 {
		t.Errorf("kinds cached without their transform: %v", want)
	}
	if opts.DefaultTransform == nil {
		t.Error("no default transform: every other kind keeps its managed fields")
	}
}

func mustStrip(t *testing.T, o client.Object) client.Object {
	t.Helper()
	var out any
	var err error
	switch o.(type) {
	case *corev1.Pod:
		out, err = StripPod(o)
	case *appsv1.Deployment, *appsv1.StatefulSet:
		out, err = StripWorkload(o)
	case *autoscalingv2.HorizontalPodAutoscaler:
		out, err = StripHPA(o)
	case *corev1.Namespace:
		out, err = StripNamespace(o)
	default:
		return o
	}
	if err != nil {
		t.Fatal(err)
	}
	return out.(client.Object)
}

func pod(f func(*corev1.Pod)) func(client.Object) {
	return func(o client.Object) {
		if p, ok := o.(*corev1.Pod); ok {
			f(p)
		}
	}
}

func deployment(f func(*appsv1.Deployment)) func(client.Object) {
	return func(o client.Object) {
		if d, ok := o.(*appsv1.Deployment); ok {
			f(d)
		}
	}
}

func statefulSet(f func(*appsv1.StatefulSet)) func(client.Object) {
	return func(o client.Object) {
		if s, ok := o.(*appsv1.StatefulSet); ok {
			f(s)
		}
	}
}

func hpa(f func(*autoscalingv2.HorizontalPodAutoscaler)) func(client.Object) {
	return func(o client.Object) {
		if h, ok := o.(*autoscalingv2.HorizontalPodAutoscaler); ok {
			f(h)
		}
	}
}

func namespace(f func(*corev1.Namespace)) func(client.Object) {
	return func(o client.Object) {
		if ns, ok := o.(*corev1.Namespace); ok {
			f(ns)
		}
	}
}

func forContainers(p *corev1.Pod, f func(*corev1.Container)) {
	for i := range p.Spec.Containers {
		f(&p.Spec.Containers[i])
	}
	for i := range p.Spec.InitContainers {
		f(&p.Spec.InitContainers[i])
	}
}

// world is what the cache holds of one namespace, twice over: next is the same objects at a
// later moment (for the update predicates).
type world struct {
	ns        *corev1.Namespace
	workloads []client.Object // Deployment "app", StatefulSet "db"
	hpas      []*autoscalingv2.HorizontalPodAutoscaler
	pods      []*corev1.Pod
	next      *world
}

const worldNS = "w"

func (w *world) objects() []client.Object {
	out := []client.Object{w.ns}
	out = append(out, w.workloads...)
	for _, h := range w.hpas {
		out = append(out, h)
	}
	for _, p := range w.pods {
		out = append(out, p)
	}
	return out
}

// strip is the world as the cache keeps it, with breaker (if any) applied to every stripped object.
func (w *world) strip(breaker func(client.Object)) *world {
	s := func(o client.Object) client.Object {
		var v any
		var err error
		switch o.(type) {
		case *corev1.Pod:
			v, err = StripPod(o.DeepCopyObject())
		case *appsv1.Deployment, *appsv1.StatefulSet:
			v, err = StripWorkload(o.DeepCopyObject())
		case *autoscalingv2.HorizontalPodAutoscaler:
			v, err = StripHPA(o.DeepCopyObject())
		case *corev1.Namespace:
			v, err = StripNamespace(o.DeepCopyObject())
		}
		if err != nil {
			panic(err)
		}
		c := v.(client.Object)
		if breaker != nil {
			breaker(c)
		}
		return c
	}
	out := &world{ns: s(w.ns).(*corev1.Namespace)}
	for _, o := range w.workloads {
		out.workloads = append(out.workloads, s(o))
	}
	for _, h := range w.hpas {
		out.hpas = append(out.hpas, s(h).(*autoscalingv2.HorizontalPodAutoscaler))
	}
	for _, p := range w.pods {
		out.pods = append(out.pods, s(p).(*corev1.Pod))
	}
	if w.next != nil {
		out.next = w.next.strip(breaker)
	}
	return out
}

// The quotas of the world's namespace, the same in both worlds (they are not stripped): one
// over both workloads (the StatefulSet's HPA named, with a rate contract so that the rate shares
// are computed too), one over a Deployment that does not exist.
func worldQuotas() []*apportionv1.DownstreamQuota {
	return []*apportionv1.DownstreamQuota{
		builders.MakeDownstreamQuota("dq", worldNS).Limit(100).Factor(80).Rate(40, 8).Targets(
			apportionv1.Target{Kind: apportionv1.KindDeployment, Name: "app"},
			apportionv1.Target{Kind: apportionv1.KindStatefulSet, Name: "db", HPAName: "db-hpa", Weight: 2},
		).Obj(),
		builders.MakeDownstreamQuota("gone", worldNS).Limit(10).Target(apportionv1.KindDeployment, "missing").Obj(),
	}
}

// readings is everything the readers of the stripped kinds derive from a world.
type readings struct {
	Observed        []string // per target of "dq": found, spec replicas, HPA, replicas, max replicas
	Desired         push.DesiredQuota
	Status          apportionv1.DownstreamQuotaStatus
	Workloads       []string // targets.Get of each workload
	PodQuotas       [][]string
	HPAQuotas       [][]string
	WorkloadQuotas  [][]string
	PodChanged      []bool
	WorkloadChanged []bool
	TrustWanted     bool
}

func (w *world) read(t *testing.T) readings {
	t.Helper()
	ctx := context.Background()
	c := newMemClient(t)
	for _, dq := range worldQuotas() {
		c.add(dq)
	}
	for _, o := range w.objects()[1:] {
		c.add(o)
	}
	r := &DownstreamQuotaReconciler{Client: c}
	var out readings
	dq := worldQuotas()[0]
	obs := make([]targetObservation, len(dq.Spec.Targets))
	for i, tg := range dq.Spec.Targets {
		o, err := r.observe(ctx, worldNS, tg)
		if err != nil {
			t.Fatal(err)
		}
		obs[i] = o
		out.Observed = append(out.Observed, fmt.Sprintf("found=%v spec=%d hpa=%+v replicas=%d max=%d",
			o.Found, o.SpecReplicas, o.HPA, o.replicas(), o.maxReplicas()))
	}
	split := splitFor(dq, obs, 0)
	out.Desired = desiredQuota(dq, obs, split, nil)
	out.Status = computeStatus(dq, obs, split, nil, metav1.NewTime(time.Unix(1e9, 0)))
	for _, tg := range []apportionv1.Target{{Kind: apportionv1.KindDeployment, Name: "app"}, {Kind: apportionv1.KindStatefulSet, Name: "db"}} {
		wl, err := targets.Get(ctx, c, worldNS, tg)
		if err != nil {
			t.Fatal(err)
		}
		out.Workloads = append(out.Workloads, fmt.Sprintf("exists=%v terminating=%v replicas=%d selector=%v",
			wl.Exists, wl.Terminating, wl.SpecReplicas, wl.Selector))
	}
	names := func(reqs []reconcile.Request) []string {
		var s []string
		for _, q := range reqs {
			s = append(s, q.String())
		}
		return s
	}
	for _, p := range w.pods {
		out.PodQuotas = append(out.PodQuotas, names(r.quotasForPod(ctx, p)))
	}
	for _, h := range w.hpas {
		out.HPAQuotas = append(out.HPAQuotas, names(r.quotasForHPA(ctx, h)))
	}
	for i, o := range w.workloads {
		kind := []apportionv1.WorkloadKind{apportionv1.KindDeployment, apportionv1.KindStatefulSet}[i]
		out.WorkloadQuotas = append(out.WorkloadQuotas, names(r.quotasForWorkload(kind)(ctx, o)))
	}
	if w.next != nil {
		for i := range min(len(w.pods), len(w.next.pods)) {
			out.PodChanged = append(out.PodChanged, podChanged{}.Update(event.UpdateEvent{ObjectOld: w.pods[i], ObjectNew: w.next.pods[i]}))
		}
		for i := range w.workloads {
			out.WorkloadChanged = append(out.WorkloadChanged, workloadChanged{}.Update(event.UpdateEvent{ObjectOld: w.workloads[i], ObjectNew: w.next.workloads[i]}))
		}
	}
	// Without quotas in the namespace, so that the label decides.
	wanted, err := (&TrustReconciler{Client: newMemClient(t)}).wanted(ctx, w.ns)
	if err != nil {
		t.Fatal(err)
	}
	out.TrustWanted = wanted
	return out
}

// randomWorld fills every field of every object at random, then draws the fields the readers
// care about from small sets. Its next world is drawn from the same sets, so that the update
// predicates see both changes and no changes.
func randomWorld(seed int64) *world {
	w := randomMoment(seed, 0)
	w.next = randomMoment(seed, 1)
	return w
}

func randomMoment(seed int64, moment int64) *world {
	rng := rand.New(rand.NewSource(seed*2 + moment))
	fill := randfill.New().RandSource(rand.NewSource(seed*7+moment)).NilChance(0.3).NumElements(1, 2).MaxDepth(6).Funcs(
		func(q *resource.Quantity, c randfill.Continue) {
			*q = *resource.NewQuantity(c.Int63n(1000), resource.DecimalSI)
		},
	)
	pick := func(choices ...string) string { return choices[rng.Intn(len(choices))] }
	maybe := func(p float64) bool { return rng.Float64() < p }
	at := func() metav1.Time { return metav1.NewTime(time.Unix(1e9+rng.Int63n(4), 0)) }
	meta := func(m *metav1.ObjectMeta, name string) {
		m.Namespace, m.Name = worldNS, name
		m.Generation = rng.Int63n(2) + 1
		m.CreationTimestamp = at()
		m.DeletionTimestamp, m.Finalizers = nil, nil
		if maybe(0.2) {
			m.DeletionTimestamp, m.Finalizers = ptr.To(at()), []string{"example.com/f"}
		}
	}
	w := &world{}

	w.ns = &corev1.Namespace{}
	fill.Fill(w.ns)
	meta(&w.ns.ObjectMeta, "")
	w.ns.Namespace, w.ns.Name = "", worldNS
	if w.ns.Labels == nil {
		w.ns.Labels = map[string]string{}
	}
	if maybe(0.5) {
		w.ns.Labels[apportionv1.InjectionLabel] = pick(apportionv1.InjectionEnabled, "disabled")
	}

	selector := func() *metav1.LabelSelector {
		switch rng.Intn(4) {
		case 0:
			return nil
		case 1:
			return &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "app", Operator: metav1.LabelSelectorOpIn, Values: []string{"app", "db"}}}}
		default:
			return &metav1.LabelSelector{MatchLabels: map[string]string{"app": pick("app", "db")}}
		}
	}
	replicas := func() *int32 {
		if maybe(0.2) {
			return nil
		}
		return ptr.To(rng.Int31n(5))
	}
	d := &appsv1.Deployment{}
	fill.Fill(d)
	meta(&d.ObjectMeta, "app")
	d.Spec.Selector, d.Spec.Replicas = selector(), replicas()
	s := &appsv1.StatefulSet{}
	fill.Fill(s)
	meta(&s.ObjectMeta, "db")
	s.Spec.Selector, s.Spec.Replicas = selector(), replicas()
	w.workloads = []client.Object{d, s}

	for i := range rng.Intn(4) {
		h := &autoscalingv2.HorizontalPodAutoscaler{}
		fill.Fill(h)
		meta(&h.ObjectMeta, pick("app-hpa", "db-hpa", "other")+fmt.Sprint("-", i))
		if maybe(0.5) {
			h.Name = pick("app-hpa", "db-hpa") // the named HPA, or a second one for the same target
		}
		h.Spec.ScaleTargetRef = autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1",
			Kind: pick("Deployment", "StatefulSet"), Name: pick("app", "db")}
		h.Spec.MaxReplicas = rng.Int31n(8) + 1
		h.Status.DesiredReplicas, h.Status.CurrentReplicas = rng.Int31n(8), rng.Int31n(8)
		if !slicesContainsHPA(w.hpas, h.Name) {
			w.hpas = append(w.hpas, h)
		}
	}

	for i := range rng.Intn(8) {
		p := &corev1.Pod{}
		fill.Fill(p)
		meta(&p.ObjectMeta, fmt.Sprintf("pod-%d", i))
		p.UID = types.UID(fmt.Sprintf("uid-%d-%d", i, rng.Intn(2)))
		p.Labels = map[string]string{"app": pick("app", "db", "other")}
		if maybe(0.3) {
			p.Labels["tier"] = pick("a", "b")
		}
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		if maybe(0.6) {
			p.Annotations[apportionv1.AgentPortAnnotation] = pick("15000", "15001", "ctl", "0", "70000")
		}
		for j := range p.Spec.Containers {
			randomAgentBits(rng, &p.Spec.Containers[j])
		}
		for j := range p.Spec.InitContainers {
			c := &p.Spec.InitContainers[j]
			randomAgentBits(rng, c)
			switch rng.Intn(3) {
			case 0:
				c.RestartPolicy = ptr.To(corev1.ContainerRestartPolicyAlways)
			case 1:
				c.RestartPolicy = nil
			}
		}
		p.Status.Phase = corev1.PodPhase(pick("", "Pending", "Running", "Running", "Succeeded", "Failed", "Unknown"))
		p.Status.PodIP = pick("", "10.0.0.1", "10.0.0.2", "fd00::1")
		w.pods = append(w.pods, p)
	}
	return w
}

// randomAgentBits draws a container's ports and words from sets that may or may not make it an
// agent.
func randomAgentBits(rng *rand.Rand, c *corev1.Container) {
	if rng.Intn(3) == 0 {
		c.Name = apportionv1.AgentContainerName // the injected (or a hand-written) agent's name
	}
	names := []string{apportionv1.AgentPortName, apportionv1.AgentPortName, "http", ""}
	for i := range c.Ports {
		c.Ports[i].Name = names[rng.Intn(len(names))]
		c.Ports[i].ContainerPort = []int32{0, 15000, 15002, 8080}[rng.Intn(4)]
	}
	words := []string{"/agent", "--bootstrap", "--bootstrap=/b.json", "-bootstrap", "bootstrap", "--listen=:1", "--bootstrap-x", "serve"}
	for _, l := range []*[]string{&c.Command, &c.Args} {
		for i := range *l {
			(*l)[i] = words[rng.Intn(len(words))]
		}
	}
}

func slicesContainsHPA(hs []*autoscalingv2.HorizontalPodAutoscaler, name string) bool {
	for _, h := range hs {
		if h.Name == name {
			return true
		}
	}
	return false
}

// memClient is a client.Client that answers Get and List from objects in memory, like the
// manager's cache: deep copies, namespace and label selectors, and the field indexes
// SetupIndexes registers (their functions, run on each object). Nothing else is used.
type memClient struct {
	client.Client
	objs    []client.Object
	indexes map[string]client.IndexerFunc // by "<Go type>/<field>"
}

func newMemClient(t *testing.T) *memClient {
	c := &memClient{indexes: map[string]client.IndexerFunc{}}
	if err := SetupIndexes(context.Background(), indexRecorder{c}); err != nil {
		t.Fatal(err)
	}
	return c
}

type indexRecorder struct{ c *memClient }

func (r indexRecorder) IndexField(_ context.Context, o client.Object, field string, f client.IndexerFunc) error {
	r.c.indexes[fmt.Sprintf("%T/%s", o, field)] = f
	return nil
}

func (c *memClient) add(o client.Object) { c.objs = append(c.objs, o) }

func (c *memClient) Get(_ context.Context, key client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	for _, o := range c.objs {
		if reflect.TypeOf(o) == reflect.TypeOf(obj) && o.GetNamespace() == key.Namespace && o.GetName() == key.Name {
			reflect.ValueOf(obj).Elem().Set(reflect.ValueOf(o.DeepCopyObject()).Elem())
			return nil
		}
	}
	return apierrors.NewNotFound(schema.GroupResource{}, key.Name)
}

func (c *memClient) List(_ context.Context, list client.ObjectList, opts ...client.ListOption) error {
	lo := (&client.ListOptions{}).ApplyOptions(opts)
	items := reflect.ValueOf(list).Elem().FieldByName("Items")
	elem := reflect.PointerTo(items.Type().Elem())
	for _, o := range c.objs {
		if reflect.TypeOf(o) != elem || (lo.Namespace != "" && o.GetNamespace() != lo.Namespace) {
			continue
		}
		if lo.LabelSelector != nil && !lo.LabelSelector.Matches(labels.Set(o.GetLabels())) {
			continue
		}
		if lo.FieldSelector != nil && !c.fieldsMatch(o, lo) {
			continue
		}
		items.Set(reflect.Append(items, reflect.ValueOf(o.DeepCopyObject()).Elem()))
	}
	return nil
}

func (c *memClient) fieldsMatch(o client.Object, lo *client.ListOptions) bool {
	for _, req := range lo.FieldSelector.Requirements() {
		f, ok := c.indexes[fmt.Sprintf("%T/%s", o, req.Field)]
		if !ok {
			panic("no index " + req.Field)
		}
		found := false
		for _, v := range f(o) {
			found = found || v == req.Value
		}
		if !found {
			return false
		}
	}
	return true
}

// BenchmarkStripPodRetained reports what the cache keeps of a typical injected pod (an app
// container with environment, resources, probes and mounts, the agent as a native sidecar, a
// Deployment's labels and owner, a kubelet's status), with its managed fields already dropped
// as before: the heap bytes per pod after a collection, unstripped and stripped.
func BenchmarkStripPodRetained(b *testing.B) {
	for _, strip := range []bool{false, true} {
		b.Run(fmt.Sprintf("stripped=%v", strip), func(b *testing.B) {
			const n = 2000
			var ms0, ms1 runtime.MemStats
			for range b.N {
				keep := make([]any, n)
				runtime.GC()
				runtime.ReadMemStats(&ms0)
				for i := range keep {
					p := typicalPod(i)
					if strip {
						keep[i], _ = StripPod(p)
					} else {
						keep[i] = p
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&ms1)
				runtime.KeepAlive(keep)
			}
			b.ReportMetric(float64(ms1.HeapAlloc-ms0.HeapAlloc)/n, "B/pod")
		})
	}
}

// typicalPod is a Deployment's pod after injection, as the API server returns it.
func typicalPod(i int) *corev1.Pod {
	now := metav1.NewTime(time.Unix(1e9, 0))
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt32(8080)}}, PeriodSeconds: 10}
	app := corev1.Container{
		Name: "gateway", Image: "registry.example.com/shop/gateway:v1.42.3", Args: []string{"--config=/etc/gateway/config.yaml", "--log-level=info"},
		Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("256Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
		},
		LivenessProbe: probe, ReadinessProbe: probe,
		VolumeMounts:             []corev1.VolumeMount{{Name: "config", MountPath: "/etc/gateway"}, {Name: "kube-api-access-x7k2p", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true}},
		TerminationMessagePath:   "/dev/termination-log",
		TerminationMessagePolicy: corev1.TerminationMessageReadFile, ImagePullPolicy: corev1.PullIfNotPresent,
	}
	for _, e := range []string{"LOG_FORMAT", "REGION", "OTEL_EXPORTER_OTLP_ENDPOINT", "PARTNER_TIMEOUT", "CACHE_TTL", "FEATURE_FLAGS"} {
		app.Env = append(app.Env, corev1.EnvVar{Name: e, Value: "value-of-" + strings.ToLower(e)})
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: fmt.Sprintf("gateway-7d9f8b6c5d-%05d", i), Namespace: "shop", UID: types.UID(fmt.Sprintf("0b6f2d1e-3c4a-4f5b-9e8d-%012d", i)),
			ResourceVersion: "123456789", CreationTimestamp: now,
			GenerateName: "gateway-7d9f8b6c5d-",
			Labels:       map[string]string{"app": "gateway", "pod-template-hash": "7d9f8b6c5d", "app.kubernetes.io/version": "v1.42.3"},
			Annotations:  map[string]string{"kubectl.kubernetes.io/restartedAt": "2026-11-30T10:00:00Z", "prometheus.io/scrape": "true"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "gateway-7d9f8b6c5d",
				UID: "5e1c9a7b-2d3f-4a6b-8c9d-0e1f2a3b4c5d", Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}},
		},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{app},
			Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "gateway-config"}}}},
				{Name: "kube-api-access-x7k2p", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: []corev1.VolumeProjection{
					{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token", ExpirationSeconds: ptr.To(int64(3607))}},
					{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-root-ca.crt"}, Items: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}},
				}}}}},
			RestartPolicy: corev1.RestartPolicyAlways, DNSPolicy: corev1.DNSClusterFirst, ServiceAccountName: "gateway", NodeName: "node-17",
			SchedulerName: "default-scheduler", TerminationGracePeriodSeconds: ptr.To(int64(30)), Priority: ptr.To(int32(0)),
			Tolerations: []corev1.Toleration{{Key: "node.kubernetes.io/not-ready", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To(int64(300))},
				{Key: "node.kubernetes.io/unreachable", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To(int64(300))}},
		},
	}
	if _, err := inject.Mutate(p, []string{"logistics"}, inject.Config{Image: "ghcr.io/apportion/agent:v0.1.0"}); err != nil {
		panic(err)
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, HostIP: "10.0.3.17", PodIP: fmt.Sprintf("10.244.%d.%d", i/250, i%250), StartTime: &now,
		PodIPs: []corev1.PodIP{{IP: fmt.Sprintf("10.244.%d.%d", i/250, i%250)}}, HostIPs: []corev1.HostIP{{IP: "10.0.3.17"}}, QOSClass: corev1.PodQOSBurstable}
	for _, c := range []corev1.PodConditionType{corev1.PodReadyToStartContainers, corev1.PodInitialized, corev1.PodReady, corev1.ContainersReady, corev1.PodScheduled} {
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	for _, c := range append(p.Spec.InitContainers, p.Spec.Containers...) {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{Name: c.Name, Image: c.Image, ImageID: c.Image + "@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
			ContainerID: "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", Ready: true, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}})
	}
	return p
}
