package sandbox

import "testing"

// A stack named an alias of a checkpoint's index before the index is known (a flattening
// that finished before the digest, a restore of a checkpoint whose index is not in memory)
// is registered when it becomes known, in whichever order; a checkpoint deduplicated into
// another hands on its aliases; nothing stays registered once the checkpoints are released.
func TestDigestAliasBeforeIndex(t *testing.T) {
	sd := newStateDigests()
	index := func(id string, layers ...string) *dnode {
		root := leafOf(len(id))
		sd.mu.Lock()
		defer sd.mu.Unlock()
		sd.setIndexLocked(sd.ckpts[id], ckSnapshot{id: id, layers: layers}, root, nil, nil)
		return root
	}
	known := func(key string) *dnode {
		sd.mu.Lock()
		defer sd.mu.Unlock()
		if si := sd.stacks[key]; si != nil {
			return si.root
		}
		return nil
	}
	sd.add("a", "sb-a", nil)
	sd.alias("a", "F")
	sd.alias("a", "F")
	if known("F") != nil {
		t.Fatal("an alias registered before its index is known")
	}
	root := index("a", "l1", "l2")
	if known("F") != root || known("l1/l2") != root {
		t.Fatalf("once a's index is known: F %p, l1/l2 %p, want %p", known("F"), known("l1/l2"), root)
	}
	// Known first, named after.
	sd.alias("a", "l1/G")
	if known("l1/G") != root {
		t.Fatal("an alias named after the index is known: not registered")
	}
	// b, not indexed yet, takes c's alias (Dedupe: c is released, b has its state).
	sd.add("b", "sb-b", nil)
	sd.add("c", "sb-c", nil)
	sd.alias("c", "H")
	sd.adopt("b", "c")
	sd.drop("c")
	rb := index("b", "m1")
	if known("H") != rb {
		t.Fatal("an alias of a checkpoint deduplicated into b: not registered with b's index")
	}
	sd.drop("a")
	sd.drop("b")
	sd.alias("a", "K")
	sd.mu.Lock()
	ckpts, stacks := len(sd.ckpts), len(sd.stacks)
	sd.mu.Unlock()
	if ckpts != 0 || stacks != 0 {
		t.Fatalf("released: %d checkpoints and %d stacks kept", ckpts, stacks)
	}
}
