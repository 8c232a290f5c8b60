package ledger

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// spool is the writer's durable local log: a directory of append-only segment files named by
// the sequence number of their first record, each a run of checksummed frames (record.go).
// The syncer goroutine appends and fsyncs; the deliverer goroutine reads and trims.
type spool struct {
	dir      string
	id       string // names this spool's delivery mark in Postgres
	lock     *os.File
	segBytes int64

	mu   sync.Mutex // guards segs
	segs []uint64   // first sequence number of each segment, ascending; the last is active

	// Syncer only.
	active     *os.File
	activeSize int64

	// Reader only (the deliverer's prefetching goroutine): where the last read stopped.
	cur struct {
		f    *os.File
		buf  []byte // a slab of bytes read from f: frames before off are handed out, the rest unparsed
		off  int
		seg  uint64
		next uint64 // seq of the next frame at the reader's position
	}
}

func segName(first uint64) string { return fmt.Sprintf("%020d.seg", first) }

// openSpool locks dir, recovers its segments (cutting a torn tail off the newest one) and
// returns the spool, the first and the last sequence number it holds (last = first-1 if empty).
func openSpool(dir string, segBytes int64) (_ *spool, first, last uint64, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, 0, 0, fmt.Errorf("creating spool dir: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("opening spool lock: %w", err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = lock.Close()
		return nil, 0, 0, fmt.Errorf("locking spool %s: %w", dir, ErrSpoolLocked)
	}
	s := &spool{dir: dir, lock: lock, segBytes: segBytes}
	defer func() {
		if err != nil {
			_ = s.close()
		}
	}()
	if s.id, err = spoolID(dir); err != nil {
		return nil, 0, 0, err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("listing spool: %w", err)
	}
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".seg")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(name, 10, 64)
		if err != nil || n == 0 {
			continue
		}
		s.segs = append(s.segs, n)
	}
	sort.Slice(s.segs, func(i, j int) bool { return s.segs[i] < s.segs[j] })
	if len(s.segs) == 0 {
		s.segs = []uint64{1}
	}
	first = s.segs[0]
	last = first - 1
	for i, segFirst := range s.segs {
		if last+1 != segFirst {
			return nil, 0, 0, fmt.Errorf("segment %s follows seq %d: %w", segName(segFirst), last, ErrSpoolCorrupt)
		}
		if last, err = s.recoverSegment(segFirst, i == len(s.segs)-1); err != nil {
			return nil, 0, 0, err
		}
	}
	if err := s.openActive(); err != nil {
		return nil, 0, 0, err
	}
	return s, first, last, nil
}

// recoverSegment checks a segment's frames and returns its last sequence number. A torn or
// corrupt tail of the newest segment (a crash inside a group commit) is cut off.
func (s *spool) recoverSegment(first uint64, newest bool) (uint64, error) {
	path := filepath.Join(s.dir, segName(first))
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) && newest {
		return first - 1, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading spool segment: %w", err)
	}
	next, off := first, 0
	for off < len(b) {
		r, n, err := parseFrame(b[off:])
		if err == nil && r.seq != next {
			err = fmt.Errorf("seq %d where %d expected: %w", r.seq, next, ErrSpoolCorrupt)
		}
		if err != nil {
			if !newest {
				return 0, fmt.Errorf("segment %s at offset %d: %w", segName(first), off, err)
			}
			if err := os.Truncate(path, int64(off)); err != nil {
				return 0, fmt.Errorf("cutting torn tail of spool: %w", err)
			}
			break
		}
		off += n
		next++
	}
	return next - 1, nil
}

func (s *spool) openActive() error {
	s.mu.Lock()
	first := s.segs[len(s.segs)-1]
	s.mu.Unlock()
	f, err := os.OpenFile(filepath.Join(s.dir, segName(first)), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening spool segment: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("opening spool segment: %w", err)
	}
	s.active, s.activeSize = f, fi.Size()
	return syncDir(s.dir)
}

