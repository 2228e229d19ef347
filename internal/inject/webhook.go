package inject

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/targets"
)

// Path is where the webhook server serves the injector.
const Path = "/mutate--v1-pod"

// The failure policy is Fail: a pod of a target created while no injector answers would run
// without its agent and call the downstream unmetered, which is the one thing Apportion exists to
// prevent. The namespaceSelector limits the cost of an outage to namespaces that opted in (never
// kube-system or the manager's own), the manager runs two replicas that both serve the webhook
// (behind a PodDisruptionBudget), and the ReplicaSet controller retries a refused pod creation
// by itself once the webhook answers again. Only CREATE is watched: a pod's containers cannot be
// added to later.
//
// +kubebuilder:webhook:path=/mutate--v1-pod,mutating=true,failurePolicy=fail,sideEffects=None,groups="",resources=pods,verbs=create,versions=v1,name=inject.apportion.io,admissionReviewVersions=v1,timeoutSeconds=10,reinvocationPolicy=Never,matchPolicy=Equivalent,patch=`{"namespaceSelector":{"matchLabels":{"apportion.io/injection":"enabled"}}}`

// +kubebuilder:rbac:groups=apportion.io,resources=downstreamquotas,verbs=get;list;watch
// +kubebuilder:rbac:groups=apps,resources=deployments;statefulsets,verbs=get;list;watch

// Webhook is the admission handler: it finds the quotas a new pod belongs to and patches the pod
// with Mutate's result.
type Webhook struct {
	// Reader is the manager's cache: the workloads a quota targets are read from it.
	Reader client.Reader
	// Live reads the API server: the DownstreamQuotas of the pod's namespace are listed from it
	// on every admission, and a workload the cache does not have yet is read from it
	// (admissionReader says why: a quota created a moment before the pod may not be in the
	// cache, and a pod admitted without its agent would call its downstream unmetered). nil
	// reads everything from Reader — for tests and the benchmark's baseline only.
	Live    client.Reader
	Config  Config
	Decoder admission.Decoder
	// Namespace, when set, is the only namespace the manager watches (--namespace): pods of
	// other namespaces are not its business and are allowed unchanged.
	Namespace string
}

// Handle implements admission.Handler. Every outcome:
//   - not a pod, no agent wanted (opted out, already has one, belongs to no quota, outside the
//     manager's --namespace): allowed unchanged;
//   - a bad apportion.io/* annotation or a clash with the agent's volume: denied (403), naming it;
//   - the quotas (read from the API server) or workloads (from the cache, else the API server)
//     cannot be read: an error (500), so the failure policy decides (the API server refuses the
//     pod);
//   - otherwise allowed with a JSON patch that adds the agent.
func (w *Webhook) Handle(ctx context.Context, req admission.Request) admission.Response {
	if req.Kind.Kind != "Pod" || req.Kind.Group != "" {
		return admission.Allowed("not a pod")
	}
	var pod corev1.Pod
	if err := w.Decoder.Decode(req, &pod); err != nil {
		return admission.Errored(http.StatusBadRequest, fmt.Errorf("decoding the pod: %w", err))
	}
	if HasAgent(&pod.Spec) {
		return admission.Allowed("the pod already has an agent")
	}
	out, err := OptedOut(pod.Annotations)
	if err != nil {
		return admission.Denied(err.Error())
	}
	if out {
		return admission.Allowed("opted out by " + apportionv1.InjectAnnotation)
	}
	// A pod's namespace is in the request (an unnamed pod of a generateName has none of its own yet).
	ns := req.Namespace
	if ns == "" {
		ns = pod.Namespace
	}
	if w.Namespace != "" && ns != w.Namespace {
		return admission.Allowed("outside the manager's namespace " + w.Namespace)
	}
	quotas, err := targets.QuotasForPod(ctx, w.reader(), ns, pod.Labels)
	if err != nil {
		return admission.Errored(http.StatusInternalServerError, fmt.Errorf("finding the pod's DownstreamQuotas: %w", err))
	}
	if len(quotas) == 0 {
		return admission.Allowed("the pod belongs to no DownstreamQuota target")
	}
	names := make([]string, len(quotas))
	for i, q := range quotas {
		names[i] = q.Name
	}
	changed, err := Mutate(&pod, names, w.Config)
	if err != nil {
		return admission.Denied("apportion agent injection: " + err.Error())
	}
	if !changed {
		return admission.Allowed("nothing to inject")
	}
	for _, q := range quotas {
		if err := AddUpstreamTLS(&pod, q.Name, q.Spec.UpstreamTLS); err != nil {
			return admission.Denied("apportion agent injection: " + err.Error())
		}
	}
	patched, err := json.Marshal(&pod)
	if err != nil {
		return admission.Errored(http.StatusInternalServerError, err)
	}
	log.FromContext(ctx).V(1).Info("injected the agent", "namespace", ns, "pod", podName(&pod), "quotas", names)
	return admission.PatchResponseFromRaw(req.Object.Raw, patched)
}

// reader is what Handle reads the pod's quotas and their workloads with: admissionReader, or
// Reader alone when there is no Live.
func (w *Webhook) reader() client.Reader {
	if w.Live == nil {
		return w.Reader
	}
	return admissionReader{cache: w.Reader, live: w.Live}
}

func podName(p *corev1.Pod) string {
	if p.Name != "" {
		return p.Name
	}
	return p.GenerateName + "*"
}
