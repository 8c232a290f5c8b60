package ledger

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/tidwall/wal"
)

// The spool (spool.go) against a write-ahead-log library, github.com/tidwall/wal: the same
// step records (the spool's frames, 4 KiB observations), appended in groups that are each made
// durable before the next starts (the spool's fdatasync, the library's fsync after every
// WriteBatch), then read back and decoded in the same process, as the writer's deliverer reads
// rows back when it is behind. The spool runs as the writer runs it (O_DIRECT where the file
// system takes it) and through the page cache (spool-buffered).

// benchLog is one log under test.
type benchLog interface {
	// append makes frames, records first.. of the log, durable.
	append(frames [][]byte, first uint64) error
	// readBack reads records first..last back, decoded; it returns how many it read.
	readBack(first, last uint64) (int, error)
	close() error
}

type spoolLog struct{ s *spool }

func (l *spoolLog) append(frames [][]byte, first uint64) error {
	_, err := l.s.write(frames, first+uint64(len(frames))-1, true)
	return err
}

func (l *spoolLog) readBack(first, last uint64) (int, error) {
	n := 0
	for from := first; from <= last; {
		recs, err := l.s.read(from, last, 8192, 16<<20) // the deliverer's batch bounds
		if err != nil {
			return n, err
		}
		if len(recs) == 0 {
			return n, fmt.Errorf("no record at %d: %w", from, ErrSpoolCorrupt)
		}
		from += uint64(len(recs))
		n += len(recs)
		if err := l.s.trim(from - 1); err != nil { // delivered: the reader may reuse its slabs
			return n, err
		}
	}
	return n, nil
}

func (l *spoolLog) close() error { return l.s.close() }

// walLog is tidwall/wal with its defaults but the segment size (the spool's) and NoCopy (its
// reads return the segment's bytes, as the spool's records point into its slabs).
type walLog struct {
	log   *wal.Log
	batch wal.Batch
}

func (l *walLog) append(frames [][]byte, first uint64) error {
	for i, f := range frames {
		l.batch.Write(first+uint64(i), f)
	}
	return l.log.WriteBatch(&l.batch) // fsyncs: Options.NoSync is false
}

func (l *walLog) readBack(first, last uint64) (int, error) {
	n := 0
	for i := first; i <= last; i++ {
		b, err := l.log.Read(i)
		if err != nil {
			return n, err
		}
		if _, _, err := parseFrame(b); err != nil { // the spool's reader decodes its frames too
			return n, err
		}
		n++
	}
	return n, nil
}

func (l *walLog) close() error { return l.log.Close() }

func openBenchLog(kind, dir string) (benchLog, error) {
	const segBytes = 64 << 20 // Config.SegmentBytes's default
	switch kind {
	case "spool", "spool-buffered":
		directIO = kind == "spool"
		s, _, _, err := openSpool(dir, segBytes)
		if err != nil {
			return nil, err
		}
		return &spoolLog{s: s}, nil
	case "tidwall-wal":
		l, err := wal.Open(dir, &wal.Options{SegmentSize: segBytes, NoCopy: true})
		if err != nil {
			return nil, err
		}
		return &walLog{log: l}, nil
	}
	return nil, fmt.Errorf("no log %q", kind)
}

// stepFrames encodes step records with 4 KiB observations of shell-like text, for seq 1..n of
// a ring: frame(seq) patches a ring entry's sequence number and checksum, so that any number of
// records costs the memory of the ring.
type stepFrames struct{ ring [][]byte }

func newStepFrames(n, obs int) *stepFrames {
	r := rand.New(rand.NewPCG(3, 4))
	words := []string{"ok", "PASS", "FAIL", "error:", "src/", "main.go", "line", "\n", "  ", "build", "cache", "0x7f"}
	f := &stepFrames{}
	for i := range n {
		o := make([]byte, 0, obs+16)
		for len(o) < obs {
			o = append(o, words[r.IntN(len(words))]...)
			o = fmt.Appendf(o, " %d ", r.IntN(100000))
		}
		o = o[:obs]
		sum := sha256.Sum256(o)
		row := &StepRow{EpisodeID: fmt.Sprintf("ep_bench%018d", i), Index: i, Action: []byte(`{"exec":{"command":"make test"}}`),
			Observation: o, ObservationSize: int64(obs), ObservationSHA256: sum[:], Reward: 0.5,
			StartedAt: time.Unix(1700000000, int64(i)*1000).UTC(), Duration: time.Millisecond}
		f.ring = append(f.ring, appendFrame(nil, &record{seq: uint64(i + 1), kind: recStep, step: row}))
	}
	return f
}

// frame returns the frame of record seq (valid until the ring comes round to it again).
func (f *stepFrames) frame(seq uint64) []byte {
	b := f.ring[seq%uint64(len(f.ring))]
	binary.LittleEndian.PutUint64(b[8:], seq)
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	return b
}

