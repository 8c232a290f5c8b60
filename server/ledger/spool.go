package ledger

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

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

	// Syncer only. activeSize is the end of the rows written to the active segment, syncedSize
	// that of the rows fsynced (durable); the rows between them are in the file (a SIGKILL
	// does not lose them) but not yet on stable storage.
	active     *os.File
	activeSize int64
	syncedSize int64
	// syncTail is a direct segment's partial last block at syncedSize: what stage starts with
	// again when a failure takes the segment back there (revert).
	syncTail []byte
	// syncing is the fsync in flight (beginSync to endSync), which writes do not wait for: it
	// makes the segment durable up to size, whose partial last block is tail.
	syncing struct {
		size int64
		tail []byte
	}
	// direct: the active segment is written with O_DIRECT from stage, a block-aligned buffer
	// that starts with the segment's partial last block (tailLen bytes; directIO says why).
	direct   bool
	noDirect bool // a direct write was refused: the page cache from then on
	stage    []byte

	log *slog.Logger

	// durable is the active segment's size at its last group commit: a direct segment ends in a
	// padded block past it, which the reader must not take for frames.
	// +checklocks:mu
	durable int64

	// readBuffered: the reader opens segments without O_DIRECT (set with noDirect).
	readBuffered atomic.Bool
	// slabsKept is how many retired and spare slabs the reader keeps (for tests: the reader
	// alone touches the lists).
	slabsKept atomic.Int32

	// Reader only (the deliverer's prefetching goroutine): where the last read stopped.
	cur struct {
		f   *os.File
		fd  int    // f's descriptor
		buf []byte // a slab of bytes read from f: frames before off are handed out, the rest unparsed
		off int
		pos int64 // f's offset of the end of buf
		// direct: f is open with O_DIRECT, and buf[0] is block-aligned in memory and in the file.
		direct bool
		block  []byte // a block-aligned block for topUp
		seg    uint64
		next   uint64 // seq of the next frame at the reader's position
	}
	// Reader only: slabs the cursor has left (retired, each with the last record read from
	// it) and slabs free to read into again (spare). A retired slab is spare once trim has
	// been called past its last record: every batch holding records in it has then committed,
	// and nothing else keeps them. Reusing slabs matters when the writer is behind and reads
	// most rows back: a new 4 MiB slab costs a page fault and a page zeroed per 4 KiB (reuseSlabs).
	retired []retiredSlab
	spare   [][]byte
	// trimmed is the last sequence number trim was called with (the deliverer's, read by the
	// reader).
	trimmed atomic.Uint64
}

// retiredSlab is a slab the cursor has left; last is the newest record read from it.
type retiredSlab struct {
	buf  []byte
	last uint64
}

// maxRetired bounds the retired slabs tracked (more are left to the garbage collector): a
// delivery that stalls while the reader reads ahead is bounded by the batches in flight, about
// 24 slabs with the default batch size and connections. maxSpare bounds those kept free: when a
// stall ends, the commits free many slabs at once, and a short spare list would drop most of
// them, so the reader would fault in new memory for them (on a VM, clearing new pages is a
// visible share of the machine's CPU in BenchmarkWriterSteps's saturated run). The spares are
// memory the reader already
// held; dropSlabs lets them go once rows come from memory again (nextBatch: at the next batch
// from memory, or when it waits with the spool caught up).
const (
	maxRetired = 64
	maxSpare   = 32
)

// reuseSlabs can be turned off to compare (SetSlabReuse).
var reuseSlabs = true

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
	s := &spool{dir: dir, lock: lock, segBytes: segBytes, log: slog.Default()}
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

