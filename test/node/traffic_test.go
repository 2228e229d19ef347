//go:build linux

package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

const (
	// sampleLimit is the sample quota's maxInFlight (checked in sampleManifest).
	sampleLimit    = 50
	sampleReplicas = 2
	// sampleConcurrency is each app's callers: 2 × 30 = 60 offered, above the limit of 50,
	// so without the agents the judge would see more than the limit.
	sampleConcurrency = 30
	judgePort         = "18080"
	trafficWindow     = 15 * time.Second
)

// judge is the downstream: it counts calls in flight, remembers the peak, and answers 429
// (as the logistics partner would) to a call above the limit.
type judge struct {
	limit int
	mu    sync.Mutex
	in    int
	peak  int
	ok    int
	over  int
	srv   *http.Server
}

func startJudge(t *testing.T, limit int) *judge {
	j := &judge{limit: limit}
	// On the service address in the node's namespace: the pods reach it through the bridge.
	ln, err := net.Listen("tcp", net.JoinHostPort(serviceIP, judgePort))
	if err != nil {
		t.Fatalf("judge: %v", err)
	}
	j.srv = &http.Server{Handler: j, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = j.srv.Serve(ln) }()
	t.Cleanup(func() { _ = j.srv.Close() })
	return j
}

func (j *judge) url() string { return "http://" + net.JoinHostPort(serviceIP, judgePort) }

func (j *judge) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	j.mu.Lock()
	j.in++
	if j.in > j.peak {
		j.peak = j.in
	}
	over := j.in > j.limit
	if over {
		j.over++
	} else {
		j.ok++
	}
	j.mu.Unlock()
	defer func() {
		j.mu.Lock()
		j.in--
		j.mu.Unlock()
	}()
	if over {
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	time.Sleep(50 * time.Millisecond)
	_, _ = w.Write([]byte("ok\n"))
}

func (j *judge) snapshot() (peak, ok, over int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.peak, j.ok, j.over
}

// traffic lets the apps call the judge through their agents for trafficWindow, sampling the
// quota's ledger, and asserts the bound: Σ permits ≤ limit at every sample, the judge's peak
// ≤ limit, no 429.
func traffic(ctx context.Context, t *testing.T, n *node, j *judge, pods []corev1.Pod) {
	if len(pods) == 0 {
		t.Fatal("no app pods")
	}
	end := time.Now().Add(trafficWindow)
	samples, maxSum := 0, int32(0)
	for time.Now().Before(end) {
		st := quotaSample(ctx, t, n)
		var sum int32
		for _, h := range st.Holdings {
			sum += h.Granted
		}
		if sum > maxSum {
			maxSum = sum
		}
		samples++
		time.Sleep(500 * time.Millisecond)
	}
	peak, ok, over := j.snapshot()
	var served int
	for i := range pods {
		st, err := appStats(ctx, pods[i].Status.PodIP)
		if err != nil {
			t.Errorf("app %s stats: %v", pods[i].Name, err)
			continue
		}
		t.Logf("app %s (%s): answers by status %v", pods[i].Name, pods[i].Status.PodIP, st)
		served += st["200"]
	}
	t.Logf("figure: traffic %s, %d apps × %d callers = %d offered, limit %d: judge peak %d, %d served, %d × 429; Σ granted max %d over %d samples",
		trafficWindow, len(pods), sampleConcurrency, len(pods)*sampleConcurrency, sampleLimit, peak, ok, over, maxSum, samples)
	if ok == 0 || served == 0 {
		t.Errorf("no traffic reached the judge through the agents (judge served %d, apps saw %d × 200)", ok, served)
	}
	if peak > j.limit {
		t.Errorf("judge peak %d above the limit %d", peak, j.limit)
	}
	if over != 0 {
		t.Errorf("judge answered 429 %d times", over)
	}
	if maxSum == 0 {
		t.Errorf("the quota's status never showed a granted permit")
	}
}

