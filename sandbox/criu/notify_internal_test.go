package criu

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/seccomp"
	"google.golang.org/protobuf/proto"
)

// insn encodes one struct sock_filter.
func insn(code uint16, jt, jf uint8, k uint32) []byte {
	b := binary.LittleEndian.AppendUint16(nil, code)
	b = append(b, jt, jf)
	return binary.LittleEndian.AppendUint32(b, k)
}

func join(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// A dump's filters hand nothing to a listener once rewritten: the init's
// filter keeps its other answers, and a filter that only allows or hands
// over becomes a single "allow".
func TestDropNotify(t *testing.T) {
	const ld, jeq = 0x20, 0x15
	ret := func(k uint32) []byte { return insn(bpfRetK, 0, 0, k) }
	initFilter := join(insn(ld, 0, 0, 0), insn(jeq, 0, 1, 62), ret(seccompRetNotify),
		insn(jeq, 0, 1, 165), ret(0x00050000|1), ret(seccompRetAllow)) // kill: notify; mount: EPERM
	guard := join(insn(ld, 0, 0, 0), insn(jeq, 0, 1, 62), ret(seccompRetNotify), ret(seccompRetAllow))
	plain := join(insn(ld, 0, 0, 0), insn(jeq, 0, 1, 165), ret(0x00050000|1), ret(seccompRetAllow))
	dir := t.TempDir()
	path := filepath.Join(dir, "seccomp.img")
	entry := &seccomp.SeccompEntry{SeccompFilters: []*seccomp.SeccompFilter{
		{Filter: initFilter},
		{Filter: guard, Prev: proto.Uint32(0)},
		{Filter: plain, Prev: proto.Uint32(1)},
	}}
	if err := encodeImage(path, &crit.CriuImage{Magic: "SECCOMP", Entries: []*crit.CriuEntry{{Message: entry}}}); err != nil {
		t.Fatal(err)
	}
	if err := dropNotify(dir); err != nil {
		t.Fatal(err)
	}
	img, err := decodeImage(path, &seccomp.SeccompEntry{})
	if err != nil {
		t.Fatal(err)
	}
	got := img.Entries[0].Message.(*seccomp.SeccompEntry).GetSeccompFilters()
	want := [][]byte{
		join(insn(ld, 0, 0, 0), insn(jeq, 0, 1, 62), ret(seccompRetAllow),
			insn(jeq, 0, 1, 165), ret(0x00050000|1), ret(seccompRetAllow)),
		ret(seccompRetAllow),
		plain,
	}
	if len(got) != len(want) {
		t.Fatalf("%d filters after the rewrite", len(got))
	}
	for i := range want {
		if string(got[i].GetFilter()) != string(want[i]) {
			t.Errorf("filter %d: %x, want %x", i, got[i].GetFilter(), want[i])
		}
	}
	if got[1].GetPrev() != 0 || got[2].GetPrev() != 1 {
		t.Errorf("the chain changed: prev %d and %d", got[1].GetPrev(), got[2].GetPrev())
	}
	// A dump without filters has no image, and stays so.
	empty := t.TempDir()
	if err := dropNotify(empty); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(empty, "seccomp.img")); !os.IsNotExist(err) {
		t.Fatalf("an image appeared: %v", err)
	}
}
