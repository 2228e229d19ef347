package inject

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
	"github.com/apportion/apportion/internal/testing/testenv"
)

// BenchmarkAdmission measures one pod admission through the injector's HTTP handler — decoding
// the AdmissionReview, finding the pod's quotas (a namespace with 8 quotas, 2 of which target the
// pod's Deployment), mutating, computing the JSON patch and encoding the answer — and prints p50
// and p99. The API server's own round trip to the webhook (TLS, its admission chain) is not
// included. Three ways to read the quotas and their workloads:
//   - live-quotas: what the manager does — the quotas listed from the API server, the workloads
//     from a synced cache (admissionReader);
//   - cache: everything from the cache, as before the quotas were read live (the baseline);
//   - all-live: everything from the API server (one List and a Get per target), for comparison.
func BenchmarkAdmission(b *testing.B) {
	testenv.SkipWithoutAssets(b)
	logf.SetLogger(logr.Discard())
	env, err := testenv.Start(testenv.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = env.Stop() }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rc, sch, direct := env.Config, env.Scheme, env.Client
	ns := "bench"
	must := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	must(direct.Create(ctx, builders.MakeNamespace(ns).Obj()))
	d := deployment(ns, "gateway")
	must(direct.Create(ctx, d))
	for i := range 6 {
		other := deployment(ns, fmt.Sprintf("other-%d", i))
		must(direct.Create(ctx, other))
		must(direct.Create(ctx, quota(ns, fmt.Sprintf("partner-%d", i), other.Name)))
	}
	must(direct.Create(ctx, quota(ns, "logistics", "gateway", "other-0")))
	must(direct.Create(ctx, quota(ns, "recommend", "gateway")))

	c, err := cache.New(rc, cache.Options{Scheme: sch})
	must(err)
	go func() { _ = c.Start(ctx) }()
	if !c.WaitForCacheSync(ctx) {
		b.Fatal("cache did not sync")
	}
	reader, err := client.New(rc, client.Options{Scheme: sch, Cache: &client.CacheOptions{Reader: c}})
	must(err)
	// Warm the informers the handler reads, as the manager's controllers do.
	must(reader.List(ctx, &apportionv1.DownstreamQuotaList{}, client.InNamespace(ns)))
	pod := replicaSetPod(d)
	pod.Name = "gateway-7d9f8b6c5-abcde"
	raw, err := json.Marshal(pod)
	must(err)
	review, err := json.Marshal(&admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID:       types.UID("0f2d9a3e-2222-4c5e-9a7b-000000000002"),
			Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Namespace: ns, Name: pod.Name, Operation: admissionv1.Create,
			Object: runtime.RawExtension{Raw: raw},
		},
	})
	must(err)
	for _, v := range []struct {
		name         string
		reader, live client.Reader
	}{
		{"live-quotas", reader, direct},
		{"cache", reader, nil},
		{"all-live", direct, nil},
	} {
		b.Run(v.name, func(b *testing.B) {
			handler := &webhook.Admission{Handler: &Webhook{Reader: v.reader, Live: v.live, Config: testConfig(), Decoder: admission.NewDecoder(sch)}}
			admit := func() *admissionv1.AdmissionResponse {
				req := httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(review))
				req.Header.Set("Content-Type", "application/json")
				rec := httptest.NewRecorder()
				handler.ServeHTTP(rec, req)
				var out admissionv1.AdmissionReview
				if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &out) != nil || out.Response == nil {
					b.Fatalf("answer %d: %s", rec.Code, rec.Body.String())
				}
				return out.Response
			}
			// The first answer also proves the handler injects (both quotas) before anything is timed.
			if r := admit(); !r.Allowed || r.PatchType == nil || !bytes.Contains(r.Patch, []byte("APPORTION_RECOMMEND_URL")) {
				b.Fatalf("the benchmark pod was not injected: %+v", r)
			}

			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				admit()
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(lat)
			p := func(q float64) time.Duration { return lat[min(len(lat)-1, int(q*float64(len(lat))))] }
			b.ReportMetric(float64(p(0.50).Microseconds()), "p50-µs")
			b.ReportMetric(float64(p(0.99).Microseconds()), "p99-µs")
			b.Logf("admission through the handler (%s): n=%d p50=%s p99=%s max=%s", v.name, len(lat), p(0.50), p(0.99), lat[len(lat)-1])
		})
	}
}
