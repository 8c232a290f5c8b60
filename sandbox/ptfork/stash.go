//go:build linux && amd64

package ptfork

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// A copy made by Become costs the copy of the pages the other process
// wrote, at every copy. Stash pays it once: the process that forks the
// copies (the child's template) gets the other's memory at once, mapped
// as it is mapped but elsewhere, away from its own mappings and the
// other's. A fork shares those pages with it; Become then moves them where
// they belong (mremap: their page tables move, no page is copied), and
// the copy that stays the child unmaps them (DropStash).

// stash is where the memory of a Source waits in a process: from[k] is the
// address its mapping k is made at (0 for the vDSO and such, which are not
// stashed), all within lo..hi, which holds nothing else.
type stash struct {
	lo, hi uint64
	from   []uint64
}

// hugeSize is a huge page's size: a mapping is stashed at an address
// congruent to its own modulo it, so that huge pages move whole.
const hugeSize = 2 << 20

// stashLow is where a stash is looked for room from: above the programs a
// process maps low, and its heap, in a 47-bit address space.
const stashLow = 1 << 40

// planStash places the stash of the mappings src in a range free in own
// and src.
func planStash(own, src []vma) (*stash, error) {
	st := &stash{from: make([]uint64, len(src))}
	var off uint64
	for k, v := range src {
		if v.special() {
			continue
		}
		off += (v.start - off) % hugeSize // congruent to v.start
		st.from[k] = off
		off += v.end - v.start
	}
	used := append(slices.Clone(own), src...)
	slices.SortFunc(used, func(a, b vma) int { return cmpU64(a.start, b.start) })
	at := uint64(stashLow)
	for _, v := range used {
		if v.end <= at {
			continue
		}
		if v.start >= at+off {
			break
		}
		at = (v.end + hugeSize - 1) &^ (hugeSize - 1)
	}
	if at+off > userTop {
		return nil, fmt.Errorf("%w: no room for the other process's %d bytes", ErrBecome, off)
	}
	for k, v := range src {
		if !v.special() {
			st.from[k] += at
		}
	}
	st.lo, st.hi = at, at+off
	return st, nil
}

// Stash maps the memory of s's process into t, a stopped process of one
// thread that is to fork copies which Become it, and returns t's layout
// for Become: each mapping of s's where no mapping of t's or s's is, with
// its protections, its files mapped from their paths as t sees them, the
// pages s's process wrote copied. t runs on as before; what it stashed is
// its memory too, which it does not touch. t must be able to become s's
// process (Fits); once the stash is made, Become needs that process no
// more. t is unusable if Stash fails (kill it).
func (t *Proc) Stash(s *Source) (*Layout, error) {
	if len(t.threads) > 0 || t.group != nil {
		return nil, fmt.Errorf("%w: pid %d has more than one thread", ErrBecome, t.Pid)
	}
	own, err := ReadLayout(t.Pid)
	if err != nil {
		return nil, err
	}
	if err := s.Fits(own); err != nil {
		return nil, err
	}
	st, err := planStash(own.maps, s.maps)
	if err != nil {
		return nil, err
	}
	base, err := t.placeScratch(own.maps, append(slices.Clone(s.maps), vma{start: st.lo, end: st.hi}))
	if err != nil {
		return nil, err
	}
	b := &batch{x: t, data: base, code: base + 2*scratchSize}
	paths := b.openFiles(s.maps)
	fds, err := b.run()
	if err == nil {
		b.mapLike(s, paths, fds, st.from)
		_, err = b.run()
	}
	if err == nil {
		err = copyWritten(s.pid, t.Pid, s.maps, s.written, st.from)
	}
	if _, uerr := t.Syscall(unix.SYS_MUNMAP, base, 3*scratchSize); uerr != nil {
		err = errors.Join(err, fmt.Errorf("unmapping the scratch pages of pid %d: %w", t.Pid, uerr))
	}
	if err != nil {
		return nil, err
	}
	like, err := ReadLayout(t.Pid)
	if err != nil {
		return nil, err
	}
	like.stash = st
	return like, nil
}

// StashCost is how many bytes a stash of s's process takes: the pages it
// wrote (those Become copies, and Stash places), and, where the machine
// gives anonymous memory huge pages unasked (THP "always"), the whole of
// each 2 MiB of an anonymous mapping it wrote a page of.
func (s *Source) StashCost() int64 { return s.stashCost(thpAlways()) }

func (s *Source) stashCost(always bool) int64 {
	var n uint64
	for k, w := range s.written {
		v := s.maps[k]
		lo, hi := (v.start+hugeSize-1)&^(hugeSize-1), v.end&^(hugeSize-1)
		counted := map[uint64]bool{}
		for _, r := range w {
			for pg := r.lo; pg < r.hi; pg++ {
				a := v.start + pg*pageSize
				if !always || !v.anon() || a < lo || a >= hi {
					n += pageSize
					continue
				}
				if h := a &^ (hugeSize - 1); !counted[h] {
					counted[h] = true
					n += hugeSize
				}
			}
		}
	}
	return int64(n)
}

// thpAlways reports whether the machine backs anonymous memory with
// transparent huge pages unasked.
func thpAlways() bool {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	return err == nil && strings.Contains(string(b), "[always]")
}

// DropStash unmaps from c, a fork of the process of layout like, what
// Stash placed there: c is then a copy of that process as it was before.
func (c *Proc) DropStash(like *Layout) error {
	if like == nil || like.stash == nil {
		return nil
	}
	st := like.stash
	if _, err := c.Syscall(unix.SYS_MUNMAP, uintptr(st.lo), uintptr(st.hi-st.lo)); err != nil {
		return fmt.Errorf("unmapping the stash of pid %d: %w", c.Pid, err)
	}
	return nil
}

// takeStash adds the calls that move each stashed mapping of s's where
// it belongs: x's own are unmapped by then.
func (b *batch) takeStash(s *Source, st *stash) error {
	if len(st.from) != len(s.maps) {
		return fmt.Errorf("%w: the stash of pid %d is not of pid %d", ErrBecome, b.x.Pid, s.pid)
	}
	for k, v := range s.maps {
		if v.special() {
			continue
		}
		size := uintptr(v.end - v.start)
		b.add(unix.SYS_MREMAP, uintptr(st.from[k]), size, size, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, uintptr(v.start))
	}
	return nil
}