// write appends chunks of frames (ending with seq last) to the active segment and makes them durable,
// then starts a new segment if the active one is full. Called by the syncer only.
func (s *spool) write(chunks [][]byte, last uint64) error {
	var n int
	var err error
	for _, c := range chunks {
		var k int
		k, err = s.active.Write(c)
		n += k
		if err != nil {
			break
		}
	}
	if err == nil {
		err = syscall.Fdatasync(int(s.active.Fd()))
	}
	if err != nil {
		// Leave no partial frames behind: the caller retries the whole buffer.
		_ = s.active.Truncate(s.activeSize)
		return fmt.Errorf("writing spool: %w", err)
	}
	// The rows are durable and, unless the writer is overloaded, the in-memory queue holds
	// them too: drop their pages from the page cache (an overloaded writer reads them back
	// from disk). Kept cached, a busy spool grows the page cache by every row's bytes, pages
	// that must be freshly allocated (and, on this VM, first touched) while Postgres needs new
	// pages for the same rows; BenchmarkWriterSteps at rate=max went from 37k to 42k steps/s
	// and 16 to 13.5 µs of writer CPU per step with it. Only whole pages: the partial last
	// one is appended to next (a length of 0 would also mean "to the end of the file").
	ps := int64(os.Getpagesize())
	if from, to := s.activeSize&^(ps-1), (s.activeSize+int64(n))&^(ps-1); to > from {
		_ = unix.Fadvise(int(s.active.Fd()), from, to-from, unix.FADV_DONTNEED)
	}
	s.activeSize += int64(n)
	if s.activeSize < s.segBytes {
		return nil
	}
	old := s.active
	s.mu.Lock()
	s.segs = append(s.segs, last+1)
	s.mu.Unlock()
	if err := s.openActive(); err != nil {
		return err
	}
	return old.Close()
}

// read returns up to maxRows durable records with sequence numbers in [from, to], stopping
// early past maxBytes. Called by the deliverer only.
func (s *spool) read(from, to uint64, maxRows, maxBytes int) ([]record, error) {
	var out []record
	bytes := 0
	for from <= to && len(out) < maxRows && bytes < maxBytes {
		if err := s.seek(from); err != nil {
			return out, err
		}
		r, err := s.readFrame()
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			// End of this segment: the next one starts at from (or it is not written yet).
			s.closeCursor()
			s.mu.Lock()
			i := sort.Search(len(s.segs), func(i int) bool { return s.segs[i] > s.cur.seg })
			hasNext := i < len(s.segs) && s.segs[i] == from
			s.mu.Unlock()
			if !hasNext {
				return out, fmt.Errorf("record %d missing from the spool: %w", from, ErrSpoolCorrupt)
			}
			continue
		}
		if err != nil {
			return out, err
		}
		out = append(out, r)
		bytes += r.size()
		from++
	}
	return out, nil
}

// seek positions the cursor at the frame with sequence number seq.
func (s *spool) seek(seq uint64) error {
	if s.cur.f != nil && s.cur.next == seq {
		return nil
	}
	s.mu.Lock()
	i := sort.Search(len(s.segs), func(i int) bool { return s.segs[i] > seq }) - 1
	var first uint64
	if i >= 0 {
		first = s.segs[i]
	}
	s.mu.Unlock()
	if i < 0 {
		return fmt.Errorf("record %d is older than the spool: %w", seq, ErrSpoolCorrupt)
	}
	if s.cur.f == nil || s.cur.seg != first || s.cur.next > seq {
		s.closeCursor()
		f, err := os.Open(filepath.Join(s.dir, segName(first)))
		if err != nil {
			return fmt.Errorf("opening spool segment: %w", err)
		}
		s.cur.f, s.cur.buf, s.cur.off, s.cur.seg, s.cur.next = f, nil, 0, first, first
	}
	for s.cur.next < seq {
		if _, err := s.readFrame(); err != nil {
			return fmt.Errorf("skipping to record %d: %w", seq, err)
		}
	}
	return nil
}

func (s *spool) readFrame() (record, error) {
	if err := s.fill(frameHeader); err != nil {
		return record{}, err
	}
	size := frameHeader + int(binary.LittleEndian.Uint32(s.cur.buf[s.cur.off:]))
	if size > frameHeader+maxPayload {
		return record{}, fmt.Errorf("frame length: %w", ErrSpoolCorrupt)
	}
	if err := s.fill(size); err != nil {
		return record{}, err
	}
	// No CRC here: every frame was checked when the spool was opened (recoverSegment) or was
	// written by this process, and the frame's seq is still checked. That spares a second
	// checksum pass over each row read back.
	r, _, err := parseFrameCheck(s.cur.buf[s.cur.off:s.cur.off+size], false)
	if err != nil {
		return record{}, err
	}
	if r.seq != s.cur.next {
		return record{}, fmt.Errorf("seq %d where %d expected: %w", r.seq, s.cur.next, ErrSpoolCorrupt)
	}
	s.cur.off += size
	s.cur.next++
	return r, nil
}

