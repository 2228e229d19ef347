package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"
)

// Module is the module path of the repository the harness builds.
const Module = "github.com/apportion/apportion"

// RepoRoot finds the repository root: the nearest directory above the working directory whose
// go.mod declares Module.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && regexp.MustCompile(`(?m)^module\s+`+regexp.QuoteMeta(Module)+`\s*$`).Match(data) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no go.mod of %s above the working directory", Module)
		}
		dir = parent
	}
}

// Binaries are the built manager and agent, with the flags each accepts.
type Binaries struct {
	Dir     string
	Manager string
	// Agent is "" when cmd/agent does not exist or does not build (AgentErr says why).
	Agent    string
	AgentErr error
	// Race is true when they were built with -race.
	Race         bool
	ManagerFlags map[string]bool
	AgentFlags   map[string]bool
	BuildTime    time.Duration
}

// HasAgent reports whether the agent binary was built.
func (b *Binaries) HasAgent() bool { return b != nil && b.Agent != "" }

// ManagerHas reports whether the manager accepts --name.
func (b *Binaries) ManagerHas(name string) bool { return b.ManagerFlags[name] }

// AgentHas reports whether the agent accepts --name.
func (b *Binaries) AgentHas(name string) bool { return b.AgentFlags[name] }

// Pushes reports whether the manager has the push engine wired (it takes --lease-ttl).
func (b *Binaries) Pushes() bool { return b.ManagerHas("lease-ttl") }

var (
	buildOnce sync.Once
	buildRes  *Binaries
	buildErr  error
)

// Build builds ./cmd/manager and ./cmd/agent once per process into a temporary directory (the
// Go build cache makes a rebuild fast). They are built without -race, even under `go test
// -race`: a dozen race-instrumented agents and the manager take too much of two cores for the
// monitor to keep its rate; E2E_RACE=1 builds them with -race (then every data race in the
// manager or an agent shows in its log). E2E_MANAGER_PKG builds another main package as the
// manager. The directory is removed by RemoveBuild.
//
// The build is shared by every test of the process, so it does not run under the deadline of
// the test that happens to ask first (a test's one-minute context once failed every e2e test of
// a `make test` when the build took longer on a loaded machine): it keeps ctx's values, not its
// cancellation, and has a bound of its own, buildTimeout.
func Build(ctx context.Context) (*Binaries, error) {
	buildOnce.Do(func() {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), buildTimeout)
		defer cancel()
		buildRes, buildErr = build(bctx)
	})
	return buildRes, buildErr
}

// buildTimeout bounds the shared build: a cold build of both binaries on a loaded 2-core
// machine takes a few minutes; far beyond that something hangs.
const buildTimeout = 15 * time.Minute

// RemoveBuild deletes the binaries' directory.
func RemoveBuild() {
	if buildRes != nil {
		_ = os.RemoveAll(buildRes.Dir)
	}
}

func build(ctx context.Context) (*Binaries, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "apportion-e2e-bin-")
	if err != nil {
		return nil, err
	}
	race := false
	switch os.Getenv("E2E_RACE") {
	case "1", "true":
		race = true
	case "follow":
		race = raceEnabled
	}
	b := &Binaries{Dir: dir, Manager: filepath.Join(dir, "manager"), Race: race}
	start := time.Now()
	buildPkg := func(pkg string) error { return goBuild(ctx, root, dir, race, pkg) }
	managerPkg := "./cmd/manager"
	if p := os.Getenv("E2E_MANAGER_PKG"); p != "" {
		managerPkg = p // a variant of the manager, e.g. while a change is being wired
	}
	if err := buildPkg(managerPkg); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if base := filepath.Base(managerPkg); base != "manager" {
		if err := os.Rename(filepath.Join(dir, base), b.Manager); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	if fi, err := os.Stat(filepath.Join(root, "cmd", "agent")); err != nil || !fi.IsDir() {
		b.AgentErr = errors.New("cmd/agent does not exist")
	} else if err := buildPkg("./cmd/agent"); err != nil {
		b.AgentErr = err
	} else {
		b.Agent = filepath.Join(dir, "agent")
	}
	b.BuildTime = time.Since(start)
	if b.ManagerFlags, err = flagsOf(ctx, b.Manager); err != nil {
		return nil, err
	}
	if b.Agent != "" {
		if b.AgentFlags, err = flagsOf(ctx, b.Agent); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// goBuild builds main package pkg of the repository at root into dir (buildFlags).
func goBuild(ctx context.Context, root, dir string, race bool, pkg string) error {
	args, env := buildFlags(dir, race)
	args = append(args, pkg)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out.String())
	}
	return nil
}

// buildFlags are the go build arguments (up to the package) and environment of the binaries
// put in dir. Without -race they are built as the images build them (hack/images: static, with
// CGO_ENABLED=0 and -trimpath): what runs here is what ships, and in `make test` the
// dependencies compiled once for the images' test serve these builds too, from the build cache
// (a third configuration of the whole dependency graph would cost minutes of a cold run). -race
// needs cgo, so a race build keeps the default configuration.
func buildFlags(dir string, race bool) (args, env []string) {
	args = []string{"build", "-o", dir + string(filepath.Separator)}
	if race {
		return append(args, "-race"), os.Environ()
	}
	return append(args, "-trimpath"), append(os.Environ(), "CGO_ENABLED=0")
}

var flagLine = regexp.MustCompile(`(?m)^\s+--?([A-Za-z0-9][-A-Za-z0-9_.]*)`)

// flagsOf runs "bin -h" and collects the flag names its usage lists (Go's flag package and
// pflag formats).
func flagsOf(ctx context.Context, bin string) (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-h")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return nil, fmt.Errorf("%s -h: %w", bin, err)
	}
	flags := map[string]bool{}
	for _, m := range flagLine.FindAllStringSubmatch(out.String(), -1) {
		flags[m[1]] = true
	}
	if len(flags) == 0 {
		return nil, fmt.Errorf("%s -h listed no flags:\n%s", bin, out.String())
	}
	return flags, nil
}

// BuildPackage builds one more main package of the repository (e.g. ./test/e2e/fakeagent) into
// the binaries' directory, with the same flags, and returns its path.
func BuildPackage(ctx context.Context, pkg string) (string, error) {
	b, err := Build(ctx)
	if err != nil {
		return "", err
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	if err := goBuild(ctx, root, b.Dir, b.Race, pkg); err != nil {
		return "", err
	}
	return filepath.Join(b.Dir, filepath.Base(pkg)), nil
}

// FirstLine is the first line of err's message ("" for nil): build errors carry the whole
// compiler output, which is too long for a test's or the demo's one-line report.
func FirstLine(err error) string {
	if err == nil {
		return ""
	}
	s := err.Error()
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}