func appStats(ctx context.Context, ip string) (map[string]int, error) {
	if ip == "" {
		return nil, errors.New("pod has no IP")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(ip, "8080")+"/stats", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d", resp.StatusCode)
	}
	st := map[string]int{}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// quotaSample reads the sample quota and checks the bound on it: Σ granted and Σ counted (the
// ledger) ≤ the limit. It returns the status.
func quotaSample(ctx context.Context, t *testing.T, n *node) apportionv1.DownstreamQuotaStatus {
	t.Helper()
	var q apportionv1.DownstreamQuota
	if err := n.c.Get(ctx, types.NamespacedName{Namespace: "shop", Name: "logistics"}, &q); err != nil {
		t.Fatal(err)
	}
	var granted, counted int32
	for _, h := range q.Status.Holdings {
		granted += h.Granted
		counted += h.Counted
	}
	if granted > sampleLimit || counted > sampleLimit || q.Status.Ledger > sampleLimit {
		t.Errorf("Σ granted %d, Σ counted %d, ledger %d: above the limit %d: %+v", granted, counted, q.Status.Ledger, sampleLimit, q.Status.Holdings)
	}
	return q.Status
}

// scaleStep scales the sample with the scale subresource (`kubectl scale`), under traffic, and
// waits until every pod's agent acknowledged the new share, floor(limit × 80 % / replicas):
// the bound holds at every sample of the quota's ledger, and at the judge.
func scaleStep(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	start := time.Now()
	if _, err := n.kubectl(ctx, "-n", "shop", "scale", "deployment/gateway", fmt.Sprintf("--replicas=%d", replicas)); err != nil {
		t.Fatal(err)
	}
	want := int32(sampleBudget / replicas)
	samples := 0
	waitFor(ctx, t, 3*time.Minute, fmt.Sprintf("%d pods, each agent holding %d or %d permits, %d in all (acknowledged)", replicas, want, want+1, sampleBudget), func() (bool, error) {
		failIfCrashing(ctx, t, n, "shop")
		st := quotaSample(ctx, t, n)
		samples++
		return fullShares(st.Holdings, replicas, nil), nil
	})
	t.Logf("figure: kubectl scale 2 -> %d: every agent acknowledged %d permits after %s (%d ledger samples, every one within the limit)",
		replicas, want, time.Since(start).Round(time.Millisecond), samples)
	// The new pod's app calls too: a few seconds of traffic at the new split.
	time.Sleep(5 * time.Second)
	st := quotaSample(ctx, t, n)
	peak, ok, over := j.snapshot()
	t.Logf("figure: after the scale step: judge peak %d, %d served, %d × 429; holdings %+v", peak, ok, over, st.Holdings)
	if peak > j.limit {
		t.Errorf("judge peak %d above the limit %d", peak, j.limit)
	}
	if over != 0 {
		t.Errorf("judge answered 429 %d times", over)
	}
}

// leader is the manager pod holding the leader lease (the holder identity is "<pod>_<uuid>").
func leader(ctx context.Context, n *node) (string, error) {
	var l coordinationv1.Lease
	if err := n.c.Get(ctx, types.NamespacedName{Namespace: system, Name: "manager.apportion.io"}, &l); err != nil {
		return "", err
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		return "", errors.New("no holder")
	}
	pod, _, _ := strings.Cut(*l.Spec.HolderIdentity, "_")
	return pod, nil
}

// failover deletes the leader manager pod under traffic and waits until the other replica
// leads; the bound holds at every ledger sample and at the judge through a window longer than
// the agents' lease (10 s), so agents whose lease the new leader did not renew in time would
// have shown; at its end every agent holds its full share, acknowledged.
func failover(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	old, err := leader(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := n.kubectl(ctx, "-n", system, "delete", "pod", old, "--wait=false"); err != nil {
		t.Fatal(err)
	}
	samples := 0
	var now string
	waitFor(ctx, t, 2*time.Minute, "a new leader", func() (bool, error) {
		quotaSample(ctx, t, n)
		samples++
		l, err := leader(ctx, n)
		now = l
		return err == nil && l != old, nil
	})
	newLeader := time.Since(start)
	// Full permits: every agent at its full share, acknowledged, first seen after the new leader
	// led (its first pushes carry its new epoch).
	var full time.Duration
	for time.Since(start) < newLeader+20*time.Second {
		st := quotaSample(ctx, t, n)
		samples++
		if full == 0 && fullShares(st.Holdings, replicas, nil) {
			full = time.Since(start)
		}
		time.Sleep(250 * time.Millisecond)
	}
	waitFor(ctx, t, time.Minute, "every agent holding its full share", func() (bool, error) {
		st := quotaSample(ctx, t, n)
		samples++
		return fullShares(st.Holdings, replicas, nil), nil
	})
	if full == 0 {
		full = time.Since(start)
	}
	t.Logf("figure: leader %s deleted: %s leads after %s, every agent at its full share (status) %s after the delete; %d ledger samples within the limit over %s",
		old, now, newLeader.Round(time.Millisecond), full.Round(time.Millisecond), samples, time.Since(start).Round(time.Millisecond))
	peak, ok, over := j.snapshot()
	t.Logf("figure: after the failover: judge peak %d, %d served, %d × 429", peak, ok, over)
	if peak > j.limit {
		t.Errorf("judge peak %d above the limit %d", peak, j.limit)
	}
	if over != 0 {
		t.Errorf("judge answered 429 %d times", over)
	}
}

// rollingUpdate restarts the sample's Deployment (`kubectl rollout restart`) under traffic:
// new pods (injected) replace the old ones while the old drain; the ledger and the judge stay
// within the limit at every sample, and at the end every new pod's agent holds the full share.
func rollingUpdate(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	start := time.Now()
	if _, err := n.kubectl(ctx, "-n", "shop", "rollout", "restart", "deployment/gateway"); err != nil {
		t.Fatal(err)
	}
	want := int32(sampleBudget / replicas)
	samples, minShare := 0, want
	var pods corev1.PodList
	waitFor(ctx, t, 4*time.Minute, "the rollout done, every new agent holding its full share", func() (bool, error) {
		failIfCrashing(ctx, t, n, "shop")
		st := quotaSample(ctx, t, n)
		samples++
		for _, tg := range st.Targets {
			minShare = min(minShare, tg.PermitsPerPod)
		}
		if err := n.c.List(ctx, &pods, client.InNamespace("shop"), client.MatchingLabels{"app": "gateway"}); err != nil {
			return false, err
		}
		if len(pods.Items) != replicas || len(st.Holdings) != replicas {
			return false, nil
		}
		names := map[string]bool{}
		for i := range pods.Items {
			p := &pods.Items[i]
			if !podReady(p) || p.DeletionTimestamp != nil || p.CreationTimestamp.Time.Before(start.Truncate(time.Second)) {
				return false, nil
			}
			names[p.Name] = true
		}
		return fullShares(st.Holdings, replicas, names), nil
	})
	for i := range pods.Items {
		checkInjected(t, &pods.Items[i])
	}
	peak, ok, over := j.snapshot()
	t.Logf("figure: rolling update of %d pods under traffic: %s to every new agent at %d permits (lowest per-pod share during it %d); %d ledger samples within the limit; judge peak %d, %d served, %d × 429",
		replicas, time.Since(start).Round(time.Millisecond), want, minShare, samples, peak, ok, over)
	if peak > j.limit {
		t.Errorf("judge peak %d above the limit %d", peak, j.limit)
	}
	if over != 0 {
		t.Errorf("judge answered 429 %d times", over)
	}
}

// sampleBudget is what the sample quota's pods share: its limit at the default safety factor of
// 80 %.
const sampleBudget = sampleLimit * 80 / 100

// fullShares says whether the holdings are the sample quota's whole budget split over replicas
// pods, every one acknowledged: each pod at the floor or one more (the split hands the remainder
// out, internal/apportion), summing to the budget; with names, only those pods.
func fullShares(hs []apportionv1.PodHolding, replicas int, names map[string]bool) bool {
	if len(hs) != replicas {
		return false
	}
	floor := int32(sampleBudget / replicas)
	var sum int32
	for _, h := range hs {
		if (names != nil && !names[h.Pod]) || !h.Synced || h.Granted < floor || h.Granted > floor+1 {
			return false
		}
		sum += h.Granted
	}
	return sum == sampleBudget
}
