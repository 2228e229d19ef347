package controller

import (
	"context"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// Field indexes let a watch event on a workload, HPA or rule find the quotas it affects without
// listing every quota.
const (
	// indexQuotaWorkload indexes DownstreamQuotas by "<Kind>/<name>" of each target.
	indexQuotaWorkload = "apportion.io/target-workload"
	// indexQuotaHPA indexes DownstreamQuotas by each target's explicit hpaName.
	indexQuotaHPA = "apportion.io/target-hpa"
	// indexHPATarget indexes HPAs by "<Kind>/<name>" of their scaleTargetRef.
	indexHPATarget = "apportion.io/scale-target"
	// indexRuleDownstream indexes DegradeRules by spec.downstream.
	indexRuleDownstream = "apportion.io/downstream"
)

func workloadKey(kind, name string) string { return kind + "/" + name }

// SetupIndexes registers the field indexes the controllers use. Call it once per manager.
func SetupIndexes(ctx context.Context, fi client.FieldIndexer) error {
	if err := fi.IndexField(ctx, &apportionv1.DownstreamQuota{}, indexQuotaWorkload, func(o client.Object) []string {
		dq := o.(*apportionv1.DownstreamQuota)
		keys := make([]string, 0, len(dq.Spec.Targets))
		for _, t := range dq.Spec.Targets {
			keys = append(keys, workloadKey(string(t.Kind), t.Name))
		}
		return keys
	}); err != nil {
		return err
	}
	if err := fi.IndexField(ctx, &apportionv1.DownstreamQuota{}, indexQuotaHPA, func(o client.Object) []string {
		dq := o.(*apportionv1.DownstreamQuota)
		var keys []string
		for _, t := range dq.Spec.Targets {
			if t.HPAName != "" {
				keys = append(keys, t.HPAName)
			}
		}
		return keys
	}); err != nil {
		return err
	}
	if err := fi.IndexField(ctx, &autoscalingv2.HorizontalPodAutoscaler{}, indexHPATarget, func(o client.Object) []string {
		hpa := o.(*autoscalingv2.HorizontalPodAutoscaler)
		return []string{workloadKey(hpa.Spec.ScaleTargetRef.Kind, hpa.Spec.ScaleTargetRef.Name)}
	}); err != nil {
		return err
	}
	return fi.IndexField(ctx, &apportionv1.DegradeRule{}, indexRuleDownstream, func(o client.Object) []string {
		return []string{o.(*apportionv1.DegradeRule).Spec.Downstream}
	})
}
