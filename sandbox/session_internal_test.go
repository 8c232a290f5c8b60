package sandbox

import (
	"errors"
	"io"
	"os"
	"testing"
	"time"
)

// What a shell wrote before it exited is read even when the reader first runs after the drain's
// deadline has passed.
func TestShellStreamReadsPastDeadline(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close() // held open, as a template's copy of the write end holds it
	want := "bye\n" + string(make([]byte, 20_000)) + "end\n"
	if _, err := w.Write([]byte(want)); err != nil {
		t.Fatal(err)
	}
	if err := r.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(shellStream(r))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("reading past the deadline ended with %v, want the deadline's error", err)
	}
	if string(got) != want {
		t.Fatalf("read %d bytes of the %d the pipe held", len(got), len(want))
	}
}
