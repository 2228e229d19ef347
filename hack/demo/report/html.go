package report

import (
	"bytes"
	"fmt"
	"html/template"
	"image/color"
	"io"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Colors of the runs in every chart, by position in Report.Runs (the first is the baseline,
// the second the run with Apportion); more runs take the next ones. The rendering test finds a
// run's lines by these.
var RunColors = []color.RGBA{
	{R: 0xD6, G: 0x27, B: 0x28, A: 0xFF}, // red
	{R: 0x1F, G: 0x77, B: 0xB4, A: 0xFF}, // blue
	{R: 0xFF, G: 0x7F, B: 0x0E, A: 0xFF}, // orange
	{R: 0x2C, G: 0xA0, B: 0x2C, A: 0xFF}, // green
}

// LimitColor draws the partner's limit; PhaseColor the phases' boundaries.
var (
	LimitColor = color.RGBA{A: 0xFF}
	PhaseColor = color.RGBA{R: 0x99, G: 0x99, B: 0x99, A: 0xFF}
)

// plainTicks are gonum's default ticks labelled without trailing zeros ("250", not "250.00").
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = strconv.FormatFloat(ticks[i].Value, 'f', -1, 64)
		}
	}
	return ticks
}

// Chart is one chart of the report: a title, a unit and what to plot of each point.
type Chart struct {
	ID, Title, YLabel string
	// Limit draws the partner's limit as a dashed line.
	Limit bool
	// Values gives one or more series per run (e.g. the per-pod min and max).
	Values []func(Point) float64
}

// Charts are the report's charts, in order.
var Charts = []Chart{
	{ID: "inflight", Title: "Calls in flight at the partner (peak per step) and its limit", YLabel: "in flight", Limit: true,
		Values: []func(Point) float64{func(p Point) float64 { return float64(p.PartnerPeak) }}},
	{ID: "429", Title: "429 answers from the partner per second", YLabel: "429/s",
		Values: []func(Point) float64{func(p Point) float64 { return p.TooMany }}},
	{ID: "fallback", Title: "Calls answered by a fallback per second (never reached the partner)", YLabel: "fallbacks/s",
		Values: []func(Point) float64{func(p Point) float64 { return p.Fallback }}},
	{ID: "goodput", Title: "Goodput: 2xx answers per second", YLabel: "2xx/s",
		Values: []func(Point) float64{func(p Point) float64 { return p.OK }}},
	{ID: "permits", Title: "Σ permits (without Apportion: Σ of the local semaphores) and the limit", YLabel: "Σ permits", Limit: true,
		Values: []func(Point) float64{func(p Point) float64 { return float64(p.SumPermits) }}},
	{ID: "perpod", Title: "Permits per pod (highest and lowest pod)", YLabel: "permits",
		Values: []func(Point) float64{
			func(p Point) float64 { return float64(p.PerPodMax) },
			func(p Point) float64 { return float64(p.PerPodMin) },
		}},
	{ID: "pods", Title: "Pods receiving traffic", YLabel: "pods",
		Values: []func(Point) float64{func(p Point) float64 { return float64(p.Pods) }}},
}

