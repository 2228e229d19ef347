package harness

import (
	"strings"
	"text/template"
)

// Annotations the harness's kubelet sets on a pod for kwok's stages (kwokStages) to act on.
const (
	// AgentReadyAnnotation ("true") says the pod's agent answered /readyz: kwok's pod-ready
	// stage then sets the pod's Ready condition, as a readiness probe on /readyz would.
	AgentReadyAnnotation = "e2e.apportion.io/agent-ready"
	// AgentStoppedAnnotation ("true") on a terminating pod says its agent has exited: kwok's
	// pod-delete stage then deletes the pod, as a kubelet does once the containers stopped.
	AgentStoppedAnnotation = "e2e.apportion.io/agent-stopped"
)

// kwokStages is kwok's configuration: which status each node and pod it manages gets, and when.
//
//   - node-initialize (kwok's own "fast" stage): a managed node is Ready at once, with room for
//     any number of pods.
//   - pod-start: a pod scheduled to a managed node gets an address from the node's podCIDR (a
//     loopback /24, see Cluster), phase Running, its containers running but not ready, and
//     Ready=False: the harness starts its agent at that address.
//   - pod-ready: once the harness set AgentReadyAnnotation, Ready=True (and ContainersReady):
//     readiness follows the agent's /readyz, so the endpoint-slice controller publishes the pod
//     only then.
//   - pod-delete: a terminating pod is deleted once the harness set AgentStoppedAnnotation, so
//     the pod stays terminating for as long as its agent drains.
//
// The node heartbeat is kwok's node Lease (--node-lease-duration-seconds), which the
// node-lifecycle controller reads; a lost node is a deleted Node object, which the pod garbage
// collector acts on.
var kwokStages = renderKwokStages([]kwokStage{{
	Name: "node-initialize", Kind: "Node",
	When:   []kwokMatch{{`.status.conditions.[] | select( .type == "Ready" ) | .status`, "NotIn", []string{"True"}}},
	Status: kwokNodeStatus,
}, {
	Name: "pod-start", Kind: "Pod",
	When: []kwokMatch{notDeleted, {".status.podIP", "DoesNotExist", nil}},
	Pod: &kwokPodStatus{
		Conditions: []kwokCondition{{"PodScheduled", "True"}, {"Initialized", "True"}, {"ContainersReady", "False"}, {"Ready", "False"}},
		Containers: ".spec.containers", InitContainers: ".spec.initContainers",
	},
	Status: kwokPodAddress,
}, {
	Name: "pod-ready", Kind: "Pod",
	When: []kwokMatch{
		notDeleted,
		{".status.phase", "In", []string{"Running"}},
		annotated(AgentReadyAnnotation),
		{`.status.conditions.[] | select( .type == "Ready" ) | .status`, "NotIn", []string{"True"}},
	},
	Pod: &kwokPodStatus{
		Conditions: []kwokCondition{{"ContainersReady", "True"}, {"Ready", "True"}},
		Containers: ".status.containerStatuses", InitContainers: ".status.initContainerStatuses",
		Ready: true,
	},
}, {
	Name: "pod-delete", Kind: "Pod",
	When:   []kwokMatch{{".metadata.deletionTimestamp", "Exists", nil}, annotated(AgentStoppedAnnotation)},
	Delete: true,
}})

// kwokStage is one kwok Stage: the objects of Kind it acts on (When: every expression holds),
// and what they get next: a status (Pod's, then Status, kwok's own template text as is), or
// their deletion.
type kwokStage struct {
	Name, Kind string
	When       []kwokMatch
	Pod        *kwokPodStatus
	Status     string
	Delete     bool
}

// kwokMatch is one of a stage's selector's match expressions.
type kwokMatch struct {
	Key, Op string
	Values  []string
}

var notDeleted = kwokMatch{".metadata.deletionTimestamp", "DoesNotExist", nil}

