package ledger

import (
	"encoding/binary"
	"io"
	"math"
	"time"
)

// copySteps is the COPY statement stepCopier's stream is written for (the columns in the order
// appendStepTuple encodes them).
const copySteps = `COPY steps (episode_id, idx, action, observation, observation_size, observation_sha256,
	reward, terminated, truncated, started_at, duration_ns, checkpoint_id, setup) FROM STDIN (FORMAT binary)`

// copyHeader starts a binary COPY stream: signature, flags, header extension length.
var copyHeader = []byte("PGCOPY\n\xff\r\n\x00\x00\x00\x00\x00\x00\x00\x00\x00")

// pgEpochMicros is 2000-01-01T00:00:00Z, Postgres's timestamp epoch, in Unix microseconds.
const pgEpochMicros = 946684800 * 1_000_000

// stepTupleSize is the exact size appendStepTuple adds for s.
func stepTupleSize(s *StepRow) int {
	n := 2 + 13*4 // field count, field lengths
	n += len(s.EpisodeID) + 4 + 1 + len(s.Action) + len(s.Observation) + 8 + len(s.ObservationSHA256) + 8 + 1 + 1 + 8 + 8 + 1
	n += len(s.CheckpointID)
	return n
}

// appendStepTuple encodes s as one tuple of the binary COPY format, in copySteps's column order.
// It writes the bytes itself instead of going through pgx's type map: a step is thirteen
// fixed-type values, and the generic path (one []any and thirteen encode plans per row) costs
// the writer more Go CPU per row (BenchmarkStepCopy; docs/PERFORMANCE.md, "Binary COPY").
func appendStepTuple(b []byte, s *StepRow) []byte {
	b = binary.BigEndian.AppendUint16(b, 13)
	b = appendField(b, s.EpisodeID)
	b = binary.BigEndian.AppendUint32(b, 4)
	b = binary.BigEndian.AppendUint32(b, uint32(int32(s.Index)))
	b = binary.BigEndian.AppendUint32(b, uint32(1+len(s.Action))) // jsonb: version 1, then the text
	b = append(b, 1)
	b = append(b, s.Action...)
	b = appendField(b, s.Observation)
	b = appendInt8(b, s.ObservationSize)
	b = appendField(b, s.ObservationSHA256)
	b = binary.BigEndian.AppendUint32(b, 8)
	b = binary.BigEndian.AppendUint64(b, math.Float64bits(s.Reward))
	b = appendBool(b, s.Terminated)
	b = appendBool(b, s.Truncated)
	b = appendInt8(b, pgMicros(s.StartedAt))
	b = appendInt8(b, int64(s.Duration))
	if s.CheckpointID == "" {
		b = binary.BigEndian.AppendUint32(b, math.MaxUint32) // -1: NULL
	} else {
		b = appendField(b, s.CheckpointID)
	}
	return appendBool(b, s.Setup)
}

func appendField[T string | []byte](b []byte, v T) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	return append(b, v...)
}

func appendInt8(b []byte, v int64) []byte {
	b = binary.BigEndian.AppendUint32(b, 8)
	return binary.BigEndian.AppendUint64(b, uint64(v))
}

func appendBool(b []byte, v bool) []byte {
	b = binary.BigEndian.AppendUint32(b, 1)
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}

// pgMicros converts t to a timestamptz's binary value (microseconds since 2000-01-01 UTC,
// truncated as pgx does).
func pgMicros(t time.Time) int64 { return t.UnixMicro() - pgEpochMicros }

// stepCopier is the io.Reader pgconn.CopyFrom reads a binary COPY stream of steps from. It
// encodes rows straight into the buffer it is given (pgconn's 64 KiB CopyData message), so a
// row is copied once on its way from the record to the socket.
type stepCopier struct {
	rows   []*StepRow
	header bool   // header written
	done   bool   // trailer written
	rest   []byte // encoded bytes that did not fit the last Read
}

func (c *stepCopier) Read(p []byte) (int, error) {
	n := 0
	if len(c.rest) > 0 {
		k := copy(p, c.rest)
		c.rest = c.rest[k:]
		n += k
		if len(c.rest) > 0 {
			return n, nil
		}
	}
	if !c.header {
		if len(p)-n < len(copyHeader) {
			return n, nil
		}
		n += copy(p[n:], copyHeader)
		c.header = true
	}
	for len(c.rows) > 0 {
		s := c.rows[0]
		size := stepTupleSize(s)
		if size <= len(p)-n {
			out := appendStepTuple(p[n:n], s)
			n += len(out)
			c.rows = c.rows[1:]
			continue
		}
		if n > 0 {
			return n, nil
		}
		// A row bigger than the whole buffer: encode it aside and hand it out in pieces.
		buf := appendStepTuple(make([]byte, 0, size), s)
		c.rows = c.rows[1:]
		k := copy(p, buf)
		c.rest = buf[k:]
		return k, nil
	}
	if c.done {
		return n, io.EOF
	}
	if len(p)-n < 2 {
		return n, nil
	}
	p[n], p[n+1] = 0xff, 0xff // trailer: field count -1
	c.done = true
	return n + 2, io.EOF
}
