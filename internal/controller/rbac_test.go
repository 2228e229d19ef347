package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
)

// The RBAC of config/rbac, applied as `kustomize build config/default` would (namespace
// apportion-system, name prefix apportion-), bound to the manager's ServiceAccount.
const (
	rbacNamespace = "apportion-system"
	rbacPrefix    = "apportion-"
	managerSA     = "system:serviceaccount:" + rbacNamespace + ":" + rbacPrefix + "controller-manager"
)

// applyConfigRBAC creates every object of config/rbac with kustomize's namespace and prefix.
func applyConfigRBAC(ctx context.Context) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rbacNamespace}}
	if err := k8sClient.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		Expect(err).NotTo(HaveOccurred())
	}
	files, err := filepath.Glob(filepath.Join("..", "..", "config", "rbac", "*.yaml"))
	Expect(err).NotTo(HaveOccurred())
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		data, err := os.ReadFile(f)
		Expect(err).NotTo(HaveOccurred())
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var raw map[string]any
			if err := dec.Decode(&raw); err != nil {
				break
			}
			if raw == nil {
				continue
			}
			var obj client.Object
			switch raw["kind"] {
			case "ClusterRole":
				obj = &rbacv1.ClusterRole{}
			case "ClusterRoleBinding":
				obj = &rbacv1.ClusterRoleBinding{}
			case "Role":
				obj = &rbacv1.Role{}
			case "RoleBinding":
				obj = &rbacv1.RoleBinding{}
			case "ServiceAccount":
				obj = &corev1.ServiceAccount{}
			case "ValidatingAdmissionPolicy":
				obj = &admissionregistrationv1.ValidatingAdmissionPolicy{}
			case "ValidatingAdmissionPolicyBinding":
				obj = &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
			default:
				Fail("unexpected kind in " + f)
			}
			b, _ := utilyaml.ToJSON(mustJSON(raw))
			Expect(utilyaml.Unmarshal(b, obj)).To(Succeed())
			kustomize(obj)
			if err := k8sClient.Create(ctx, obj); err != nil && !apierrors.IsAlreadyExists(err) {
				Expect(err).NotTo(HaveOccurred(), f)
			}
		}
	}
}

// kustomize applies config/default's namespace and namePrefix to an object of config/rbac (and
// to the references between them that kustomize follows).
func kustomize(obj client.Object) {
	obj.SetName(rbacPrefix + obj.GetName())
	if obj.GetNamespace() != "" {
		obj.SetNamespace(rbacNamespace)
	}
	fix := func(subjects []rbacv1.Subject, ref *rbacv1.RoleRef) {
		for i := range subjects {
			subjects[i].Name = rbacPrefix + subjects[i].Name
			subjects[i].Namespace = rbacNamespace
		}
		ref.Name = rbacPrefix + ref.Name
	}
	switch o := obj.(type) {
	case *rbacv1.ClusterRoleBinding:
		fix(o.Subjects, &o.RoleRef)
	case *rbacv1.RoleBinding:
		fix(o.Subjects, &o.RoleRef)
	case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
		o.Spec.PolicyName = rbacPrefix + o.Spec.PolicyName
	}
}

func mustJSON(v any) []byte {
	var buf bytes.Buffer
	Expect(jsonEncoder(&buf).Encode(v)).To(Succeed())
	return buf.Bytes()
}

// allowed asks the API server's authorizer (SubjectAccessReview) whether the manager's
// ServiceAccount may do verb on resource in namespace ("" for cluster-wide).
func allowed(ctx context.Context, verb, resource, namespace string) bool {
	return allowedNamed(ctx, verb, "", resource, namespace, "")
}

// allowedNamed is allowed for the object name of group's resource ("" for any, as a create or a
// list without a metadata.name field selector is authorized).
func allowedNamed(ctx context.Context, verb, group, resource, namespace, name string) bool {
	sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User:   managerSA,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + rbacNamespace, "system:authenticated"},
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: verb, Group: group, Resource: resource,
			Namespace: namespace, Name: name},
	}}
	Expect(k8sClient.Create(ctx, sar)).To(Succeed())
	return sar.Status.Allowed
}