// annotated matches a pod the harness annotated key=true.
func annotated(key string) kwokMatch {
	return kwokMatch{`.metadata.annotations["` + key + `"]`, "In", []string{"true"}}
}

// kwokPodStatus is a pod's status at a stage: its Conditions set at the stage's time (one not
// True says why: AgentNotReady), and every container listed at Containers and InitContainers
// (paths into the pod) running, Ready or not.
type kwokPodStatus struct {
	Conditions                 []kwokCondition
	Containers, InitContainers string
	Ready                      bool
}

type kwokCondition struct{ Type, Status string }

// kwokStageTemplate renders stages. Its own actions are [[ ]]: the {{ }} are kwok's, evaluated
// by kwok over each object.
const kwokStageTemplate = `[[ range $i, $s := . ]][[ if $i ]]---
[[ end ]]apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: [[ .Name ]]
spec:
  resourceRef:
    apiGroup: v1
    kind: [[ .Kind ]]
  selector:
    matchExpressions:
[[- range .When ]]
    - key: '[[ .Key ]]'
      operator: '[[ .Op ]]'
[[- with .Values ]]
      values:
[[- range . ]]
      - '[[ . ]]'
[[- end ]][[ end ]][[ end ]]
  next:
[[- if .Delete ]]
    delete: true
[[- else ]]
    statusTemplate: |
[[- with .Pod ]]
      {{ $now := Now }}
      conditions:
[[- range .Conditions ]]
      - lastTransitionTime: {{ $now | Quote }}
        status: "[[ .Status ]]"
[[- if ne .Status "True" ]]
        reason: AgentNotReady
[[- end ]]
        type: [[ .Type ]]
[[- end ]]
[[- template "containers" (list "containerStatuses" .Containers .Ready) ]]
[[- template "containers" (list "initContainerStatuses" .InitContainers .Ready) ]]
[[- end ]]
[[- with .Status ]]
[[ indent . ]]
[[- end ]]
[[- end ]]
[[ end ]]
[[- define "containers" ]]
      [[ index . 0 ]]:
      {{ range [[ index . 1 ]] }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: [[ index . 2 ]]
        restartCount: 0
        started: true
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
[[- end ]]`

func renderKwokStages(stages []kwokStage) string {
	t := template.Must(template.New("stages").Delims("[[", "]]").Funcs(template.FuncMap{
		"list": func(v ...any) []any { return v },
		// indent puts kwok's status text under statusTemplate's block scalar.
		"indent": func(s string) string {
			return "      " + strings.ReplaceAll(strings.TrimSpace(s), "\n", "\n      ")
		},
	}).Parse(kwokStageTemplate))
	var b strings.Builder
	if err := t.Execute(&b, stages); err != nil {
		panic(err) // the stages are constants: a test run of the cluster mode finds any mistake
	}
	return b.String()
}

// kwokNodeStatus is a managed node's status, Ready (kwok's "fast" node stage).
const kwokNodeStatus = `
{{ $now := Now }}
{{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $lastTransitionTime | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type  | Quote}}
{{ end }}
addresses:
{{ with NodeIP }}
- address: {{ . | Quote }}
  type: InternalIP
{{ end }}
{{ with NodeName }}
- address: {{ . | Quote }}
  type: Hostname
{{ end }}
allocatable:
  cpu: 1k
  memory: 1Ti
  pods: 1M
capacity:
  cpu: 1k
  memory: 1Ti
  pods: 1M
nodeInfo:
  architecture: amd64
  containerRuntimeVersion: kwok
  kernelVersion: kwok
  kubeProxyVersion: kwok
  kubeletVersion: kwok
  operatingSystem: linux
phase: Running
`

// kwokPodAddress is a started pod's addresses (from its node's podCIDR), phase and start.
const kwokPodAddress = `
{{ $hostIPs := NodeIPsWith .spec.nodeName }}
{{ with $hostIPs }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
`