// directIO makes the spool write its segments with O_DIRECT where the file system allows it.
//
// Through the page cache, every row is copied into pages that write then drops, and on a VM a
// page the guest has not used lately costs microseconds to fill (docs/ARCHITECTURE.md, "Known
// limits"): the spool's write would be a large share of the writer's CPU
// (BenchmarkWriterSteps with DELTAGYM_LEDGER_BENCH_BUFFERED=1; docs/PERFORMANCE.md, "The
// ledger"). With O_DIRECT the rows go from one reused, block-aligned buffer (stage) to the disk.
//
// The price:
//   - A group commit rewrites the segment's last, partial block: the bytes already there, the
//     same again, then the new rows. Acknowledged rows are thus rewritten in place, as
//     PostgreSQL rewrites its WAL's last page; a device that tore that block in a crash would
//     take them with it (recovery cuts the newest segment at the first frame that does not
//     check), and the reader checks each frame's CRC for the same reason.
//   - The file ends in a block padded with zeros until the segment is closed or a new one
//     starts, when it is cut to its frames: recovery cuts a zero tail off the newest segment as
//     it cuts a torn frame, and the reader never reads past the last group commit (durable).
//   - The reader may read the block a direct write is rewriting; the bytes it may take (below
//     durable) are the same in both.
//
// The reader, which reads rows back when the writer's in-memory queue has overflowed, reads
// with O_DIRECT too, for the same reason: through the page cache each 4 KiB row read back
// takes a page new to the VM, a large share of the writer's CPU in BenchmarkWriterSteps'
// saturated run. fill says how its reads stay aligned.
//
// Where O_DIRECT is refused at open, or the file wants an alignment dioBlock does not meet
// (statx's STATX_DIOALIGN), or a direct write fails with EINVAL anyway, the spool writes
// through the page cache; where a direct read fails with EINVAL, the reader reads through it.
var directIO = true

// Hooks for tests that make writes fail.
var (
	pwrite    = unix.Pwrite
	fdatasync = syscall.Fdatasync
)

const (
	// dioBlock is the alignment of direct writes: offsets, lengths and the buffer.
	dioBlock = 4096
	// stageBytes is the most one direct write carries; a bigger group commit takes several.
	stageBytes = 1 << 20
)

// openSegment opens a segment for appending: with O_DIRECT if direct and the file allows it.
func openSegment(path string, direct bool) (*os.File, bool, error) {
	if direct {
		if f, err := openWithDirect(path, unix.O_CREAT|unix.O_WRONLY, 0o600); f != nil || err != nil {
			return f, f != nil, err
		}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	return f, false, err
}

// openWithDirect opens path with O_DIRECT added to flags. It returns nil and no error when the file
// refuses O_DIRECT (EINVAL) or wants an alignment dioBlock does not meet.
func openWithDirect(path string, flags int, perm uint32) (*os.File, error) {
	fd, err := unix.Open(path, flags|unix.O_DIRECT|unix.O_CLOEXEC, perm)
	switch {
	case errors.Is(err, unix.EINVAL):
		return nil, nil
	case err != nil:
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	case !directAligned(fd):
		_ = unix.Close(fd)
		return nil, nil
	}
	return os.NewFile(uintptr(fd), path), nil
}

// directAligned reports whether direct writes aligned to dioBlock suit the open file fd, as far
// as statx says (file systems that do not say are trusted until a write fails with EINVAL).
func directAligned(fd int) bool {
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &st); err != nil || st.Mask&unix.STATX_DIOALIGN == 0 {
		return true
	}
	return st.Dio_offset_align != 0 && dioBlock%st.Dio_offset_align == 0 && st.Dio_mem_align != 0 && dioBlock%st.Dio_mem_align == 0
}

// alignedBuf returns n bytes starting on a dioBlock boundary.
func alignedBuf(n int) []byte {
	b := make([]byte, n+dioBlock)
	off := int(uintptr(unsafe.Pointer(&b[0])) & (dioBlock - 1))
	if off != 0 {
		off = dioBlock - off
	}
	return b[off : off+n : off+n]
}

