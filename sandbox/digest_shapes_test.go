package sandbox_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// Shapes of a sandbox's files that make state digests and diffs cost more than their bytes
// would say: many names of one file, a directory of many entries.

// linkShape makes n hard links /w/l0.. to a file of content base in checkpoint base, and
// with target non-empty the links to a file of that content in checkpoint ck (without, the
// links are made in ck only).
func linkShape(tb testing.TB, b *bundle, n int, base, target string) (string, string) {
	tb.Helper()
	ctx := context.Background()
	s := b.create(tb, sandbox.Spec{})
	links := fmt.Sprintf("cd /w && i=0; while [ $i -lt %d ]; do ln -f %%s l$i; i=$((i+1)); done", n)
	must(tb, s.WriteFile(ctx, "/w/a.txt", []byte(base), 0, false))
	if target != "" {
		sh(tb, s, fmt.Sprintf(links, "a.txt"))
	}
	ck0, err := s.Checkpoint(ctx)
	must(tb, err)
	if target != "" {
		must(tb, s.WriteFile(ctx, "/w/b.txt", []byte(target), 0, false))
		sh(tb, s, fmt.Sprintf(links, "b.txt"))
	} else {
		sh(tb, s, fmt.Sprintf(links, "a.txt"))
	}
	ck1, err := s.Checkpoint(ctx)
	must(tb, err)
	return ck0.ID, ck1.ID
}

// diffShape is what a diff answered: bytes of paths and unified text, and line counts.
func diffShape(d sandbox.Diff) (bytes int) {
	for _, c := range d.Paths {
		bytes += len(c.Path) + len(c.Unified)
	}
	return bytes
}

// BenchmarkDiffAmplified: DiffCheckpoints over the shapes that amplify a diff: unified, 1,000
// names of one 65,534-byte text file added; lines, 200 names of a file whose 4,000 lines all
// change (a pathological pair for the line diff). It reports the diff's time, the bytes of
// paths and unified text it answers, and what it allocates.
func BenchmarkDiffAmplified(b *testing.B) {
	bb := setup(b)
	ctx := context.Background()
	for _, tc := range []struct {
		name         string
		n            int
		base, target string
		detail       sandbox.DiffDetail
	}{
		{"unified", 1000, strings.Repeat("a\n", 32767), "", sandbox.DiffUnified},
		{"lines", 200, strings.Repeat("a\n", 4000), strings.Repeat("b\n", 4000), sandbox.DiffLines},
	} {
		b.Run(tc.name, func(b *testing.B) {
			base, ck := linkShape(b, bb, tc.n, tc.base, tc.target)
			_, err := bb.rt.StateDigest(ctx, ck)
			must(b, err)
			var l lat
			var answered int
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			alloc := ms.TotalAlloc
			for b.Loop() {
				t := time.Now()
				d, err := bb.rt.DiffCheckpoints(ctx, base, ck, sandbox.DiffOptions{Detail: tc.detail})
				must(b, err)
				l = append(l, time.Since(t))
				answered = diffShape(d)
			}
			runtime.ReadMemStats(&ms)
			b.ReportMetric(float64(answered)/(1<<20), "answer-MiB")
			b.ReportMetric(float64(ms.TotalAlloc-alloc)/float64(len(l))/(1<<20), "alloc-MiB/op")
			l.report(b, "diff-")
		})
	}
}

// BenchmarkDigestHardLinks: 64 names of one 64 MiB file, then a checkpoint; ready- is the time
// from its return to its state digest's.
func BenchmarkDigestHardLinks(b *testing.B) {
	bb := setup(b)
	ctx := context.Background()
	s := bb.create(b, sandbox.Spec{})
	base, err := s.Checkpoint(ctx)
	must(b, err)
	_, err = bb.rt.StateDigest(ctx, base.ID)
	must(b, err)
	var ready lat
	n := 0
	for b.Loop() {
		b.StopTimer()
		must(b, s.Restore(ctx, base.ID))
		sh(b, s, fmt.Sprintf("mkdir -p /w && head -c %d /dev/urandom > /w/f && cd /w && i=0; while [ $i -lt 63 ]; do ln f l$i; i=$((i+1)); done", 64<<20))
		n++
		b.StartTimer()
		ck, err := s.Checkpoint(ctx)
		must(b, err)
		t := time.Now()
		_, err = bb.rt.StateDigest(ctx, ck.ID)
		must(b, err)
		ready = append(ready, time.Since(t))
		b.StopTimer()
		must(b, bb.rt.ReleaseCheckpoint(ck.ID))
		b.StartTimer()
	}
	ready.report(b, "ready-")
}

