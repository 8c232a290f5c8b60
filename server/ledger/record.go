package ledger

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"time"
)

// recKind tags a spool record.
type recKind uint8

const (
	recEpisodeStart recKind = iota + 1
	recEpisodeEnd
	recStep
	recCheckpoint
	recRelease
	recReward
	recSandboxesEnded
	recEgress
	recDigest
	recEdge
)

// sandboxesEnded records that sandboxes ended under their running episodes (a crash of the
// server that ran them).
type sandboxesEnded struct {
	IDs []string
	At  time.Time
}

// checkpointRelease records that a checkpoint was released.
type checkpointRelease struct {
	ID string
	At time.Time
}

// checkpointDigest records a checkpoint's state digest.
type checkpointDigest struct {
	ID     string
	Digest Digest
}

// record is one row on its way to Postgres; exactly one of the pointers is set, per kind.
type record struct {
	seq     uint64
	kind    recKind
	start   *EpisodeStart
	end     *EpisodeEnd
	step    *StepRow
	ckpt    *CheckpointRow
	release *checkpointRelease
	reward  *RewardRow
	ended   *sandboxesEnded
	egress  *EgressRow
	digest  *checkpointDigest
	edge    *CheckpointEdge
}

// Frame layout: payload length (u32 LE), CRC-32C of everything after the CRC (u32 LE),
// sequence number (u64 LE), kind (u8), payload.
const frameHeader = 17

// maxPayload bounds one record so a corrupt length cannot make recovery allocate gigabytes.
const maxPayload = 64 << 20

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

var errShortFrame = errors.New("short frame")

// appendFrame encodes r (with its seq) onto buf.
func appendFrame(buf []byte, r *record) []byte {
	start := len(buf)
	buf = append(buf, make([]byte, frameHeader)...)
	buf = r.appendPayload(buf)
	payload := len(buf) - start - frameHeader
	binary.LittleEndian.PutUint32(buf[start:], uint32(payload))
	binary.LittleEndian.PutUint64(buf[start+8:], r.seq)
	buf[start+16] = byte(r.kind)
	binary.LittleEndian.PutUint32(buf[start+4:], crc32.Checksum(buf[start+8:], castagnoli))
	return buf
}

// parseFrame decodes the frame at the start of b, returning the record and the frame's size.
// errShortFrame means b ends inside the frame; any other error means the frame is corrupt.
func parseFrame(b []byte) (record, int, error) {
	if len(b) < frameHeader {
		return record{}, 0, errShortFrame
	}
	n := binary.LittleEndian.Uint32(b)
	if n > maxPayload {
		return record{}, 0, fmt.Errorf("frame length %d: %w", n, ErrSpoolCorrupt)
	}
	size := frameHeader + int(n)
	if len(b) < size {
		return record{}, 0, errShortFrame
	}
	if crc32.Checksum(b[8:size], castagnoli) != binary.LittleEndian.Uint32(b[4:]) {
		return record{}, 0, fmt.Errorf("frame checksum: %w", ErrSpoolCorrupt)
	}
	r := record{seq: binary.LittleEndian.Uint64(b[8:]), kind: recKind(b[16])}
	if err := r.decodePayload(b[frameHeader:size]); err != nil {
		return record{}, 0, fmt.Errorf("frame seq %d: %w: %w", r.seq, err, ErrSpoolCorrupt)
	}
	return r, size, nil
}

// size estimates the memory a record holds, for the in-memory queue's bound.
func (r *record) size() int {
	n := 128
	if r.step != nil {
		n += len(r.step.Observation) + len(r.step.Action) + len(r.step.EpisodeID)
	}
	return n
}

