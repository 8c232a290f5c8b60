package sandbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// BenchmarkStateDigest: 1,000 files of 4 KiB written, then a checkpoint; ckpt- is the
// checkpoint's latency, ready- the time from its return to its state digest's.
func BenchmarkStateDigest(b *testing.B) {
	bb := setup(b)
	s := bb.create(b, sandbox.Spec{})
	ctx := context.Background()
	data := make([]byte, 4096)
	must(b, s.WriteFile(ctx, "/d/base", data, 0, false))
	base, err := s.Checkpoint(ctx)
	must(b, err)
	_, err = bb.rt.StateDigest(ctx, base.ID)
	must(b, err)
	var ckpt, ready lat
	n := 0
	for b.Loop() {
		b.StopTimer()
		// A fresh delta each time, over the same base.
		must(b, s.Restore(ctx, base.ID))
		for i := range 1000 {
			copy(data, fmt.Sprintf("%d %d", n, i))
			must(b, s.WriteFile(ctx, fmt.Sprintf("/d/%d/%d", n, i), data, 0, false))
		}
		n++
		b.StartTimer()
		var ck sandbox.CheckpointInfo
		ckpt.time(func() {
			var err error
			ck, err = s.Checkpoint(ctx)
			must(b, err)
		})
		t := time.Now()
		_, err := bb.rt.StateDigest(ctx, ck.ID)
		must(b, err)
		ready = append(ready, time.Since(t))
		b.StopTimer()
		must(b, bb.rt.ReleaseCheckpoint(ck.ID))
		b.StartTimer()
	}
	ckpt.report(b, "ckpt-")
	ready.report(b, "ready-")
}
