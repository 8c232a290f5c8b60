package layers

// The transfer format of a sealed layer: what Export writes, Import reads and
// Digest hashes. A layer moves between nodes as this stream, named by its
// digest, "sha256:" and the hex SHA-256 of the whole stream.
//
// The stream is canonical: one tree has exactly one stream, so the same
// layer exported twice, or exported again on the node that imported it,
// gives the same bytes and the same digest. Import refuses every stream
// that is not the canonical form of the tree it describes, rather than
// rewriting it.
//
// Integers are big-endian, unsigned unless said otherwise.
//
//	stream  = magic entry* end
//	magic   = "dglayer" 0x01
//	entry   = kind:u8 depth:u16 nlen:u8 name[nlen] body
//	body    = meta kbody        kinds d f l p s w
//	        | ordinal:u64       kind h
//	meta    = mode:u32 uid:u32 gid:u32 msec:i64 mnsec:u32 nx:u16 xattr[nx]
//	xattr   = klen:u8 key[klen] vlen:u32 value[vlen]
//	kbody   = size:u64 next:u32 extent[next]    kind f
//	        | tlen:u16 target[tlen]              kind l
//	        | (nothing)                          kinds d p s w
//	extent  = off:u64 len:u64 data[len]
//	end     = 'E', then the end of the stream
//
// Kinds: 'd' directory, 'f' regular file, 'l' symbolic link, 'h' hard link,
// 'p' FIFO, 's' socket, 'w' overlayfs whiteout (a 0:0 character device).
// Other devices do not travel: a sandbox cannot make one (its user
// namespace may not), so a layer holds one only as a copy-up of an image's
// node, and a receiving node cannot tell such a copy from a device that a
// compromised peer planted, one that would give a sandbox a host device.
// Export refuses such a layer (ErrUntransferable) and Import such a stream.
// FIFOs and sockets are inert nodes: they carry no access to anything.
//
// Order. Entries come depth first, a directory's entries right after it,
// sorted by name (bytewise). The first entry is the layer's root: kind 'd',
// depth 0, no name. Every other entry's depth is the number of components of
// its path: its parent is the directory entry of depth-1 that came last, and
// its name is greater than every earlier name in that directory. So paths
// are only ever single names under a directory the stream made (never "",
// ".", "..", nor holding '/' or NUL), and a path cannot repeat. Depth is at
// most maxDepth.
//
// Entries are numbered from 0 (the root) in stream order; every entry,
// hard links included, takes a number. A hard-link group is its first name,
// a regular file, followed later by an 'h' entry per other name, carrying
// the number of that file; 'h' entries have no meta of their own.
//
// meta: mode holds the permission, set-id and sticky bits only (0o7777; a
// symlink's is always 0o777). Owners are the ids stored in the layer, as
// they are on disk: image-relative, since sandboxes see layers through
// idmapped mounts; 2^32-1 is not an id. mtime is seconds (signed) and
// nanoseconds (below 10^9); times of access are not carried (an import sets
// them to mtime). Extended attributes of every namespace, sorted by key
// without repeats: key at most 255 bytes (XATTR_NAME_MAX), value at most
// 64 KiB (XATTR_SIZE_MAX), and all keys and values of one entry at most
// maxEntryXattrBytes.
//
// A regular file's extents are its data as SEEK_DATA and SEEK_HOLE find it,
// in order: everything else is a hole, so only data travels (a 1 GiB sparse
// file holding 4 KiB costs 4 KiB). An extent starts on a page boundary, ends
// on one or at the file's size, is not empty, and a hole of at least a page
// lies between two extents: what a tmpfs holds, and so what an import
// writes back exactly.
//
// A symlink's target is 1 to 4095 bytes without NUL, never followed.

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"strings"
)

