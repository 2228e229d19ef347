// Command demo runs Apportion's main job on one machine (`make demo`): a local control plane
// (envtest's kube-apiserver and etcd, from KUBEBUILDER_ASSETS), the CRDs, the real manager, the
// sample scenario of config/samples (the `logistics` DownstreamQuota, global limit 50, shared by
// the `gateway` Deployment and its HPA), real agents on loopback addresses, and a test
// downstream that answers 429 beyond 50 calls in flight. It sends steady load through the
// agents, plays the HPA's decisions 8 → 10 → 16 → 4 and prints, per step, what every pod
// enforces, what is in flight, the downstream's peak and its 429s, and `kubectl get dq`.
//
// When the manager has no push engine yet or there is no agent binary, the demo runs without
// agents and shows the permits the manager computes (kubectl) per step.
//
// It ends on its own in about a minute, or on Ctrl-C, leaving no process behind. DEMO_KEEP=1
// keeps the logs directory.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/apportion/apportion/test/e2e/harness"
)

func main() {
	// envtest logs its webhook installation through controller-runtime's logger; the demo's
	// output is its own narration.
	ctrllog.SetLogger(logr.Discard())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	harness.KillAll()
	if err != nil {
		if errors.Is(err, context.Canceled) {
			fmt.Fprintln(os.Stderr, "demo: interrupted; everything stopped")
			os.Exit(130)
		}
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// steps are the HPA's decisions after the initial 8 pods.
var steps = []int32{10, 16, 4}

func run(ctx context.Context) (err error) {
	start := time.Now()
	dir, err := os.MkdirTemp("", "apportion-demo-")
	if err != nil {
		return err
	}
	defer func() {
		if os.Getenv("DEMO_KEEP") != "" || err != nil {
			fmt.Printf("\nlogs: %s\n", dir)
			return
		}
		_ = os.RemoveAll(dir)
	}()

	fmt.Println("== building the manager and the agent")
	bin, err := harness.Build(ctx)
	if err != nil {
		return err
	}
	defer harness.RemoveBuild()
	fmt.Printf("   built in %s", bin.BuildTime.Round(100*time.Millisecond))
	if !bin.HasAgent() {
		fmt.Printf(" (no agent: %v)", harness.FirstLine(bin.AgentErr))
	}
	fmt.Println()

	fmt.Println("== starting a local control plane (kube-apiserver + etcd) and installing the CRDs")
	cp, err := harness.StartControlPlane(dir)
	if err != nil {
		return err
	}
	defer func() {
		if serr := cp.Stop(); serr != nil && err == nil {
			err = serr
		}
	}()

	sample, err := harness.LoadManifest(filepath.Join(cp.Root, "config", "samples", "apportion_v1alpha1_downstreamquota.yaml"), cp.Scheme)
	if err != nil {
		return err
	}
	if sample.Quota == nil || sample.Deployment == nil || sample.HPA == nil {
		return errors.New("the sample lacks the DownstreamQuota, the Deployment or the HPA")
	}
	// Adapted: the upstream is the local test downstream (set by the scenario), and the HPA may
	// go down to 4 so that the last decision is within its bounds.
	sample.HPA.Spec.MinReplicas = ptr(int32(4))
	ns := sample.Quota.Namespace
	limit := sample.Quota.Spec.MaxInFlight
	env := &harness.Env{CP: cp, Bin: bin, IPs: harness.NewIPPool(), Dir: dir}
	cfg := harness.ScenarioConfig{
		Namespace: ns, Limit: limit, FactorPercent: sample.Quota.Spec.SafetyFactorPercent,
		Replicas: 8, MinReplicas: 4, MaxReplicas: sample.HPA.Spec.MaxReplicas,
		Latency:  50 * time.Millisecond,
		LeaseTTL: 3 * time.Second, RenewEvery: time.Second, PushTimeout: 500 * time.Millisecond,
		QuotaObject: sample.Quota, Deployment: sample.Deployment, HPA: sample.HPA,
		WorkersPerAgent: 10, Terminating: 500 * time.Millisecond,
	}
	fmt.Printf("== running the manager, the %s quota (global %d) and the %s Deployment with 8 pods\n",
		sample.Quota.Name, limit, sample.Deployment.Name)
	s, err := env.NewScenario(ctx, cfg)
	if err != nil {
		return err
	}
	defer s.Close()
	if len(s.Manager.Unsupported) > 0 {
		fmt.Printf("   (the manager does not take %s yet: it runs with its defaults for those)\n", strings.Join(s.Manager.Unsupported, ", "))
	}
	if s.Pushing {
		fmt.Printf("   8 real agents on 127.x loopback addresses, %d workers each calling %s through their agent;\n", cfg.WorkersPerAgent, sample.Quota.Name)
		fmt.Printf("   the downstream (%s) admits %d calls in flight, holds each %s, answers 429 beyond\n", s.DS.URL, limit, cfg.Latency)
	} else {
		why := "the manager has no push engine yet (no --lease-ttl flag)"
		if !bin.HasAgent() {
			why = "there is no agent binary yet"
		}
		fmt.Printf("   without agents: %s; showing the permits the manager computes\n", why)
	}

	decisions := append([]int32{8}, steps...)
	var rows []row
	for i, n := range decisions {
		t0 := s.Started
		if i > 0 {
			fmt.Printf("\n== step %d: the HPA decides %d → %d pods\n", i, decisions[i-1], n)
			t0 = time.Now()
			if err := s.Workload.ScaleTo(ctx, n, harness.ScaleOptions{Step: 200 * time.Millisecond}); err != nil {
				return err
			}
		} else {
			fmt.Printf("\n== step 0: %d pods\n", n)
			if s.Pushing {
				fmt.Println("   (a manager that starts waits out its recovery window — lease + push timeout + grace + the quota's")
				fmt.Println("   requestTimeout — before it grants anything; until its first assignment an agent answers 404)")
			}
		}
		r, err := observe(ctx, s, n, t0)
		if err != nil {
			return err
		}
		rows = append(rows, r)
		printRows(rows[len(rows)-1:], s.Pushing)
		out, _ := cp.Kubectl(ctx, "get", "dq", "-n", ns)
		fmt.Print("\n$ kubectl get dq -n " + ns + "\n" + out)
	}

	fmt.Println("\n== summary")
	printRows(rows, s.Pushing)
	fmt.Println("(per step: maxima over a 4 s window once converged; 2xx and 503 in that window; CONVERGED: from the")
	fmt.Println(" HPA's decision until every pod enforces its new permits, pod start-up and termination included)")
	if s.Pushing {
		ls := s.Load.Stop()
		st := s.Monitor.Stop()
		fmt.Printf("\nload: %s\nmonitor: %s\n", ls, st)
		if !st.PhysicallyOk() {
			return fmt.Errorf("the global limit was not kept: %d confirmed Σ-permit violations, downstream peak %d/%d, %d × 429",
				st.PermitViolations, st.Downstream.Peak, st.Downstream.Limit, st.Downstream.TooMany429)
		}
		if st.LedgerViolations > 0 {
			fmt.Printf("\nnote: the manager's ledger (status.ledger) went over %d in %d samples (max %d), an over-count\n", limit, st.LedgerViolations, st.MaxLedger)
		}
		fmt.Printf("\nThe downstream never saw more than %d of %d calls in flight and answered 429 %d times.\n",
			st.Downstream.Peak, limit, st.Downstream.TooMany429)
	}
	fmt.Printf("done in %s\n", time.Since(start).Round(100*time.Millisecond))
	return nil
}

type row struct {
	pods                  int32
	perPod                string
	sumPermits, sumFlight int32
	converge              time.Duration
	peak, tooMany         int64
	ok, fallback          int64
}

// observe waits for the permits to follow the decision taken at t0, then measures a 4-second
// window.
func observe(ctx context.Context, s *harness.Scenario, n int32, t0 time.Time) (row, error) {
	r := row{pods: n}
	want := s.PerPod(n)
	if s.Pushing {
		if err := s.WaitPermits(ctx, want, 30*time.Second); err != nil {
			fmt.Printf("   warning: %v\n", err)
		}
	} else if err := waitStatus(ctx, s, n, want); err != nil {
		fmt.Printf("   warning: %v\n", err)
	}
	r.converge = time.Since(t0)
	if !s.Pushing {
		dq, err := s.Quota(ctx)
		if err != nil {
			return r, err
		}
		r.perPod, r.sumPermits = dq.Status.PerPod, dq.Status.Assigned
		return r, nil
	}
	s.Monitor.ResetWindow()
	s.DS.ResetWindow()
	before := s.Load.Stats()
	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(4 * time.Second):
	}
	r.sumPermits, r.sumFlight = s.Monitor.ResetWindow()
	r.peak = s.DS.ResetWindow()
	after := s.Load.Stats()
	r.ok, r.fallback = after.OK-before.OK, after.Fallback-before.Fallback
	r.tooMany = s.DS.Stats().TooMany429
	if cur, ok := s.Monitor.Current(); ok {
		set := map[int32]bool{}
		for _, a := range cur.Agents {
			set[a.Effective] = true
		}
		var vals []string
		for v := range set {
			vals = append(vals, strconv.Itoa(int(v)))
		}
		slices.Sort(vals)
		r.perPod = strings.Join(vals, ",")
	}
	return r, nil
}

func waitStatus(ctx context.Context, s *harness.Scenario, n, want int32) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		dq, err := s.Quota(ctx)
		if err == nil && dq.Status.Pods == n && dq.Status.PerPod == strconv.Itoa(int(want)) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("status did not show %d pods × %d within 20s", n, want)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func printRows(rows []row, pushing bool) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	if pushing {
		fmt.Fprintln(w, "PODS\tPER-POD\tΣ PERMITS (max)\tΣ IN-FLIGHT (max)\tDOWNSTREAM PEAK\t429s\t2xx\t503 FALLBACK\tCONVERGED\t")
		for _, r := range rows {
			fmt.Fprintf(w, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t\n", r.pods, r.perPod, r.sumPermits, r.sumFlight, r.peak, r.tooMany, r.ok, r.fallback, r.converge.Round(time.Millisecond))
		}
	} else {
		fmt.Fprintln(w, "PODS\tPER-POD\tΣ ASSIGNED\tCOMPUTED IN\t")
		for _, r := range rows {
			fmt.Fprintf(w, "%d\t%s\t%d\t%s\t\n", r.pods, r.perPod, r.sumPermits, r.converge.Round(time.Millisecond))
		}
	}
	_ = w.Flush()
}

func ptr[T any](v T) *T { return &v }