var _ = Describe("The manager's RBAC (config/rbac)", Ordered, func() {
	ctx := context.Background()
	BeforeAll(func() { applyConfigRBAC(ctx) })

	It("grants no access to Secrets outside the manager's namespace", func() {
		app := newNamespace(ctx)
		for _, verb := range []string{"get", "list", "watch", "create", "update", "patch", "delete"} {
			Expect(allowed(ctx, verb, "secrets", app)).To(BeFalse(), "%s secrets in an app namespace", verb)
			Expect(allowed(ctx, verb, "secrets", "")).To(BeFalse(), "%s secrets cluster-wide", verb)
		}
		// In its own namespace: the signing key Secret, and the webhook's serving certificate, which
		// cert-controller's rotator watches through a cache of that namespace only.
		for _, verb := range []string{"get", "list", "watch", "create", "update", "patch"} {
			Expect(allowed(ctx, verb, "secrets", rbacNamespace)).To(BeTrue(), "%s its own Secrets", verb)
		}
		Expect(allowed(ctx, "delete", "secrets", rbacNamespace)).To(BeFalse(), "delete Secrets even in its namespace")
		Expect(allowed(ctx, "watch", "namespaces", "")).To(BeTrue())
		Expect(allowed(ctx, "list", "pods", "")).To(BeTrue())
		Expect(allowed(ctx, "create", "pods", app)).To(BeFalse())
	})

	It("grants nothing on GlobalQuotas or ClusterSlices: only the hub's manager has those (config/hub)", func() {
		for _, res := range []string{"globalquotas", "globalquotas/status", "globalquotas/finalizers", "clusterslices", "clusterslices/status"} {
			for _, verb := range []string{"get", "list", "watch", "create", "update", "patch", "delete"} {
				Expect(allowedNamed(ctx, verb, apportionv1.GroupVersion.Group, res, "", "")).To(BeFalse(), "%s %s", verb, res)
			}
		}
	})

	It("changes only the ConfigMaps it owns: the trust ConfigMaps and, in its namespace, the epoch", func() {
		app := newNamespace(ctx)
		cm := func(verb, ns, name string) bool { return allowedNamed(ctx, verb, "", "configmaps", ns, name) }
		// Another name, anywhere: the ones the issue names (coredns, aws-auth) and an app's own.
		for _, other := range []struct{ ns, name string }{
			{"kube-system", "coredns"}, {"kube-system", "aws-auth"}, {app, "app-config"}, {rbacNamespace, "app-config"},
		} {
			for _, verb := range []string{"get", "update", "patch", "delete"} {
				Expect(cm(verb, other.ns, other.name)).To(BeFalse(), "%s ConfigMap %s/%s", verb, other.ns, other.name)
			}
		}
		for _, verb := range []string{"get", "list", "watch", "update", "patch", "delete", "deletecollection"} {
			Expect(cm(verb, app, "")).To(BeFalse(), "%s every ConfigMap of a namespace", verb)
			Expect(cm(verb, "", "")).To(BeFalse(), "%s every ConfigMap of the cluster", verb)
		}
		// The trust ConfigMap, in any namespace: read it (list and watch select it by name, as the
		// cache does), change it, replace it (delete, create). Not patch: the manager updates.
		for _, verb := range []string{"get", "list", "watch", "update", "delete"} {
			Expect(cm(verb, app, apportionv1.TrustConfigMap)).To(BeTrue(), "%s the trust ConfigMap in an app namespace", verb)
			Expect(cm(verb, "", apportionv1.TrustConfigMap)).To(BeTrue(), "%s the trust ConfigMaps of the cluster", verb)
		}
		Expect(cm("patch", app, apportionv1.TrustConfigMap)).To(BeFalse())
		// Create cannot name the object (RBAC authorizes it before the object exists).
		Expect(cm("create", app, "")).To(BeTrue())
		// The epoch counter in its own namespace, and no other namespace's.
		for _, verb := range []string{"get", "update"} {
			Expect(cm(verb, rbacNamespace, push.DefaultEpochConfigMap)).To(BeTrue(), "%s its epoch ConfigMap", verb)
			Expect(cm(verb, app, push.DefaultEpochConfigMap)).To(BeFalse(), "%s an epoch ConfigMap elsewhere", verb)
		}
		Expect(cm("delete", rbacNamespace, push.DefaultEpochConfigMap)).To(BeFalse(), "delete its epoch (it only ever grows)")
		// Who may write a trust ConfigMap past the admission policy: the manager, cluster-wide.
		Expect(allowedNamed(ctx, "publish", "apportion.io", "trustconfigmaps", "", "")).To(BeTrue())
	})

	It("is what the API server enforces on requests made as the ServiceAccount", func() {
		app := newNamespace(ctx)
		Expect(k8sClient.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: app, Name: "app-db"},
			StringData: map[string]string{"password": "hunter2"}})).To(Succeed())
		appConfig := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: app, Name: "app-config"}, Data: map[string]string{"a": "b"}}
		Expect(k8sClient.Create(ctx, appConfig)).To(Succeed())
		imp := rest.CopyConfig(cfg)
		imp.Impersonate = rest.ImpersonationConfig{UserName: managerSA,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + rbacNamespace, "system:authenticated"}}
		asManager, err := client.New(imp, client.Options{Scheme: scheme})
		Expect(err).NotTo(HaveOccurred())

		var s corev1.Secret
		err = asManager.Get(ctx, client.ObjectKey{Namespace: app, Name: "app-db"}, &s)
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "reading an app's Secret: %v", err)
		// Its own key Secret works.
		own := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: rbacNamespace, Name: "apportion-signing-key-rbac-test"}}
		Expect(asManager.Create(ctx, own)).To(Succeed())
		Expect(asManager.Get(ctx, client.ObjectKeyFromObject(own), own)).To(Succeed())

		// An app's own ConfigMap: not even readable, let alone changeable.
		var theirs corev1.ConfigMap
		Expect(apierrors.IsForbidden(asManager.Get(ctx, client.ObjectKeyFromObject(appConfig), &theirs))).To(BeTrue())
		appConfig.Data["a"] = "manager"
		Expect(apierrors.IsForbidden(asManager.Update(ctx, appConfig))).To(BeTrue(), "updating an app's ConfigMap")
		Expect(apierrors.IsForbidden(asManager.Patch(ctx, appConfig, client.RawPatch("application/merge-patch+json", []byte(`{"data":{"a":"x"}}`))))).To(BeTrue())
		Expect(apierrors.IsForbidden(asManager.Delete(ctx, appConfig))).To(BeTrue(), "deleting an app's ConfigMap")
		// Listing ConfigMaps works only for the trust ConfigMaps' name (what the cache asks).
		var list corev1.ConfigMapList
		Expect(apierrors.IsForbidden(asManager.List(ctx, &list))).To(BeTrue(), "listing every ConfigMap")
		Expect(asManager.List(ctx, &list, client.MatchingFields{"metadata.name": apportionv1.TrustConfigMap})).To(Succeed())

		// The trust ConfigMap of an app namespace: create, change, replace. (Unlabelled, in a
		// namespace without agents: the suite's own trust reconciler leaves it alone.)
		trust := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: app, Name: apportionv1.TrustConfigMap}, Data: currentTrustData()}
		Expect(asManager.Create(ctx, trust)).To(Succeed())
		Expect(asManager.Get(ctx, client.ObjectKeyFromObject(trust), trust)).To(Succeed())
		trust.Annotations = map[string]string{"apportion.io/rbac-test": "updated"}
		Expect(asManager.Update(ctx, trust)).To(Succeed())
		Expect(asManager.Delete(ctx, trust)).To(Succeed())

		// Its epoch counter, in its own namespace.
		epoch := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: rbacNamespace, Name: push.DefaultEpochConfigMap}, Data: map[string]string{"epoch": "1"}}
		if err := asManager.Create(ctx, epoch); err != nil && !apierrors.IsAlreadyExists(err) {
			Expect(err).NotTo(HaveOccurred())
		}
		Expect(asManager.Get(ctx, client.ObjectKeyFromObject(epoch), epoch)).To(Succeed())
		epoch.Data["epoch"] = "2"
		Expect(asManager.Update(ctx, epoch)).To(Succeed())
		Expect(strings.HasPrefix(managerSA, "system:serviceaccount:")).To(BeTrue())
	})
})

func jsonEncoder(w *bytes.Buffer) interface{ Encode(any) error } { return json.NewEncoder(w) }
