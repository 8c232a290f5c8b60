package sandbox

import (
	"crypto/sha256"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// leafOf is a sealed entry standing for value v.
func leafOf(v int) *dnode {
	n := &dnode{mode: 0o100644}
	n.data = sha256.Sum256(fmt.Append(nil, v))
	n.seal()
	return n
}

// checkTrie compares trie h with model m: lookups, size, names, and the shape rule (a node
// below the root holds two entries at least).
func checkTrie(t *testing.T, h *hnode, m map[string]int) {
	t.Helper()
	if h.size() != len(m) {
		t.Fatalf("size %d, want %d", h.size(), len(m))
	}
	for k, v := range m {
		if got := h.get(k); got == nil || got.data != leafOf(v).data {
			t.Fatalf("get %q: %v", k, got)
		}
	}
	if h.get("absent-name") != nil {
		t.Fatal("absent name found")
	}
	if !slices.Equal(h.names(), slices.Sorted(maps.Keys(m))) {
		t.Fatal("names differ")
	}
	var walk func(n *hnode, root bool) int
	walk = func(n *hnode, root bool) int {
		if n.edit != nil {
			t.Fatal("node not sealed")
		}
		c := 0
		for _, s := range n.slots {
			if s.sub != nil {
				c += walk(s.sub, false)
			} else {
				c++
			}
		}
		if c != n.n || !root && c < 2 || popcount(n.bitmap) != len(n.slots) {
			t.Fatalf("node of %d entries counts %d, %d slots for bitmap %b", c, n.n, len(n.slots), n.bitmap)
		}
		return c
	}
	if h != nil {
		walk(h, true)
	}
}

// build makes a trie of m's entries inserted in order, in batches of random sizes, after
// inserting and removing noise names.
func build(rng *rand.Rand, m map[string]int) *hnode {
	names := slices.Sorted(maps.Keys(m))
	rng.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
	var h *hnode
	e := newEdit()
	for i, k := range names {
		h = h.set(e, k, leafOf(m[k]+1)) // a first value, replaced below
		noise := fmt.Sprintf("noise%d", rng.IntN(50))
		h = h.set(e, noise, leafOf(-1))
		if rng.IntN(7) == 0 {
			h.seal()
			e = newEdit()
		}
		h = h.set(e, noise, nil)
		h = h.set(e, k, leafOf(m[k]))
		if i%13 == 0 {
			h.seal()
			e = newEdit()
		}
	}
	h.seal()
	return h
}

// A trie holds what a map does, its hash depends on its entries only (not on the order of
// changes nor their batches), old versions stay as they were, and diffNames names exactly the
// entries that differ.
func TestTrieModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, size := range []int{0, 1, 2, 31, 33, 500, 5000} {
		m := map[string]int{}
		for i := range size {
			m[fmt.Sprintf("f%d", i)] = rng.IntN(3)
		}
		a, b := build(rng, m), build(rng, m)
		checkTrie(t, a, m)
		checkTrie(t, b, m)
		if trieHash(a) != trieHash(b) {
			t.Fatalf("size %d: hashes differ by the order of changes", size)
		}
		if got := diffNames(a, b, nil); len(got) != 0 {
			t.Fatalf("size %d: equal tries differ at %v", size, got)
		}
		// Changes in a new batch: the old version stays, the diff finds the changes.
		m2 := maps.Clone(m)
		c := a
		e := newEdit()
		for range 1 + size/10 {
			k := fmt.Sprintf("f%d", rng.IntN(size+20))
			switch rng.IntN(3) {
			case 0:
				delete(m2, k)
				c = c.set(e, k, nil)
			default:
				m2[k] = rng.IntN(3)
				c = c.set(e, k, leafOf(m2[k]))
			}
		}
		c.seal()
		checkTrie(t, a, m)
		checkTrie(t, c, m2)
		var want []string
		for k, v := range m2 {
			if w, ok := m[k]; !ok || w != v {
				want = append(want, k)
			}
		}
		for k := range m {
			if _, ok := m2[k]; !ok {
				want = append(want, k)
			}
		}
		got := diffNames(a, c, nil)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("size %d: diff %v, want %v", size, got, want)
		}
		if (trieHash(c) == trieHash(a)) != (len(want) == 0) {
			t.Fatalf("size %d: hash equality does not follow the entries", size)
		}
		if rebuilt := build(rng, m2); trieHash(rebuilt) != trieHash(c) {
			t.Fatalf("size %d: a trie changed and one built fresh hash differently", size)
		}
	}
}

// A change to one entry of a large directory copies the nodes on the way to it only.
func TestTrieChangeCopiesPath(t *testing.T) {
	m := map[string]int{}
	for i := range 131_000 {
		m[fmt.Sprintf("file-%d", i)] = 0
	}
	a := build(rand.New(rand.NewPCG(1, 1)), m)
	old := map[*hnode]bool{}
	var mark func(n *hnode)
	mark = func(n *hnode) {
		old[n] = true
		for _, s := range n.slots {
			if s.sub != nil {
				mark(s.sub)
			}
		}
	}
	mark(a)
	b := a.set(newEdit(), "file-77", leafOf(1))
	b.seal()
	fresh, slots := 0, 0
	var count func(n *hnode)
	count = func(n *hnode) {
		if old[n] {
			return
		}
		fresh++
		slots += cap(n.slots)
		for _, s := range n.slots {
			if s.sub != nil {
				count(s.sub)
			}
		}
	}
	count(b)
	if fresh > 6 || slots > 6*32 {
		t.Fatalf("one change made %d nodes of %d slots", fresh, slots)
	}
}

// Hard links are hashed once: a file with many names in a layer costs its content once.
func TestLayerWalkHardLinks(t *testing.T) {
	dir := t.TempDir()
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := os.WriteFile(filepath.Join(dir, "f"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range 32 {
		if err := os.Link(filepath.Join(dir, "f"), filepath.Join(dir, fmt.Sprintf("l%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	w := &layerWalk{buf: make([]byte, chunkSize)}
	root, err := w.applyLayer(nil, dir)
	if err != nil {
		t.Fatal(err)
	}
	if w.hashed != int64(len(data)) {
		t.Fatalf("hashed %d bytes for one file of %d with 33 names", w.hashed, len(data))
	}
	f := root.kids.get("f")
	for i := range 32 {
		if l := root.kids.get(fmt.Sprintf("l%d", i)); l == nil || l.hash != f.hash {
			t.Fatalf("link %d: %v", i, l)
		}
	}
}