// processCPU is the CPU time (user and system) this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkSpoolVsWAL appends b.N step records (4 KiB observations, about 4.3 KiB a frame) to
// each log in groups of 1, 32 and 512, each group durable before the next starts (group=512 is
// the writer's group commit at 50,000 steps/s), then reads them all back. The logs take turns,
// a group each (the first of a turn going round), and then 8192 records each of the read-back,
// so that they meet the machine at the same moments. For each log it reports appends/s and MB/s
// (over its own appends' time), the p50/p99 time of a group's append+sync (what an append waits
// for before it is acknowledged), the process's CPU per append, and the read-back's rows/s and
// CPU per row. DELTAGYM_LEDGER_BENCH_DIR names the directory to write in (default: the temp
// dir, which must not be a tmpfs for the syncs to mean anything).
func BenchmarkSpoolVsWAL(b *testing.B) {
	frames := newStepFrames(1024, 4096) // more than a group: a group's frames are distinct buffers
	defer func(d bool) { directIO = d }(directIO)
	for _, group := range []int{1, 32, 512} {
		b.Run(fmt.Sprintf("group=%d", group), func(b *testing.B) { benchLogs(b, group, frames) })
	}
}

// benchLogKinds are the logs BenchmarkSpoolVsWAL compares.
var benchLogKinds = []string{"spool", "spool-buffered", "tidwall-wal"}

// logStats is what one log's appends and reads took.
type logStats struct {
	appendWall, appendCPU, readWall, readCPU time.Duration
	bytes                                    int64
	lat                                      []time.Duration
}

func benchLogs(b *testing.B, group int, frames *stepFrames) {
	dir, err := os.MkdirTemp(os.Getenv("DELTAGYM_LEDGER_BENCH_DIR"), "logbench")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	logs := make([]benchLog, len(benchLogKinds))
	for i, kind := range benchLogKinds {
		if logs[i], err = openBenchLog(kind, filepath.Join(dir, kind)); err != nil {
			b.Fatal(err)
		}
		defer func() {
			if err := logs[i].close(); err != nil {
				b.Error(err)
			}
		}()
	}
	n := uint64(b.N)
	stats := make([]logStats, len(logs))
	batch := make([][]byte, 0, group)
	b.ResetTimer()
	for turn, first := 0, uint64(1); first <= n; turn, first = turn+1, first+uint64(group) {
		for k := range logs {
			i := (turn + k) % len(logs)
			batch = batch[:0]
			for seq := first; seq < first+uint64(group) && seq <= n; seq++ {
				batch = append(batch, frames.frame(seq))
				stats[i].bytes += int64(len(batch[len(batch)-1]))
			}
			directIO = benchLogKinds[i] == "spool" // the spool's writes check it
			cpu0, t0 := processCPU(), time.Now()
			if err := logs[i].append(batch, first); err != nil {
				b.Fatal(err)
			}
			d := time.Since(t0)
			stats[i].appendWall, stats[i].appendCPU = stats[i].appendWall+d, stats[i].appendCPU+processCPU()-cpu0
			stats[i].lat = append(stats[i].lat, d)
		}
	}
	b.StopTimer()
	for from := uint64(1); from <= n; from += 8192 {
		for i, l := range logs {
			directIO = benchLogKinds[i] == "spool"
			cpu0, t0 := processCPU(), time.Now()
			to := min(from+8191, n)
			if got, err := l.readBack(from, to); err != nil || uint64(got) != to-from+1 {
				b.Fatalf("%s: read back %d of records %d..%d: %v", benchLogKinds[i], got, from, to, err)
			}
			stats[i].readWall, stats[i].readCPU = stats[i].readWall+time.Since(t0), stats[i].readCPU+processCPU()-cpu0
		}
	}
	for i, st := range stats {
		reportLog(b, benchLogKinds[i], st, float64(b.N))
	}
}

func reportLog(b *testing.B, name string, st logStats, n float64) {
	slices.Sort(st.lat)
	b.ReportMetric(n/st.appendWall.Seconds(), name+"-appends/s")
	b.ReportMetric(float64(st.bytes)/st.appendWall.Seconds()/1e6, name+"-MB/s")
	b.ReportMetric(float64(st.lat[len(st.lat)/2].Nanoseconds())/1e3, name+"-commit-p50-us")
	b.ReportMetric(float64(st.lat[min(len(st.lat)-1, len(st.lat)*99/100)].Nanoseconds())/1e3, name+"-commit-p99-us")
	b.ReportMetric(float64(st.appendCPU)/1e3/n, name+"-cpu-us/append")
	b.ReportMetric(n/st.readWall.Seconds(), name+"-read-rows/s")
	b.ReportMetric(float64(st.readCPU)/1e3/n, name+"-read-cpu-us/row")
}

// tidwall/wal keeps no checksum and cuts no torn tail: a crash inside a write leaves a log it
// refuses to open (ErrCorrupt), where the spool cuts the torn frame off and goes on (as
// TestSpoolRecoversTornTail shows). The spool's crash recovery is thus a property the library
// would have to be given.
func TestWALLibraryTornTail(t *testing.T) {
	dir := t.TempDir()
	l, err := wal.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	frames := newStepFrames(4, 256)
	for seq := uint64(1); seq <= 4; seq++ {
		if err := l.Write(seq, frames.frame(seq)); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	seg := filepath.Join(dir, fmt.Sprintf("%020d", 1))
	st, err := os.Stat(seg)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(seg, st.Size()-100); err != nil { // the last write torn
		t.Fatal(err)
	}
	if l, err := wal.Open(dir, nil); !errors.Is(err, wal.ErrCorrupt) {
		if err == nil {
			_ = l.Close()
		}
		t.Fatalf("opening a log with a torn last entry: %v, want wal.ErrCorrupt", err)
	}
}
