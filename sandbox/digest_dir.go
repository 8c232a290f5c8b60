package sandbox

import (
	"crypto/sha256"
	"encoding/binary"
	"io"
	"slices"
)

// A directory's entries in the files index are a persistent hash array mapped trie: keyed by
// the SHA-256 of each name, five bits of it a level, each node a 32-bit map of the slots it
// holds and those slots (an entry, or the node of the names that share the node's bits and
// the slot's). A node below the root holds two names at least, so the trie's shape, and its
// Merkle hash, depend only on the entries, however they were reached. A change copies the
// nodes on the way to its entry (log32 of the entries, each at most 32 slots) and shares the
// rest: a checkpoint that changes one file of a directory of 100,000 keeps a few KiB of it,
// not a copy of its 100,000 entries, and hashes a few nodes, not every name.
//
// Nodes are built in batches: a batch (an edit) changes the nodes it made in place, so that a
// directory built entry by entry copies nothing; seal hashes them and ends the batch's hold
// on them, after which they are immutable and shared like any other.

// hbits is the bits of a name's hash a level takes; hlevels how many levels a hash gives.
const (
	hbits   = 5
	hlevels = 256 / hbits
)

// hnode is a node of a directory's trie.
type hnode struct {
	bitmap uint32
	slots  []hslot // in the order of their bits
	n      int     // entries below
	hash   [32]byte
	// edit is the batch that made the node and may change it in place; nil once sealed.
	edit *edit
}

// hslot is one slot of a node: an entry (name, val) or a node (sub).
type hslot struct {
	name string
	val  *dnode
	sub  *hnode
}

// edit is a batch of changes to tries (see hnode.edit).
type edit struct{ _ byte }

func newEdit() *edit { return &edit{} }

// nameKey is the key of name in a trie.
func nameKey(name string) [32]byte { return sha256.Sum256([]byte(name)) }

// frag is the slot of key at level: its bits [level*hbits, level*hbits+hbits).
func frag(key *[32]byte, level int) uint {
	bit := level * hbits
	v := uint(key[bit/8]) << 8
	if bit/8+1 < len(key) {
		v |= uint(key[bit/8+1])
	}
	return (v >> (16 - hbits - bit%8)) & (1<<hbits - 1)
}

// index is where slot bit f is in h.slots, and whether h holds it.
func (h *hnode) index(f uint) (int, bool) {
	m := uint32(1) << f
	return popcount(h.bitmap & (m - 1)), h.bitmap&m != 0
}

func popcount(x uint32) int {
	n := 0
	for ; x != 0; x &= x - 1 {
		n++
	}
	return n
}

// size is the number of entries of trie h (nil: empty).
func (h *hnode) size() int {
	if h == nil {
		return 0
	}
	return h.n
}

// get returns the entry named name in trie h, nil if none.
func (h *hnode) get(name string) *dnode {
	if h == nil {
		return nil
	}
	key := nameKey(name)
	for level := 0; ; level++ {
		i, ok := h.index(frag(&key, level))
		if !ok {
			return nil
		}
		s := &h.slots[i]
		if s.sub == nil {
			if s.name == name {
				return s.val
			}
			return nil
		}
		h = s.sub
	}
}

// set returns trie h with the entry name set to val (nil: removed), in batch e: h's nodes of
// e change in place, others are copied. The result is nil for an empty trie.
func (h *hnode) set(e *edit, name string, val *dnode) *hnode {
	key := nameKey(name)
	out, _ := h.put(e, &key, 0, name, val)
	return out
}

// own returns h if batch e may change it, else a copy of it that e may.
func (h *hnode) own(e *edit) *hnode {
	if e != nil && h.edit == e {
		return h
	}
	return &hnode{bitmap: h.bitmap, slots: slices.Clone(h.slots), n: h.n, edit: e}
}

// put is set at level; delta is the change of the entries' count.
func (h *hnode) put(e *edit, key *[32]byte, level int, name string, val *dnode) (*hnode, int) {
	if level >= hlevels {
		// Two names whose SHA-256 agree on every bit the trie uses.
		panic("sandbox: a SHA-256 collision of two names")
	}
	if h == nil {
		if val == nil {
			return nil, 0
		}
		n := &hnode{edit: e, n: 1}
		n.bitmap = 1 << frag(key, level)
		n.slots = []hslot{{name: name, val: val}}
		return n, 1
	}
	f := frag(key, level)
	i, ok := h.index(f)
	if !ok {
		if val == nil {
			return h, 0
		}
		out := h.own(e)
		out.bitmap |= 1 << f
		out.slots = slices.Insert(out.slots, i, hslot{name: name, val: val})
		out.n++
		return out, 1
	}
	s := h.slots[i]
	var ns hslot
	delta := 0
	switch {
	case s.sub != nil:
		sub, d := s.sub.put(e, key, level+1, name, val)
		if d == 0 && sub == s.sub {
			return h, 0
		}
		delta = d
		switch {
		case sub == nil:
			// Cannot be (a node below the root holds two entries): the slot goes.
			out := h.own(e)
			out.bitmap &^= 1 << f
			out.slots = slices.Delete(out.slots, i, i+1)
			out.n += delta
			if out.n == 0 {
				return nil, delta
			}
			return out, delta
		case sub.n == 1 && sub.slots[0].sub == nil:
			ns = sub.slots[0] // one entry left: it moves up, as if never nested
		default:
			ns = hslot{sub: sub}
		}
	case s.name == name:
		if val == nil {
			out := h.own(e)
			out.bitmap &^= 1 << f
			out.slots = slices.Delete(out.slots, i, i+1)
			out.n--
			if out.n == 0 {
				return nil, -1
			}
			return out, -1
		}
		if s.val == val {
			return h, 0
		}
		ns = hslot{name: name, val: val}
	default:
		if val == nil {
			return h, 0
		}
		// Two names in one slot: a node of both below it.
		okey := nameKey(s.name)
		sub := &hnode{edit: e}
		sub, _ = sub.putPair(e, &okey, s, key, hslot{name: name, val: val}, level+1)
		ns, delta = hslot{sub: sub}, 1
	}
	out := h.own(e)
	out.slots[i] = ns
	out.n += delta
	return out, delta
}