func (s *spool) openActive() error {
	s.mu.Lock()
	first := s.segs[len(s.segs)-1]
	s.mu.Unlock()
	path := filepath.Join(s.dir, segName(first))
	f, direct, err := openSegment(path, directIO && !s.noDirect)
	if err != nil {
		return fmt.Errorf("opening spool segment: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return fmt.Errorf("opening spool segment: %w", err)
	}
	size := fi.Size()
	if direct {
		// The next write starts at the last partial block: keep its bytes.
		if base := size &^ (dioBlock - 1); size > base {
			if err := readTail(path, s.stageBuf()[:size-base], base); err != nil {
				_ = f.Close()
				return err
			}
		}
	}
	s.active, s.activeSize, s.direct = f, size, direct
	s.markSynced()
	return syncDir(s.dir)
}

// markSynced records that the active segment's rows are durable up to activeSize: the reader
// may read them, and a later failure takes the segment back no further.
func (s *spool) markSynced() {
	s.syncedSize = s.activeSize
	s.syncTail = append(s.syncTail[:0], s.stageBuf()[:s.tailLen()]...)
	if !s.direct {
		s.syncTail = s.syncTail[:0]
	}
	s.mu.Lock()
	s.durable = s.syncedSize
	s.mu.Unlock()
}

// beginSync starts an fsync of what is written so far: it returns a descriptor of the active
// segment for fdatasync, which the caller closes, and runs beside later writes. Call endSync
// with the result before the next beginSync.
func (s *spool) beginSync() (int, error) {
	fd, err := unix.Dup(int(s.active.Fd()))
	if err != nil {
		return -1, fmt.Errorf("syncing spool: %w", err)
	}
	s.syncing.size = s.activeSize
	s.syncing.tail = append(s.syncing.tail[:0], s.stageBuf()[:s.tailLen()]...)
	if !s.direct {
		s.syncing.tail = s.syncing.tail[:0]
	}
	return fd, nil
}

// endSync records the end of the fsync beginSync started: on success the segment is durable up
// to where it was then; on failure (err) it goes back to the last good fsync, the rows written
// since dropped, to be written again.
func (s *spool) endSync(err error) {
	if err != nil {
		s.revert()
		return
	}
	from := s.syncedSize
	s.syncedSize = s.syncing.size
	s.syncTail, s.syncing.tail = s.syncing.tail, s.syncTail
	s.mu.Lock()
	s.durable = s.syncedSize
	s.mu.Unlock()
	if !s.direct {
		// The rows are durable and, unless the writer is overloaded, the in-memory queue
		// holds them too: drop their pages from the page cache (an overloaded writer reads
		// them back from disk). Only whole pages: the partial last one is appended to next
		// (a length of 0 would also mean "to the end of the file").
		ps := int64(os.Getpagesize())
		if from, to := from&^(ps-1), s.syncedSize&^(ps-1); to > from {
			_ = unix.Fadvise(int(s.active.Fd()), from, to-from, unix.FADV_DONTNEED)
		}
	}
}

// full reports whether the active segment has reached the size at which the next starts.
func (s *spool) full() bool { return s.activeSize >= s.segBytes }

// rotateIfFull starts a new segment, whose first record follows last, once the active one is
// full and durable to its end (no fsync in flight).
func (s *spool) rotateIfFull(last uint64) {
	if s.activeSize < s.segBytes || s.activeSize != s.syncedSize {
		return
	}
	if err := s.rotate(last + 1); err != nil {
		// The rows are durable: the segment stays active and grows, and a later fsync
		// tries again.
		s.log.Warn("ledger spool: could not start a new segment", "dir", s.dir, "err", err)
	}
}

// revert takes the active segment back to its last fsync (syncedSize), dropping the rows
// written after it: they are to be written again.
func (s *spool) revert() {
	_ = s.active.Truncate(s.syncedSize)
	s.activeSize = s.syncedSize
	if s.direct {
		copy(s.stageBuf(), s.syncTail)
	}
}

// tailLen is the length of the active segment's partial last block, which a direct write
// writes again (from the head of stage) before the new rows.
func (s *spool) tailLen() int { return int(s.activeSize & (dioBlock - 1)) }

func (s *spool) stageBuf() []byte {
	if s.stage == nil {
		s.stage = alignedBuf(stageBytes)
	}
	return s.stage
}

func readTail(path string, b []byte, off int64) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("reading spool segment: %w", err)
	}
	defer f.Close()
	if _, err := f.ReadAt(b, off); err != nil {
		return fmt.Errorf("reading spool segment: %w", err)
	}
	return nil
}

