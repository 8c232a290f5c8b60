package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// IndexEntry is one path's hashes in a files index: its attributes' and its content's.
type IndexEntry struct{ Attr, Data [32]byte }

// IndexBelow returns the entries of checkpoint id's files index at directory p (absolute) and
// below it, by path relative to p ("." for p).
func (r *Runtime) IndexBelow(ctx context.Context, id, p string) (map[string]IndexEntry, error) {
	root, _, _, err := r.indexOf(ctx, id)
	if err != nil {
		return nil, err
	}
	n := lookupNode(root, strings.Split(strings.TrimPrefix(p, "/"), "/"))
	if n == nil {
		return nil, fmt.Errorf("%s: not in the index", p)
	}
	out := map[string]IndexEntry{}
	var walk func(rel string, n *dnode)
	walk = func(rel string, n *dnode) {
		out[rel] = IndexEntry{Attr: n.attr, Data: n.data}
		n.kids.each(func(name string, k *dnode) {
			if rel == "." {
				walk(name, k)
			} else {
				walk(rel+"/"+name, k)
			}
		})
	}
	walk(".", n)
	return out, nil
}

// EntryOf hashes path p of a plain tree (a merged tree as the host sees it) as the index
// hashes an entry, its owner and group taken less shift (the sandbox's host ids' base).
func EntryOf(p string, shift uint32) (IndexEntry, error) {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return IndexEntry{}, err
	}
	if st.Uid >= shift {
		st.Uid -= shift
	}
	if st.Gid >= shift {
		st.Gid -= shift
	}
	xs, err := readXattrs(p)
	if err != nil {
		return IndexEntry{}, err
	}
	e := IndexEntry{Attr: attrHash(&st, xs)}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return IndexEntry{}, err
		}
		defer unix.Close(fd)
		var read int64
		e.Data, err = contentHash(fd, st.Size, make([]byte, chunkSize), &read)
		return e, err
	case unix.S_IFLNK:
		target, err := readlinkat(unix.AT_FDCWD, p)
		if err != nil {
			return IndexEntry{}, err
		}
		e.Data = sha256.Sum256([]byte(target))
	case unix.S_IFCHR, unix.S_IFBLK:
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], st.Rdev)
		e.Data = sha256.Sum256(b[:])
	}
	return e, nil
}

// TemplatePids returns the host pids of checkpoint ck's templates.
func (r *Runtime) TemplatePids(ck string) []int {
	c, err := r.lookup(ck)
	if err != nil {
		return nil
	}
	var out []int
	for _, p := range c.Procs {
		out = append(out, p.HostPid)
	}
	return out
}