// svgChart draws one chart with every run on the same axes and returns the SVG element.
func (r *Report) svgChart(c Chart) (string, error) {
	p := plot.New()
	p.Title.Text = c.Title
	p.X.Label.Text = "seconds"
	p.Y.Label.Text = c.YLabel
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	var xmax, ymax float64
	for i, run := range r.Runs {
		col := RunColors[i%len(RunColors)]
		for j, value := range c.Values {
			xys := make(plotter.XYs, len(run.Points))
			for k, pt := range run.Points {
				xys[k] = plotter.XY{X: pt.T, Y: value(pt)}
				xmax, ymax = max(xmax, pt.T), max(ymax, xys[k].Y)
			}
			if len(xys) == 0 {
				continue
			}
			l, err := plotter.NewLine(xys)
			if err != nil {
				return "", fmt.Errorf("chart %s, run %s: %w", c.ID, run.Name, err)
			}
			l.Color, l.Width = col, vg.Points(1.4)
			if j > 0 {
				l.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
			}
			p.Add(l)
			if j == 0 {
				p.Legend.Add(run.Name, l)
			}
		}
	}
	if c.Limit && r.Limit > 0 && xmax > 0 {
		l, err := plotter.NewLine(plotter.XYs{{X: 0, Y: float64(r.Limit)}, {X: xmax, Y: float64(r.Limit)}})
		if err != nil {
			return "", err
		}
		l.Color, l.Width, l.Dashes = LimitColor, vg.Points(1.2), []vg.Length{vg.Points(5), vg.Points(3)}
		p.Add(l)
		p.Legend.Add(fmt.Sprintf("partner limit (%d)", r.Limit), l)
		ymax = max(ymax, float64(r.Limit))
	}
	// Phase boundaries: thin grey lines; the phases are named under the axis (text inside the
	// plot would collide with the legend).
	top := ymax * 1.35 // headroom for the legend
	if top == 0 {
		top = 1
	}
	var names []string
	for _, ph := range r.Phases {
		names = append(names, fmt.Sprintf("%s %g–%g", ph.Name, ph.Start.Seconds(), ph.End.Seconds()))
		if x := ph.Start.Seconds(); x > 0 {
			l, err := plotter.NewLine(plotter.XYs{{X: x, Y: 0}, {X: x, Y: top}})
			if err != nil {
				return "", err
			}
			l.Color, l.Width = PhaseColor, vg.Points(0.8)
			p.Add(l)
		}
	}
	if len(names) > 0 {
		p.X.Label.Text += " — " + strings.Join(names, ", ")
	}
	p.X.Min, p.X.Max = 0, xmax
	p.Y.Max = top
	p.Y.Tick.Marker = plainTicks{}
	p.Legend.TextStyle.Font.Size = vg.Points(10)
	cv := vgsvg.NewWith(vgsvg.UseWH(7*vg.Inch, 2.6*vg.Inch))
	p.Draw(draw.New(cv))
	var buf bytes.Buffer
	if _, err := cv.WriteTo(&buf); err != nil {
		return "", err
	}
	out := buf.String()
	// Inline in HTML: drop the XML prolog and comments before the <svg> element.
	if i := strings.Index(out, "<svg"); i >= 0 {
		out = out[i:]
	}
	return out, nil
}

type figure struct {
	ID, Title string
	SVG       template.HTML
}

var page = template.Must(template.New("report").Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{.R.Title}}</title>
<style>
body { font-family: sans-serif; margin: 24px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; }
p.meta { color: #555; margin: 2px 0; font-size: 13px; }
table { border-collapse: collapse; margin: 14px 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; }
td.l { text-align: left; }
.run0 { color: #D62728; font-weight: bold; } .run1 { color: #1F77B4; font-weight: bold; }
.charts { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 8px 16px; }
figure { margin: 0; }
figure svg { width: 100%; height: auto; }
</style></head><body>
<h1>{{.R.Title}}</h1>
<p class="meta">{{.R.Date.Format "2006-01-02 15:04 UTC"}} · {{.R.Machine}}</p>
{{range .R.Notes}}<p class="meta">{{.}}</p>
{{end}}
<table id="comparison">
<tr>{{range .Header}}<th>{{.}}</th>{{end}}</tr>
{{range .Rows}}{{$row := .}}<tr data-run="{{.Run}}">{{range $i, $c := .Cells}}<td{{if eq $i 0}} class="l"{{else if eq $i 1}} class="l {{$row.Class}}"{{end}}>{{$c}}</td>{{end}}</tr>
{{end}}</table>
<div class="charts">
{{range .Figures}}<figure class="chart" id="chart-{{.ID}}" data-chart="{{.ID}}">{{.SVG}}</figure>
{{end}}</div>
</body></html>
`))

type htmlRow struct {
	Run, Class string
	Cells      []string
}

// Render writes the report as one self-contained HTML page: the comparison table and the
// charts as inline SVG (gonum/plot), with no script, stylesheet or font fetched from anywhere.
func (r *Report) Render(w io.Writer) error {
	var figs []figure
	for _, c := range Charts {
		svg, err := r.svgChart(c)
		if err != nil {
			return err
		}
		figs = append(figs, figure{ID: c.ID, Title: c.Title, SVG: template.HTML(svg)}) //nolint:gosec // SVG generated by gonum/plot from numbers and escaped labels
	}
	index := map[string]int{}
	for i, run := range r.Runs {
		index[run.Name] = i
	}
	var rows []htmlRow
	for _, row := range r.Rows() {
		rows = append(rows, htmlRow{Run: row.Run, Class: fmt.Sprintf("run%d", index[row.Run]), Cells: r.cells(row)})
	}
	return page.Execute(w, map[string]any{"R": r, "Header": tableHeader, "Rows": rows, "Figures": figs})
}