func (r *record) appendPayload(b []byte) []byte {
	e := enc{b}
	switch r.kind {
	case recEpisodeStart:
		s := r.start
		e.str(s.ID)
		e.str(s.Env)
		e.str(s.Run)
		e.str(s.Group)
		e.i64(s.Seed)
		e.str(s.StartCheckpoint)
		e.str(s.ParentEpisode)
		e.time(s.StartedAt)
		e.str(s.Sandbox) // last: records of earlier versions end before it
	case recEpisodeEnd:
		s := r.end
		e.str(s.ID)
		e.str(string(s.Status))
		e.str(string(s.FailureClass))
		e.f64(s.TotalReward)
		e.time(s.EndedAt)
		e.str(s.FailureMessage)
	case recStep:
		s := r.step
		e.str(s.EpisodeID)
		e.i64(int64(s.Index))
		e.bytes(s.Action)
		e.bytes(s.Observation)
		e.i64(s.ObservationSize)
		e.bytes(s.ObservationSHA256)
		e.f64(s.Reward)
		e.bool(s.Terminated)
		e.bool(s.Truncated)
		e.time(s.StartedAt)
		e.i64(int64(s.Duration))
		e.str(s.CheckpointID)
		e.bool(s.Setup) // last: records of earlier versions end before it
	case recCheckpoint:
		s := r.ckpt
		e.str(s.ID)
		e.str(s.ParentID)
		e.str(string(s.Kind))
		e.str(s.Env)
		e.str(s.Sandbox)
		e.str(s.EpisodeID)
		e.i64(int64(s.StepIndex))
		e.time(s.CreatedAt)
	case recRelease:
		e.str(r.release.ID)
		e.time(r.release.At)
	case recSandboxesEnded:
		e.i64(int64(len(r.ended.IDs)))
		for _, id := range r.ended.IDs {
			e.str(id)
		}
		e.time(r.ended.At)
	case recReward:
		s := r.reward
		e.str(s.EpisodeID)
		if s.StepIndex != nil {
			e.bool(true)
			e.i64(int64(*s.StepIndex))
		} else {
			e.bool(false)
		}
		e.str(s.Source)
		e.f64(s.Value)
		e.time(s.CreatedAt)
		e.i64(int64(len(s.Components)))
		for k, v := range s.Components {
			e.str(k)
			e.f64(v)
		}
	case recEgress:
		e.egress(r.egress)
	case recDigest, recEdge:
		e.graph(r)
	}
	return e.b
}

func (r *record) decodePayload(b []byte) error {
	d := dec{b: b}
	switch r.kind {
	case recEpisodeStart:
		r.start = &EpisodeStart{ID: d.str(), Env: d.str(), Run: d.str(), Group: d.str(), Seed: d.i64(),
			StartCheckpoint: d.str(), ParentEpisode: d.str(), StartedAt: d.time()}
		if len(d.b) > 0 {
			r.start.Sandbox = d.str()
		}
	case recEpisodeEnd:
		r.end = &EpisodeEnd{ID: d.str(), Status: Status(d.str()), FailureClass: FailureClass(d.str()),
			TotalReward: d.f64(), EndedAt: d.time()}
		if len(d.b) > 0 { // spooled by an earlier version without it
			r.end.FailureMessage = d.str()
		}
	case recStep:
		r.step = &StepRow{EpisodeID: d.str(), Index: int(d.i64()), Action: d.bytes(), Observation: d.bytes(),
			ObservationSize: d.i64(), ObservationSHA256: d.bytes(), Reward: d.f64(), Terminated: d.bool(),
			Truncated: d.bool(), StartedAt: d.time(), Duration: time.Duration(d.i64()), CheckpointID: d.str()}
		if len(d.b) > 0 { // spooled by an earlier version without it
			r.step.Setup = d.bool()
		}
	case recCheckpoint:
		r.ckpt = &CheckpointRow{ID: d.str(), ParentID: d.str(), Kind: CheckpointKind(d.str()), Env: d.str(),
			Sandbox: d.str(), EpisodeID: d.str(), StepIndex: int(d.i64()), CreatedAt: d.time()}
	case recRelease:
		r.release = &checkpointRelease{ID: d.str(), At: d.time()}
	case recSandboxesEnded:
		r.ended = d.ended(len(b))
	case recReward:
		s := &RewardRow{EpisodeID: d.str()}
		if d.bool() {
			i := int(d.i64())
			s.StepIndex = &i
		}
		s.Source, s.Value, s.CreatedAt = d.str(), d.f64(), d.time()
		if n := d.i64(); n > 0 && n < int64(len(b)) {
			s.Components = make(map[string]float64, n)
			for range n {
				k := d.str()
				s.Components[k] = d.f64()
			}
		}
		r.reward = s
	case recEgress:
		r.egress = d.egress()
	case recDigest, recEdge:
		d.graph(r)
	default:
		return fmt.Errorf("unknown record kind %d", r.kind)
	}
	if d.err != nil {
		return d.err
	}
	if len(d.b) != 0 {
		return fmt.Errorf("%d trailing bytes", len(d.b))
	}
	return nil
}

