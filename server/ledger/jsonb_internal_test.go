package ledger

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// jsonbText changes no JSON but its escapes of NUL and of lone surrogates, each to \ufffd:
// what it returns decodes to what b does with each NUL as U+FFFD (encoding/json decodes a
// lone surrogate as U+FFFD already), and holds none of them.
func FuzzJSONBText(f *testing.F) {
	for _, s := range []string{`{"a":"x\u0000y"}`, `"\ud800"`, `"\udc00\u0041"`, `"\ud83d\ude00"`, `"\\u0000"`, `"\\\u0000"`,
		`["\ud800\u0000", "\ud800\ud800\udc00"]`, `{"k\u0000":1,"w":"AAAA"}`, `"\u00"`, `"\"\u0000"`, `null`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		lower := bytes.ToLower(b)
		if !json.Valid(b) || !utf8.Valid(b) || bytes.Contains(b, []byte("\uFFFD")) || bytes.Contains(lower, []byte(`\ufffd`)) {
			return // U+FFFD already there: keys that read the same once NUL is one would make the decoding's order matter
		}
		in := bytes.Clone(b)
		out := jsonbText(b)
		if !bytes.Equal(b, in) {
			t.Fatalf("jsonbText changed its input")
		}
		var want, got any
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("jsonbText(%q) = %q: %v", b, out, err)
		}
		if want = nulAsReplacement(want); !reflect.DeepEqual(got, want) {
			t.Fatalf("jsonbText(%q) = %q: decodes to %q, want %q", b, out, got, want)
		}
		if !bytes.Equal(out, b) && !bytes.Contains(b, []byte(`\u0000`)) && !bytes.Contains(lower, []byte(`\ud`)) {
			t.Fatalf("jsonbText(%q) = %q: changed JSON that needed no change", b, out)
		}
		if bytes.Contains(out, []byte(`\u0000`)) && !bytes.Contains(out, []byte(`\\u0000`)) {
			t.Fatalf("jsonbText(%q) = %q: NUL left", b, out)
		}
	})
}

// nulAsReplacement is v, decoded JSON, with each NUL in its strings and keys as U+FFFD.
func nulAsReplacement(v any) any {
	switch x := v.(type) {
	case string:
		return strings.ReplaceAll(x, "\x00", "\uFFFD")
	case []any:
		for i := range x {
			x[i] = nulAsReplacement(x[i])
		}
	case map[string]any:
		m := map[string]any{}
		for k, e := range x {
			m[strings.ReplaceAll(k, "\x00", "\uFFFD")] = nulAsReplacement(e)
		}
		return m
	}
	return v
}

// BenchmarkJSONBText is what jsonbText adds to Writer.Step for actions that need no change:
// an exec's and a write_file's of 64 KiB (its content base64), as the episode core records
// them.
func BenchmarkJSONBText(b *testing.B) {
	content := make([]byte, 64<<10)
	for i := range content {
		content[i] = byte(i * 7)
	}
	write, err := json.Marshal(map[string]any{"writeFile": map[string]any{"path": "/work/src/main.py", "content": content}})
	if err != nil {
		b.Fatal(err)
	}
	for _, a := range []struct {
		name string
		json []byte
	}{
		{"exec", []byte(`{"exec":{"command":"cd /work && grep -rn \"def main\" src | head -n 20","env":{"PAGER":"cat"}}}`)},
		{"write_file=64KiB", write},
	} {
		b.Run(a.name, func(b *testing.B) {
			b.SetBytes(int64(len(a.json)))
			for b.Loop() {
				if out := jsonbText(a.json); len(out) != len(a.json) {
					b.Fatal("changed")
				}
			}
		})
	}
}
