//go:build linux

package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// Rotation settings the key-rotation step gives the manager, the way an operator shortens the
// schedule (docs/protocol.md §10, "Rotation"): the shortest overlap the manager accepts
// (keys.MinKeyOverlap) and an interval just above twice that, its shortest too.
const (
	rotationOverlap  = 2 * time.Minute
	rotationInterval = 4*time.Minute + 30*time.Second
)

// keyRotation rotates the agents' signing key as an operator would, with the manager's flags
// (`--key-rotation-interval`, `--key-overlap`, patched into its Deployment), under traffic, and
// follows the new key to every agent: the manager makes it and publishes it in the namespace's
// `apportion-trust` ConfigMap; the kubelet writes it into every pod's ConfigMap volume (a new
// timestamped directory and an atomic swap of the `..data` symlink: asserted); the agent re-reads
// its trust directory; once the overlap has passed the manager signs with it. Asserted: every
// agent's `apportion_agent_rejected_pushes_total` (every reason) is the same after the switch as
// before the patch -- a push signed with a key the agent did not hold yet would count
// `unknown-key` -- and every agent holds its full share, acknowledged, after pushes signed with
// the new key; Σ permits within the limit at every ledger sample, and at the judge.
func keyRotation(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	start := time.Now()
	pods := gatewayPods(ctx, t, n, replicas)
	checkRefusalCounted(ctx, t, pods[0])
	before := map[string]float64{}
	dataLinks := map[string]string{}
	for _, p := range pods {
		v, err := rejectedPushes(ctx, p.Status.PodIP)
		if err != nil {
			t.Fatalf("agent of %s: %v", p.Name, err)
		}
		before[p.Name] = v
		if dataLinks[p.Name], err = os.Readlink(filepath.Join(n.trustVolume(&p), "..data")); err != nil {
			t.Fatalf("pod %s: the kubelet's ConfigMap volume: %v", p.Name, err)
		}
	}
	sk := &keys.SigningKeys{Reader: n.c, Writer: n.c, Namespace: system}
	ring, err := sk.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	oldID := ring[len(ring)-1].ID
	t.Logf("signing key %s, made %s ago; agents' rejected pushes so far %v",
		oldID, time.Since(ring[len(ring)-1].Created).Round(time.Second), before)

	patch := fmt.Sprintf(`[{"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--key-rotation-interval=%s"},`+
		`{"op":"add","path":"/spec/template/spec/containers/0/args/-","value":"--key-overlap=%s"}]`, rotationInterval, rotationOverlap)
	for _, args := range [][]string{
		{"-n", system, "patch", "deployment", managerName, "--type=json", "-p", patch},
		{"-n", system, "rollout", "status", "deployment/" + managerName, "--timeout=3m"},
	} {
		if out, err := n.kubectl(ctx, args...); err != nil {
			t.Fatal(err)
		} else {
			t.Logf("kubectl %s:\n%s", strings.Join(args, " "), strings.TrimSpace(out))
		}
	}
	t.Logf("figure: manager rolled with the rotation flags in %s", time.Since(start).Round(time.Millisecond))

	// The leader makes the new key once the newest is rotationInterval old (its tick is
	// overlap/4); the trust reconciler then writes it into every namespace's ConfigMap.
	var newID string
	var created time.Time
	waitFor(ctx, t, rotationInterval+3*time.Minute, "a new signing key in "+keys.DefaultSigningKeySecret, func() (bool, error) {
		quotaSample(ctx, t, n)
		r, err := sk.Load(ctx)
		if err != nil {
			return false, err
		}
		if last := r[len(r)-1]; last.ID != oldID {
			newID, created = last.ID, last.Created
			return true, nil
		}
		return false, nil
	})
	var published time.Time
	waitFor(ctx, t, time.Minute, "the new key in shop's "+apportionv1.TrustConfigMap, func() (bool, error) {
		var cm corev1.ConfigMap
		if err := n.c.Get(ctx, types.NamespacedName{Namespace: "shop", Name: apportionv1.TrustConfigMap}, &cm); err != nil {
			return false, err
		}
		_, ok := cm.Data[newID+".pem"]
		_, old := cm.Data[oldID+".pem"]
		if ok && !old {
			t.Fatalf("the old key %s left the ConfigMap with the new one's publication: %v", oldID, cm.Data)
		}
		published = time.Now()
		return ok, nil
	})
	t.Logf("figure: key %s made %s, in the trust ConfigMap (seen) %s later", newID, created.Format(time.RFC3339), published.Sub(created).Round(time.Second))

	// The kubelet's delivery: <newID>.pem in each pod's volume, through a new ..data target.
	delivered := map[string]time.Duration{}
	waitFor(ctx, t, 3*time.Minute, "the new key in every pod's "+apportionv1.TrustConfigMap+" volume", func() (bool, error) {
		quotaSample(ctx, t, n)
		for _, p := range pods {
			if _, done := delivered[p.Name]; done {
				continue
			}
			if _, err := os.Stat(filepath.Join(n.trustVolume(&p), newID+".pem")); err == nil {
				delivered[p.Name] = time.Since(published)
				link, err := os.Readlink(filepath.Join(n.trustVolume(&p), "..data"))
				if err != nil || link == dataLinks[p.Name] {
					t.Errorf("pod %s: ..data -> %q (before %q, err %v): want the kubelet's swap to a new directory", p.Name, link, dataLinks[p.Name], err)
				}
			}
		}
		return len(delivered) == len(pods), nil
	})
	for name, d := range delivered {
		t.Logf("figure: kubelet delivered the new key into pod %s's volume %s after the ConfigMap changed (syncFrequency 10s)", name, d.Round(100*time.Millisecond))
	}
	// The agent re-reads its trust directory every 30 s and logs the key ids it then holds.
	waitFor(ctx, t, time.Minute+10*time.Second, "every agent logging the new key", func() (bool, error) {
		for _, p := range pods {
			if !logLine(n.containerLog("shop", p.Name, agentContainer), "control API trust reloaded", newID) {
				return false, nil
			}
		}
		return true, nil
	})
	t.Logf("figure: every agent reloaded its trust directory %s after the ConfigMap changed", time.Since(published).Round(time.Second))

	// The leader signs with the new key once it is rotationOverlap old (at its next tick).
	waitFor(ctx, t, rotationOverlap+2*time.Minute, "the manager signing with "+newID, func() (bool, error) {
		quotaSample(ctx, t, n)
		return logLine(n.containerLog(system, "", "manager"), "signing agent requests with a new key", `"`+newID+`"`), nil
	})
	switched := time.Now()
	t.Logf("figure: the manager signs with %s %s after it was made (overlap %s)", newID, switched.Sub(created).Round(time.Second), rotationOverlap)
	// Renewals every 3 s: wait for several, all signed with the new key.
	for time.Since(switched) < 12*time.Second {
		quotaSample(ctx, t, n)
		time.Sleep(500 * time.Millisecond)
	}
	waitFor(ctx, t, time.Minute, "every agent holding its full share, acknowledged", func() (bool, error) {
		return fullShares(quotaSample(ctx, t, n).Holdings, replicas, nil), nil
	})
	for _, p := range pods {
		v, err := rejectedPushes(ctx, p.Status.PodIP)
		if err != nil {
			t.Fatalf("agent of %s: %v", p.Name, err)
		}
		if v != before[p.Name] {
			t.Errorf("agent of %s refused %v pushes during the rotation (apportion_agent_rejected_pushes_total %v -> %v)", p.Name, v-before[p.Name], before[p.Name], v)
		}
	}
	peak, ok, over := j.snapshot()
	t.Logf("figure: key rotation under traffic: %s in all; judge peak %d, %d served, %d × 429", time.Since(start).Round(time.Second), peak, ok, over)
	if peak > j.limit || over != 0 {
		t.Errorf("judge peak %d (limit %d), %d × 429", peak, j.limit, over)
	}
}

