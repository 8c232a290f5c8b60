package loadtest

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"
	"slices"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// WritePlot draws the latency CDF of every operation (x: latency in ms, log scale; y: the
// fraction of calls at or below it) as a PNG at path.
func (r *Report) WritePlot(path string) error {
	const W, H, left, right, top, bottom = 1000, 620, 70, 190, 40, 50
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
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
	pw, ph := W-left-right, H-top-bottom
	xOf := func(v float64) int {
		return left + int(float64(pw)*(math.Log10(v)-math.Log10(lo))/(math.Log10(hi)-math.Log10(lo)))
	}
	yOf := func(f float64) int { return top + ph - int(float64(ph)*f) }
	grey, black := color.RGBA{220, 220, 220, 255}, color.Black
	// Grid and labels.
	for d := lo; d <= hi*1.001; d *= 10 {
		x := xOf(d)
		vline(img, x, top, top+ph, grey)
		label(img, x-12, top+ph+16, fmt.Sprintf("%g", d), black)
	}
	for f := 0.0; f <= 1.0001; f += 0.1 {
		y := yOf(f)
		hline(img, left, left+pw, y, grey)
		label(img, left-34, y+4, fmt.Sprintf("%.1f", f), black)
	}
	hline(img, left, left+pw, top+ph, black)
	vline(img, left, top, top+ph, black)
	label(img, left+pw/2-60, H-12, "latency (ms, log scale)", black)
	label(img, 8, top-14, "fraction of calls <= latency", black)
	label(img, left+pw/2-120, 18, fmt.Sprintf("%s: %.0f %s/s, %d sandboxes", r.Scenario, r.Throughput, r.Unit, r.Concurrency), black)
	palette := []color.RGBA{{31, 119, 180, 255}, {214, 39, 40, 255}, {44, 160, 44, 255}, {255, 127, 14, 255},
		{148, 103, 189, 255}, {140, 86, 75, 255}, {227, 119, 194, 255}, {23, 190, 207, 255}}
	for i, op := range ops {
		c := palette[i%len(palette)]
		h := r.hists[op]
		total := float64(h.TotalCount())
		var cum int64
		px, py := -1, -1
		for _, b := range h.Distribution() {
			if b.Count == 0 {
				continue
			}
			cum += b.Count
			x, y := xOf(math.Max(float64(b.To)/1000, lo)), yOf(float64(cum)/total)
			if px >= 0 {
				line(img, px, py, x, py, c) // a step: the CDF is flat until the next value
				line(img, x, py, x, y, c)
			}
			px, py = x, y
		}
		ly := top + 20 + 18*i
		for t := range 3 {
			hline(img, left+pw+12, left+pw+36, ly-4+t, c)
		}
		label(img, left+pw+42, ly, op, black)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("writing plot: %w", err)
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return fmt.Errorf("encoding plot: %w", err)
	}
	return f.Close()
}

func hline(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.Color) {
	for y := y0; y <= y1; y++ {
		img.Set(x, y, c)
	}
}

// line draws a thick axis-parallel or general segment.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	n := max(abs(x1-x0), abs(y1-y0), 1)
	for i := 0; i <= n; i++ {
		x := x0 + (x1-x0)*i/n
		y := y0 + (y1-y0)*i/n
		img.Set(x, y, c)
		img.Set(x+1, y, c)
		img.Set(x, y+1, c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func label(img *image.RGBA, x, y int, s string, c color.Color) {
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}
