package loadtest

import (
	"errors"
	"image"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"testing"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// TestWritePlot: the plot is a 1000 x 620 PNG with one curve per operation, each in its own
// colour, over a white background; a report without latencies is refused and writes nothing.
func TestWritePlot(t *testing.T) {
	rep := &Report{Scenario: "rollback", Unit: "rollbacks", Throughput: 1234, Concurrency: 64,
		hists: map[string]*hdrhistogram.Histogram{"restore": newHist(), "write_file": newHist(), "unused": newHist()}}
	for i := range 10_000 {
		_ = rep.hists["restore"].RecordValue(int64(300 + i%700))           // 0.3–1 ms
		_ = rep.hists["write_file"].RecordValue(int64(2_000 + 7*(i%3000))) // 2–23 ms
	}
	path := filepath.Join(t.TempDir(), "cdf.png")
	if err := rep.WritePlot(path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("the plot is not a PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() != 1000 || b.Dy() != 620 {
		t.Fatalf("the plot is %dx%d, want 1000x620", b.Dx(), b.Dy())
	}
	if c := rgba(img.At(1, 1)); c != (color.RGBA{255, 255, 255, 255}) {
		t.Fatalf("background %v, want white", c)
	}
	// The operations sorted by name take the palette in turn: restore the first colour,
	// write_file the second ("unused" recorded nothing and has no curve).
	for _, want := range []color.RGBA{plotPalette[0], plotPalette[1]} {
		if n := countColour(img, want); n < 200 {
			t.Errorf("%d pixels of colour %v, want a curve of it", n, want)
		}
	}
	if n := countColour(img, plotPalette[2]); n != 0 {
		t.Errorf("%d pixels of colour %v: a curve for an operation without latencies", n, plotPalette[2])
	}

	empty := filepath.Join(t.TempDir(), "none.png")
	if err := (&Report{hists: map[string]*hdrhistogram.Histogram{"x": newHist()}}).WritePlot(empty); !errors.Is(err, ErrInvalid) {
		t.Fatalf("plot of no latencies: %v, want ErrInvalid", err)
	}
	if _, err := os.Stat(empty); !os.IsNotExist(err) {
		t.Fatalf("plot of no latencies left a file: %v", err)
	}
}

func rgba(c color.Color) color.RGBA {
	r, g, b, a := c.RGBA()
	return color.RGBA{uint8(r >> 8), uint8(g >> 8), uint8(b >> 8), uint8(a >> 8)}
}

// countColour counts the pixels of img that are exactly c.
func countColour(img image.Image, c color.RGBA) int {
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			if rgba(img.At(x, y)) == c {
				n++
			}
		}
	}
	return n
}
