package sandbox

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/procstate"
)

// A template's memory is hashed page by page, only the pages that hold memory of their own:
// present or swapped out, found by the PAGEMAP_SCAN ioctl of /proc/PID/pagemap (Linux 6.7),
// which walks the page tables the process has and skips what it has not (a 64 TiB mapping with
// one page touched costs a few microseconds), and creates none. Reading a page through
// /proc/PID/mem that is not there would map the zero page into the template, with page tables
// charged to the reader's group, not the sandbox's. An absent page of an anonymous mapping reads
// as zeros, as does the shared zero page, so a page of zeros the program wrote, one it never
// touched and one it only read hash alike (all skipped): the digest does not depend on
// residency. In a private file mapping, a page the program has not written reads as the file,
// whose contents the files digest covers; only the pages of its own (copied on write) are
// hashed, zeros included.

// Constants of PAGEMAP_SCAN (linux/fs.h).
const (
	pageIsFile    = 1 << 2
	pageIsPresent = 1 << 3
	pageIsSwapped = 1 << 4
	pageIsPFNZero = 1 << 5
	// pagemapScan is _IOWR('f', 16, struct pm_scan_arg).
	pagemapScan = 3<<30 | uint(unsafe.Sizeof(pmScanArg{}))<<16 | 'f'<<8 | 16
)

// pmScanArg is struct pm_scan_arg.
type pmScanArg struct {
	size, flags, start, end, walkEnd, vec, vecLen, maxPages       uint64
	categoryInverted, categoryMask, categoryAnyofMask, returnMask uint64
}

// pageRegion is struct page_region.
type pageRegion struct{ start, end, categories uint64 }

// Bits of a /proc/PID/pagemap entry.
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61
)

// procBudget bounds one checkpoint's processes digest: the bytes of memory it may read, and the
// time it may take. A process's resident memory is charged to the sandbox's group and its
// memory limit forbids swap, so the limit bounds what one process of it has present; forked
// processes sharing their pages count them once each.
type procBudget struct {
	bytes    int64
	deadline time.Time
}

// procDigestTime is how long one checkpoint's processes digest may take.
const procDigestTime = 20 * time.Second

// newProcBudget is the budget of a checkpoint's processes digest starting now, in a sandbox of
// memory limit limit (0: none, the machine's memory and swap bound it).
func newProcBudget(limit int64) *procBudget {
	if limit <= 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err == nil {
			limit = int64(si.Totalram+si.Totalswap) * int64(si.Unit)
		} else {
			limit = 1 << 62
		}
	}
	return &procBudget{bytes: limit, deadline: time.Now().Add(procDigestTime)}
}

// errOverBudget: the processes digest went past its procBudget.
var errOverBudget = errors.New("processes digest over its budget")

// check returns errOverBudget past the deadline, or canceled's error.
func (b *procBudget) check(canceled func() error) error {
	if err := canceled(); err != nil {
		return err
	}
	if time.Now().After(b.deadline) {
		return fmt.Errorf("%w: past its deadline", errOverBudget)
	}
	return nil
}

// take counts n bytes read; errOverBudget past the budget.
func (b *procBudget) take(n int) error {
	if b.bytes -= int64(n); b.bytes < 0 {
		return fmt.Errorf("%w: more memory than its sandbox's limit", errOverBudget)
	}
	return nil
}

// unequalDigest is a processes digest that equals no other: a random one.
func unequalDigest() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return "sha256:" + hex.EncodeToString(b[:])
}

// memWalk hashes the memory of one template.
type memWalk struct {
	h            hash.Hash
	mem, pagemap *os.File
	masks        []procstate.Span
	budget       *procBudget
	canceled     func() error
	buf, zero    []byte
	vec          []pageRegion
	page         uint64
	// noScan: PAGEMAP_SCAN is not there, pagemap's entries are read instead.
	noScan  bool
	entries []byte
}

func newMemWalk(h hash.Hash, mem, pagemap *os.File, masks []procstate.Span, b *procBudget, canceled func() error) *memWalk {
	page := os.Getpagesize()
	return &memWalk{h: h, mem: mem, pagemap: pagemap, masks: masks, budget: b, canceled: canceled,
		buf: make([]byte, 1<<20), zero: make([]byte, page), vec: make([]pageRegion, 512), page: uint64(page)}
}

