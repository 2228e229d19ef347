package inject

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// admissionReader is what Handle finds a pod's quotas with (targets.QuotasForPod): a List — of
// the namespace's DownstreamQuotas, the only List it makes — from the API server, and a Get — of
// a target's workload — from the cache, or from the API server when the cache has no such object.
//
// Why a pod's quotas come from the API server on every admission: the cache is behind the API
// server by its watch's latency, and nothing in a cached list tells that it is complete. A user
// who applies two quotas and their Deployment at once can see the Deployment's first pods
// admitted while the cache holds one quota of the two (the envtest "gives a pod of two quotas one
// agent serving both" once failed so under load); such a pod runs without the agent for the
// other quota, and a pod's containers cannot be changed afterwards, so it would call that
// downstream unmetered for its life. A live List is consistent: every quota created before the
// pod is in it. It costs one API round trip per admitted pod (docs/benchmarks.md, "Webhook
// admission latency").
//
// Why a workload found in the cache is trusted: a Deployment's and a StatefulSet's spec.selector
// is immutable, so a cached workload selects what the live one selects; and one created a moment
// before its pod but not cached yet is missed, not mistaken, so it is read again live. The one
// case left: a workload deleted and recreated under the same name with a different selector, both
// unseen by the cache when its pods are admitted — a window of the watch's latency after two
// controllers (Deployment, ReplicaSet) have already acted on the new object.
type admissionReader struct {
	cache, live client.Reader
}

// Get reads from the cache, and from the API server when the cache does not have the object.
// Any other error of the cache's is returned: Handle then refuses the pod rather than guess.
func (r admissionReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	err := r.cache.Get(ctx, key, obj, opts...)
	if apierrors.IsNotFound(err) {
		return r.live.Get(ctx, key, obj, opts...)
	}
	return err
}

// List reads from the API server.
func (r admissionReader) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	return r.live.List(ctx, list, opts...)
}
