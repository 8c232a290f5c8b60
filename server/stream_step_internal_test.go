package server

import (
	"bytes"
	"testing"
	"unsafe"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
)

// queued counts the queue's pieces and the bytes they hold: their buffers, messages and
// pointers.
func queued(q *outputQueue) (pieces, held int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, c := range q.pieces {
		held += cap(c.Data) + int(unsafe.Sizeof(*c)+unsafe.Sizeof(c))
	}
	return len(q.pieces), held
}

// A client that reads nothing costs the output's bytes and a constant, however small the pieces
// the readers hand over and however the two streams interleave: a piece is joined to its stream's
// last piece not taken yet, and each stream's bytes keep their order.
func TestOutputQueueMemory(t *testing.T) {
	const n = 1 << 20 // one-byte pieces per stream, the default output cap
	out, errs := bytes.Repeat([]byte("o"), n), make([]byte, n)
	for i := range errs {
		errs[i] = byte('a' + i%26)
	}
	q := newOutputQueue()
	// The sender has taken the first piece and is blocked sending it.
	taken := make(chan struct{})
	release := make(chan struct{})
	got := map[deltagymv1.OutputStream]*bytes.Buffer{deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT: {}, deltagymv1.OutputStream_OUTPUT_STREAM_STDERR: {}}
	sent := 0
	drained := make(chan error, 1)
	go func() {
		drained <- q.drain(func(c *deltagymv1.OutputChunk) error {
			if sent == 0 {
				close(taken)
				<-release
			}
			sent++
			got[c.Stream].Write(c.Data)
			return nil
		})
	}()
	q.put(sandbox.OutputStdout, out[:1:1])
	<-taken
	for i := range n {
		if i > 0 {
			q.put(sandbox.OutputStdout, out[i:i+1:i+1])
		}
		q.put(sandbox.OutputStderr, errs[i:i+1:i+1])
	}
	pieces, held := queued(q)
	if limit := 2*n + 4*outputChunkMax; held > limit || pieces > 2*(n/outputChunkMax+1) {
		t.Fatalf("%d pieces hold %d bytes for %d bytes of output (at most %d)", pieces, held, 2*n-1, limit)
	}
	close(release)
	q.close()
	if err := <-drained; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT].Bytes(), out) || !bytes.Equal(got[deltagymv1.OutputStream_OUTPUT_STREAM_STDERR].Bytes(), errs) {
		t.Fatal("the streams' bytes came out of order")
	}
	if sent > pieces+1 {
		t.Fatalf("%d messages for %d queued pieces", sent, pieces)
	}
}

// A piece larger than a message, or one that overflows the piece it joins, is cut at
// outputChunkMax; pieces of one stream queued together go out joined, in order.
func TestOutputQueueJoins(t *testing.T) {
	q := newOutputQueue()
	big := bytes.Repeat([]byte("x"), outputChunkMax+10)
	q.put(sandbox.OutputStdout, []byte("ab"))
	q.put(sandbox.OutputStdout, big)
	q.put(sandbox.OutputStderr, []byte("e"))
	q.put(sandbox.OutputStdout, []byte("cd"))
	q.put(sandbox.OutputStdout, nil)
	q.close()
	var msgs []string
	if err := q.drain(func(c *deltagymv1.OutputChunk) error {
		msgs = append(msgs, c.Stream.String()+":"+string(c.Data))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"OUTPUT_STREAM_STDOUT:ab" + string(big[:outputChunkMax-2]),
		"OUTPUT_STREAM_STDOUT:" + string(big[outputChunkMax-2:]) + "cd",
		"OUTPUT_STREAM_STDERR:e",
	}
	if len(msgs) != len(want) {
		t.Fatalf("%d messages, want %d", len(msgs), len(want))
	}
	for i := range want {
		if msgs[i] != want[i] {
			t.Fatalf("message %d: %d bytes, want %d", i, len(msgs[i]), len(want[i]))
		}
	}
}