// write appends chunks of frames (ending with seq last) to the active segment, and with fsync
// makes every row written so far durable, then starts a new segment if the active one is full.
// Without fsync, the rows are in the file once it returns (a SIGKILL of the process does not
// lose them) but not yet on stable storage. An error means chunks are not in the segment, and
// with dropped, neither is anything written since the last fsync (the fsync failed): the caller
// writes those rows again too.
func (s *spool) write(chunks [][]byte, last uint64, fsync bool) (dropped bool, err error) {
	if err := s.append(chunks); err != nil {
		return false, err
	}
	if !fsync || s.activeSize == s.syncedSize {
		return false, nil
	}
	fd, err := s.beginSync()
	if err != nil {
		return false, err
	}
	err = fdatasync(fd)
	_ = unix.Close(fd)
	s.endSync(err)
	if err != nil {
		return true, fmt.Errorf("syncing spool: %w", err)
	}
	s.rotateIfFull(last)
	return false, nil
}

// append writes chunks of frames after the active segment's: they are in the file (a SIGKILL
// of the process does not lose them), not yet durable. On error they are not in the file.
// Called by the syncer only.
func (s *spool) append(chunks [][]byte) error {
	n, err := s.writeChunks(chunks)
	if err != nil && s.direct && errors.Is(err, unix.EINVAL) {
		// The file system took O_DIRECT at open but not these writes: go on through the
		// page cache, for this segment and the next.
		if berr := s.toBuffered(); berr != nil {
			return fmt.Errorf("writing spool: %w (and going on without O_DIRECT: %w)", err, berr)
		}
		s.log.Warn("ledger spool: direct writes refused; writing through the page cache", "dir", s.dir, "err", err)
		n, err = s.writeChunks(chunks)
	}
	if err != nil {
		return fmt.Errorf("writing spool: %w", err)
	}
	s.activeSize += int64(n)
	return nil
}

// writeChunks writes chunks after the active segment's frames. On failure it leaves the
// segment, and stage's copy of its partial last block, as they were.
func (s *spool) writeChunks(chunks [][]byte) (n int, err error) {
	if len(chunks) == 0 {
		return 0, nil
	}
	if !s.direct {
		n, err = s.writeBuffered(chunks)
		if err != nil {
			_ = s.active.Truncate(s.activeSize)
		}
		return n, err
	}
	var saved [dioBlock]byte
	tail := copy(saved[:], s.stageBuf()[:s.tailLen()])
	n, err = s.writeDirect(chunks)
	if err != nil {
		copy(s.stage, saved[:tail])
		_ = s.active.Truncate(s.activeSize)
	}
	return n, err
}

// usePageCache makes the spool write and read through the page cache from now on.
func (s *spool) usePageCache() error {
	s.noDirect = true
	s.readBuffered.Store(true)
	if !s.direct {
		return nil
	}
	if err := s.toBuffered(); err != nil {
		return fmt.Errorf("opening spool segment: %w", err)
	}
	s.markSynced() // what is there is durable: openActive synced it
	return nil
}

// toBuffered reopens the active segment for writes through the page cache, cut to its frames.
func (s *spool) toBuffered() error {
	if err := s.active.Truncate(s.activeSize); err != nil {
		return err
	}
	f, _, err := openSegment(s.active.Name(), false)
	if err != nil {
		return err
	}
	_ = s.active.Close()
	s.active, s.direct, s.noDirect = f, false, true
	s.readBuffered.Store(true)
	return nil
}

