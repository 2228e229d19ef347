package main

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// TestBuildPushPull builds both images as `make images` does, pushes them to a registry served
// in process on loopback as `make images-push` does, pulls them back and checks what a cluster
// relies on: the digest survives the round trip, the entrypoint, the non-root user, the
// annotations, the CA bundle, and that the binary taken out of the pulled image runs and
// reports the stamped version. The docker-style archive holds the same image under its tag.
func TestBuildPushPull(t *testing.T) {
	if testing.Short() {
		t.Skip("builds two binaries")
	}
	srv := httptest.NewServer(registry.New(registry.Logger(discardLogger())))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")

	const version = "v0.0.0-imagetest"
	out := t.TempDir()
	spec, err := parseBuild([]string{"-out", out, "-version", version, "-revision", "0123abcd",
		"-created", "2026-01-02T03:04:05Z",
		"-manager", host + "/apportion/manager:test", "-agent", host + "/apportion/agent:test"})
	if err != nil {
		t.Fatal(err)
	}
	spec.ModuleDir = filepath.Join("..", "..")
	ctx := context.Background()
	res, err := build(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	pushed, err := push(ctx, filepath.Join(out, "oci"))
	if err != nil {
		t.Fatal(err)
	}
	if len(pushed) != 2 || len(res) != 2 {
		t.Fatalf("built %d, pushed %d images; want 2 and 2", len(res), len(pushed))
	}
	for i, b := range res {
		t.Run(b.Name, func(t *testing.T) {
			if pushed[i].Ref.String() != b.Ref.String() || pushed[i].Digest != b.Digest {
				t.Errorf("pushed %s@%s, built %s@%s", pushed[i].Ref, pushed[i].Digest, b.Ref, b.Digest)
			}
			pulled, err := remote.Image(b.Ref, remote.WithContext(ctx))
			if err != nil {
				t.Fatal(err)
			}
			if d, _ := pulled.Digest(); d != b.Digest {
				t.Errorf("pulled digest %s, built %s", d, b.Digest)
			}
			checkImage(t, pulled, b.Name, version)

			// The docker-style archive: one image under its tag. Its format has no manifest (a
			// loader writes its own, without annotations), so what must match is the image ID
			// (the config's digest) and the layers.
			fromTar, err := tarball.ImageFromPath(b.Archive, &b.Ref)
			if err != nil {
				t.Fatalf("reading %s as a docker archive: %v", b.Archive, err)
			}
			if got, want := configAndLayers(t, fromTar), configAndLayers(t, b.Image); !slices.Equal(got, want) {
				t.Errorf("archive holds config and layers %v, built %v", got, want)
			}
			m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(b.Archive) })
			if err != nil || len(m) != 1 || len(m[0].RepoTags) != 1 || m[0].RepoTags[0] != b.Ref.String() {
				t.Errorf("archive manifest.json = %+v, %v; want one image tagged %s", m, err, b.Ref)
			}
			t.Logf("%s: %d bytes to pull, binary %d bytes", b.Name, b.CompressedSize, b.BinarySize)
		})
	}
}

// configAndLayers lists the digests of img's config and layers.
func configAndLayers(t *testing.T, img v1.Image) []v1.Hash {
	t.Helper()
	c, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	out := []v1.Hash{c}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// checkImage reads the pulled image's config, manifest and files.
func checkImage(t *testing.T, img v1.Image, bin, version string) {
	t.Helper()
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if got := cf.Config.Entrypoint; len(got) != 1 || got[0] != "/"+bin {
		t.Errorf("entrypoint %q, want [/%s]", got, bin)
	}
	if cf.Config.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532", cf.Config.User)
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH {
		t.Errorf("platform %s/%s", cf.OS, cf.Architecture)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"org.opencontainers.image.version":  version,
		"org.opencontainers.image.revision": "0123abcd",
		"org.opencontainers.image.source":   "https://github.com/apportion/apportion",
		"org.opencontainers.image.created":  "2026-01-02T03:04:05Z",
		"org.opencontainers.image.title":    "apportion-" + bin,
	}
	for k, v := range want {
		if m.Annotations[k] != v {
			t.Errorf("manifest annotation %s = %q, want %q", k, m.Annotations[k], v)
		}
		if cf.Config.Labels[k] != v {
			t.Errorf("config label %s = %q, want %q", k, cf.Config.Labels[k], v)
		}
	}

	files := extract(t, img)
	if !strings.Contains(string(files["etc/passwd"].body), "nonroot:x:65532:65532:") {
		t.Errorf("/etc/passwd lacks the nonroot user: %q", files["etc/passwd"].body)
	}
	if ca := files[caPath]; !strings.Contains(string(ca.body), "BEGIN CERTIFICATE") {
		t.Errorf("%s is not a PEM bundle (%d bytes)", caPath, len(ca.body))
	}
	if files["tmp"].mode&0o1777 != 0o1777 {
		t.Errorf("/tmp mode %o, want 1777", files["tmp"].mode)
	}
	f, ok := files[bin]
	if !ok || f.mode&0o111 == 0 {
		t.Fatalf("/%s missing or not executable (mode %o)", bin, f.mode)
	}
	if runtime.GOOS != "linux" {
		t.Skip("the image's binary runs on linux only")
	}
	exe := filepath.Join(t.TempDir(), bin)
	if err := os.WriteFile(exe, f.body, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "--version")
	cmd.Env = []string{} // as in the image: nothing inherited
	b, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("%s --version: %v\n%s", bin, err, ee.Stderr)
		}
		t.Fatal(err)
	}
	if got := string(b); !strings.HasPrefix(got, bin+" "+version+" (revision ") {
		t.Errorf("%s --version printed %q, want %q first", bin, got, bin+" "+version)
	}
}

type file struct {
	mode int64
	body []byte
}

// extract reads the flattened file system of img.
func extract(t *testing.T, img v1.Image) map[string]file {
	t.Helper()
	rc := mutate.Extract(img)
	defer func() { _ = rc.Close() }()
	tr := tar.NewReader(rc)
	files := map[string]file{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[strings.TrimSuffix(h.Name, "/")] = file{mode: h.Mode, body: body}
	}
}

func TestParseBuildRefusesBadInput(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"-manager", "r/m:1", "-agent", "r/a:1"}, "-version is required"},
		{[]string{"-version", "v1", "-manager", "r/m", "-agent", "r/a:1"}, "-manager \"r/m\""},
		{[]string{"-version", "v1", "-manager", "r/m:1", "-agent", "R/A:1"}, "-agent"},
		{[]string{"-version", "v1", "-manager", "r/m:1", "-agent", "r/a:1", "-created", "yesterday"}, "-created"},
		{[]string{"-version", "v1", "-manager", "r/m:1", "-agent", "r/a:1", "-ca-bundle", "/nonexistent"}, "-ca-bundle"},
		{[]string{"-version", "v1", "-manager", "r/m:1", "-agent", "r/a:1", "extra"}, "unexpected arguments"},
	}
	for _, tt := range tests {
		if _, err := parseBuild(tt.args); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("parseBuild(%q) = %v, want an error naming %q", tt.args, err, tt.want)
		}
	}
}

func TestPushRefusesLayoutWithoutReference(t *testing.T) {
	if _, err := push(context.Background(), filepath.Join(t.TempDir(), "missing")); err == nil ||
		!strings.Contains(err.Error(), "make images") {
		t.Errorf("push of a missing layout = %v, want an error pointing at make images", err)
	}
}

// discardLogger keeps the registry's per-request log lines out of the test output.
func discardLogger() *log.Logger { return log.New(io.Discard, "", 0) }
