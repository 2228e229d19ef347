package controller

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestAgentBootstraps(t *testing.T) {
	for _, tc := range []struct {
		name    string
		command []string
		args    []string
		want    bool
	}{
		{"no flags", nil, nil, false},
		{"other flags", []string{"/agent"}, []string{"--listen=:15001", "--bootstrap-not-this"}, false},
		{"a value that says bootstrap", []string{"/agent"}, []string{"--key-file", "bootstrap"}, false},
		{"--bootstrap FILE", []string{"/agent"}, []string{"--bootstrap", "/etc/boot.json"}, true},
		{"--bootstrap=FILE", nil, []string{"--bootstrap=/etc/boot.json"}, true},
		{"-bootstrap in the command", []string{"/agent", "-bootstrap", "/b.json"}, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{
				{Name: "app", Args: []string{"serve"}},
				{Name: "agent", Command: tc.command, Args: tc.args},
			}}}
			if got := agentBootstraps(p); got != tc.want {
				t.Fatalf("agentBootstraps(%q %q) = %v, want %v", tc.command, tc.args, got, tc.want)
			}
		})
	}
}
