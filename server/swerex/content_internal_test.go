package swerex

import (
	"bufio"
	"encoding/json"
	"io"
	"runtime"
	"strings"
	"testing"
)

// read_file's content is written as it is encoded: valid JSON that decodes to the text, in
// memory that does not grow with the text (a JSON encoding of NULs is six times their size).
func TestFileContentStreamed(t *testing.T) {
	for _, s := range []string{"", "plain", "\x00\x01\x1f\x7f \"q\" \\ \n\r\t", "wörld \u2028\u2029 \U0001F600", "bad \xff\xfe utf-8 \xe2\x82"} {
		var b strings.Builder
		w := bufio.NewWriter(&b)
		writeJSONString(w, s)
		_ = w.Flush()
		var got string
		if err := json.Unmarshal([]byte(b.String()), &got); err != nil {
			t.Fatalf("%q: %s is not JSON: %v", s, b.String(), err)
		}
		want := strings.ToValidUTF8(s, "\ufffd")
		if s == "bad \xff\xfe utf-8 \xe2\x82" {
			want = "bad \ufffd\ufffd utf-8 \ufffd\ufffd" // encoding/json's: one per byte
		}
		if got != want {
			t.Fatalf("%q: decoded %q, want %q", s, got, want)
		}
	}

	// The process allocates besides (the suite's server, its digests of checkpoints in the
	// background), in bursts: the least of five writes is the write's own, and it must be
	// less than the text itself, where encoding it whole takes six times it.
	nuls := strings.Repeat("\x00", 16<<20)
	least := uint64(1 << 63)
	for range 5 {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		w := bufio.NewWriterSize(io.Discard, 64<<10)
		writeJSONString(w, nuls)
		_ = w.Flush()
		runtime.ReadMemStats(&after)
		least = min(least, after.TotalAlloc-before.TotalAlloc)
	}
	if least > uint64(len(nuls)) {
		t.Fatalf("writing %d NULs as JSON allocated at least %d bytes in five tries", len(nuls), least)
	}
}
