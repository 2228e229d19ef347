//go:build linux

package node

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// testImage is the lane's own image (test/node/testimage): the node's sandbox image and the
// sample Deployment's app. Its tag is fixed and it is never pulled: the node imports it.
const testImage = "apportion.local/node-testimage:v1"

// prepareImages runs the user's `make images` (dist/images/{manager,agent}.tar) and builds
// the lane's own image into the run directory, before the node starts: both need the Go
// module proxy, which the node's network namespace cannot reach.
func prepareImages(r *runState) error {
	root := repoRoot()
	start := time.Now()
	// Two runs at once (from one clone) must not write dist/images together: one waits.
	lock, err := os.OpenFile(filepath.Join(baseDir(), ".images.lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer func() { _ = lock.Close() }()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	cmd := exec.Command("make", "--no-print-directory", "images")
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("make images: %w\n%s", err, out.String())
	}
	for _, n := range []string{"manager.tar", "agent.tar"} {
		fi, err := os.Stat(filepath.Join(root, "dist", "images", n))
		if err != nil {
			return fmt.Errorf("make images did not write dist/images/%s: %w", n, err)
		}
		if fi.Size() == 0 {
			return fmt.Errorf("make images wrote an empty dist/images/%s", n)
		}
		// The node imports this run's copy: another run may rewrite dist/images meanwhile.
		if err := copyFile(filepath.Join(root, "dist", "images", n), filepath.Join(r.Dir, n)); err != nil {
			return err
		}
	}
	logf("step make images: ok in %s", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	bin := filepath.Join(r.Dir, "testimage")
	cmd = exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./test/node/testimage")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	out.Reset()
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("building test/node/testimage: %w\n%s", err, out.String())
	}
	if err := writeImage(bin, "/testimage", testImage, filepath.Join(r.Dir, "testimage.tar")); err != nil {
		return fmt.Errorf("packing %s: %w", testImage, err)
	}
	logf("built %s in %s", testImage, time.Since(start).Round(time.Millisecond))
	return nil
}

// writeImage packs one static binary as an image (scratch plus one layer, the binary as the
// entrypoint) into a docker archive that `ctr images import` reads.
func writeImage(bin, path, ref, out string) error {
	data, err := os.ReadFile(bin)
	if err != nil {
		return err
	}
	var layerTar bytes.Buffer
	tw := tar.NewWriter(&layerTar)
	if err := tw.WriteHeader(&tar.Header{Name: path[1:], Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	if _, err := tw.Write(data); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar.Bytes())), nil
	})
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Entrypoint: []string{path}}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(out, tag, img)
}

func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	out, err := os.Create(to)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}
