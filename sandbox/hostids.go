package sandbox

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"github.com/deltagym/deltagym/sandbox/launch"
)

// Host id ranges: sandbox n maps its ids 0..launch.IDRange-1 onto
// firstHostID+n*launch.IDRange and up, all below 2^31 (the last range ends at
// 2^31-1), less the ranges the host's users have a part of (hostRanges).
const (
	firstHostID = 1 << 20
	maxRanges   = (1<<31 - firstHostID) / launch.IDRange
)

// idFiles names the files that say which host ids are someone's: the
// subordinate ranges of /etc/subuid and /etc/subgid (name:first:count), and
// the ids of /etc/passwd and /etc/group.
type idFiles struct {
	subuid, subgid, passwd, group string
}

// hostIDFiles are the files hostRanges reads; tests point them elsewhere.
var hostIDFiles = idFiles{subuid: "/etc/subuid", subgid: "/etc/subgid", passwd: "/etc/passwd", group: "/etc/group"}

// hostRanges returns the first host ids of the ranges the sandboxes may
// have, highest first, and how many were dropped: a range that holds an id
// of f's files, any user's or group's uid or gid, or a part of anyone's
// subordinate range, is never a sandbox's, since its owner could then own
// the sandbox's files and signal its processes. The files are read once: a
// range given to a user later is seen at the next start. A missing file names
// no ids; none left is an error.
func hostRanges(f idFiles) (ranges []int, dropped int, err error) {
	taken := make([]bool, maxRanges)
	mark := func(first, count int64) {
		lo, hi := max(first, firstHostID), min(first+count, firstHostID+int64(maxRanges)*launch.IDRange)
		for n := (lo - firstHostID) / launch.IDRange; lo < hi && n <= (hi-1-firstHostID)/launch.IDRange; n++ {
			taken[n] = true
		}
	}
	for _, src := range []struct {
		path   string
		fields []int // the fields that are ids (of a subordinate range, the first, then the count)
		sub    bool
	}{{f.subuid, []int{1, 2}, true}, {f.subgid, []int{1, 2}, true}, {f.passwd, []int{2, 3}, false}, {f.group, []int{2}, false}} {
		if err := readIDs(src.path, src.fields, src.sub, mark); err != nil {
			return nil, 0, err
		}
	}
	for n := maxRanges - 1; n >= 0; n-- {
		if taken[n] {
			dropped++
			continue
		}
		ranges = append(ranges, firstHostID+n*launch.IDRange)
	}
	if len(ranges) == 0 {
		return nil, dropped, fmt.Errorf("host id ranges: each of the %d ranges of %d ids from %d holds an id of %s, %s, %s or %s: no sandbox can have one",
			maxRanges, launch.IDRange, firstHostID, f.subuid, f.subgid, f.passwd, f.group)
	}
	return ranges, dropped, nil
}

// readIDs gives mark each id of path's lines: fields names the fields that
// are ids, or, when sub, the first id and the count of a subordinate range.
// Lines that are blank, comments, or do not parse name nothing.
func readIDs(path string, fields []int, sub bool, mark func(first, count int64)) error {
	fd, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("host id ranges: %w", err)
	}
	defer fd.Close()
	sc := bufio.NewScanner(fd)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		parts := strings.Split(line, ":")
		var ids []int64
		for _, i := range fields {
			if i >= len(parts) {
				break
			}
			if v, err := strconv.ParseUint(parts[i], 10, 32); err == nil {
				ids = append(ids, int64(v))
			}
		}
		switch {
		case sub && len(ids) == 2:
			mark(ids[0], ids[1])
		case !sub:
			for _, id := range ids {
				mark(id, 1)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("host id ranges: reading %s: %w", path, err)
	}
	return nil
}
