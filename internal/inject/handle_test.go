package inject

import (
	"context"
	"encoding/json"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// The answers Handle gives before it reads anything (Reader is nil: a read would panic).
func TestHandleWithoutReading(t *testing.T) {
	sch := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(sch); err != nil {
		t.Fatal(err)
	}
	w := &Webhook{Config: testConfig(), Decoder: admission.NewDecoder(sch), Namespace: "shop"}
	req := func(ns string, kind metav1.GroupVersionKind, obj any) admission.Request {
		raw, err := json.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		return admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{
			Kind: kind, Namespace: ns, Operation: admissionv1.Create, Object: runtime.RawExtension{Raw: raw},
		}}
	}
	podKind := metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}
	for name, tc := range map[string]struct {
		req     admission.Request
		allowed bool
		code    int32
	}{
		"not a pod":             {req("shop", metav1.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}, map[string]any{}), true, 200},
		"outside --namespace":   {req("other", podKind, makePod("p").Obj()), true, 200},
		"opted out":             {req("shop", podKind, makePod("p").Annotation(apportionv1.InjectAnnotation, "false").Obj()), true, 200},
		"already has the agent": {req("shop", podKind, makePod("p").Container(corev1Agent()).Obj()), true, 200},
		"bad opt-out value":     {req("shop", podKind, makePod("p").Annotation(apportionv1.InjectAnnotation, "off").Obj()), false, 403},
		"not a pod's JSON":      {admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{Kind: podKind, Namespace: "shop", Object: runtime.RawExtension{Raw: []byte("{")}}}, false, 400},
	} {
		t.Run(name, func(t *testing.T) {
			r := w.Handle(context.Background(), tc.req)
			if r.Allowed != tc.allowed || r.Result == nil || r.Result.Code != tc.code || len(r.Patches) != 0 {
				t.Fatalf("Handle = allowed %v, result %+v, %d patches; want allowed %v, code %d, no patch", r.Allowed, r.Result, len(r.Patches), tc.allowed, tc.code)
			}
		})
	}
}

func corev1Agent() corev1.Container {
	return corev1.Container{Name: AgentContainerName, Image: "agent:hand"}
}
