package main

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/version"
)

func TestCheckServerVersion(t *testing.T) {
	for _, c := range []struct {
		git  string
		want string // "" for nil, else a substring of the error
	}{
		{"v1.37.2", ""},
		{"v1.30.0", ""},
		{"v1.33.1-gke.100", ""},
		{"v1.29.4", "apportion-trust-guard"},
		{"v1.28.15", "native sidecars"},
		{"v1.25.0+k3s1", "native sidecars"},
		{"not-a-version", "not-a-version"},
	} {
		err := checkServerVersion(&version.Info{GitVersion: c.git})
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v, want nil", c.git, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error naming %q", c.git, err, c.want)
		}
	}
	if checkServerVersion(nil) == nil {
		t.Error("nil version: want an error")
	}
}
