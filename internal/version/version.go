// Package version holds the release version of the manager and agent binaries, stamped at link
// time by `make build` and `make images`:
//
//	go build -ldflags "-X github.com/apportion/apportion/internal/version.Version=v0.2.0" ./cmd/agent
//
// A binary built without the stamp (go run, go test) reports "dev". The VCS revision and the Go
// version come from the build information the go command embeds, so they need no stamp.
package version

import (
	"fmt"
	"runtime/debug"
)

// Version is the release version; overwritten by the linker (-X), never at run time.
var Version = "dev"

// String is the one-line answer to --version: "<program> <version> (revision <rev>[, modified], <go>)".
// The revision is "unknown" when the binary was built outside a VCS checkout or with -buildvcs=false.
func String(program string) string {
	rev, modified, goVersion := "unknown", false, "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		goVersion = bi.GoVersion
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if modified {
		rev += ", modified"
	}
	return fmt.Sprintf("%s %s (revision %s, %s)", program, Version, rev, goVersion)
}