// putPair fills empty node h (of batch e) with entries a and b, of keys ka and kb, at level.
func (h *hnode) putPair(e *edit, ka *[32]byte, a hslot, kb *[32]byte, b hslot, level int) (*hnode, int) {
	if level >= hlevels {
		panic("sandbox: a SHA-256 collision of two names")
	}
	fa, fb := frag(ka, level), frag(kb, level)
	h.n = 2
	if fa == fb {
		sub, _ := (&hnode{edit: e}).putPair(e, ka, a, kb, b, level+1)
		h.bitmap = 1 << fa
		h.slots = []hslot{{sub: sub}}
		return h, 2
	}
	h.bitmap = 1<<fa | 1<<fb
	if fa < fb {
		h.slots = []hslot{a, b}
	} else {
		h.slots = []hslot{b, a}
	}
	return h, 2
}

// seal hashes the nodes of trie h not sealed yet and ends their batch: they are immutable
// from now on. Every entry must be sealed.
func (h *hnode) seal() {
	if h == nil || h.edit == nil {
		return
	}
	for i := range h.slots {
		h.slots[i].sub.seal()
	}
	w := sha256.New()
	var b [9]byte
	b[0] = 1
	binary.LittleEndian.PutUint32(b[1:], h.bitmap)
	w.Write(b[:5])
	var lh [32]byte
	for _, s := range h.slots {
		if s.sub != nil {
			w.Write(s.sub.hash[:])
			continue
		}
		leafHash(&lh, s.name, s.val)
		w.Write(lh[:])
	}
	w.Sum(h.hash[:0])
	h.edit = nil
}

// leafHash is an entry's hash in its node: its name and its hash.
func leafHash(out *[32]byte, name string, val *dnode) {
	w := sha256.New()
	var b [9]byte
	binary.LittleEndian.PutUint64(b[1:], uint64(len(name)))
	w.Write(b[:])
	io.WriteString(w, name)
	w.Write(val.hash[:])
	w.Sum(out[:0])
}

// emptyTrieHash is the hash of a directory without entries.
var emptyTrieHash = sha256.Sum256([]byte{1, 0, 0, 0, 0})

// trieHash is the hash of sealed trie h.
func trieHash(h *hnode) [32]byte {
	if h == nil {
		return emptyTrieHash
	}
	return h.hash
}

// each calls f for each entry of trie h, in no particular order.
func (h *hnode) each(f func(name string, val *dnode)) {
	if h == nil {
		return
	}
	for _, s := range h.slots {
		if s.sub != nil {
			s.sub.each(f)
			continue
		}
		f(s.name, s.val)
	}
}

// names returns the names of trie h, sorted.
func (h *hnode) names() []string {
	out := make([]string, 0, h.size())
	h.each(func(name string, _ *dnode) { out = append(out, name) })
	slices.Sort(out)
	return out
}

// diffNames appends to out the names whose entries differ between sealed tries a and b
// (absent from one, or of another hash), descending only into nodes whose hashes differ.
func diffNames(a, b *hnode, out []string) []string {
	if a == b || a != nil && b != nil && a.hash == b.hash {
		return out
	}
	if a == nil || b == nil {
		a.each(func(name string, _ *dnode) { out = append(out, name) })
		b.each(func(name string, _ *dnode) { out = append(out, name) })
		return out
	}
	for f := range uint(1 << hbits) {
		out = diffSlots(a.slot(f), b.slot(f), out)
	}
	return out
}

// slot is h's slot of bit f, nil if none.
func (h *hnode) slot(f uint) *hslot {
	if i, ok := h.index(f); ok {
		return &h.slots[i]
	}
	return nil
}

// diffSlots is diffNames of slots sa and sb (either nil) of one bit.
func diffSlots(sa, sb *hslot, out []string) []string {
	switch {
	case sa == nil && sb == nil:
		return out
	case sa != nil && sb != nil && sa.sub != nil && sb.sub != nil:
		return diffNames(sa.sub, sb.sub, out)
	case sa != nil && sb != nil && sa.sub == nil && sb.sub == nil && sa.name == sb.name:
		if sa.val != sb.val && sa.val.hash != sb.val.hash {
			out = append(out, sa.name)
		}
		return out
	}
	// An entry against a node, or two entries of other names: the union of the two, each
	// compared by hash.
	ma := slotEntries(sa)
	for name, v := range slotEntries(sb) {
		if w, ok := ma[name]; !ok || w.hash != v.hash {
			out = append(out, name)
		}
		delete(ma, name)
	}
	for name := range ma {
		out = append(out, name)
	}
	return out
}

// slotEntries are the entries of slot s (nil: none).
func slotEntries(s *hslot) map[string]*dnode {
	m := map[string]*dnode{}
	switch {
	case s == nil:
	case s.sub != nil:
		s.sub.each(func(name string, v *dnode) { m[name] = v })
	default:
		m[s.name] = s.val
	}
	return m
}