// gatewayPods lists the sample's pods, failing t unless there are replicas of them, all Ready.
func gatewayPods(ctx context.Context, t *testing.T, n *node, replicas int) []corev1.Pod {
	t.Helper()
	var pods corev1.PodList
	waitFor(ctx, t, time.Minute, fmt.Sprintf("%d gateway pods Ready", replicas), func() (bool, error) {
		if err := n.c.List(ctx, &pods, client.InNamespace("shop"), client.MatchingLabels{"app": "gateway"}); err != nil {
			return false, err
		}
		ready := 0
		for i := range pods.Items {
			if podReady(&pods.Items[i]) && pods.Items[i].DeletionTimestamp == nil {
				ready++
			}
		}
		return ready == replicas && len(pods.Items) == replicas, nil
	})
	return pods.Items
}

// trustVolume is where the kubelet writes the pod's apportion-trust ConfigMap volume.
func (n *node) trustVolume(p *corev1.Pod) string {
	return filepath.Join(n.dir, "kubelet", "root", "pods", string(p.UID), "volumes", "kubernetes.io~configmap", "apportion-trust")
}

// containerLog is what the kubelet kept of a container's output (every restart), in pods of ns
// whose name starts with podPrefix.
func (n *node) containerLog(ns, podPrefix, container string) string {
	files, _ := filepath.Glob(filepath.Join(n.dir, "pod-logs", ns+"_"+podPrefix+"*", container, "*.log"))
	var b strings.Builder
	for _, f := range files {
		data, _ := os.ReadFile(f)
		b.Write(data)
	}
	return b.String()
}

// checkRefusalCounted shows that the rotation's check can see a refused push: a control request
// without credentials (GET /v1/state), refused with 401, raises the agent's
// apportion_agent_rejected_pushes_total as read by rejectedPushes by exactly one.
func checkRefusalCounted(ctx context.Context, t *testing.T, p corev1.Pod) {
	t.Helper()
	v0, err := rejectedPushes(ctx, p.Status.PodIP)
	if err != nil {
		t.Fatalf("agent of %s: %v", p.Name, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(p.Status.PodIP, "15000")+assignment.PathState, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("agent of %s: %v", p.Name, err)
	}
	_ = resp.Body.Close()
	v1, err := rejectedPushes(ctx, p.Status.PodIP)
	if err != nil {
		t.Fatalf("agent of %s: %v", p.Name, err)
	}
	if resp.StatusCode != http.StatusUnauthorized || v1 != v0+1 {
		t.Fatalf("agent of %s: an unsigned control request got %d and moved apportion_agent_rejected_pushes_total %v -> %v: want 401 and one more (else the rotation's check could not see a refusal)",
			p.Name, resp.StatusCode, v0, v1)
	}
}

// logLine says whether a line of log holds every one of parts.
func logLine(log string, parts ...string) bool {
	for _, l := range strings.Split(log, "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(l, p)
		}
		if all {
			return true
		}
	}
	return false
}

// rejectedPushes is the sum over reasons of the agent's apportion_agent_rejected_pushes_total,
// read from its control port's /metrics.
func rejectedPushes(ctx context.Context, ip string) (float64, error) {
	if ip == "" {
		return 0, errors.New("pod has no IP")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(ip, "15000")+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("/metrics: status %d", resp.StatusCode)
	}
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apportion_agent_rejected_pushes_total") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("/metrics: %q: %w", line, err)
		}
		sum += v
	}
	return sum, sc.Err()
}
