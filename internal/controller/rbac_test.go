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
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
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

// kustomize applies config/default's namespace and namePrefix to an object of config/rbac.
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
	sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
		User:               managerSA,
		Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:" + rbacNamespace, "system:authenticated"},
		ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: verb, Resource: resource, Namespace: namespace},
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
		// What it needs elsewhere: the trust ConfigMaps, namespaces, pods.
		for _, verb := range []string{"get", "list", "watch", "create", "update"} {
			Expect(allowed(ctx, verb, "configmaps", app)).To(BeTrue(), "%s configmaps in an app namespace", verb)
		}
		Expect(allowed(ctx, "delete", "configmaps", app)).To(BeFalse())
		Expect(allowed(ctx, "watch", "namespaces", "")).To(BeTrue())
		Expect(allowed(ctx, "list", "pods", "")).To(BeTrue())
		Expect(allowed(ctx, "create", "pods", app)).To(BeFalse())
	})

	It("is what the API server enforces on requests made as the ServiceAccount", func() {
		app := newNamespace(ctx)
		Expect(k8sClient.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: app, Name: "app-db"},
			StringData: map[string]string{"password": "hunter2"}})).To(Succeed())
		imp := rest.CopyConfig(cfg)
		imp.Impersonate = rest.ImpersonationConfig{UserName: managerSA,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + rbacNamespace, "system:authenticated"}}
		asManager, err := client.New(imp, client.Options{Scheme: scheme})
		Expect(err).NotTo(HaveOccurred())

		var s corev1.Secret
		err = asManager.Get(ctx, client.ObjectKey{Namespace: app, Name: "app-db"}, &s)
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "reading an app's Secret: %v", err)
		// Its own key Secret and an app namespace's trust ConfigMap work.
		own := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: rbacNamespace, Name: "apportion-signing-key-rbac-test"}}
		Expect(asManager.Create(ctx, own)).To(Succeed())
		Expect(asManager.Get(ctx, client.ObjectKeyFromObject(own), own)).To(Succeed())
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: app, Name: testTrustName + "-rbac-test"}, Data: map[string]string{"k.pem": "x"}}
		Expect(asManager.Create(ctx, cm)).To(Succeed())
		cm.Data["k.pem"] = "y"
		Expect(asManager.Update(ctx, cm)).To(Succeed())
		Expect(strings.HasPrefix(managerSA, "system:serviceaccount:")).To(BeTrue())
	})
})

func jsonEncoder(w *bytes.Buffer) interface{ Encode(any) error } { return json.NewEncoder(w) }
