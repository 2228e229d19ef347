package push

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// TestLedgerProperty drives the engine's core through random sequences of desired changes,
// pod churn, answered, lost, dropped, refused and late-landing pushes, network partitions, agent
// restarts and manager restarts (a new epoch, with the old manager's pushes still in the air),
// and lying pods — some pods answer most requests with a State, a 409 or a 403 wrong-instance
// claiming a huge epoch (while the agent behind them may have applied the push), and any answer
// may be such a lie — with reads of the epoch record (which holds the running manager's epoch,
// or fails) deciding the claims; while model agents run calls under the permits they really
// hold. After every step:
//
//   - every plan that raises what a pod is counted at leaves Σ counted ≤ limit (the ledger may
//     exceed the limit only through what the engine learns, never through what it grants);
//   - Σ over pods of what they really hold — max(limit in force, calls in flight) for live agent
//     processes, calls still running for old processes and deleted pods — ≤ limit;
//   - the engine is never fenced: no record read shows a newer manager.
//
// PROP_SEEDS=n runs n seeds (default 200; 40 with -short). PROP_SEED=s runs only seed s and logs
// every change of the ledger; PROP_POD=p<i> also logs every request to and delivery at that pod.
func TestLedgerProperty(t *testing.T) {
	if s, err := strconv.Atoi(os.Getenv("PROP_SEED")); err == nil {
		runProperty(t, uint64(s))
		return
	}
	seeds := 200
	if testing.Short() {
		seeds = 40
	}
	if n, err := strconv.Atoi(os.Getenv("PROP_SEEDS")); err == nil {
		seeds = n
	}
	var total propStats
	for seed := range seeds {
		st := runProperty(t, uint64(seed))
		total.batched += st.batched
		total.lies += st.lies
		total.refuted += st.refuted
		total.early += st.early
	}
	// The runs must start renewals together as the engine does to sign them in a batch
	// (core.startRenewals), and have claims of a newer epoch refuted, else they would check
	// nothing of either.
	if total.batched == 0 {
		t.Fatalf("%d runs started no renewal together with another", seeds)
	}
	if total.refuted == 0 {
		t.Fatalf("%d runs refuted no claim of a newer epoch (%d lies)", seeds, total.lies)
	}
	// And raise pods after a recovery window closed early, else the early close goes unchecked.
	if total.early == 0 {
		t.Fatalf("%d runs raised nobody in a recovery window that closed early", seeds)
	}
	t.Logf("%d renewals started together with another, %d answers claiming a newer epoch (%d refuted by the record), %d raises after a recovery window closed early over %d runs",
		total.batched, total.lies, total.refuted, total.early, seeds)
}

// TestLedgerPropertyHandover runs TestLedgerProperty's checks where a new manager's recovery
// window closes early (ledger.settled, docs/protocol.md Lemma 8): frequent manager restarts, a
// short request timeout, and the previous manager's pushes landing as late as they may, after
// the new one probed the pod. The runs must raise pods after an early close.
// PROP_SEEDS=n runs n seeds (default 60; 20 with -short).
func TestLedgerPropertyHandover(t *testing.T) {
	seeds := 60
	if testing.Short() {
		seeds = 20
	}
	if n, err := strconv.Atoi(os.Getenv("PROP_SEEDS")); err == nil {
		seeds = n
	}
	early := 0
	for seed := range seeds {
		early += runPropertyMode(t, uint64(2_000_000+seed), true).early
	}
	if early == 0 {
		t.Fatalf("%d runs raised nobody in a recovery window that closed early", seeds)
	}
	t.Logf("%d raises after a recovery window closed early over %d runs", early, seeds)
}

