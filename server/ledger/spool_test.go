package ledger

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func sampleRecords() []record {
	step := 3
	now := time.Unix(1700000000, 123456789).UTC()
	return []record{
		{kind: recEpisodeStart, start: &EpisodeStart{ID: "e", Env: "env", Run: "r", Group: "g", Seed: -7, StartCheckpoint: "c0", ParentEpisode: "p", StartedAt: now}},
		{kind: recStep, step: &StepRow{EpisodeID: "e", Index: 3, Action: json.RawMessage(`{"a":1}`), Observation: []byte("out"),
			ObservationSize: 3, ObservationSHA256: []byte{1, 2, 3}, Reward: 0.25, Terminated: true, StartedAt: now, Duration: time.Second, CheckpointID: "c1", Setup: true}},
		{kind: recCheckpoint, ckpt: &CheckpointRow{ID: "c1", ParentID: "c0", Kind: KindUser, Env: "env", Sandbox: "s", EpisodeID: "e", StepIndex: 4, CreatedAt: now}},
		{kind: recRelease, release: &checkpointRelease{ID: "c1", At: now}},
		{kind: recReward, reward: &RewardRow{EpisodeID: "e", StepIndex: &step, Source: "verifier", Components: map[string]float64{"x": 1.5}, Value: 2, CreatedAt: now}},
		{kind: recReward, reward: &RewardRow{EpisodeID: "e", Source: "trainer", Value: -1}},
		{kind: recEpisodeEnd, end: &EpisodeEnd{ID: "e", Status: StatusFailed, FailureClass: FailureInfra, FailureMessage: "its sandbox died", TotalReward: 1, EndedAt: now}},
		{kind: recEpisodeStart, start: &EpisodeStart{ID: "e2", Env: "env", Sandbox: "sb-1", StartedAt: now}},
		{kind: recSandboxesEnded, ended: &sandboxesEnded{IDs: []string{"sb-1", "sb-2"}, At: now}},
		{kind: recDigest, digest: &checkpointDigest{ID: "c1", Digest: Digest{Files: "sha256:" + strings.Repeat("a", 64), Processes: "sha256:" + strings.Repeat("b", 64)}}},
		{kind: recDigest, digest: &checkpointDigest{ID: "c0", Digest: Digest{Files: "sha256:" + strings.Repeat("c", 64)}}},
		{kind: recEdge, edge: &CheckpointEdge{ChildID: "c0", ParentID: "c1", CreatedAt: now}},
	}
}

// An episode start spooled by an earlier version, without the sandbox, still reads.
func TestEpisodeStartOfEarlierVersion(t *testing.T) {
	r := record{seq: 9, kind: recEpisodeStart, start: &EpisodeStart{ID: "e", Env: "env", Run: "r", StartedAt: time.Unix(1700000000, 0).UTC()}}
	b := appendFrame(nil, &r)
	// Drop the sandbox (an empty string: one byte of length) and mend the frame's length and CRC.
	b = b[:len(b)-1]
	binary.LittleEndian.PutUint32(b, uint32(len(b)-frameHeader))
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	got, n, err := parseFrame(b)
	if err != nil || n != len(b) || !reflect.DeepEqual(got, r) {
		t.Fatalf("parse = %+v, %d, %v; want %+v", got.start, n, err, r.start)
	}
}

// A step spooled by an earlier version, without the setup flag, still reads: the agent's.
func TestStepOfEarlierVersion(t *testing.T) {
	r := record{seq: 9, kind: recStep, step: &StepRow{EpisodeID: "e", Index: 2, Action: json.RawMessage("1"), Observation: []byte("o"),
		StartedAt: time.Unix(1700000000, 0).UTC()}}
	b := appendFrame(nil, &r)
	b = b[:len(b)-1] // the setup flag: one byte
	binary.LittleEndian.PutUint32(b, uint32(len(b)-frameHeader))
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	got, n, err := parseFrame(b)
	if err != nil || n != len(b) || !reflect.DeepEqual(got, r) {
		t.Fatalf("parse = %+v, %d, %v; want %+v", got.step, n, err, r.step)
	}
	r.step.Setup = true
	if got, _, err := parseFrame(appendFrame(nil, &r)); err != nil || !got.step.Setup {
		t.Fatalf("a setup step parses as %+v, %v", got.step, err)
	}
}