// rotate starts the segment whose first record is first, once the active one is cut to its
// frames and the new one is durably in the directory. On failure the active segment stays.
func (s *spool) rotate(first uint64) error {
	if s.direct {
		// Only the newest segment may end in anything but frames.
		if err := s.active.Truncate(s.activeSize); err != nil {
			return err
		}
		if err := fdatasync(int(s.active.Fd())); err != nil {
			return err
		}
	}
	path := filepath.Join(s.dir, segName(first))
	f, direct, err := openSegment(path, directIO && !s.noDirect)
	if err != nil {
		return err
	}
	if err := syncDir(s.dir); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return err
	}
	old := s.active
	s.mu.Lock()
	s.segs = append(s.segs, first)
	s.durable = 0
	s.mu.Unlock()
	s.active, s.activeSize, s.direct = f, 0, direct
	s.markSynced()
	_ = old.Close() // its rows are durable
	return nil
}

// writeBuffered appends chunks through the page cache.
func (s *spool) writeBuffered(chunks [][]byte) (n int, err error) {
	for _, c := range chunks {
		k, err := s.active.Write(c)
		n += k
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// writeDirect writes chunks after the active segment's frames with O_DIRECT, in whole blocks
// from stage: the segment's partial last block first, the last block padded with zeros. It
// leaves that last block's bytes at the head of stage for the next write, whose tailLen they
// are once write has added n to activeSize (writeSync puts the old ones back if the write or
// its fsync fails).
func (s *spool) writeDirect(chunks [][]byte) (n int, err error) {
	stage := s.stageBuf()
	fill := s.tailLen()
	base := s.activeSize - int64(fill)
	fd := int(s.active.Fd())
	for _, c := range chunks {
		for len(c) > 0 {
			k := copy(stage[fill:], c)
			fill, c, n = fill+k, c[k:], n+k
			if fill == len(stage) {
				if err := pwriteFull(fd, stage, base); err != nil {
					return n, err
				}
				base, fill = base+int64(fill), 0
			}
		}
	}
	if fill > 0 {
		end := (fill + dioBlock - 1) &^ (dioBlock - 1)
		clear(stage[fill:end])
		if err := pwriteFull(fd, stage[:end], base); err != nil {
			return n, err
		}
	}
	whole := fill &^ (dioBlock - 1)
	copy(stage, stage[whole:fill])
	return n, nil
}

// pwriteFull writes b at off in one direct write: a short one is an error, since what is left
// would no longer be aligned (the caller retries the whole group commit).
func pwriteFull(fd int, b []byte, off int64) error {
	for {
		k, err := pwrite(fd, b, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if k != len(b) {
			return io.ErrShortWrite
		}
		return nil
	}
}

// read returns up to maxRows durable records with sequence numbers in [from, to], stopping
// early past maxBytes. Called by the deliverer only.
func (s *spool) read(from, to uint64, maxRows, maxBytes int) ([]record, error) {
	var out []record
	bytes := 0
	for from <= to && len(out) < maxRows && bytes < maxBytes {
		if err := s.seek(from); err != nil {
			s.closeCursor() // the next read starts over from the file
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
			s.closeCursor()
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
		f, direct, err := openForReading(filepath.Join(s.dir, segName(first)), directIO && !s.readBuffered.Load())
		if err != nil {
			return fmt.Errorf("opening spool segment: %w", err)
		}
		s.cur.f, s.cur.fd, s.cur.direct = f, int(f.Fd()), direct
		s.cur.buf, s.cur.off, s.cur.pos, s.cur.seg, s.cur.next = nil, 0, 0, first, first
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
	// The CRC is checked again (cheap beside the read): a direct write rewrites the block of
	// the last rows acknowledged (directIO).
	r, _, err := parseFrame(s.cur.buf[s.cur.off : s.cur.off+size])
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
// per frame), so a slab's handed-out bytes are never overwritten while a batch may hold them:
// reading continues in another slab, and a full one is read into again only once the records
// in it are delivered (takeSlab), or left to the garbage collector (dropSlabs).
const readSlab = 4 << 20

// The reader reads with O_DIRECT too where the file allows it (directIO says why). A direct
// cursor's slab starts on a block boundary, in memory and in the file, so reads into it stay
// aligned; a slab that ends inside a block (a read stopped at the active segment's durable end,
// or at a segment's end) is topped up from that block read aside (cur.block), not in place,
// where it would write over bytes already handed out.

// pread is a hook for tests that make reads fail.
var pread = unix.Pread

// fill makes at least n unparsed bytes available in the cursor's slab, reading ahead as far as
// the slab and the segment's durable end allow. It returns io.EOF at that end, io.ErrUnexpectedEOF
// inside a frame.
func (s *spool) fill(n int) error {
	c := &s.cur
	for len(c.buf)-c.off < n {
		if cap(c.buf)-c.off < n {
			s.newSlab(n)
		}
		end := s.readEnd(c.seg)
		var k int
		var err error
		if c.direct && c.pos&(dioBlock-1) != 0 {
			k, err = s.topUp(end)
		} else {
			want := c.buf[len(c.buf):cap(c.buf)]
			if c.pos+int64(len(want)) > end {
				limit := max(0, end-c.pos)
				if c.direct {
					limit = (limit + dioBlock - 1) &^ (dioBlock - 1)
				}
				want = want[:limit]
			}
			if len(want) > 0 {
				k, err = preadFull(c.fd, want, c.pos, c.direct)
				k = int(min(int64(k), max(0, end-c.pos))) // never the padding past durable
				c.buf = c.buf[:len(c.buf)+k]
				c.pos += int64(k)
			}
		}
		if k > 0 {
			continue
		}
		if c.direct && errors.Is(err, unix.EINVAL) {
			if err = s.readBufferedNow(); err != nil {
				return err
			}
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

// topUp reads the block the direct cursor's slab ends inside into cur.block and appends what
// of it the slab lacks, up to end. It returns how many bytes it appended.
func (s *spool) topUp(end int64) (int, error) {
	c := &s.cur
	if c.block == nil {
		c.block = alignedBuf(dioBlock)
	}
	at := c.pos &^ (dioBlock - 1)
	k, err := preadFull(c.fd, c.block, at, true)
	k = int(min(int64(k), max(0, end-at)))
	have := int(c.pos - at)
	if k <= have {
		return 0, err
	}
	m := copy(c.buf[len(c.buf):cap(c.buf)], c.block[have:k])
	c.buf = c.buf[:len(c.buf)+m]
	c.pos += int64(m)
	return m, nil
}

// newSlab moves the cursor's unparsed bytes to a new slab with room for n of them. A direct
// cursor's new slab starts at the block holding the first unparsed byte, which keeps its place
// in that block.
func (s *spool) newSlab(n int) {
	c := &s.cur
	rest := c.buf[c.off:]
	lead := 0
	var nb []byte
	if c.direct {
		lead = int(c.pos-int64(len(rest))) & (dioBlock - 1)
		nb = s.takeSlab((max(readSlab, lead+n) + dioBlock - 1) &^ (dioBlock - 1))
	} else {
		nb = make([]byte, 0, max(readSlab, n))
	}
	nb = append(nb[:lead], rest...)
	s.retireSlab()
	c.buf = nb
	c.off = lead
}

// takeSlab returns a block-aligned slab of size bytes: a spare one when it has the standard
// size, else a new one.
func (s *spool) takeSlab(size int) []byte {
	if size == readSlab && reuseSlabs {
		done := s.trimmed.Load()
		keep := s.retired[:0]
		for _, r := range s.retired {
			switch {
			case r.last > done:
				keep = append(keep, r)
			case len(s.spare) < maxSpare:
				s.spare = append(s.spare, r.buf)
			}
		}
		clear(s.retired[len(keep):])
		s.retired = keep
		if k := len(s.spare); k > 0 {
			b := s.spare[k-1]
			s.spare[k-1] = nil
			s.spare = s.spare[:k-1]
			s.noteKept()
			return b[:size:size]
		}
		s.noteKept()
	}
	return alignedBuf(size)
}

// dropSlabs forgets the retired and spare slabs, for the garbage collector to take once no batch
// holds their records: the reader calls it when it serves rows from memory again, or waits with
// the spool caught up, so that a burst of reading back does not keep its slabs (some two dozen
// of 4 MiB with the defaults, up to maxRetired+maxSpare) for good.
func (s *spool) dropSlabs() {
	if len(s.retired) == 0 && len(s.spare) == 0 {
		return
	}
	clear(s.retired)
	clear(s.spare)
	s.retired, s.spare = s.retired[:0], s.spare[:0]
	s.noteKept()
}

// retireSlab records that the cursor leaves its slab, for takeSlab to reuse once every record
// read from it is delivered. Only a direct cursor's standard slabs are reused.
func (s *spool) retireSlab() {
	c := &s.cur
	if c.buf == nil || !c.direct || cap(c.buf) != readSlab || !reuseSlabs {
		return
	}
	var last uint64
	if c.next > 0 {
		last = c.next - 1
	}
	if len(s.retired) == maxRetired {
		s.retired[0] = retiredSlab{}
		s.retired = s.retired[1:]
	}
	s.retired = append(s.retired, retiredSlab{buf: c.buf[:0], last: last})
	s.noteKept()
}

// noteKept publishes how many slabs the reader keeps (slabsKept).
func (s *spool) noteKept() { s.slabsKept.Store(int32(len(s.retired) + len(s.spare))) }

// preadFull reads b at off until it is full, the file ends or a read fails. A direct read that
// comes back short has met the end of the file: going on would read at an unaligned offset.
func preadFull(fd int, b []byte, off int64, direct bool) (int, error) {
	n := 0
	for n < len(b) {
		k, err := pread(fd, b[n:], off+int64(n))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if k == 0 {
			return n, io.EOF
		}
		n += k
		if direct && n < len(b) {
			return n, io.EOF
		}
	}
	return n, nil
}

// openForReading opens a segment for the reader: with O_DIRECT if direct and the file allows it.
func openForReading(path string, direct bool) (*os.File, bool, error) {
	if direct {
		if f, err := openWithDirect(path, unix.O_RDONLY, 0); f != nil || err != nil {
			return f, f != nil, err
		}
	}
	f, err := os.Open(path)
	return f, false, err
}

// readBufferedNow reopens the cursor's segment without O_DIRECT, after a direct read was refused;
// the spool reads through the page cache from then on. The slab stays.
func (s *spool) readBufferedNow() error {
	c := &s.cur
	s.log.Warn("ledger spool: a direct read was refused (EINVAL); reading through the page cache", "segment", c.f.Name())
	s.readBuffered.Store(true)
	f, err := os.Open(c.f.Name())
	if err != nil {
		return fmt.Errorf("opening spool segment: %w", err)
	}
	_ = c.f.Close()
	c.f, c.fd, c.direct = f, int(f.Fd()), false
	return nil
}

// readEnd is how far the reader may read the segment that starts with seq first: the active
// segment's durable size, or all of an older one (cut to its frames when it was closed).
func (s *spool) readEnd(first uint64) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if first == s.segs[len(s.segs)-1] {
		return s.durable
	}
	return math.MaxInt64
}

func (s *spool) closeCursor() {
	if s.cur.f != nil {
		s.retireSlab()
		_ = s.cur.f.Close()
		s.cur.f, s.cur.fd, s.cur.buf, s.cur.off, s.cur.direct = nil, -1, nil, 0, false
	}
}

// trim removes the segments every record of which has been delivered, never the active one.
// Called by the deliverer; it does not touch the reader's cursor.
func (s *spool) trim(delivered uint64) error {
	if delivered > s.trimmed.Load() {
		s.trimmed.Store(delivered) // the deliverer is the only writer
	}
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
		if s.direct {
			// Cut the padding off the last block. Not fsynced: recovery would cut it too.
			_ = s.active.Truncate(s.activeSize)
		}
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
