package inject

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// A cache that lags the API server must not cost a pod its agent: the quotas come from the API
// server, the workloads from the cache unless it does not have them yet. The cache here is a
// client holding only what it has seen so far; the API server holds everything, and counts the
// reads it serves.
func TestHandleDoesNotTrustALaggingCache(t *testing.T) {
	sch := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(sch); err != nil {
		t.Fatal(err)
	}
	if err := apportionv1.AddToScheme(sch); err != nil {
		t.Fatal(err)
	}
	d := deployment("shop", "gateway")
	logistics, recommend := quota("shop", "logistics", "gateway"), quota("shop", "recommend", "gateway")
	pod := replicaSetPod(d)
	raw, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	req := admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{
		Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}, Namespace: "shop",
		Operation: admissionv1.Create, Object: runtime.RawExtension{Raw: raw},
	}}

	for name, tc := range map[string]struct {
		cached []client.Object // what the cache has seen of the quotas and the Deployment
		want   []string        // the quotas whose URL the pod gets
		// liveGets is how many workloads the API server is asked for: none when cached.
		liveGets int
	}{
		"the cache has one quota of two":             {[]client.Object{d, logistics}, []string{"LOGISTICS", "RECOMMEND"}, 0},
		"the cache has no quota":                     {[]client.Object{d}, []string{"LOGISTICS", "RECOMMEND"}, 0},
		"the cache has neither quota nor workload":   {nil, []string{"LOGISTICS", "RECOMMEND"}, 2},
		"the cache has the quotas, not the workload": {[]client.Object{logistics, recommend}, []string{"LOGISTICS", "RECOMMEND"}, 2},
		"the cache is up to date":                    {[]client.Object{d, logistics, recommend}, []string{"LOGISTICS", "RECOMMEND"}, 0},
	} {
		t.Run(name, func(t *testing.T) {
			cache := fake.NewClientBuilder().WithScheme(sch).WithObjects(deepCopies(tc.cached)...).Build()
			gets := 0
			live := fake.NewClientBuilder().WithScheme(sch).WithObjects(deepCopies([]client.Object{d, logistics, recommend})...).
				WithInterceptorFuncs(interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
					gets++
					return c.Get(ctx, key, obj, opts...)
				}}).Build()
			w := &Webhook{Reader: cache, Live: live, Config: testConfig(), Decoder: admission.NewDecoder(sch)}
			r := w.Handle(context.Background(), req)
			patch, err := json.Marshal(r.Patches)
			if err != nil {
				t.Fatal(err)
			}
			if !r.Allowed {
				t.Fatalf("Handle refused the pod: %+v", r.Result)
			}
			for _, q := range tc.want {
				if !strings.Contains(string(patch), "APPORTION_"+q+"_URL") {
					t.Errorf("the pod was not given %s's URL: %s", q, patch)
				}
			}
			if gets != tc.liveGets {
				t.Errorf("%d workload reads from the API server; want %d", gets, tc.liveGets)
			}
		})
	}
}

func deepCopies(objs []client.Object) []client.Object {
	out := make([]client.Object, len(objs))
	for i, o := range objs {
		out[i] = o.DeepCopyObject().(client.Object)
	}
	return out
}
