package controller

import (
	"context"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
)

// claimingAgents is an in-process AgentClient: the agent at "http://liar" answers every request
// with a State claiming the largest epoch; every other agent accepts what it is pushed.
type claimingAgents struct {
	mu   sync.Mutex
	held map[string]*assignment.Assignment
}

func (c *claimingAgents) Push(_ context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error) {
	if to.URL == "http://liar" {
		return nil, &assignment.StaleError{State: assignment.State{Epoch: 1<<53 - 1, Generation: 1, Configured: true}}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held[to.Pod] = a
	return &assignment.State{Instance: "i", Epoch: a.Epoch, Generation: a.Generation, Configured: true}, nil
}

func (c *claimingAgents) State(_ context.Context, to assignment.Endpoint, _ int64) (*assignment.State, error) {
	if to.URL == "http://liar" {
		return &assignment.State{Epoch: 1<<53 - 1, Generation: 1, Configured: true}, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if a := c.held[to.Pod]; a != nil {
		return &assignment.State{Instance: "i", Epoch: a.Epoch, Generation: a.Generation, Configured: true}, nil
	}
	return &assignment.State{Instance: "i"}, nil
}

// docs/protocol.md §9 with a real API server: the epoch record (the ConfigMap apportion-epoch,
// read without a cache) decides whether an agent's newer epoch fences the engine. A pod claiming
// the largest epoch is named misbehaving and the engine goes on; once a newer manager took an
// epoch, the next claim fences it.
var _ = Describe("Fencing by the epoch record", func() {
	It("refutes a pod's claim of a newer epoch, and fences once a newer manager wrote the record", func() {
		ctx := context.Background()
		managerNS, appNS := newNamespace(ctx), newNamespace(ctx)
		epochs := &push.ConfigMapEpoch{Reader: k8sClient, Writer: k8sClient, Namespace: managerNS}
		var mu sync.Mutex
		var events []push.Event
		e, err := push.New(push.Options{
			Client: &claimingAgents{held: map[string]*assignment.Assignment{}},
			Epoch:  epochs, Record: epochs,
			LeaseTTL: time.Second, RenewEvery: 300 * time.Millisecond, PushTimeout: 200 * time.Millisecond,
			AcceptGrace: 100 * time.Millisecond, RetryBase: 50 * time.Millisecond, RetryMax: 200 * time.Millisecond,
			OnEvent: func(ev push.Event) {
				mu.Lock()
				events = append(events, ev)
				mu.Unlock()
			},
		})
		Expect(err).NotTo(HaveOccurred())
		runCtx, stop := context.WithCancel(ctx)
		defer stop()
		done := make(chan error, 1)
		go func() { done <- e.Start(runCtx) }()
		Eventually(e.Epoch).ShouldNot(BeZero())

		key := types.NamespacedName{Namespace: appNS, Name: "q"}
		d := push.DesiredQuota{Key: key, Limit: 8, Downstream: assignment.Downstream{Name: "q", Upstream: "http://upstream",
			RequestTimeout: assignment.Duration(100 * time.Millisecond)}}
		d.Pods = []push.DesiredPod{
			{Name: "honest", UID: "uid-honest", Target: "web", Endpoint: "http://honest", Permits: 4, SafeDefault: 1},
			{Name: "liar", UID: "uid-liar", Target: "web", Endpoint: "http://liar", Permits: 4, SafeDefault: 1},
		}
		e.SetQuota(d)
		Eventually(func() []string { return e.Report(key).Misbehaving }).Should(Equal([]string{"liar"}))
		Eventually(func() int32 { return grantOf(e.Report(key), "honest") }, 10*time.Second).Should(Equal(int32(4)))
		Consistently(done, time.Second).ShouldNot(Receive())
		mu.Lock()
		Expect(events).To(ContainElement(Satisfy(func(ev push.Event) bool {
			return ev.Quota == key && ev.Warning && ev.Reason == push.ReasonAgentClaimsNewerEpoch && strings.Contains(ev.Message, "pod liar ")
		})))
		mu.Unlock()

		// A newer manager takes the next epoch from the same record: the liar's next claim is
		// now confirmed by the record, and the engine stops.
		newer, err := (&push.ConfigMapEpoch{Reader: k8sClient, Writer: k8sClient, Namespace: managerNS}).NextEpoch(ctx)
		Expect(err).NotTo(HaveOccurred())
		Expect(newer).To(BeNumerically(">", e.Epoch()))
		var stopped error
		Eventually(done, 10*time.Second).Should(Receive(&stopped))
		Expect(stopped).To(MatchError(push.ErrFenced))
	})
})

func grantOf(r push.Report, pod string) int32 {
	for _, h := range r.Holdings {
		if h.Pod == pod {
			return h.Granted
		}
	}
	return -1
}
