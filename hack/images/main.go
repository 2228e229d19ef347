// Command images builds and pushes the manager and agent container images without a container
// daemon, with go-containerregistry as a library (`make images`, `make images-push`).
//
//	go run ./hack/images build -out dist/images -version v0.1.0 \
//	    -manager ghcr.io/apportion/manager:v0.1.0 -agent ghcr.io/apportion/agent:v0.1.0
//	go run ./hack/images push -layout dist/images/oci
//
// build compiles each binary with `go build` (CGO_ENABLED=0, -trimpath, the version stamped into
// internal/version by -ldflags) for linux/<-arch> and assembles an image from nothing (scratch)
// plus two layers:
//
//   - base: /etc/passwd and /etc/group with root and nonroot (65532), /home/nonroot, /tmp (1777),
//     and the CA bundle (-ca-bundle, the build machine's Debian/Alpine bundle by default) at
//     /etc/ssl/certs/ca-certificates.crt, where Go's crypto/x509 looks on Linux, so https
//     upstreams verify;
//   - app: the binary at /manager or /agent, mode 0755.
//
// The config runs the binary as the entrypoint as user 65532:65532; the OCI annotations
// (org.opencontainers.image.*: title, description, version, revision, source, created) are on
// the manifest and repeated as config labels, where `docker inspect` shows them. Every file's
// time and the image's created time are -created (default: the commit time of HEAD), so two
// builds of one commit give the same digests.
//
// Outputs under -out: <name>.tar per image, a docker-style archive (manifest.json with RepoTags)
// that `docker load`, `kind load image-archive` and `ctr images import` accept; and oci/, an OCI
// image layout holding both, each manifest annotated with its reference
// (org.opencontainers.image.ref.name), which push reads.
//
// push sends every image of the layout to the reference it is annotated with, using the
// credentials of ~/.docker/config.json (authn.DefaultKeychain); a registry on localhost or a
// loopback address is spoken to over plain HTTP, as go-containerregistry does for those names.
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const (
	// nonRoot is the uid and gid the images run as (distroless' nonroot).
	nonRoot = 65532
	// caPath is where Go's crypto/x509 looks first on Linux.
	caPath = "etc/ssl/certs/ca-certificates.crt"
	// refAnnotation names an image's reference in the OCI layout's index.
	refAnnotation = "org.opencontainers.image.ref.name"
	// versionPkg receives the version at link time.
	versionPkg = "github.com/apportion/apportion/internal/version.Version"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("usage: images build|push [flags]")
	}
	switch args[0] {
	case "build":
		spec, err := parseBuild(args[1:])
		if err != nil {
			return err
		}
		res, err := build(ctx, spec)
		if err != nil {
			return err
		}
		for _, r := range res {
			_, _ = fmt.Fprintf(stdout, "%s %s: %s, %d bytes compressed (binary %d bytes), archive %s\n",
				r.Name, r.Ref, r.Digest, r.CompressedSize, r.BinarySize, r.Archive)
		}
		return nil
	case "push":
		fs := flag.NewFlagSet("push", flag.ContinueOnError)
		dir := fs.String("layout", "dist/images/oci", "OCI layout written by build")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if fs.NArg() > 0 {
			return fmt.Errorf("push: unexpected arguments %q", fs.Args())
		}
		pushed, err := push(ctx, *dir, remote.WithAuthFromKeychain(authn.DefaultKeychain))
		for _, p := range pushed {
			_, _ = fmt.Fprintf(stdout, "pushed %s@%s\n", p.Ref, p.Digest)
		}
		return err
	default:
		return fmt.Errorf("unknown command %q: want build or push", args[0])
	}
}

// image is one image to build: its short name (the binary, ./cmd/<name>) and reference.
type image struct {
	Name        string
	Ref         name.Tag
	Description string
}

// buildSpec is everything build needs; parseBuild fills it from flags and checks it.
type buildSpec struct {
	Out      string
	Version  string
	Revision string
	Source   string
	Created  time.Time
	Arch     string
	CABundle string
	Images   []image
	// ModuleDir is where `go build ./cmd/<name>` runs (the repository root).
	ModuleDir string
}