// mapping hashes the mapping of line (of /proc/PID/maps) if it is private and writable: its
// range, its name and its pages of its own.
func (w *memWalk) mapping(line string) error {
	var f [5]string
	rest := line
	for i := range f {
		f[i], rest, _ = strings.Cut(strings.TrimLeft(rest, " "), " ")
	}
	name := strings.TrimLeft(rest, " ")
	if f[1] != "rw-p" {
		return nil
	}
	lo, hi, found := strings.Cut(f[0], "-")
	if !found {
		return nil
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil || end < start {
		return nil
	}
	file := f[4] != "0"
	var rec [25]byte
	rec[0] = 'm'
	if file {
		rec[0] = 'f'
	}
	binary.LittleEndian.PutUint64(rec[1:], start)
	binary.LittleEndian.PutUint64(rec[9:], end)
	binary.LittleEndian.PutUint64(rec[17:], uint64(len(name)))
	w.h.Write(rec[:])
	io.WriteString(w.h, name)
	return w.regions(start, end, file, func(lo, hi uint64) error { return w.hashRun(lo, hi, file) })
}

// regions calls f for each run of pages of [start, end) that hold memory of their own: present
// or swapped out, not the zero page and, in a file mapping (file), not the file's.
func (w *memWalk) regions(start, end uint64, file bool, f func(lo, hi uint64) error) error {
	if w.noScan {
		return w.regionsByEntry(start, end, file, f)
	}
	not := uint64(pageIsPFNZero)
	if file {
		not |= pageIsFile
	}
	for start < end {
		if err := w.budget.check(w.canceled); err != nil {
			return err
		}
		a := pmScanArg{size: uint64(unsafe.Sizeof(pmScanArg{})), start: start, end: end,
			vec: uint64(uintptr(unsafe.Pointer(&w.vec[0]))), vecLen: uint64(len(w.vec)),
			categoryInverted: not, categoryMask: not, categoryAnyofMask: pageIsPresent | pageIsSwapped,
			returnMask: pageIsPresent | pageIsSwapped}
		n, _, errno := unix.Syscall(unix.SYS_IOCTL, w.pagemap.Fd(), uintptr(pagemapScan), uintptr(unsafe.Pointer(&a)))
		switch {
		case errno == unix.ENOTTY || errno == unix.EINVAL:
			w.noScan = true
			return w.regionsByEntry(start, end, file, f)
		case errno != 0:
			return fmt.Errorf("scanning a template's pages: %w", errno)
		}
		for _, r := range w.vec[:n] {
			if err := f(max(r.start, start), min(r.end, end)); err != nil {
				return err
			}
		}
		if a.walkEnd <= start {
			return errors.New("scanning a template's pages: no progress")
		}
		start = a.walkEnd
	}
	return nil
}

// regionsByEntry is regions from the entries of /proc/PID/pagemap, 8 bytes a page, read for
// the whole range (a kernel without PAGEMAP_SCAN: the time a range costs is bounded by the
// deadline alone). The zero page is not told apart: it is read, and found all zeros.
func (w *memWalk) regionsByEntry(start, end uint64, file bool, f func(lo, hi uint64) error) error {
	if w.entries == nil {
		w.entries = make([]byte, 64<<10)
	}
	runLo, inRun := uint64(0), false
	for at := start; at < end; {
		if err := w.budget.check(w.canceled); err != nil {
			return err
		}
		n := min(uint64(len(w.entries))/8, (end-at)/w.page)
		k, err := w.pagemap.ReadAt(w.entries[:n*8], int64(at/w.page*8))
		if k < int(n*8) {
			return fmt.Errorf("reading a template's pagemap: %w", err)
		}
		for i := range n {
			e := binary.LittleEndian.Uint64(w.entries[i*8:])
			own := e&(pmPresent|pmSwapped) != 0 && (!file || e&pmFile == 0)
			addr := at + i*w.page
			switch {
			case own && !inRun:
				runLo, inRun = addr, true
			case !own && inRun:
				inRun = false
				if err := f(runLo, addr); err != nil {
					return err
				}
			}
		}
		at += n * w.page
	}
	if inRun {
		return f(runLo, end)
	}
	return nil
}

// hashRun reads the pages of [lo, hi) through mem and hashes each, its address first, the
// bytes of masks as zeros; in an anonymous mapping (not file) a page of zeros is left out.
func (w *memWalk) hashRun(lo, hi uint64, file bool) error {
	var rec [9]byte
	for off := lo; off < hi; {
		if err := w.budget.check(w.canceled); err != nil {
			return err
		}
		n := int(min(uint64(len(w.buf)), hi-off))
		if err := w.budget.take(n); err != nil {
			return err
		}
		k, _ := w.mem.ReadAt(w.buf[:n], int64(off))
		k -= k % int(w.page)
		zeroMasked(w.buf[:k], off, w.masks)
		for p := 0; p < k; p += int(w.page) {
			pg := w.buf[p : p+int(w.page)]
			if !file && bytes.Equal(pg, w.zero) {
				continue
			}
			rec[0] = 'p'
			binary.LittleEndian.PutUint64(rec[1:], off+uint64(p))
			w.h.Write(rec[:])
			w.h.Write(pg)
		}
		if k < n {
			// An unreadable page: the mark stands for the rest of the run.
			rec[0] = '?'
			binary.LittleEndian.PutUint64(rec[1:], off+uint64(k))
			w.h.Write(rec[:])
			return nil
		}
		off += uint64(n)
	}
	return nil
}

// zeroMasked zeroes the bytes of b, read at address off, that masks cover.
func zeroMasked(b []byte, off uint64, masks []procstate.Span) {
	end := off + uint64(len(b))
	for _, m := range masks {
		lo, hi := max(m.Addr, off), min(m.Addr+m.Len, end)
		if lo < hi {
			clear(b[lo-off : hi-off])
		}
	}
}
