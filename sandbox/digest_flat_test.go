package sandbox_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// flatWatch records what each checkpoint's files index walked and which flattenings were
// recorded.
type flatWatch struct {
	mu sync.Mutex
	// walks are, by checkpoint, the layers its files index applied and the entries it walked.
	// +checklocks:mu
	walks map[string][2]int
	flat  chan string
}

func watchDigests(b *bundle) *flatWatch {
	fw := &flatWatch{walks: map[string][2]int{}, flat: make(chan string, 256)}
	b.rt.OnDigestWalk(func(id string, layers, entries int) {
		fw.mu.Lock()
		defer fw.mu.Unlock()
		fw.walks[id] = [2]int{layers, entries}
	})
	b.rt.OnFlattened(func(id string) { fw.flat <- id })
	return fw
}

func (fw *flatWatch) walk(id string) ([2]int, bool) {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	w, ok := fw.walks[id]
	return w, ok
}

// waitFlattened waits for checkpoint id's flattening to be recorded.
func (fw *flatWatch) waitFlattened(t *testing.T, id string) {
	t.Helper()
	timeout := time.After(time.Minute)
	for {
		select {
		case got := <-fw.flat:
			if got == id {
				return
			}
		case <-timeout:
			t.Fatalf("checkpoint %s not flattened", id)
		}
	}
}

// Every checkpoint's digest applies its own new layer alone over an index already known,
// whatever stack the sandbox sits on: its parent's as taken, a merged layer the deep
// flattener made while the sandbox went on, a flattened checkpoint restored, a hot
// checkpoint's merged top, a descendant of either restored over it. The directory the
// sandbox changes a file of is never walked again. Released, the checkpoints leave no index.
func TestStateDigestFlattenedStacks(t *testing.T) {
	b := setup(t) // the default FlattenDepth
	fw := watchDigests(b)
	const entries = 3000
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, fmt.Sprintf("mkdir -p /w && cd /w && seq 1 %d | xargs touch", entries))
	base, _ := ckDigest(t, b, s)
	ids := []string{base.ID}
	n := 0
	step := func(what string) string {
		t.Helper()
		n++
		sh(t, s, fmt.Sprintf("echo %d > /w/%d", n%10, 1+n%entries))
		ck, _ := ckDigest(t, b, s)
		ids = append(ids, ck.ID)
		w, ok := fw.walk(ck.ID)
		if !ok || w[0] != 1 || w[1] >= entries/10 {
			t.Errorf("checkpoint %d (%s, depth %d): its digest applied %d layers and walked %d entries, want its own layer alone",
				n, what, ck.Depth, w[0], w[1])
		}
		return ck.ID
	}
	restore := func(id string) {
		t.Helper()
		if err := s.Restore(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	// Up to the flattening depth: the 16th checkpoint over the base is 17 layers deep.
	for range 15 {
		step("on its parent")
	}
	// The sandbox goes on while its flattening waits; later checkpoints sit on the merged
	// layer with the layers taken meanwhile above it.
	release := b.rt.HoldFlattening()
	deep := step("the flattening held")
	step("the flattening held")
	release()
	fw.waitFlattened(t, deep)
	step("over the merged layer and the layers taken meanwhile")
	step("over the merged layer")
	// A flattened checkpoint restored, again and again; its descendant taken before the merge.
	for range 3 {
		restore(deep)
		step("the flattened checkpoint restored")
	}
	restore(ids[17])
	step("a descendant of the flattened checkpoint restored")
	// A hot checkpoint: restored twice in a row, its layers are merged; then it, and a
	// descendant of it, are restored over the merged layer.
	hot := ids[3]
	restore(hot)
	restore(hot)
	fw.waitFlattened(t, hot)
	for range 3 {
		restore(hot)
		step("the hot checkpoint restored")
	}
	restore(ids[5])
	step("a descendant of the hot checkpoint restored")
	// On to 40 checkpoints, the flattener running as it comes.
	for n < 40 {
		step("on its parent")
	}
	if t.Failed() {
		return
	}
	for _, id := range ids {
		if err := b.rt.ReleaseCheckpoint(id); err != nil {
			t.Fatal(err)
		}
	}
	if ckpts, stacks := b.rt.DigestIndexes(); ckpts != 0 || stacks != 0 {
		t.Errorf("released: %d checkpoints' digests and %d stacks' indexes kept", ckpts, stacks)
	}
}