func parseBuild(args []string) (buildSpec, error) {
	var s buildSpec
	fs := flag.NewFlagSet("build", flag.ContinueOnError)
	fs.StringVar(&s.Out, "out", "dist/images", "output `directory`")
	fs.StringVar(&s.Version, "version", "", "version stamped into the binaries and the annotations (required)")
	fs.StringVar(&s.Revision, "revision", "", "VCS revision for the annotations (default: git rev-parse HEAD)")
	fs.StringVar(&s.Source, "source", "https://github.com/apportion/apportion", "source repository URL for the annotations")
	created := fs.String("created", "", "RFC 3339 time of the files and the image (default: HEAD's commit time)")
	fs.StringVar(&s.Arch, "arch", runtime.GOARCH, "GOARCH of the linux binaries")
	fs.StringVar(&s.CABundle, "ca-bundle", "/etc/ssl/certs/ca-certificates.crt", "PEM bundle of trusted CAs copied into the images")
	mgr := fs.String("manager", "", "manager image reference, registry/name:tag (required)")
	agent := fs.String("agent", "", "agent image reference, registry/name:tag (required)")
	if err := fs.Parse(args); err != nil {
		return s, err
	}
	var errs []error
	if fs.NArg() > 0 {
		errs = append(errs, fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	if s.Version == "" {
		errs = append(errs, errors.New("-version is required"))
	}
	for _, i := range []struct{ flag, ref, name, desc string }{
		{"-manager", *mgr, "manager", "Apportion manager: apportions each downstream's global concurrency limit among the pods that share it"},
		{"-agent", *agent, "agent", "Apportion agent: the in-pod sidecar proxy that enforces a pod's permits"},
	} {
		// A tag, never a digest or an implied :latest: the reference lands in manifests.
		t, err := name.NewTag(i.ref, name.StrictValidation)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %q: want registry/name:tag: %w", i.flag, i.ref, err))
			continue
		}
		s.Images = append(s.Images, image{Name: i.name, Ref: t, Description: i.desc})
	}
	if s.Revision == "" {
		rev, err := git("rev-parse", "HEAD")
		if err != nil {
			errs = append(errs, fmt.Errorf("-revision not given and git failed: %w", err))
		}
		s.Revision = rev
	}
	if *created == "" {
		ts, err := git("log", "-1", "--format=%ct")
		if err == nil {
			var sec int64
			sec, err = strconv.ParseInt(ts, 10, 64)
			s.Created = time.Unix(sec, 0).UTC()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("-created not given and HEAD's commit time unknown: %w", err))
		}
	} else {
		t, err := time.Parse(time.RFC3339, *created)
		if err != nil {
			errs = append(errs, fmt.Errorf("-created %q: %w", *created, err))
		}
		s.Created = t.UTC()
	}
	if _, err := os.Stat(s.CABundle); err != nil {
		errs = append(errs, fmt.Errorf("-ca-bundle: %w (install the ca-certificates package or point -ca-bundle at a PEM bundle)", err))
	}
	return s, errors.Join(errs...)
}

func git(args ...string) (string, error) {
	out, err := exec.Command("git", args...).Output()
	return strings.TrimSpace(string(out)), err
}

// built describes one image build wrote.
type built struct {
	Name, Archive  string
	Ref            name.Tag
	Digest         v1.Hash
	Image          v1.Image
	CompressedSize int64 // manifest + config + compressed layers: what a pull transfers
	BinarySize     int64
}

// build compiles the binaries and writes the archives and the OCI layout under s.Out. The
// layout is written afresh: images of an earlier build with other references do not linger.
func build(ctx context.Context, s buildSpec) ([]built, error) {
	if err := os.MkdirAll(s.Out, 0o755); err != nil {
		return nil, err
	}
	binDir, err := os.MkdirTemp("", "apportion-images")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(binDir) }()

	ca, err := os.ReadFile(s.CABundle)
	if err != nil {
		return nil, err
	}
	base, err := baseLayer(ca, s.Created)
	if err != nil {
		return nil, err
	}
	ociDir := filepath.Join(s.Out, "oci")
	if err := os.RemoveAll(ociDir); err != nil {
		return nil, err
	}
	lp, err := layout.Write(ociDir, empty.Index)
	if err != nil {
		return nil, err
	}
	var res []built
	for _, im := range s.Images {
		bin := filepath.Join(binDir, im.Name)
		if err := goBuild(ctx, s, im.Name, bin); err != nil {
			return nil, err
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			return nil, err
		}
		img, err := assemble(s, im, base, b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", im.Name, err)
		}
		archive := filepath.Join(s.Out, im.Name+".tar")
		if err := tarball.WriteToFile(archive, im.Ref, img); err != nil {
			return nil, fmt.Errorf("%s: writing %s: %w", im.Name, archive, err)
		}
		if err := lp.AppendImage(img, layout.WithAnnotations(map[string]string{refAnnotation: im.Ref.String()})); err != nil {
			return nil, fmt.Errorf("%s: OCI layout: %w", im.Name, err)
		}
		d, err := img.Digest()
		if err != nil {
			return nil, err
		}
		size, err := pullSize(img)
		if err != nil {
			return nil, err
		}
		res = append(res, built{Name: im.Name, Archive: archive, Ref: im.Ref, Digest: d, Image: img,
			CompressedSize: size, BinarySize: int64(len(b))})
	}
	return res, nil
}

// goBuild compiles ./cmd/<name> as a static linux binary with the version stamped in.
func goBuild(ctx context.Context, s buildSpec, cmdName, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags", fmt.Sprintf("-s -w -X %s=%s", versionPkg, s.Version),
		"-o", out, "./cmd/"+cmdName)
	cmd.Dir = s.ModuleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+s.Arch)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/%s: %w\n%s", cmdName, err, b)
	}
	return nil
}

