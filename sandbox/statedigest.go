package sandbox

import (
	"context"
	"fmt"
	"time"
)

// StateDigest identifies the state a checkpoint holds: equal digests, equal states, however
// they were reached. Files covers the merged tree: each path's type, permission bits, owner
// and group as the sandbox sees them, content, symlink target and xattrs, not times. Processes
// covers what the process capture describes stably; "" when the checkpoint holds no process.
// Both are "sha256:" and 64 hex digits.
type StateDigest struct {
	Files     string
	Processes string
}

// IsZero reports whether d is no digest (not computed yet).
func (d StateDigest) IsZero() bool { return d.Files == "" }

// ChangeKind is how a path or a process differs between two checkpoints.
type ChangeKind int

// Change kinds.
const (
	ChangeAdded ChangeKind = iota + 1
	ChangeRemoved
	ChangeModified
)

// DiffDetail is how much DiffCheckpoints says of each changed file.
type DiffDetail int

// Diff details.
const (
	// DiffPaths gives paths, types, sizes and modes.
	DiffPaths DiffDetail = iota
	// DiffLines also counts lines added and removed in text files of at most 64 KiB.
	DiffLines
	// DiffUnified also gives their unified diff (three lines of context).
	DiffUnified
)

// DiffOptions shape a DiffCheckpoints.
type DiffOptions struct {
	Detail DiffDetail
	// Path keeps changes at this absolute path and below; "": all.
	Path string
	// MaxPaths is the most path changes returned (Diff.Truncated past it); 0: 10,000.
	MaxPaths int
}

// PathChange is one path that differs between two checkpoints.
type PathChange struct {
	Path             string // absolute in the sandbox
	Kind             ChangeKind
	OldType, NewType FileType // 0 when absent on that side
	OldSize, NewSize int64
	OldMode, NewMode uint32 // permission bits with setuid, setgid, sticky
	// MetadataOnly: content and link target kept; mode, owner or xattrs changed.
	MetadataOnly bool
	// Binary (DiffLines and up): a regular file not text on either side, or over 64 KiB.
	Binary                   bool
	LinesAdded, LinesRemoved int
	Unified                  string // DiffUnified, text files only
}

// ProcessChange is one process that differs between two checkpoints.
type ProcessChange struct {
	Kind    ChangeKind
	Pid     int // in the sandbox's pid namespace
	Command string
	Details []string // what changed in a modified process, e.g. "cwd /a -> /b"
}

// Diff is what DiffCheckpoints found.
type Diff struct {
	Paths     []PathChange // sorted by path
	Truncated bool         // more changes than Paths (DiffOptions.MaxPaths, or 16 MiB of paths)
	// DetailsTruncated: the diff's budgets for file details (content read, line diff work,
	// 16 MiB of unified text) ran out, and some text files have no line counts or unified
	// diff. Files of one pair of contents share their details.
	DetailsTruncated bool
	Processes        []ProcessChange // sorted by pid
	Base             StateDigest
	Target           StateDigest
}

// StateDigest returns checkpoint id's digest, waiting until it is computed or ctx ends.
// ErrNotFound for an unknown or released checkpoint.
func (r *Runtime) StateDigest(ctx context.Context, id string) (StateDigest, error) {
	ck := r.jobs.digests.get(id)
	if ck == nil {
		return StateDigest{}, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	select {
	case <-ck.done:
		if ck.err != nil {
			return StateDigest{}, ck.err
		}
		return ck.d, nil
	case <-ctx.Done():
		return StateDigest{}, ctx.Err()
	case <-r.done:
		return StateDigest{}, fmt.Errorf("%w: the runtime is closed", ErrClosed)
	}
}

// StateDigestReady returns checkpoint id's digest if it is computed, without waiting.
func (r *Runtime) StateDigestReady(id string) (StateDigest, bool) {
	ck := r.jobs.digests.get(id)
	if ck == nil {
		return StateDigest{}, false
	}
	select {
	case <-ck.done:
		return ck.d, ck.err == nil
	default:
		return StateDigest{}, false
	}
}

// Dedupe waits for checkpoint id's digest and looks for another checkpoint of the same image
// holding the same state (both digests equal) that match accepts (nil: any). match is called
// with Runtime.mu held: it must not call the runtime. Found, it releases id, makes the sandbox that
// took id descend from the one found (its next checkpoint's parent), and returns the one
// found; otherwise it returns id's own info with dup false.
//
// Of several equal checkpoints the oldest is found. The found one counts as used (its TTL
// starts again), and the sandbox's head moves to it, so it does not expire while the sandbox
// lives. Two Dedupes that would each find the other's checkpoint run one after the other
// (under Runtime.mu): the second finds the first's gone and keeps its own.
func (r *Runtime) Dedupe(ctx context.Context, id string, match func(CheckpointInfo) bool) (info CheckpointInfo, dup bool, err error) {
	d, err := r.StateDigest(ctx, id)
	if err != nil {
		return CheckpointInfo{}, false, err
	}
	c, err := r.lookup(id)
	if err != nil {
		return CheckpointInfo{}, false, err
	}
	// The sandbox that took id, if it lives: its head moves under its op lock, which comes
	// before Runtime.mu.
	r.mu.Lock()
	s := r.sandboxes[c.SandboxID]
	r.mu.Unlock()
	if s != nil {
		s.op.Lock()
		defer s.op.Unlock()
		return s.dedupe(c, d, match)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	found, err := r.findDupLocked(c, d, match)
	if found == nil || err != nil {
		return c.info(), false, err
	}
	r.dropCheckpointLocked(c, true)
	return found.info(), true, nil
}

// dedupe is Dedupe of c, a checkpoint s took, whose digest is d.
// +checklocks:s.op
func (s *Sandbox) dedupe(c *checkpoint, d StateDigest, match func(CheckpointInfo) bool) (CheckpointInfo, bool, error) {
	r := s.rt
	r.mu.Lock()
	defer r.mu.Unlock()
	found, err := r.findDupLocked(c, d, match)
	if found == nil || err != nil {
		return c.info(), false, err
	}
	if r.sandboxes[s.id] == s && s.head == c.ID {
		// The head moves before c goes: found is held by it from now on, and c's index stays
		// known (as found's) for the sandbox's next checkpoint, whose stack begins as c's.
		r.moveHead(c.ID, found.ID)
		s.head = found.ID
		r.jobs.digests.adopt(found.ID, c.ID)
	}
	r.dropCheckpointLocked(c, true)
	return found.info(), true, nil
}

// findDupLocked returns the oldest checkpoint other than c of c's image whose digest is d and
// that match accepts (nil: none), and counts it as used.
// +checklocks:r.mu
func (r *Runtime) findDupLocked(c *checkpoint, d StateDigest, match func(CheckpointInfo) bool) (*checkpoint, error) {
	if r.ckpts[c.ID] != c {
		return nil, fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, c.ID)
	}
	var found *checkpoint
	for _, o := range r.ckpts {
		if o == c || o.Image != c.Image || o.Digest == nil || o.Digest.Files != d.Files || o.Digest.Processes != d.Processes {
			continue
		}
		if found != nil && !o.Created.Before(found.Created) && (!o.Created.Equal(found.Created) || o.ID > found.ID) {
			continue
		}
		if match == nil || match(o.info()) {
			found = o
		}
	}
	if found != nil {
		found.used.Store(time.Now().UnixNano())
	}
	return found, nil
}