const (
	xferMagic = "dglayer\x01"

	kindDir      = 'd'
	kindFile     = 'f'
	kindSymlink  = 'l'
	kindLink     = 'h'
	kindFIFO     = 'p'
	kindSocket   = 's'
	kindWhiteout = 'w'
	kindEnd      = 'E'

	// maxDepth is the deepest entry a stream may hold. An import keeps a
	// descriptor per directory level open.
	maxDepth = 256
	// maxNameLen is NAME_MAX; maxXattrKey XATTR_NAME_MAX; maxXattrValue
	// XATTR_SIZE_MAX; maxTarget PATH_MAX less its NUL.
	maxNameLen    = 255
	maxXattrKey   = 255
	maxXattrValue = 64 << 10
	maxTarget     = 4095
	// maxEntryXattrBytes bounds the keys and values of one entry's
	// extended attributes together: one value of the largest size and
	// room for more. An import holds a directory's until its entries are
	// written.
	maxEntryXattrBytes = 128 << 10

	digestPrefix = "sha256:"
)

// xattr is one extended attribute of an entry.
type xattr struct {
	key   string
	value []byte
}

// xattrBytes is what the attributes of one entry count against
// maxEntryXattrBytes.
func xattrBytes(xs []xattr) int {
	n := 0
	for _, x := range xs {
		n += len(x.key) + len(x.value)
	}
	return n
}

// DigestOf is the digest of what h hashed, as the layers and the process images between nodes
// name theirs: "sha256:" and the hex SHA-256.
func DigestOf(h hash.Hash) string { return digestPrefix + hex.EncodeToString(h.Sum(nil)) }

// checkDigest refuses a digest not of the form "sha256:" and 64 lowercase
// hex digits.
func checkDigest(d string) error {
	hexPart, ok := strings.CutPrefix(d, digestPrefix)
	if !ok || len(hexPart) != 2*sha256.Size || strings.ToLower(hexPart) != hexPart {
		return fmt.Errorf("%w: layer digest %q is not sha256:<64 hex digits>", ErrBadDigest, d)
	}
	if _, err := hex.DecodeString(hexPart); err != nil {
		return fmt.Errorf("%w: layer digest %q is not sha256:<64 hex digits>", ErrBadDigest, d)
	}
	return nil
}

// streamReader reads a stream and counts what it consumed, for messages.
type streamReader struct {
	r *bufio.Reader
	n int64 // bytes consumed
}

// full reads exactly len(p) bytes. The end of the stream before them is a
// truncated stream.
func (r *streamReader) full(p []byte) error {
	n, err := io.ReadFull(r.r, p)
	r.n += int64(n)
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		return fmt.Errorf("%w: truncated at byte %d", ErrBadStream, r.n)
	}
	if err != nil {
		return fmt.Errorf("reading the layer stream: %w", err)
	}
	return nil
}

// asyncHash computes a stream's SHA-256 in a goroutine of its own, from a
// copy of each write, so that hashing overlaps with reading and writing the
// layer: an import costs about the larger of the two, not their sum.
// close ends the goroutine, whatever was written.
type asyncHash struct {
	h      hash.Hash
	blocks chan []byte // to hash, in order
	free   chan []byte // hashed, for reuse
	made   int
	done   chan struct{}
	closed bool
}

const (
	hashBlock  = 256 << 10
	hashBlocks = 8
)

func newAsyncHash() *asyncHash {
	a := &asyncHash{h: sha256.New(), blocks: make(chan []byte, hashBlocks), free: make(chan []byte, hashBlocks),
		done: make(chan struct{})}
	go func() {
		defer close(a.done)
		for b := range a.blocks {
			a.h.Write(b)
			a.free <- b
		}
	}()
	return a
}

// Write queues a copy of p to be hashed; it blocks only while hashBlocks
// blocks wait.
func (a *asyncHash) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		var b []byte
		select {
		case b = <-a.free:
		default:
			if a.made < hashBlocks {
				a.made++
				b = make([]byte, 0, hashBlock)
			} else {
				b = <-a.free
			}
		}
		k := min(len(p), cap(b))
		a.blocks <- append(b[:0], p[:k]...)
		p = p[k:]
	}
	return n, nil
}

// digest waits for everything written to be hashed and returns the digest.
func (a *asyncHash) digest() string {
	a.close()
	return DigestOf(a.h)
}

// close ends the hashing goroutine once it has hashed what was written. It
// is idempotent.
func (a *asyncHash) close() {
	if !a.closed {
		a.closed = true
		close(a.blocks)
	}
	<-a.done
}