// annotations are the OCI annotations of one image, also used as its config labels.
func annotations(s buildSpec, im image) map[string]string {
	return map[string]string{
		"org.opencontainers.image.title":       "apportion-" + im.Name,
		"org.opencontainers.image.description": im.Description,
		"org.opencontainers.image.version":     s.Version,
		"org.opencontainers.image.revision":    s.Revision,
		"org.opencontainers.image.source":      s.Source,
		"org.opencontainers.image.url":         s.Source,
		"org.opencontainers.image.created":     s.Created.Format(time.RFC3339),
	}
}

// assemble makes the image of one binary: scratch + base + the binary, OCI media types.
func assemble(s buildSpec, im image, base v1.Layer, bin []byte) (v1.Image, error) {
	app, err := layerOf(s.Created, []entry{{path: im.Name, mode: 0o755, body: bin}})
	if err != nil {
		return nil, err
	}
	anns := annotations(s, im)
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, History: v1.History{Created: v1.Time{Time: s.Created}, CreatedBy: "hack/images: passwd, group, tmp, CA bundle", Comment: "base"}},
		mutate.Addendum{Layer: app, History: v1.History{Created: v1.Time{Time: s.Created}, CreatedBy: "hack/images: go build ./cmd/" + im.Name}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", s.Arch
	cf.Created = v1.Time{Time: s.Created}
	cf.Config = v1.Config{
		Entrypoint: []string{"/" + im.Name},
		User:       fmt.Sprintf("%d:%d", nonRoot, nonRoot),
		WorkingDir: "/",
		Env:        []string{"PATH=/", "SSL_CERT_FILE=/" + caPath},
		Labels:     anns,
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, err
	}
	out, ok := mutate.Annotations(img, anns).(v1.Image)
	if !ok {
		return nil, errors.New("annotating the manifest did not return an image")
	}
	return out, nil
}

// entry is one file or directory of a layer.
type entry struct {
	path     string
	mode     int64
	dir      bool
	body     []byte
	uid, gid int
}

func baseLayer(ca []byte, t time.Time) (v1.Layer, error) {
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonRoot, nonRoot)
	group := fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", nonRoot)
	return layerOf(t, []entry{
		{path: "etc", dir: true, mode: 0o755},
		{path: "etc/passwd", mode: 0o644, body: []byte(passwd)},
		{path: "etc/group", mode: 0o644, body: []byte(group)},
		{path: "etc/ssl", dir: true, mode: 0o755},
		{path: "etc/ssl/certs", dir: true, mode: 0o755},
		{path: caPath, mode: 0o644, body: ca},
		{path: "home", dir: true, mode: 0o755},
		{path: "home/nonroot", dir: true, mode: 0o700, uid: nonRoot, gid: nonRoot},
		{path: "root", dir: true, mode: 0o700},
		{path: "tmp", dir: true, mode: 0o1777},
	})
}

// layerOf writes the entries into an uncompressed tar, every time set to t, and wraps it as a
// gzip-compressed OCI layer.
func layerOf(t time.Time, entries []entry) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.path, Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: t, Format: tar.FormatPAX}
		if e.dir {
			h.Typeflag, h.Name = tar.TypeDir, e.path+"/"
		} else {
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.body); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

// pullSize is what pulling img transfers: manifest, config and compressed layers.
func pullSize(img v1.Image) (int64, error) {
	m, err := img.RawManifest()
	if err != nil {
		return 0, err
	}
	c, err := img.RawConfigFile()
	if err != nil {
		return 0, err
	}
	n := int64(len(m) + len(c))
	layers, err := img.Layers()
	if err != nil {
		return 0, err
	}
	for _, l := range layers {
		s, err := l.Size()
		if err != nil {
			return 0, err
		}
		n += s
	}
	return n, nil
}

// pushedImage is one image push sent.
type pushedImage struct {
	Ref    name.Tag
	Digest v1.Hash
}

// push sends every image of the OCI layout at dir to the reference it is annotated with. An
// image without a reference is an error, not skipped: the layout is build's, which names all.
func push(ctx context.Context, dir string, opts ...remote.Option) ([]pushedImage, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("reading the OCI layout %s (run make images first): %w", dir, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(im.Manifests) == 0 {
		return nil, fmt.Errorf("the OCI layout %s holds no image", dir)
	}
	opts = append(opts, remote.WithContext(ctx))
	var done []pushedImage
	for _, desc := range im.Manifests {
		ref, ok := desc.Annotations[refAnnotation]
		if !ok {
			return done, fmt.Errorf("image %s in %s has no %s annotation", desc.Digest, dir, refAnnotation)
		}
		tag, err := name.NewTag(ref, name.StrictValidation)
		if err != nil {
			return done, fmt.Errorf("image %s: reference %q: %w", desc.Digest, ref, err)
		}
		img, err := idx.Image(desc.Digest)
		if err != nil {
			return done, err
		}
		if err := remote.Write(tag, img, opts...); err != nil {
			return done, fmt.Errorf("pushing %s: %w", tag, err)
		}
		done = append(done, pushedImage{Ref: tag, Digest: desc.Digest})
	}
	return done, nil
}
