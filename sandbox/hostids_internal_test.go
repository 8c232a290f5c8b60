package sandbox

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox/launch"
)

// idFilesOf writes the four files of host ids into a temporary directory; a
// nil content leaves that file out.
func idFilesOf(t *testing.T, subuid, subgid, passwd, group []string) idFiles {
	t.Helper()
	dir := t.TempDir()
	f := idFiles{subuid: filepath.Join(dir, "subuid"), subgid: filepath.Join(dir, "subgid"), passwd: filepath.Join(dir, "passwd"), group: filepath.Join(dir, "group")}
	for path, lines := range map[string][]string{f.subuid: subuid, f.subgid: subgid, f.passwd: passwd, f.group: group} {
		if lines != nil {
			if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return f
}

// Every sandbox's host id range lies below 2^31, and none holds an id of a user or group of the
// host or of anyone's subordinate range; none left is an error that says why.
func TestHostRanges(t *testing.T) {
	at := func(n int) int { return firstHostID + n*launch.IDRange }
	free, dropped, err := hostRanges(idFilesOf(t, nil, nil, nil, nil))
	if err != nil || dropped != 0 || len(free) < 32000 {
		t.Fatalf("without files: %d ranges, %d dropped, %v", len(free), dropped, err)
	}
	for _, h := range free {
		if h < firstHostID || h+launch.IDRange > 1<<31 {
			t.Fatalf("range %d..%d is not within [2^20, 2^31)", h, h+launch.IDRange-1)
		}
	}
	if free[0] != 1<<31-launch.IDRange || free[len(free)-1] != firstHostID {
		t.Fatalf("ranges from %d to %d", free[len(free)-1], free[0])
	}

	last := maxRanges - 1
	f := idFilesOf(t,
		[]string{"# comment", "alice:1048576:65536", "eve:" + itoa(at(5)-1) + ":2", "low:100000:65536", "bad:x:y", ""},
		[]string{"bob:" + itoa(at(2)) + ":1"},
		[]string{"root:x:0:0:root:/root:/bin/sh", "carol:x:" + itoa(at(3)+7) + ":100::/:/bin/sh", "dan:x:1000:" + itoa(at(7)) + "::/:/bin/sh", "short:x"},
		[]string{"g:x:2147483647:", "h:x:" + itoa(at(9)) + ":carol"})
	free, dropped, err = hostRanges(f)
	if err != nil {
		t.Fatal(err)
	}
	gone := map[int]bool{at(0): true, at(2): true, at(3): true, at(4): true, at(5): true, at(7): true, at(9): true, at(last): true}
	if dropped != len(gone) || len(free) != maxRanges-len(gone) {
		t.Fatalf("%d dropped, %d left; want %d dropped", dropped, len(free), len(gone))
	}
	for _, h := range free {
		if gone[h] {
			t.Fatalf("range %d..%d holds a host id of someone's", h, h+launch.IDRange-1)
		}
	}

	_, _, err = hostRanges(idFilesOf(t, []string{"all:0:4294967295"}, nil, nil, nil))
	if err == nil || !strings.Contains(err.Error(), "no sandbox can have one") {
		t.Fatalf("every range taken: %v", err)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
