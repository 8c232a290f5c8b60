package loadtest

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// The plot's size: 750 x 465 points, 1000 x 620 pixels at vgimg's 96 dpi.
const (
	plotWidth  = 750 * vg.Inch / 72
	plotHeight = 465 * vg.Inch / 72
)

// plotPalette colours the operations' curves, in the order of their names.
var plotPalette = []color.RGBA{{31, 119, 180, 255}, {214, 39, 40, 255}, {44, 160, 44, 255}, {255, 127, 14, 255},
	{148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}, {23, 190, 207, 255}}

// WritePlot draws the latency CDF of every operation (x: latency in ms, log scale; y: the
// fraction of calls at or below it) as a PNG at path.
func (r *Report) WritePlot(path string) error {
	ops := make([]string, 0, len(r.hists))
	lo, hi := math.Inf(1), math.Inf(-1)
	for op, h := range r.hists {
		if h.TotalCount() == 0 {
			continue
		}
		ops = append(ops, op)
		lo = math.Min(lo, float64(max(h.Min(), 1))/1000)
		hi = math.Max(hi, float64(h.Max())/1000)
	}
	if len(ops) == 0 {
		return fmt.Errorf("plotting: no latencies recorded: %w", ErrInvalid)
	}
	slices.Sort(ops)
	lo = math.Pow(10, math.Floor(math.Log10(lo)))
	hi = math.Pow(10, math.Ceil(math.Log10(hi)))
	if hi <= lo {
		hi = lo * 10
	}
	p := cdfAxes(fmt.Sprintf("%s: %.0f %s/s, %d sandboxes", r.Scenario, r.Throughput, r.Unit, r.Concurrency), lo, hi)
	for i, op := range ops {
		line, err := plotter.NewLine(r.cdf(op, lo))
		if err != nil {
			return fmt.Errorf("plotting %s: %w", op, err)
		}
		line.StepStyle = plotter.PostStep // the CDF is flat until the next value
		line.Color = plotPalette[i%len(plotPalette)]
		line.Width = vg.Points(1.5)
		p.Add(line)
		p.Legend.Add(op, line)
	}
	c := vgimg.PngCanvas{Canvas: vgimg.New(plotWidth, plotHeight)}
	// A margin, so that the last tick's label (centred on the plot's edge) stays whole.
	p.Draw(draw.Crop(draw.New(c), vg.Points(6), -vg.Points(12), vg.Points(6), -vg.Points(6)))
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("writing plot: %w", err)
	}
	if _, err := c.WriteTo(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("encoding plot: %w", err)
	}
	return f.Close()
}

// cdfAxes is an empty CDF plot: x from lo to hi ms on a log scale with a tick at every power
// of ten, y from 0 to 1 with a tick every tenth, a grid, the legend at the bottom right (the
// curves leave it empty: they end at the top).
func cdfAxes(title string, lo, hi float64) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "latency (ms, log scale)"
	p.Y.Label.Text = "fraction of calls <= latency"
	p.X.Scale = plot.LogScale{}
	p.X.Min, p.X.Max = lo, hi
	p.Y.Min, p.Y.Max = 0, 1
	var xt, yt plot.ConstantTicks
	for d := lo; d <= hi*1.001; d *= 10 {
		xt = append(xt, plot.Tick{Value: d, Label: fmt.Sprintf("%g", d)})
	}
	for i := 0; i <= 10; i++ {
		yt = append(yt, plot.Tick{Value: float64(i) / 10, Label: fmt.Sprintf("%.1f", float64(i)/10)})
	}
	p.X.Tick.Marker, p.Y.Tick.Marker = xt, yt
	grid := plotter.NewGrid()
	grid.Vertical.Color, grid.Horizontal.Color = color.Gray{220}, color.Gray{220}
	p.Add(grid)
	p.Legend.Top, p.Legend.Left = false, false
	p.Legend.XOffs, p.Legend.YOffs = -vg.Points(12), vg.Points(12)
	p.Title.Padding = vg.Points(8)
	return p
}

// cdf is the cumulative distribution of op's latencies: one point per histogram bucket that
// holds calls, at the bucket's upper bound in ms (not below lo, the axis's start).
func (r *Report) cdf(op string, lo float64) plotter.XYs {
	h := r.hists[op]
	total := float64(h.TotalCount())
	var pts plotter.XYs
	var cum int64
	for _, b := range h.Distribution() {
		if b.Count == 0 {
			continue
		}
		cum += b.Count
		pts = append(pts, plotter.XY{X: math.Max(float64(b.To)/1000, lo), Y: float64(cum) / total})
	}
	return pts
}
