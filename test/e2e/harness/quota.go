package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// QuotaConfig is a DownstreamQuota with one Deployment target.
type QuotaConfig struct {
	Namespace, Name string
	Limit           int32
	// FactorPercent is safetyFactorPercent (default 80).
	FactorPercent int32
	Upstream      string
	Target        string
	// AcquireTimeout and RequestTimeout of the agents (defaults 200ms and 1s).
	AcquireTimeout, RequestTimeout time.Duration
}

// NewQuota builds the DownstreamQuota.
func NewQuota(c QuotaConfig) *apportionv1.DownstreamQuota {
	if c.FactorPercent == 0 {
		c.FactorPercent = apportionv1.DefaultSafetyFactorPercent
	}
	if c.AcquireTimeout == 0 {
		c.AcquireTimeout = apportionv1.DefaultAcquireTimeout
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = time.Second
	}
	return builders.MakeDownstreamQuota(c.Name, c.Namespace).
		Limit(c.Limit).
		Factor(c.FactorPercent).
		Upstream(c.Upstream).
		Targets(apportionv1.Target{Kind: apportionv1.KindDeployment, Name: c.Target, Weight: apportionv1.DefaultWeight}).
		Timeouts(c.AcquireTimeout, c.RequestTimeout).
		Fallback(apportionv1.Fallback{Action: apportionv1.FallbackReject}).
		FailurePolicy(apportionv1.FailureSafeDefault).
		Obj()
}

// GetQuota reads a DownstreamQuota.
func (cp *ControlPlane) GetQuota(ctx context.Context, ns, name string) (*apportionv1.DownstreamQuota, error) {
	var dq apportionv1.DownstreamQuota
	if err := cp.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &dq); err != nil {
		return nil, err
	}
	return &dq, nil
}

// Manifest is the objects of a sample manifest (config/samples).
type Manifest struct {
	Quota      *apportionv1.DownstreamQuota
	Deployment *appsv1.Deployment
	HPA        *autoscalingv2.HorizontalPodAutoscaler
	Others     []client.Object
}

// LoadManifest decodes a multi-document YAML manifest into typed objects.
func LoadManifest(path string, scheme *runtime.Scheme) (*Manifest, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	s := &Manifest{}
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(u.Object) == 0 {
			continue
		}
		obj, err := scheme.New(u.GroupVersionKind())
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, obj); err != nil {
			return nil, fmt.Errorf("%s: %s: %w", path, u.GetName(), err)
		}
		switch o := obj.(type) {
		case *apportionv1.DownstreamQuota:
			s.Quota = o
		case *appsv1.Deployment:
			s.Deployment = o
		case *autoscalingv2.HorizontalPodAutoscaler:
			s.HPA = o
		default:
			s.Others = append(s.Others, obj.(client.Object))
		}
	}
	return s, nil
}