// An episode end spooled by an earlier version, without the failure message, still reads.
func TestEpisodeEndOfEarlierVersion(t *testing.T) {
	r := record{seq: 9, kind: recEpisodeEnd, end: &EpisodeEnd{ID: "e", Status: StatusFailed, FailureClass: FailureInfra, EndedAt: time.Unix(1700000000, 0).UTC()}}
	b := appendFrame(nil, &r)
	b = b[:len(b)-1] // the empty message: one byte of length
	binary.LittleEndian.PutUint32(b, uint32(len(b)-frameHeader))
	binary.LittleEndian.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	got, n, err := parseFrame(b)
	if err != nil || n != len(b) || !reflect.DeepEqual(got, r) {
		t.Fatalf("parse = %+v, %d, %v; want %+v", got.end, n, err, r.end)
	}
}

func TestFrameRoundTrip(t *testing.T) {
	for i, r := range sampleRecords() {
		t.Run(string(rune('a'+i)), func(t *testing.T) {
			r.seq = uint64(100 + i)
			b := appendFrame(nil, &r)
			got, n, err := parseFrame(b)
			if err != nil || n != len(b) {
				t.Fatalf("parse: n=%d/%d err=%v", n, len(b), err)
			}
			if !reflect.DeepEqual(got, r) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, r)
			}
			if _, _, err := parseFrame(b[:len(b)-1]); !errors.Is(err, errShortFrame) {
				t.Fatalf("short frame: %v", err)
			}
			b[len(b)-1] ^= 0xff
			if _, _, err := parseFrame(b); !errors.Is(err, ErrSpoolCorrupt) {
				t.Fatalf("flipped byte: %v, want ErrSpoolCorrupt", err)
			}
		})
	}
}

func FuzzParseFrame(f *testing.F) {
	for _, r := range sampleRecords() {
		r.seq = 1
		f.Add(appendFrame(nil, &r))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, n, err := parseFrame(b)
		if err != nil {
			return
		}
		if n > len(b) {
			t.Fatalf("frame size %d beyond input %d", n, len(b))
		}
		// Whatever parses re-encodes to the same bytes.
		if again := appendFrame(nil, &r); len(again) != n && r.kind != recReward {
			t.Fatalf("re-encoded %d bytes, parsed %d", len(again), n)
		}
	})
}

