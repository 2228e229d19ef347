package report

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"image/color"
	"image/png"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// fixture is report.json from a short real run (`DEMO_SHORT=1 make demo`), the renderer's
// input: what the test checks is that the browser draws it.
const fixture = "testdata/short-run.json"

// chromium returns the browser, installed through hack/chromium.sh when missing (as
// hack/envtest-assets.sh provides the control plane), or $CHROMIUM.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("CHROMIUM"); p != "" {
		return p
	}
	script, err := filepath.Abs("../../chromium.sh")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(script).Output()
	if err != nil {
		var stderr string
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("hack/chromium.sh: %v\n%s", err, stderr)
	}
	return strings.TrimSpace(string(out))
}

// drawn is what the page shows, read from the DOM after rendering.
type drawn struct {
	Charts []struct {
		ID    string   `json:"id"`
		Texts []string `json:"texts"`
		// Strokes: per stroke color (as written, e.g. "#D62728"), the drawn paths' vertex
		// count, total length and bounding-box width; Dashed counts dashed paths per color.
		Strokes map[string]struct {
			Vertices int     `json:"vertices"`
			Length   float64 `json:"length"`
			Width    float64 `json:"width"`
			Dashed   int     `json:"dashed"`
		} `json:"strokes"`
		SVGWidth float64 `json:"svgWidth"`
	} `json:"charts"`
	TableRuns []string `json:"tableRuns"`
	// Resources is how many resources the page fetched (it must need none).
	Resources int `json:"resources"`
}

const inspect = `(() => {
  const charts = [...document.querySelectorAll('figure.chart')].map(f => {
    const svg = f.querySelector('svg');
    const strokes = {};
    for (const p of f.querySelectorAll('path')) {
      const m = /stroke:(#[0-9A-Fa-f]{6})/.exec(p.getAttribute('style') || '');
      if (!m) continue;
      const s = strokes[m[1].toUpperCase()] ||= {vertices: 0, length: 0, width: 0, dashed: 0};
      s.vertices += ((p.getAttribute('d') || '').match(/[ML]/g) || []).length;
      s.length += p.getTotalLength();
      s.width = Math.max(s.width, p.getBBox().width);
      if (/stroke-dasharray:[0-9]/.test(p.getAttribute('style'))) s.dashed++;
    }
    return {id: f.dataset.chart, texts: [...f.querySelectorAll('text')].map(t => t.textContent),
            strokes, svgWidth: svg ? svg.getBoundingClientRect().width : 0};
  });
  return {charts, tableRuns: [...document.querySelectorAll('#comparison tr[data-run]')].map(r => r.dataset.run),
          resources: performance.getEntriesByType('resource').length};
})()`

// hex is a color as gonum's SVG writes it.
func hex(c color.RGBA) string { return fmt.Sprintf("#%02X%02X%02X", c.R, c.G, c.B) }