// readSlab is the size of the reader's slabs. Records decoded from a slab point into it (no copy
// per frame), so a slab is never overwritten: a full one is left to the garbage collector once
// the records in it are delivered, and reading continues in a new one.
const readSlab = 4 << 20

// fill makes at least n unparsed bytes available in the cursor's slab, reading ahead as far as
// the slab allows. It returns io.EOF at the end of the file, io.ErrUnexpectedEOF inside a frame.
func (s *spool) fill(n int) error {
	c := &s.cur
	for len(c.buf)-c.off < n {
		if cap(c.buf)-c.off < n {
			nb := make([]byte, len(c.buf)-c.off, max(readSlab, n))
			copy(nb, c.buf[c.off:])
			c.buf, c.off = nb, 0
		}
		k, err := c.f.Read(c.buf[len(c.buf):cap(c.buf)])
		c.buf = c.buf[:len(c.buf)+k]
		if k > 0 {
			continue
		}
		if err == nil || errors.Is(err, io.EOF) {
			if len(c.buf) == c.off {
				return io.EOF
			}
			return io.ErrUnexpectedEOF
		}
		return fmt.Errorf("reading spool segment: %w", err)
	}
	return nil
}

func (s *spool) closeCursor() {
	if s.cur.f != nil {
		_ = s.cur.f.Close()
		s.cur.f, s.cur.buf, s.cur.off = nil, nil, 0
	}
}

// trim removes the segments every record of which has been delivered, never the active one.
// Called by the deliverer; it does not touch the reader's cursor.
func (s *spool) trim(delivered uint64) error {
	s.mu.Lock()
	var drop []uint64
	for len(s.segs) > 1 && s.segs[1] <= delivered+1 {
		drop = append(drop, s.segs[0])
		s.segs = s.segs[1:]
	}
	s.mu.Unlock()
	// The reader's cursor may still hold a removed segment open: it is past every record there
	// and moves on at its end; the file goes when the cursor closes it.
	for _, first := range drop {
		if err := os.Remove(filepath.Join(s.dir, segName(first))); err != nil {
			return fmt.Errorf("removing delivered spool segment: %w", err)
		}
	}
	return nil
}

// deliveredHint returns what the last writer recorded as delivered when it closed (0 if
// unknown). Postgres's mark stays the authority; the hint only spares reading rows back.
func (s *spool) deliveredHint() uint64 {
	b, err := os.ReadFile(filepath.Join(s.dir, "delivered"))
	if err != nil {
		return 0
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// setDeliveredHint records seq as delivered (rows up to it are committed to Postgres).
func (s *spool) setDeliveredHint(seq uint64) error {
	path := filepath.Join(s.dir, "delivered")
	if err := os.WriteFile(path+".tmp", []byte(strconv.FormatUint(seq, 10)+"\n"), 0o600); err != nil {
		return fmt.Errorf("writing delivery hint: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return fmt.Errorf("writing delivery hint: %w", err)
	}
	return nil
}

func (s *spool) close() error {
	s.closeCursor()
	var errs []error
	if s.active != nil {
		errs = append(errs, s.active.Close())
		s.active = nil
	}
	if s.lock != nil {
		errs = append(errs, s.lock.Close()) // releases the flock
		s.lock = nil
	}
	return errors.Join(errs...)
}

// spoolID reads the spool's identity, creating it on first use.
func spoolID(dir string) (string, error) {
	path := filepath.Join(dir, "id")
	b, err := os.ReadFile(path)
	if err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return strings.TrimSpace(string(b)), nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("reading spool id: %w", err)
	}
	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		return "", fmt.Errorf("making spool id: %w", err)
	}
	id := hex.EncodeToString(raw)
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return "", fmt.Errorf("writing spool id: %w", err)
	}
	_, err = f.WriteString(id + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		return "", fmt.Errorf("writing spool id: %w", err)
	}
	return id, syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing spool dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing spool dir: %w", err)
	}
	return nil
}
