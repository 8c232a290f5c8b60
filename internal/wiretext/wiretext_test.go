package wiretext_test

import (
	"encoding/json"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/wiretext"
)

func TestString(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", ""},
		{"plain/ascii", "plain/ascii"},
		{"é ü 日本", "é ü 日本"},
		{"bad\xff\nname", "bad\uFFFD\nname"},
		{"ev\xff\xfeil", "ev\uFFFD\uFFFDil"},   // each byte its own
		{"\xe6\x97", "\uFFFD\uFFFD"},           // a sequence cut short
		{"\xed\xa0\x80", "\uFFFD\uFFFD\uFFFD"}, // a surrogate
		{"a\x00b", "a\x00b"},                   // NUL is UTF-8
		{"\uFFFD\xff", "\uFFFD\uFFFD"},         // one already there stays
	} {
		got := wiretext.String(c.in)
		if got != c.want {
			t.Errorf("String(%q) = %q, want %q", c.in, got, c.want)
		}
		// encoding/json's rule is the same.
		j, err := json.Marshal(c.in)
		if err != nil {
			t.Fatal(err)
		}
		var back string
		if err := json.Unmarshal(j, &back); err != nil || back != c.want {
			t.Errorf("encoding/json makes %q of %q, want %q (%v)", back, c.in, c.want, err)
		}
	}
}

func TestMessage(t *testing.T) {
	m := &deltagymv1.DiffCheckpointsResponse{
		Paths:     []*deltagymv1.PathChange{{Path: "/work/bad\xff\nname", UnifiedDiff: "--- a\n"}, {Path: "/ok"}},
		Processes: []*deltagymv1.ProcessChange{{Command: "ev\xff\xfeil", Details: []string{"ok", "cwd /x\xff"}}},
	}
	if _, err := proto.Marshal(m); err == nil {
		t.Fatal("a message with invalid UTF-8 marshals: the test proves nothing")
	}
	if !wiretext.Message(m) {
		t.Fatal("Message reports no change")
	}
	if _, err := proto.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetPaths()[0].GetPath(); got != "/work/bad\uFFFD\nname" {
		t.Errorf("path %q", got)
	}
	if got := m.GetProcesses()[0]; got.GetCommand() != "ev\uFFFD\uFFFDil" || got.GetDetails()[1] != "cwd /x\uFFFD" || got.GetDetails()[0] != "ok" {
		t.Errorf("process %v", got)
	}
	if wiretext.Message(m) {
		t.Error("Message changes a valid message")
	}
	// Maps: keys and values; a message in a oneof.
	info := &errdetails.ErrorInfo{Reason: "R", Metadata: map[string]string{"path": "/a\xff", "k\xff": "v", "ok": "fine"}}
	if !wiretext.Message(info) {
		t.Fatal("no change in a map")
	}
	if md := info.GetMetadata(); len(md) != 3 || md["path"] != "/a\uFFFD" || md["k\uFFFD"] != "v" || md["ok"] != "fine" {
		t.Errorf("metadata %q", md)
	}
	obs := &deltagymv1.Observation{Kind: &deltagymv1.Observation_ListDir{ListDir: &deltagymv1.ListDirResult{
		Entries: []*deltagymv1.FileInfo{{Path: "/w/\xff"}}}}}
	if !wiretext.Message(obs) || obs.GetListDir().GetEntries()[0].GetPath() != "/w/\uFFFD" {
		t.Errorf("oneof: %v", obs)
	}
	if wiretext.Message(nil) {
		t.Error("nil changed")
	}
}

func FuzzMessage(f *testing.F) {
	f.Add("bad\xff\nname", "ev\xff\xfeil")
	f.Fuzz(func(t *testing.T, a, b string) {
		m := &deltagymv1.PathChange{Path: a, UnifiedDiff: b}
		wiretext.Message(m)
		if _, err := proto.Marshal(m); err != nil {
			t.Fatal(err)
		}
		if s := wiretext.String(a); len(s) < len(a) {
			t.Fatalf("String shortened %q to %q", a, s)
		}
	})
}