// TestRenderInChromium renders the report of a short recorded run, opens it in headless
// Chromium with no network and checks what a reader would: every chart is drawn, with a line
// per run that goes through all of its points, the limit line where it belongs, both runs in
// the legend and the table; and it saves a screenshot.
func TestRenderInChromium(t *testing.T) {
	rep, err := Load(fixture)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) < 2 {
		t.Fatalf("the fixture has %d runs; want both", len(rep.Runs))
	}
	dir := t.TempDir()
	var page bytes.Buffer
	if err := rep.Render(&page); err != nil {
		t.Fatal(err)
	}
	// Self-contained: nothing the browser would fetch.
	if m := regexp.MustCompile(`(?i)<script[^>]*\ssrc=|<link[^>]*\shref=|url\(\s*['"]?https?:|<img[^>]*\ssrc=["']?https?:`).FindString(page.String()); m != "" {
		t.Errorf("the report refers to an outside resource: %q", m)
	}
	html := filepath.Join(dir, "report.html")
	if err := os.WriteFile(html, page.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := chromedp.NewExecAllocator(t.Context(),
		chromedp.ExecPath(chromium(t)),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(filepath.Join(dir, "profile")),
		chromedp.WindowSize(1600, 1200),
	)
	defer cancel()
	ctx, cancel = chromedp.NewContext(ctx)
	defer cancel()
	// The first Run starts the browser: no timeout on it (it would stop the browser); the test's
	// own deadline bounds it.
	if err := chromedp.Do(ctx, chromedp.Navigate((&url.URL{Scheme: "file", Path: html}).String())); err != nil {
		t.Fatalf("opening the report: %v", err)
	}
	rctx, rcancel := context.WithTimeout(ctx, time.Minute)
	defer rcancel()
	got, err := chromedp.Run(rctx, chromedp.Evaluate[drawn](inspect))
	if err != nil {
		t.Fatalf("reading the page: %v", err)
	}

	if got.Resources != 0 {
		t.Errorf("the page fetched %d resources; it must need none", got.Resources)
	}
	var runs []string
	for _, r := range rep.Runs {
		runs = append(runs, r.Name)
	}
	var tableRuns []string
	for _, r := range got.TableRuns {
		if !slices.Contains(tableRuns, r) {
			tableRuns = append(tableRuns, r)
		}
	}
	if strings.Join(tableRuns, ",") != strings.Join(runs, ",") || len(got.TableRuns) != len(rep.Phases)*len(runs) {
		t.Errorf("table rows by run %v; want every run %v in each of the %d phases", got.TableRuns, runs, len(rep.Phases))
	}
	if len(got.Charts) != len(Charts) {
		t.Fatalf("%d charts drawn, want %d", len(got.Charts), len(Charts))
	}
	limitLabel := "partner limit (" + strconv.Itoa(rep.Limit) + ")"
	for i, c := range got.Charts {
		want := Charts[i]
		if c.ID != want.ID {
			t.Errorf("chart %d is %q, want %q", i, c.ID, want.ID)
			continue
		}
		if c.SVGWidth < 300 {
			t.Errorf("chart %s: drawn %.0f px wide", c.ID, c.SVGWidth)
		}
		for ri, run := range rep.Runs {
			if !slices.Contains(c.Texts, run.Name) {
				t.Errorf("chart %s: the legend does not name %q (texts %q)", c.ID, run.Name, c.Texts)
			}
			s, ok := c.Strokes[hex(RunColors[ri])]
			// Every series of the run is one line through all of its points.
			if min := len(want.Values) * len(run.Points); !ok || s.Vertices < min || s.Length <= 0 {
				t.Errorf("chart %s, run %q: %+v drawn; want a line through its %d points per series", c.ID, run.Name, s, len(run.Points))
			}
			if ok && s.Width < c.SVGWidth/3 {
				t.Errorf("chart %s, run %q: its line spans %.0f of %.0f px", c.ID, run.Name, s.Width, c.SVGWidth)
			}
		}
		lim, hasLimit := c.Strokes[hex(LimitColor)]
		switch {
		case want.Limit && (!slices.Contains(c.Texts, limitLabel) || !hasLimit || lim.Dashed == 0 || lim.Width < c.SVGWidth/3):
			t.Errorf("chart %s: no dashed limit line labelled %q (%+v, texts %q)", c.ID, limitLabel, lim, c.Texts)
		case !want.Limit && slices.Contains(c.Texts, limitLabel):
			t.Errorf("chart %s: a limit line where none belongs", c.ID)
		}
		// The phases: a boundary line at each start after the first, named under the axis.
		if s := c.Strokes[hex(PhaseColor)]; s.Vertices != 2*(len(rep.Phases)-1) {
			t.Errorf("chart %s: %d phase boundary vertices, want a line for each of the %d phases after the first", c.ID, s.Vertices, len(rep.Phases)-1)
		}
		for _, ph := range rep.Phases {
			if !slices.ContainsFunc(c.Texts, func(s string) bool { return strings.Contains(s, ph.Name+" ") }) {
				t.Errorf("chart %s: phase %q not named (texts %q)", c.ID, ph.Name, c.Texts)
			}
		}
	}

	shot, err := chromedp.Run(rctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	img, err := png.Decode(bytes.NewReader(shot))
	if err != nil {
		t.Fatalf("screenshot is no PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() < 800 || b.Dy() < 800 {
		t.Errorf("screenshot %v: the page is smaller than its charts", b)
	}
	path := filepath.Join(dir, "report.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(shot))
}