// BenchmarkDigestHeldDirectory: a directory of 131,000 files (and, for comparison, of 10),
// then 20 checkpoints held, each changing one byte of one file in it and waiting for its
// digest; heap-KiB/ckpt is the heap each keeps (after a GC), all it holds: its index, its
// layer's and record's state; ready- is the time from a checkpoint's return to its digest's.
// With FlattenDepth 64 the stack is not flattened meanwhile, so each keeps what its own change
// costs; with the default (16) the 16th checkpoint is flattened in the background while the
// others are taken, and the heap is read once its flattening is recorded.
func BenchmarkDigestHeldDirectory(b *testing.B) {
	for _, entries := range []int{131_000, 10} {
		for _, depth := range []int{64, 0} {
			name := fmt.Sprintf("entries=%d/flatten=%d", entries, depth)
			if depth == 0 {
				name = fmt.Sprintf("entries=%d/flatten=default", entries)
			}
			b.Run(name, func(b *testing.B) { benchHeldDirectory(b, entries, depth) })
		}
	}
}

func benchHeldDirectory(b *testing.B, entries, depth int) {
	bb := setup(b, func(c *sandbox.Config) { c.FlattenDepth = depth })
	flattened := make(chan string, 64)
	bb.rt.OnFlattened(func(id string) { flattened <- id })
	ctx := context.Background()
	s := bb.create(b, sandbox.Spec{})
	sh(b, s, fmt.Sprintf("mkdir -p /w && cd /w && seq 1 %d | xargs touch", entries))
	base, err := s.Checkpoint(ctx)
	must(b, err)
	_, err = bb.rt.StateDigest(ctx, base.ID)
	must(b, err)
	const held = 20
	var perCk float64
	var ready lat
	for b.Loop() {
		b.StopTimer()
		must(b, s.Restore(ctx, base.ID))
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		before := ms.HeapAlloc
		var ids []string
		b.StartTimer()
		for i := range held {
			sh(b, s, fmt.Sprintf("echo %d > /w/%d", i, 1+i%7))
			ck, err := s.Checkpoint(ctx)
			must(b, err)
			ready.time(func() {
				_, err = bb.rt.StateDigest(ctx, ck.ID)
			})
			must(b, err)
			ids = append(ids, ck.ID)
		}
		b.StopTimer()
		if depth == 0 {
			for id := ""; id != ids[15]; {
				id = <-flattened
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&ms)
		perCk = (float64(ms.HeapAlloc) - float64(before)) / held
		for _, id := range ids {
			must(b, bb.rt.ReleaseCheckpoint(id))
		}
		b.StartTimer()
	}
	b.ReportMetric(perCk/1024, "heap-KiB/ckpt")
	ready.report(b, "ready-")
}

// deepShape makes n one-line text files at the bottom of a chain of depth directories under /w
// in a checkpoint over one without them, and returns the two checkpoints.
func deepShape(tb testing.TB, b *bundle, depth, n int) (string, string) {
	tb.Helper()
	ctx := context.Background()
	s := b.create(tb, sandbox.Spec{})
	base, err := s.Checkpoint(ctx)
	must(tb, err)
	sh(tb, s, fmt.Sprintf("mkdir -p /w && cd /w && i=0; while [ $i -lt %d ]; do mkdir y && cd y; i=$((i+1)); done; "+
		"i=0; while [ $i -lt %d ]; do echo line $i > f$i; i=$((i+1)); done", depth, n))
	ck, err := s.Checkpoint(ctx)
	must(tb, err)
	return base.ID, ck.ID
}

// BenchmarkDiffDeepPaths: the line counts of 200 files at the bottom of a chain of 500
// directories, which a diff finds in the checkpoint's layers a component at a time.
func BenchmarkDiffDeepPaths(b *testing.B) {
	bb := setup(b)
	ctx := context.Background()
	base, ck := deepShape(b, bb, 500, 200)
	var l lat
	for b.Loop() {
		t := time.Now()
		_, err := bb.rt.DiffCheckpoints(ctx, base, ck, sandbox.DiffOptions{Detail: sandbox.DiffLines})
		must(b, err)
		l = append(l, time.Since(t))
	}
	l.report(b, "diff-")
}

// A diff's line counts of files deep below directories made in the checkpoint: found, counted.
func TestDiffDeepPaths(t *testing.T) {
	b := setup(t)
	base, ck := deepShape(t, b, 100, 20)
	d, err := b.rt.DiffCheckpoints(t.Context(), base, ck, sandbox.DiffOptions{Detail: sandbox.DiffLines})
	must(t, err)
	files := 0
	for _, c := range d.Paths {
		if c.NewType == sandbox.TypeFile {
			files++
			if c.Kind != sandbox.ChangeAdded || c.LinesAdded != 1 || c.Binary || strings.Count(c.Path, "/y") != 100 {
				t.Fatalf("%+v", c)
			}
		}
	}
	if files != 20 {
		t.Fatalf("%d files in the diff, want 20: %+v", files, d.Paths)
	}
}