func writeSpool(t *testing.T, dir string, segBytes int64, n int) {
	t.Helper()
	sp, _, last, err := openSpool(dir, segBytes)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		r := record{seq: last + 1 + uint64(i), kind: recStep, step: &StepRow{EpisodeID: "e", Index: i, Action: json.RawMessage("1"), Observation: make([]byte, 100)}}
		if _, err := sp.write([][]byte{appendFrame(nil, &r)}, r.seq, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := sp.close(); err != nil {
		t.Fatal(err)
	}
}

func TestSpoolRecoversTornTail(t *testing.T) {
	dir := t.TempDir()
	writeSpool(t, dir, 1<<20, 10)
	seg := filepath.Join(dir, segName(1))
	// A crash inside a group commit leaves half a frame at the end.
	r := record{seq: 11, kind: recStep, step: &StepRow{EpisodeID: "e", Action: json.RawMessage("1")}}
	frame := appendFrame(nil, &r)
	f, err := os.OpenFile(seg, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	before, _ := f.Stat()
	if _, err := f.Write(frame[:len(frame)/2]); err != nil {
		t.Fatal(err)
	}
	f.Close()
	sp, first, last, err := openSpool(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	if first != 1 || last != 10 {
		t.Fatalf("recovered [%d, %d], want [1, 10]", first, last)
	}
	after, _ := os.Stat(seg)
	if after.Size() != before.Size() {
		t.Fatalf("torn tail not cut: %d bytes, want %d", after.Size(), before.Size())
	}
	recs, err := sp.read(1, 10, 100, 1<<20)
	if err != nil || len(recs) != 10 || recs[9].step.Index != 9 {
		t.Fatalf("read %d records, err %v", len(recs), err)
	}
}

func TestSpoolSegmentsReadAcrossAndTrim(t *testing.T) {
	dir := t.TempDir()
	writeSpool(t, dir, 1000, 50) // ~140-byte frames: a new segment every ~8 records
	sp, first, last, err := openSpool(dir, 1000)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	if first != 1 || last != 50 || len(sp.segs) < 5 {
		t.Fatalf("recovered [%d, %d] in %d segments", first, last, len(sp.segs))
	}
	for from := uint64(1); from <= 50; from += 7 {
		recs, err := sp.read(from, 50, 7, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range recs {
			if r.seq != from+uint64(i) {
				t.Fatalf("read from %d: record %d has seq %d", from, i, r.seq)
			}
		}
	}
	if err := sp.trim(30); err != nil {
		t.Fatal(err)
	}
	if sp.segs[0] > 31 {
		t.Fatalf("trimmed an undelivered record: first segment starts at %d", sp.segs[0])
	}
	if len(sp.segs) >= 7 {
		t.Fatalf("nothing trimmed: %d segments", len(sp.segs))
	}
	if _, err := sp.read(31, 50, 100, 1<<20); err != nil {
		t.Fatalf("reading after trim: %v", err)
	}
}

func TestSpoolCorruptSealedSegment(t *testing.T) {
	dir := t.TempDir()
	writeSpool(t, dir, 1000, 30)
	seg := filepath.Join(dir, segName(1))
	b, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	b[40] ^= 0xff
	if err := os.WriteFile(seg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := openSpool(dir, 1000); !errors.Is(err, ErrSpoolCorrupt) {
		t.Fatalf("open = %v, want ErrSpoolCorrupt", err)
	}
}

func stepFrame(seq uint64, obs int) []byte {
	r := record{seq: seq, kind: recStep, step: &StepRow{EpisodeID: "e", Index: int(seq), Action: json.RawMessage("1"), Observation: make([]byte, obs)}}
	for i := range r.step.Observation {
		r.step.Observation[i] = byte(seq) + byte(i)
	}
	return appendFrame(nil, &r)
}

func checkRecords(t *testing.T, recs []record, from uint64) {
	t.Helper()
	for i, r := range recs {
		seq := from + uint64(i)
		if r.seq != seq || r.step == nil || r.step.Index != int(seq) {
			t.Fatalf("record %d: seq %d, want %d", i, r.seq, seq)
		}
		for j, c := range r.step.Observation {
			if c != byte(seq)+byte(j) {
				t.Fatalf("record %d: observation byte %d is %d, want %d", seq, j, c, byte(seq)+byte(j))
			}
		}
	}
}

// The spool writes with O_DIRECT here (a test of its own says so), and every group commit of
// a few frames rewrites the segment's last, partial block: a reader following the writer
// commit by commit must still read every frame whole, never the zeros that padded the block
// when it read it.
func TestSpoolReaderFollowsDirectWrites(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			directIO = direct
			defer func() { directIO = true }()
			dir := t.TempDir()
			if direct && !takesDirect(t, dir) {
				t.Skipf("%s refuses O_DIRECT", dir)
			}
			sp, _, _, err := openSpool(dir, 64<<10)
			if err != nil {
				t.Fatal(err)
			}
			defer sp.close()
			if sp.direct != direct {
				t.Fatalf("direct = %v, want %v (does %s take O_DIRECT?)", sp.direct, direct, dir)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			seq, read := uint64(0), uint64(0)
			var all []record
			for range 300 {
				var chunks [][]byte
				for range 1 + rng.IntN(4) {
					seq++
					chunks = append(chunks, stepFrame(seq, rng.IntN(3000)))
				}
				if _, err := sp.write(chunks, seq, true); err != nil {
					t.Fatal(err)
				}
				recs, err := sp.read(read+1, seq, 1000, 1<<30)
				if err != nil {
					t.Fatalf("reading %d..%d: %v", read+1, seq, err)
				}
				if sp.cur.f != nil && sp.cur.direct != direct {
					t.Fatalf("the reader's O_DIRECT is %v, the writer's %v", sp.cur.direct, direct)
				}
				checkRecords(t, recs, read+1)
				read += uint64(len(recs))
				if read != seq {
					t.Fatalf("read up to %d of %d", read, seq)
				}
				all = append(all, recs...)
			}
			if len(sp.segs) < 3 {
				t.Fatalf("%d segments: the test meant to cross several", len(sp.segs))
			}
			// Records point into the reader's slabs: later reads must not have changed them.
			checkRecords(t, all, 1)
		})
	}
}

// takesDirect reports whether dir's file system takes the spool's direct writes: a probe file
// opened with O_DIRECT, a fitting alignment, and one block written.
func takesDirect(t *testing.T, dir string) bool {
	t.Helper()
	path := filepath.Join(dir, "probe")
	defer os.Remove(path)
	fd, err := unix.Open(path, unix.O_CREAT|unix.O_WRONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	if !directAligned(fd) {
		return false
	}
	_, err = unix.Pwrite(fd, alignedBuf(dioBlock), 0)
	return err == nil
}

// Where the file system takes O_DIRECT, the spool uses it.
func TestSpoolDirectIOUsed(t *testing.T) {
	dir := t.TempDir()
	want := takesDirect(t, dir)
	sp, _, _, err := openSpool(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	if sp.direct != want {
		t.Fatalf("spool direct = %v; the file system of %s takes direct writes: %v", sp.direct, dir, want)
	}
	if !want {
		t.Logf("%s refuses O_DIRECT: the spool writes through the page cache there", dir)
	}
}

// A crash leaves the newest segment ending in a zero-padded block: recovery cuts it to its
// frames, and the spool goes on after them. A group commit bigger than the stage buffer takes
// several writes.
func TestSpoolDirectRecoversPaddedTail(t *testing.T) {
	dir := t.TempDir()
	sp, _, _, err := openSpool(dir, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	if !sp.direct {
		t.Skip("no O_DIRECT here")
	}
	var chunks [][]byte
	seq := uint64(0)
	for range 300 { // 1.2 MiB: over stageBytes
		seq++
		chunks = append(chunks, stepFrame(seq, 4096))
	}
	if _, err := sp.write(chunks, seq, true); err != nil {
		t.Fatal(err)
	}
	seq++
	if _, err := sp.write([][]byte{stepFrame(seq, 10)}, seq, true); err != nil {
		t.Fatal(err)
	}
	logical := sp.activeSize
	// "Crash": let go of the files without close's cut.
	_ = sp.active.Close()
	_ = sp.lock.Close()
	seg := filepath.Join(dir, segName(1))
	fi, err := os.Stat(seg)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size()%dioBlock != 0 || fi.Size() <= logical {
		t.Fatalf("segment is %d bytes after a direct write of %d: want a padded block", fi.Size(), logical)
	}
	sp, first, last, err := openSpool(dir, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	if first != 1 || last != seq {
		t.Fatalf("recovered [%d, %d], want [1, %d]", first, last, seq)
	}
	if fi, _ := os.Stat(seg); fi.Size() != logical {
		t.Fatalf("recovered segment is %d bytes, want %d", fi.Size(), logical)
	}
	seq++
	if _, err := sp.write([][]byte{stepFrame(seq, 5000)}, seq, true); err != nil {
		t.Fatal(err)
	}
	recs, err := sp.read(1, seq, 1000, 1<<30)
	if err != nil || uint64(len(recs)) != seq {
		t.Fatalf("read %d of %d records: %v", len(recs), seq, err)
	}
	checkRecords(t, recs, 1)
}

// openDirect opens a spool in a fresh directory, skipping the test where direct writes are
// refused.
func openDirect(t *testing.T, segBytes int64) (*spool, string) {
	t.Helper()
	dir := t.TempDir()
	if !takesDirect(t, dir) {
		t.Skipf("%s refuses O_DIRECT", dir)
	}
	sp, _, _, err := openSpool(dir, segBytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sp.close() })
	if !sp.direct {
		t.Fatal("spool not direct")
	}
	return sp, dir
}

// failNth makes the nth call of a hooked function fail with err (n counts from 1), and puts it
// back at the end of the test.
func failNth[F any](t *testing.T, hook *F, n int, wrap func(orig F, fail func() bool) F) *int {
	t.Helper()
	orig := *hook
	calls := 0
	*hook = wrap(orig, func() bool { calls++; return calls == n })
	t.Cleanup(func() { *hook = orig })
	return &calls
}

// frames returns the frames of seqs from..to, each with an observation of obs bytes.
func frames(from, to uint64, obs int) [][]byte {
	var out [][]byte
	for seq := from; seq <= to; seq++ {
		out = append(out, stepFrame(seq, obs))
	}
	return out
}

// A write that fails — its fsync, or the second of its direct writes — leaves the segment and
// the partial block it began with as they were: the retry writes the same rows again after
// the same frames, and a reopened spool finds them all.
func TestSpoolDirectWriteFails(t *testing.T) {
	for _, c := range []struct {
		name string
		fail func(t *testing.T)
	}{
		{"fsync", func(t *testing.T) {
			failNth(t, &fdatasync, 1, func(orig func(int) error, fail func() bool) func(int) error {
				return func(fd int) error {
					if fail() {
						return unix.EIO
					}
					return orig(fd)
				}
			})
		}},
		{"second-write", func(t *testing.T) {
			failNth(t, &pwrite, 2, func(orig func(int, []byte, int64) (int, error), fail func() bool) func(int, []byte, int64) (int, error) {
				return func(fd int, b []byte, off int64) (int, error) {
					if fail() {
						return 0, unix.EIO
					}
					return orig(fd, b, off)
				}
			})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			sp, dir := openDirect(t, 64<<20)
			if _, err := sp.write([][]byte{stepFrame(1, 100), stepFrame(2, 5000)}, 2, true); err != nil {
				t.Fatal(err)
			}
			if sp.tailLen() == 0 {
				t.Fatal("the test needs a partial last block")
			}
			size := sp.activeSize
			c.fail(t)
			// 300 frames of 4 KiB: over stageBytes, so the second direct write comes after
			// the first has overwritten the partial block's copy in stage.
			group := frames(3, 302, 4096)
			if _, err := sp.write(group, 302, true); err == nil {
				t.Fatal("the write did not fail")
			}
			if fi, _ := os.Stat(filepath.Join(dir, segName(1))); sp.activeSize != size || fi.Size() != size {
				t.Fatalf("after the failure: activeSize %d, file %d bytes; want %d", sp.activeSize, fi.Size(), size)
			}
			if _, err := sp.write(group, 302, true); err != nil {
				t.Fatal(err)
			}
			if _, err := sp.write([][]byte{stepFrame(303, 333)}, 303, true); err != nil {
				t.Fatal(err)
			}
			if !sp.direct {
				t.Fatal("the retry was refused as a direct write and went through the page cache")
			}
			recs, err := sp.read(1, 303, 1000, 1<<30)
			if err != nil || len(recs) != 303 {
				t.Fatalf("read %d records: %v", len(recs), err)
			}
			checkRecords(t, recs, 1)
			_ = sp.active.Close() // a crash: no cut of the padding
			_ = sp.lock.Close()
			sp.active, sp.lock = nil, nil
			again, first, last, err := openSpool(dir, 64<<20)
			if err != nil || first != 1 || last != 303 {
				t.Fatalf("reopened: [%d, %d], %v; want [1, 303]", first, last, err)
			}
			defer again.close()
			recs, err = again.read(1, 303, 1000, 1<<30)
			if err != nil || len(recs) != 303 {
				t.Fatalf("read %d records after reopening: %v", len(recs), err)
			}
			checkRecords(t, recs, 1)
		})
	}
}

// A file system that takes O_DIRECT at open but refuses the writes (EINVAL) gets them through
// the page cache instead, the segment cut to its frames first, and so do its later segments.
func TestSpoolDirectRefusedFallsBack(t *testing.T) {
	sp, dir := openDirect(t, 64<<10)
	if _, err := sp.write([][]byte{stepFrame(1, 100)}, 1, true); err != nil {
		t.Fatal(err)
	}
	calls := failNth(t, &pwrite, 1, func(orig func(int, []byte, int64) (int, error), fail func() bool) func(int, []byte, int64) (int, error) {
		return func(fd int, b []byte, off int64) (int, error) {
			fail()
			return 0, unix.EINVAL
		}
	})
	seq := uint64(1)
	for range 40 { // about 160 KiB: two new segments
		seq++
		if _, err := sp.write([][]byte{stepFrame(seq, 4000)}, seq, true); err != nil {
			t.Fatal(err)
		}
	}
	if sp.direct || *calls != 1 || len(sp.segs) < 3 {
		t.Fatalf("direct %v after %d refused direct writes, %d segments", sp.direct, *calls, len(sp.segs))
	}
	recs, err := sp.read(1, seq, 1000, 1<<30)
	if err != nil || uint64(len(recs)) != seq {
		t.Fatalf("read %d of %d records: %v", len(recs), seq, err)
	}
	checkRecords(t, recs, 1)
	if err := sp.close(); err != nil {
		t.Fatal(err)
	}
	again, first, last, err := openSpool(dir, 64<<10)
	if err != nil || first != 1 || last != seq {
		t.Fatalf("reopened: [%d, %d], %v; want [1, %d]", first, last, err, seq)
	}
	again.close()
}

// The deliverer reads back and trims while the syncer writes, across new segments (run with
// -race): every record comes back whole and in order.
func TestSpoolConcurrentReadWrite(t *testing.T) {
	dir := t.TempDir()
	sp, _, _, err := openSpool(dir, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	const total = 3000
	var synced atomic.Uint64
	done := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(3, 4))
		seq := uint64(0)
		for seq < total {
			var chunks [][]byte
			for range 1 + rng.IntN(8) {
				seq++
				chunks = append(chunks, stepFrame(seq, rng.IntN(6000)))
			}
			if _, err := sp.write(chunks, seq, true); err != nil {
				done <- err
				return
			}
			synced.Store(seq)
		}
		done <- nil
	}()
	read := uint64(0)
	for read < total {
		to := synced.Load()
		if to == read {
			time.Sleep(50 * time.Microsecond)
			continue
		}
		recs, err := sp.read(read+1, to, 50, 1<<30)
		if err != nil {
			t.Fatalf("reading %d..%d: %v", read+1, to, err)
		}
		checkRecords(t, recs, read+1)
		read += uint64(len(recs))
		if err := sp.trim(read); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A frame that fails its check is read again from the file at the next read, not from the
// reader's slab: a read error the disk recovers from does not stop delivery for good.
func TestSpoolReadRetriesFromFile(t *testing.T) {
	dir := t.TempDir()
	sp, _, _, err := openSpool(dir, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	if _, err := sp.write(frames(1, 10, 500), 10, true); err != nil {
		t.Fatal(err)
	}
	seg := filepath.Join(dir, segName(1))
	f, err := os.OpenFile(seg, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	off := int64(len(stepFrame(1, 500))*4 + frameHeader + 3) // inside frame 5's payload
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	flip := func() {
		b[0] ^= 0xff
		if _, err := f.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	flip()
	recs, err := sp.read(1, 10, 100, 1<<30)
	if !errors.Is(err, ErrSpoolCorrupt) || len(recs) != 4 {
		t.Fatalf("read %d records, err %v; want 4 and ErrSpoolCorrupt", len(recs), err)
	}
	flip()
	recs, err = sp.read(5, 10, 100, 1<<30)
	if err != nil || len(recs) != 6 {
		t.Fatalf("read %d records after the repair: %v", len(recs), err)
	}
	checkRecords(t, recs, 5)
}

// The reader reads more than a slab behind the writer, in batches that end anywhere, while
// commits go on: every record it hands out stays whole to the end, across slabs and segments,
// with O_DIRECT and without.
func TestSpoolReaderAcrossSlabs(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			directIO = direct
			defer func() { directIO = true }()
			dir := t.TempDir()
			sp, _, _, err := openSpool(dir, 6<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer sp.close()
			rng := rand.New(rand.NewPCG(3, 4))
			seq, read := uint64(0), uint64(0)
			var all []record
			for seq < 6000 || read < seq {
				if seq < 6000 {
					var chunks [][]byte
					for range 1 + rng.IntN(40) {
						seq++
						chunks = append(chunks, stepFrame(seq, rng.IntN(6000)))
					}
					if _, err := sp.write(chunks, seq, true); err != nil {
						t.Fatal(err)
					}
				}
				recs, err := sp.read(read+1, seq, 1+rng.IntN(30), 1<<30)
				if err != nil {
					t.Fatalf("reading from %d: %v", read+1, err)
				}
				if sp.cur.f != nil && sp.cur.direct != direct || sp.readBuffered.Load() {
					t.Fatalf("the reader's O_DIRECT is %v (gave up: %v), the writer's %v", sp.cur.direct, sp.readBuffered.Load(), direct)
				}
				if c := sp.cur; c.direct && len(c.buf) > 0 && (uintptr(unsafe.Pointer(&c.buf[0]))|uintptr(c.pos-int64(len(c.buf))))&(dioBlock-1) != 0 {
					t.Fatalf("the direct reader's slab starts at %p, file offset %d: not block-aligned", &c.buf[0], c.pos-int64(len(c.buf)))
				}
				checkRecords(t, recs, read+1)
				read += uint64(len(recs))
				all = append(all, recs...)
			}
			if len(sp.segs) < 3 {
				t.Fatalf("%d segments: the test meant to cross several", len(sp.segs))
			}
			checkRecords(t, all, 1)
		})
	}
}

// A direct read refused with EINVAL (a file system that takes direct writes but not reads of
// that alignment) makes the reader read through the page cache, from then on, losing nothing.
func TestSpoolDirectReadRefused(t *testing.T) {
	dir := t.TempDir()
	if !takesDirect(t, dir) {
		t.Skipf("%s refuses O_DIRECT", dir)
	}
	sp, _, _, err := openSpool(dir, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer sp.close()
	refused := 0
	pread = func(fd int, p []byte, off int64) (int, error) {
		if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0); err == nil && fl&unix.O_DIRECT != 0 {
			refused++
			return 0, unix.EINVAL
		}
		return unix.Pread(fd, p, off)
	}
	defer func() { pread = unix.Pread }()
	if _, err := sp.write(frames(1, 100, 3000), 100, true); err != nil {
		t.Fatal(err)
	}
	recs, err := sp.read(1, 100, 1000, 1<<30)
	if err != nil || len(recs) != 100 {
		t.Fatalf("read %d records: %v", len(recs), err)
	}
	checkRecords(t, recs, 1)
	if refused != 1 || sp.cur.direct || !sp.readBuffered.Load() {
		t.Fatalf("%d direct reads refused, cursor direct %v, reading buffered %v; want 1, false, true", refused, sp.cur.direct, sp.readBuffered.Load())
	}
	sp.closeCursor()
	recs, err = sp.read(50, 100, 1000, 1<<30)
	if err != nil || len(recs) != 51 || refused != 1 {
		t.Fatalf("read %d records again, %d refused: %v", len(recs), refused, err)
	}
}

// A saturated writer reads most rows back: the reader reuses a slab once every record read
// from it has been delivered (trim), never before. Batches are held, as the deliverer holds
// them, until eleven later ones have been read: 1,100 rows of about 4 KiB, a little more than a
// slab holds (1,033), so that a slab reused even a batch too early is one that held rows still
// point into. Each batch is checked whole before it is trimmed.
func TestSpoolReusesDeliveredSlabs(t *testing.T) {
	sp, _ := openDirect(t, 64<<20)
	const n, obs = 8000, 4000
	for seq := uint64(1); seq <= n; seq += 100 {
		if _, err := sp.write(frames(seq, seq+99, obs), seq+99, true); err != nil {
			t.Fatal(err)
		}
	}
	type batch struct {
		recs  []record
		first uint64
	}
	var held []batch
	slabs := map[uintptr]bool{}
	switches := 0
	var last uintptr
	for read := uint64(0); read < n; {
		recs, err := sp.read(read+1, n, 100, 1<<30)
		if err != nil {
			t.Fatal(err)
		}
		if base := uintptr(unsafe.Pointer(unsafe.SliceData(sp.cur.buf))); base != last {
			// A slab read into again: no record still held may point into it.
			if slabs[base] {
				for _, b := range held {
					for _, r := range b.recs {
						if p := uintptr(unsafe.Pointer(unsafe.SliceData(r.step.Observation))); p >= base && p < base+readSlab {
							t.Fatalf("slab %#x reused while record %d, held, points into it", base, r.seq)
						}
					}
				}
			}
			slabs[base], last = true, base
			switches++
		}
		held = append(held, batch{recs, read + 1})
		read += uint64(len(recs))
		for len(held) > 11 {
			b := held[0]
			held = held[1:]
			checkRecords(t, b.recs, b.first)
			if err := sp.trim(b.recs[len(b.recs)-1].seq); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, b := range held {
		checkRecords(t, b.recs, b.first)
	}
	// 32 MB read through 4 MiB slabs: eight or nine switches, most to a reused slab.
	if switches < 4 || len(slabs) >= switches {
		t.Fatalf("the reader used %d slabs in %d: none reused", len(slabs), switches)
	}
	t.Logf("%d slabs for %d", len(slabs), switches)

	// Back to rows from memory: the reader lets go of its slabs.
	sp.dropSlabs()
	if len(sp.retired)+len(sp.spare) != 0 {
		t.Fatalf("%d retired and %d spare slabs kept after dropSlabs", len(sp.retired), len(sp.spare))
	}
}

// TestSpoolReusesSlabsFreedTogether: when one trim frees every slab the reader has filled (a
// stalled delivery catching up), the reader reuses all of them, not only a few.
func TestSpoolReusesSlabsFreedTogether(t *testing.T) {
	sp, _ := openDirect(t, 64<<20)
	const n, obs = 20000, 4000
	for seq := uint64(1); seq <= n; seq += 100 {
		if _, err := sp.write(frames(seq, seq+99, obs), seq+99, true); err != nil {
			t.Fatal(err)
		}
	}
	pass := func(from, to uint64) map[uintptr]bool {
		slabs := map[uintptr]bool{}
		for read := from - 1; read < to; {
			recs, err := sp.read(read+1, to, 100, 1<<30)
			if err != nil {
				t.Fatal(err)
			}
			checkRecords(t, recs, read+1)
			slabs[uintptr(unsafe.Pointer(unsafe.SliceData(sp.cur.buf)))] = true
			read += uint64(len(recs))
		}
		return slabs
	}
	// Nothing delivered while the first 12,000 rows are read: every slab they filled stays
	// retired. Then all are delivered at once, and the last 8,000 rows need fewer slabs.
	const cut = 12000
	first := pass(1, cut)
	if len(first) < 10 {
		t.Fatalf("the first rows went through %d slabs; the test needs 10 or more", len(first))
	}
	if err := sp.trim(cut); err != nil {
		t.Fatal(err)
	}
	fresh := 0
	for base := range pass(cut+1, n) {
		if !first[base] {
			fresh++
		}
	}
	if fresh > 0 {
		t.Fatalf("the last rows took %d new slabs with %d delivered ones to reuse", fresh, len(first)-1)
	}
}
