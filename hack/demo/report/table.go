package report

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// tableHeader names the comparison table's columns (terminal, Markdown and HTML alike).
var tableHeader = []string{"phase", "run", "calls/s", "429s at partner", "partner peak / limit", "goodput 2xx/s",
	"fallback", "refusal p50 / p99", "app p99", "partner held mean / p99"}

// cells formats one row of the comparison table.
func (r *Report) cells(row Row) []string {
	s := row.Summary
	refusal := "–"
	if s.Refusals > 0 {
		refusal = fmtDur(s.RefusalP50) + " / " + fmtDur(s.RefusalP99)
	}
	partner := "–"
	if s.PartnerP99 > 0 {
		partner = fmtDur(s.PartnerMean) + " / " + fmtDur(s.PartnerP99)
	}
	return []string{s.Phase, row.Run, fmt.Sprintf("%.0f", s.Offered), pct(s.PartnerTooManyShare),
		fmt.Sprintf("%d / %d", s.PartnerPeak, r.Limit), fmt.Sprintf("%.0f", s.Goodput), pct(s.FallbackShare),
		refusal, fmtDur(s.AppP99), partner}
}

// WriteTable prints the comparison table aligned for a terminal.
func (r *Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, strings.ToUpper(strings.Join(tableHeader, "\t")))
	for _, row := range r.Rows() {
		fmt.Fprintln(tw, strings.Join(r.cells(row), "\t"))
	}
	return tw.Flush()
}

// WriteMarkdown prints the comparison table as Markdown (the README's).
func (r *Report) WriteMarkdown(w io.Writer) error {
	fmt.Fprintf(w, "| %s |\n|%s\n", strings.Join(tableHeader, " | "), strings.Repeat("---|", len(tableHeader)))
	for _, row := range r.Rows() {
		if _, err := fmt.Fprintf(w, "| %s |\n", strings.Join(r.cells(row), " | ")); err != nil {
			return err
		}
	}
	return nil
}

func pct(v float64) string {
	switch {
	case v == 0:
		return "0 %"
	case v < 0.001:
		return "<0.1 %"
	}
	return fmt.Sprintf("%.1f %%", 100*v)
}

// fmtDur shows milliseconds below 10 s, whole and tenths as fits.
func fmtDur(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	switch {
	case d == 0:
		return "0"
	case ms < 10:
		return fmt.Sprintf("%.1f ms", ms)
	case ms < 10000:
		return fmt.Sprintf("%.0f ms", ms)
	}
	return fmt.Sprintf("%.1f s", d.Seconds())
}