type enc struct{ b []byte }

// graph encodes a record of the checkpoint graph: a digest or an edge.
func (e *enc) graph(r *record) {
	if r.kind == recDigest {
		e.str(r.digest.ID)
		e.str(r.digest.Digest.Files)
		e.str(r.digest.Digest.Processes)
		return
	}
	e.str(r.edge.ChildID)
	e.str(r.edge.ParentID)
	e.time(r.edge.CreatedAt)
}

// ended decodes a recSandboxesEnded payload of size bytes.
func (d *dec) ended(size int) *sandboxesEnded {
	e := &sandboxesEnded{}
	if n := d.i64(); n > 0 && n < int64(size) {
		e.IDs = make([]string, n)
		for i := range e.IDs {
			e.IDs[i] = d.str()
		}
	}
	e.At = d.time()
	return e
}

// graph decodes what enc.graph encoded into r.
func (d *dec) graph(r *record) {
	if r.kind == recDigest {
		r.digest = &checkpointDigest{ID: d.str(), Digest: Digest{Files: d.str(), Processes: d.str()}}
		return
	}
	r.edge = &CheckpointEdge{ChildID: d.str(), ParentID: d.str(), CreatedAt: d.time()}
}

func (e *enc) str(s string) {
	e.b = binary.AppendUvarint(e.b, uint64(len(s)))
	e.b = append(e.b, s...)
}

func (e *enc) bytes(s []byte) {
	e.b = binary.AppendUvarint(e.b, uint64(len(s)))
	e.b = append(e.b, s...)
}

func (e *enc) i64(v int64)   { e.b = binary.AppendVarint(e.b, v) }
func (e *enc) f64(v float64) { e.b = binary.LittleEndian.AppendUint64(e.b, math.Float64bits(v)) }

func (e *enc) bool(v bool) {
	if v {
		e.b = append(e.b, 1)
	} else {
		e.b = append(e.b, 0)
	}
}

// time encodes the zero time as 0 and any other as nanoseconds since the epoch.
func (e *enc) time(t time.Time) {
	if t.IsZero() {
		e.i64(0)
		return
	}
	e.i64(t.UnixNano())
}

type dec struct {
	b   []byte
	err error
}

var errTruncatedPayload = errors.New("truncated payload")

func (d *dec) fail() {
	if d.err == nil {
		d.err = errTruncatedPayload
	}
	d.b = nil
}

func (d *dec) raw() []byte {
	n, k := binary.Uvarint(d.b)
	if k <= 0 || n > uint64(len(d.b)-k) {
		d.fail()
		return nil
	}
	v := d.b[k : k+int(n)]
	d.b = d.b[k+int(n):]
	return v
}

func (d *dec) str() string { return string(d.raw()) }

// bytes returns a slice of the frame (which the caller owns), not a copy.
func (d *dec) bytes() []byte {
	v := d.raw()
	if len(v) == 0 {
		return nil
	}
	return v[:len(v):len(v)]
}

func (d *dec) i64() int64 {
	v, k := binary.Varint(d.b)
	if k <= 0 {
		d.fail()
		return 0
	}
	d.b = d.b[k:]
	return v
}

func (d *dec) f64() float64 {
	if len(d.b) < 8 {
		d.fail()
		return 0
	}
	v := math.Float64frombits(binary.LittleEndian.Uint64(d.b))
	d.b = d.b[8:]
	return v
}

func (d *dec) bool() bool {
	if len(d.b) < 1 {
		d.fail()
		return false
	}
	v := d.b[0] != 0
	d.b = d.b[1:]
	return v
}

func (d *dec) time() time.Time {
	n := d.i64()
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}