// TestQuietRenewalProperty checks the renewal fast path (core.quietRenewal) over the same random
// runs as TestLedgerProperty: every renewal the engine takes as quiet — applied without replanning
// the pod's quotas — must leave every one of the pod's entries counted at what it was counted at
// just before the answer, and granted what a plan made right then would grant, before and after;
// so that skipping the replan loses nothing. Σ of what pods really hold stays ≤ limit as in
// TestLedgerProperty (the same checks run). The runs must take the fast path (else the test
// would check nothing).
func TestQuietRenewalProperty(t *testing.T) {
	seeds := 40
	if testing.Short() {
		seeds = 10
	}
	if n, err := strconv.Atoi(os.Getenv("PROP_SEEDS")); err == nil {
		seeds = n
	}
	quiet := 0
	for seed := range seeds {
		quiet += runProperty(t, uint64(1_000_000+seed)).quiet
	}
	if quiet == 0 {
		t.Fatalf("%d runs took no quiet renewal", seeds)
	}
	t.Logf("%d quiet renewals over %d runs, each leaving counted values and grants as they were", quiet, seeds)
}

type propPod struct {
	born        time.Time
	name        string
	uid         types.UID
	endpoint    string
	hasIP       bool
	listed      bool
	terminating bool
	permits, sd int32
	// liar: most answers from the pod claim a huge epoch (the agent behind may still apply
	// what it is sent).
	liar bool
}

// propStats counts what one run exercised: renewals the engine took as quiet (each one checked:
// see TestQuietRenewalProperty), renewals started together with another (core.startRenewals, as
// Engine.signTogether does), answers claiming a newer epoch and claims the record refuted.
type propStats struct {
	quiet, batched, lies, refuted int
	// early counts plans that raised a pod after a manager restart's recovery window closed
	// early (ledger.settled), before its full length (recoverUntil).
	early int
}

// propAgent is a pod's agent across process restarts; calls of older processes keep running.
type propAgent struct {
	cur   *modelAgent
	proc  int
	calls []propCall
}

type propCall struct {
	proc int
	inc  int // the downstream's incarnation at the agent (modelAgent.inc) when the call started
	end  time.Time
}

// landing is a push that arrives late, at the agent process it was sent to.
type landing struct {
	at       time.Time
	endpoint string
	proc     int
	a        *assignment.Assignment
}

type pending struct {
	w    *work
	c    *core
	dl   time.Time // sentAt + PushTimeout: the engine gives up then
	proc int       // the agent process the request went to: a request cannot outlive its connection
}

// runProperty runs one seed and returns what it exercised.
func runProperty(t *testing.T, seed uint64) (stats propStats) {
	return runPropertyMode(t, seed, false)
}

// runPropertyMode runs one seed; handover makes manager restarts frequent (one step in ten),
// the quota's request timeout short (1 s) and the previous manager's pushes in the air land at
// the end of their land window: the runs then dwell where a new manager's recovery window may
// close early while pushes of the previous one can still land (TestLedgerPropertyHandover).
func runPropertyMode(t *testing.T, seed uint64, handover bool) (stats propStats) {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	h := newHarness(t, func(o *Options) {
		o.UnreachableAfter = 1 + rng.IntN(3)
		o.RetryMax = time.Duration(1+rng.IntN(3)) * time.Second
	})
	limit := int32(8 + rng.IntN(40))
	// The quota's request timeout: short ones let a new manager's recovery window close early
	// (ledger.settled) long before its full length, while pushes of the previous manager may
	// still land and its leases still hold; the long one leaves little between the two.
	rt := []time.Duration{time.Second, 3 * time.Second, hRT}[rng.IntN(3)]
	restartBelow := 31 // the manager restarts when r (0..99) is in [30, restartBelow)
	if handover {
		rt, restartBelow = time.Second, 40
	}
	var (
		pods     []*propPod
		agents   = map[string]*propAgent{}
		parted   = map[string]outcome{} // endpoint → how every request to it ends
		liars    = map[string]bool{}    // endpoint → the pod lies (propPod.liar)
		inflight []pending
		landings []landing
		epoch    = int64(1 + rng.IntN(5))
		live     = true // the DownstreamQuota exists
		uidN     = 0    // its object's incarnation: a new UID on every re-creation
		step     int
		lastMsg  string
		start    = h.now
	)
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("seed %d step %d (%s) at +%s: %s", seed, step, lastMsg, h.now.Sub(start), fmt.Sprintf(format, args...))
	}
	h.agents = nil // the property test routes requests itself

	// actual is what the pods really hold.
	actual := func() int64 {
		var sum int64
		for ep, ag := range agents {
			_ = ep
			var own int32
			for _, c := range ag.calls {
				if !h.now.Before(c.end) {
					continue
				}
				if c.proc == ag.proc && !ag.cur.dead && c.inc == ag.cur.inc["q"] {
					own++
				} else {
					sum++ // an old process's, a deleted pod's or a removed downstream's call, still running
				}
			}
			if !ag.cur.dead {
				sum += int64(max(ag.cur.limit("q", h.now), own))
			}
		}
		return sum
	}
	var prevLedger int32
	t0 := h.now
	since := func() time.Duration { return h.now.Sub(t0) }
	tracing, tracePod := os.Getenv("PROP_SEED") != "", os.Getenv("PROP_POD")
	planHook := func(key types.NamespacedName, lim int32, recovering bool, in []planEntry, grants []int32) {
		var sum int64
		raised := false
		for i, e := range in {
			after := e
			after.Grant = grants[i]
			sum += int64(after.counted())
			raised = raised || after.counted() > e.counted()
			if recovering && grants[i] > max(e.Grant, e.Held) {
				fail("%s raised to %d during recovery, above what it surely holds (%d)", e.Name, grants[i], max(e.Grant, e.Held))
			}
		}
		if raised && sum > int64(lim) {
			fail("a grant raised the ledger to %d > limit %d", sum, lim)
		}
		if q := h.c.quotas[key]; raised && !recovering && q != nil && h.now.Before(h.c.ledger.recoverUntil(q)) {
			stats.early++ // a raise after the recovery window closed early
		}
	}
	h.c.ledger.afterPlan = planHook
	quietHook := func(p *podState, before, after []int32) {
		stats.quiet++
		if !slices.Equal(before, after) {
			fail("quiet renewal of %s changed (counted, grant) per quota from %v to %v", p.name, before, after)
		}
	}
	h.c.onQuiet = quietHook
	h.check = func() {
		if h.c.ledger.started {
			if tracing {
				r := h.c.reports.report(qKey, h.now)
				if r.Ledger != prevLedger {
					t.Logf("step %d %s +%s ledger %d -> %d", step, lastMsg, since(), prevLedger, r.Ledger)
					for _, x := range r.Holdings {
						if x.Counted > 0 || x.Granted > 0 {
							t.Logf("   %+v", x)
						}
					}
					prevLedger = r.Ledger
				}
			}
		}
		if a := actual(); a > int64(limit) {
			for _, p := range pods {
				ag := agents[p.endpoint]
				var own, other int
				for _, c := range ag.calls {
					if h.now.Before(c.end) {
						if c.proc == ag.proc && !ag.cur.dead {
							own++
						} else {
							other++
						}
					}
				}
				lim := ag.cur.limit("q", h.now)
				if tracePod == p.name {
					t.Logf("  %s calls %+v inc %d proc %d", p.name, ag.calls, ag.cur.inc["q"], ag.proc)
				}
				if own+other > 0 || lim > 0 {
					t.Logf("  %s listed=%v term=%v dead=%v e%d g%d limit=%d own=%d other=%d leaseValid=%v accepted=+%s", p.name, p.listed, p.terminating, ag.cur.dead,
						ag.cur.epoch, ag.cur.gen, lim, own, other, ag.cur.leaseValid(h.now), ag.cur.acceptedAt.Sub(t0))
				}
			}
			t.Logf("  ledger: %+v", h.c.reports.report(qKey, h.now).Holdings)
			fail("pods really hold %d > limit %d", a, limit)
		}
	}
	h.t = &fatalHook{TB: t, fail: func(msg string) { fail("%s", msg) }}

	newPod := func() *propPod {
		i := len(pods)
		p := &propPod{born: h.now, name: fmt.Sprintf("p%d", i), uid: types.UID(fmt.Sprintf("uid-%d-%d", seed, i)), endpoint: fmt.Sprintf("http://p%d", i), hasIP: rng.IntN(4) > 0, listed: true,
			sd:   rng.Int32N(limit/6 + 1), // a pod's safe default is stable (it changes with the spec only)
			liar: rng.IntN(6) == 0 && !handover}
		liars[p.endpoint] = p.liar
		pods = append(pods, p)
		agents[p.endpoint] = &propAgent{cur: newModelAgent()}
		agents[p.endpoint].cur.started = h.now
		return p
	}
	desired := func() DesiredQuota {
		d := DesiredQuota{Key: qKey, UID: types.UID(fmt.Sprintf("dq-%d", uidN)), Limit: limit, Downstream: template("q")}
		d.Downstream.RequestTimeout = assignment.Duration(rt)
		var live []*propPod
		for _, p := range pods {
			if p.listed && !p.terminating {
				live = append(live, p)
			}
		}
		budget := limit
		if !handover && rng.IntN(3) > 0 { // with handover the desired permits take the whole limit: no slack hides an excess
			budget = limit * int32(50+rng.IntN(51)) / 100
		}
		for _, p := range live {
			p.permits = 0
		}
		for budget > 0 && len(live) > 0 {
			p := live[rng.IntN(len(live))]
			n := 1 + rng.Int32N(budget)
			if rng.IntN(2) == 0 {
				n = min(n, 1+budget/int32(len(live)))
			}
			p.permits += n
			budget -= n
		}
		for _, p := range pods {
			if !p.listed {
				continue
			}
			ep := ""
			if p.hasIP {
				ep = p.endpoint
			}
			d.Pods = append(d.Pods, DesiredPod{Name: p.name, UID: p.uid, Target: "web", Endpoint: ep,
				Permits: p.permits, SafeDefault: p.sd, Terminating: p.terminating, Since: p.born})
		}
		return d
	}
	// deliver applies a push landing on an agent (if its process is alive).
	deliver := func(endpoint string, proc int, a *assignment.Assignment) (*assignment.State, error) {
		ag := agents[endpoint]
		if tracePod != "" && endpoint == "http://"+tracePod {
			t.Logf("  step %d +%s deliver e%d g%d permits %d to agent(e%d g%d dead %v)", step, since(), a.Epoch, a.Generation, permitsOf(a), ag.cur.epoch, ag.cur.gen, ag.cur.dead)
		}
		if ag.cur.dead || ag.proc != proc {
			return nil, errors.New("connection reset") // the process it was sent to is gone
		}
		return ag.cur.put(a, h.now)
	}
	// complete ends a request the engine made, as it would see it.
	complete := func(p pending, how outcome) {
		w := p.w
		if tracePod != "" && w.to.URL == "http://"+tracePod {
			if w.assignment != nil {
				t.Logf("  step %d +%s %s e%d g%d permits %d: outcome %d", step, since(), w.kind, w.assignment.Epoch, w.assignment.Generation, permitsOf(w.assignment), how)
			} else {
				t.Logf("  step %d +%s %s: outcome %d", step, since(), w.kind, how)
			}
		}
		ag := agents[w.to.URL]
		var st *assignment.State
		var err error
		timeout := errors.New("context deadline exceeded")
		switch how {
		case ok:
			if ag.cur.dead || ag.proc != p.proc {
				err = errors.New("connection reset")
			} else if w.kind == kindPush {
				st, err = deliver(w.to.URL, p.proc, w.assignment)
			} else {
				st = ag.cur.state(h.now)
			}
		case lost:
			if w.kind == kindPush {
				_, _ = deliver(w.to.URL, p.proc, w.assignment)
			}
			err = timeout
		case dropped:
			err = errors.New("connection reset")
		case refused:
			err = &assignment.StatusError{StatusCode: 403}
		case delayed:
			if w.kind == kindPush {
				at := h.now.Add(time.Duration(rng.Int64N(int64(w.sentAt.Add(hPT+hAG).Sub(h.now)) + 1)))
				landings = append(landings, landing{at: at, endpoint: w.to.URL, proc: p.proc, a: w.assignment})
			}
			err = timeout
		case lie:
			// Something in the pod answers with a huge epoch; the agent behind it may have
			// applied the push all the same.
			if w.kind == kindPush && rng.IntN(2) == 0 && !ag.cur.dead && ag.proc == p.proc {
				_, _ = deliver(w.to.URL, p.proc, w.assignment)
			}
			fake := *ag.cur.state(h.now)
			fake.Epoch = []int64{1<<53 - 1, p.c.ledger.epoch + 1, p.c.ledger.epoch + 1 + rng.Int64N(1<<40)}[rng.IntN(3)]
			fake.Generation = 1 + rng.Int64N(1<<53-1)
			switch rng.IntN(3) {
			case 0:
				st = &fake // a 200
			case 1:
				err = &assignment.StaleError{State: fake} // a 409
			default:
				err = fmt.Errorf("pushing: %w", &assignment.StaleError{State: fake, Detail: "wrong-instance"}) // a 403 wrong-instance
			}
			stats.lies++
		}
		if p.c == h.c {
			if w.kind == kindPush && w.body == nil {
				// The engine encodes a push once per version and agent process, and reuses the
				// bytes for the renewals (work.encoded): what makes a renewal batchable.
				w.encoded(fmt.Appendf(nil, "g%d", w.assignment.Generation))
			}
			p.c.finishWork(w, st, err, h.now)
			p.c.flush(h.now)
		}
	}
	randomOutcome := func(endpoint string, late bool) outcome {
		if o, ok := parted[endpoint]; ok {
			return o
		}
		if liars[endpoint] && rng.IntN(10) < 6 {
			return lie
		}
		r := rng.IntN(100)
		switch {
		case r < 2 && !handover: // a lying pod is never settled: it would keep every early close away
			return lie
		case late && r < 40:
			return lost
		case late && r < 70:
			return delayed
		case late:
			return dropped
		case r < 75:
			return ok
		case r < 83:
			return lost
		case r < 90:
			return dropped
		case r < 95:
			return delayed
		default:
			return refused
		}
	}
	// tick moves time by d in small steps, landing late pushes, timing out requests, ending
	// calls and firing the engine's timers, checking after each.
	tick := func(d time.Duration) {
		end := h.now.Add(d)
		for h.now.Before(end) {
			next := h.now.Add(min(20*time.Millisecond, end.Sub(h.now)))
			slices.SortFunc(landings, func(a, b landing) int { return a.at.Compare(b.at) })
			for len(landings) > 0 && !landings[0].at.After(next) {
				l := landings[0]
				landings = landings[1:]
				if l.at.After(h.now) {
					h.now = l.at
				}
				_, _ = deliver(l.endpoint, l.proc, l.a)
				h.check()
			}
			h.now = next
			keep := inflight[:0]
			for _, p := range inflight {
				if !h.now.Before(p.dl) {
					complete(p, randomOutcome(p.w.to.URL, true))
				} else {
					keep = append(keep, p)
				}
			}
			inflight = keep
			if h.c.ledger.started {
				h.c.advance(h.now)
			}
			h.check()
		}
	}
	traffic := func() {
		for _, p := range pods {
			ag := agents[p.endpoint]
			if ag.cur.dead {
				continue
			}
			for k := rng.IntN(4); k > 0; k-- {
				// The agent admits a call only below the limit in force (its semaphore), and
				// reports exactly the calls running at the moment it answers (modelAgent.calls).
				if ag.cur.inFlight("q", h.now) >= ag.cur.limit("q", h.now) {
					break
				}
				end := h.now.Add(time.Duration(1 + rng.Int64N(int64(rt))))
				ag.calls = append(ag.calls, propCall{proc: ag.proc, inc: ag.cur.inc["q"], end: end})
				ag.cur.calls = append(ag.cur.calls, modelCall{ds: "q", end: end})
				ag.cur.requests["q"]++
			}
		}
		h.check()
	}
	for range 2 + rng.IntN(5) {
		newPod()
	}
	h.c.setQuota(desired(), h.now)
	h.c.begin(epoch, h.now)
	h.check()

	setQ := func() {
		if live {
			h.c.setQuota(desired(), h.now)
		}
	}
	// readRecord is the Engine's read of the epoch record, which holds the running manager's
	// epoch (no newer manager exists), or fails.
	readRecord := func() {
		upTo, ok := h.c.claims.pendingClaim()
		if !ok {
			return
		}
		var err error
		if rng.IntN(4) == 0 {
			err = errors.New("etcdserver: request timed out")
		}
		before := len(h.c.claims.claimants)
		h.c.claims.recordRead(upTo, epoch, err, h.now)
		stats.refuted += before - len(h.c.claims.claimants)
		h.c.flush(h.now)
		h.check()
	}
	for step = 0; step < 500; step++ {
		r := rng.IntN(100)
		switch {
		case r < 2:
			lastMsg = "quota deleted"
			if live {
				live = false
				h.c.deleteQuota(qKey, h.now)
			}
		case r < 4:
			lastMsg = "quota created again"
			if !live || rng.IntN(2) == 0 { // or replaced between two reconciles: only the UID tells
				live = true
				uidN++
				setQ()
			}
		case r < 10:
			lastMsg = "new desired permits"
			setQ()
		case r < 14:
			lastMsg = "scale out"
			newPod()
			setQ()
		case r < 17:
			lastMsg = "pod terminating"
			if p := pick(rng, pods, func(p *propPod) bool { return p.listed && !p.terminating }); p != nil {
				p.terminating = true
				setQ()
			}
		case r < 20:
			lastMsg = "pod deleted"
			if p := pick(rng, pods, func(p *propPod) bool { return p.listed && (p.terminating || rng.IntN(3) == 0) }); p != nil {
				p.listed = false
				agents[p.endpoint].cur.dead = true
				setQ()
			}
		case r < 22:
			lastMsg = "pod gets its IP"
			if p := pick(rng, pods, func(p *propPod) bool { return p.listed && !p.hasIP }); p != nil {
				p.hasIP = true
				setQ()
			}
		case r < 25:
			lastMsg = "partition"
			if p := pick(rng, pods, func(p *propPod) bool { return p.listed }); p != nil {
				parted[p.endpoint] = []outcome{lost, dropped, delayed}[rng.IntN(3)]
			}
		case r < 28:
			lastMsg = "heal"
			if p := pick(rng, pods, func(p *propPod) bool { _, ok := parted[p.endpoint]; return ok }); p != nil {
				delete(parted, p.endpoint)
			}
		case r < 30:
			lastMsg = "agent restart"
			if p := pick(rng, pods, func(p *propPod) bool { return p.listed }); p != nil {
				if tracePod == p.name {
					t.Logf("  step %d restart %s", step, p.name)
				}
				// The old process's calls keep running at the downstream until they end: the engine
				// must carry them until then, on top of what the new process is given.
				ag := agents[p.endpoint]
				ag.proc++
				ag.cur = newModelAgent()
				ag.cur.started = h.now
			}
		case r < restartBelow:
			lastMsg = "manager restart"
			if tracing {
				t.Logf("  step %d manager restart", step)
			}
			// The old manager stops (its requests may still land); a new one starts a little
			// later with a new epoch and learns everything again.
			// Some land as late as they may (sentAt + land window), when the new manager may
			// have probed the pod already and may close its recovery window early.
			for _, p := range inflight {
				if p.w.kind == kindPush && rng.IntN(2) == 0 {
					at := p.w.sentAt.Add(hPT + hAG)
					if !handover && rng.IntN(2) == 0 {
						at = h.now.Add(time.Duration(rng.Int64N(int64(at.Sub(h.now)) + 1)))
					}
					landings = append(landings, landing{at: at, endpoint: p.w.to.URL, proc: p.proc, a: p.w.assignment})
				}
			}
			inflight = nil
			h.c = newCore(&h.o, nil)
			h.c.ledger.afterPlan = planHook
			h.c.onQuiet = quietHook
			if !handover && rng.IntN(2) == 0 { // else the new manager starts at once (leader election handed over)
				tick(time.Duration(rng.Int64N(int64(2 * time.Second))))
			}
			epoch += int64(1 + rng.IntN(3))
			setQ()
			h.c.begin(epoch, h.now)
			if handover {
				// The new manager reaches every agent it can at once: probes, then its own
				// epoch's pushes, answered as any request is (some fail).
				for range 2 {
					for h.c.sched.hasReady() {
						if w := h.c.startWork(h.c.sched.popReady(), h.now); w != nil {
							complete(pending{w: w, c: h.c, dl: w.sentAt.Add(hPT), proc: agents[w.to.URL].proc}, randomOutcome(w.to.URL, false))
						}
					}
				}
			}
		case r < max(33, restartBelow):
			lastMsg = "epoch record read"
			readRecord()
		case r < 55:
			lastMsg = "start requests"
			for h.c.sched.hasReady() {
				if w := h.c.startWork(h.c.sched.popReady(), h.now); w != nil {
					inflight = append(inflight, pending{w: w, c: h.c, dl: w.sentAt.Add(hPT), proc: agents[w.to.URL].proc})
					// As the engine does (Engine.signTogether): a batchable renewal starts the
					// other renewals ready with it, to be signed together.
					if batchable(w) && rng.IntN(4) != 0 {
						for _, w2 := range h.c.startRenewals(1+rng.IntN(8), h.now) {
							stats.batched++
							inflight = append(inflight, pending{w: w2, c: h.c, dl: w2.sentAt.Add(hPT), proc: agents[w2.to.URL].proc})
						}
					}
				}
			}
		case r < 75:
			lastMsg = "answers"
			rng.Shuffle(len(inflight), func(i, j int) { inflight[i], inflight[j] = inflight[j], inflight[i] })
			n := rng.IntN(len(inflight) + 1)
			for _, p := range inflight[:n] {
				complete(p, randomOutcome(p.w.to.URL, false))
			}
			inflight = append(inflight[:0], inflight[n:]...)
		case r < 88:
			lastMsg = "calls"
			traffic()
		case r < 97:
			lastMsg = "time passes"
			tick(time.Duration(1 + rng.Int64N(int64(2*time.Second))))
		default:
			lastMsg = "a long time passes"
			tick(time.Duration(5+rng.IntN(40)) * time.Second)
		}
		h.check()
		if h.c.ledger.fenced {
			fail("fenced: epochs only grow")
		}
	}
	// Liveness: healed, truthful and quiet, everything converges.
	clear(parted)
	clear(liars)
	if !live {
		live = true
		uidN++
		setQ()
	}
	for range 200 {
		tick(100 * time.Millisecond)
		for range 4 { // decides every claim (a read may fail)
			readRecord()
		}
		for h.c.sched.hasReady() {
			if w := h.c.startWork(h.c.sched.popReady(), h.now); w != nil {
				inflight = append(inflight, pending{w: w, c: h.c, dl: w.sentAt.Add(hPT), proc: agents[w.to.URL].proc})
			}
		}
		for _, p := range inflight {
			complete(p, ok)
		}
		inflight = inflight[:0]
	}
	tick(hWin + hRT + time.Second)
	// A grant decided during that quiet spell may meet an agent that restarted unnoticed: its old
	// process is carried for a request timeout before the new one gets the room. Allow for it.
	for i := 0; i < int((hRT+10*time.Second)/(100*time.Millisecond)); i++ {
		if i >= 50 && h.c.reports.report(qKey, h.now).Converged {
			break
		}
		tick(100 * time.Millisecond)
		for range 4 {
			readRecord()
		}
		for h.c.sched.hasReady() {
			if w := h.c.startWork(h.c.sched.popReady(), h.now); w != nil {
				complete(pending{w: w, c: h.c, proc: agents[w.to.URL].proc}, ok)
			}
		}
	}
	rep := h.c.reports.report(qKey, h.now)
	if !rep.Converged {
		fail("did not converge once healed: %+v", rep)
	}
	return stats
}

const (
	delayed outcome = 100 // lands later, within its acceptance bound; the engine times out
	lie     outcome = 101 // answered with a huge epoch (a State, a 409 or a 403 wrong-instance)
)

func pick[T any](rng *rand.Rand, xs []T, ok func(T) bool) T {
	var c []T
	for _, x := range xs {
		if ok(x) {
			c = append(c, x)
		}
	}
	var zero T
	if len(c) == 0 {
		return zero
	}
	return c[rng.IntN(len(c))]
}

// fatalHook routes the harness's Fatalf through the property test's message with the seed.
type fatalHook struct {
	testing.TB
	fail func(string)
}

func (f *fatalHook) Fatalf(format string, args ...any) { f.fail(fmt.Sprintf(format, args...)) }
func (f *fatalHook) Helper()                           {}

// permitsOf is the permits of downstream "q" in a, -1 when a has none (for traces).
func permitsOf(a *assignment.Assignment) int32 {
	for _, d := range a.Downstreams {
		if d.Name == "q" {
			return d.Permits
		}
	}
	return -1
}
