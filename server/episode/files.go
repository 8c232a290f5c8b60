package episode

import (
	"context"
	"fmt"
	"os"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
)

// The tree actions: list_dir, stat, remove, make_dir, upload and download. Each is one call of
// the runtime (sandbox.Sandbox's method of the same name), which resolves its path as the
// other file actions do; a failure the sandbox's state gave is a *sandbox.FileError, the
// agent's (agentError).

// ListDir lists a directory: Depth levels (0 and 1: its own entries), at most MaxEntries (0:
// sandbox.MaxListEntries).
type ListDir struct {
	Path       string
	Depth      int
	MaxEntries int
}

// Stat describes a path without following a final symlink.
type Stat struct{ Path string }

// Remove removes a path; Recursive removes a directory with its tree.
type Remove struct {
	Path      string
	Recursive bool
}

// MakeDir creates a directory with Mode (0: 0755); Parents creates missing parents and makes
// an existing directory no error.
type MakeDir struct {
	Path    string
	Mode    os.FileMode
	Parents bool
}

// Upload unpacks a tar archive (plain or gzip) into a directory.
type Upload struct {
	Path string
	Tar  []byte
}

// Download packs a file or directory as a tar archive of at most MaxBytes (0:
// sandbox.MaxArchiveBytes).
type Download struct {
	Path     string
	MaxBytes int64
}

// Kind returns "list_dir".
func (ListDir) Kind() string { return "list_dir" }

// Kind returns "stat".
func (Stat) Kind() string { return "stat" }

// Kind returns "remove".
func (Remove) Kind() string { return "remove" }

// Kind returns "make_dir".
func (MakeDir) Kind() string { return "make_dir" }

// Kind returns "upload".
func (Upload) Kind() string { return "upload" }

// Kind returns "download".
func (Download) Kind() string { return "download" }

// ListDirResult is a listing, sorted by path; Truncated says entries were left out.
type ListDirResult struct {
	Entries   []sandbox.FileInfo
	Truncated bool
}

// StatResult describes a path, when it Exists.
type StatResult struct {
	Exists bool
	Info   sandbox.FileInfo
}

// RemoveResult counts the paths removed.
type RemoveResult struct{ Removed int64 }

// MakeDirResult says whether the directory was created.
type MakeDirResult struct{ Created bool }

// DownloadResult is an archive and its count of entries.
type DownloadResult struct {
	Tar   []byte
	Files int64
}

// validateFiles checks a tree action before anything runs (an upload's archive whole, as the
// runtime will again); ok is false for another kind.
func validateFiles(a Action) (ok bool, err error) {
	var path string
	switch x := a.(type) {
	case ListDir:
		path = x.Path
		if x.Depth < 0 || x.Depth > sandbox.MaxTreeDepth {
			return true, fmt.Errorf("list_dir depth %d: 0 to %d: %w", x.Depth, sandbox.MaxTreeDepth, ErrInvalid)
		}
		if x.MaxEntries < 0 || x.MaxEntries > sandbox.MaxListEntries {
			return true, fmt.Errorf("list_dir max_entries %d: 0 to %d (0: %[2]d): %w", x.MaxEntries, sandbox.MaxListEntries, ErrInvalid)
		}
	case Stat:
		path = x.Path
	case Remove:
		path = x.Path
	case MakeDir:
		path = x.Path
		if x.Mode&^(os.ModePerm|os.ModeSetgid|os.ModeSticky) != 0 {
			return true, fmt.Errorf("make_dir mode: permission bits, setgid and sticky only: %w", ErrInvalid)
		}
	case Upload:
		path = x.Path
		if err := sandbox.CheckArchive(context.Background(), x.Tar); err != nil {
			return true, err
		}
	case Download:
		path = x.Path
		if x.MaxBytes < 0 || x.MaxBytes > sandbox.MaxArchiveBytes {
			return true, fmt.Errorf("download max_bytes %d: 0 to %d (0: %[2]d): %w", x.MaxBytes, sandbox.MaxArchiveBytes, ErrInvalid)
		}
	default:
		return false, nil
	}
	if path == "" {
		return true, fmt.Errorf("%s needs a path: %w", a.Kind(), ErrInvalid)
	}
	check := sandbox.CheckPath
	switch a.(type) {
	case Remove, MakeDir, Download:
		check = sandbox.CheckEntryPath
	}
	if err := check(path); err != nil {
		return true, fmt.Errorf("%s: %w", a.Kind(), err)
	}
	return true, nil
}

// treeAction performs a tree action; ok is false for another kind.
func (c *Core) treeAction(ctx context.Context, l *envpool.Lease, a Action, attrs []attribute.KeyValue) (out outcome, ok bool, err error) {
	switch a.(type) {
	case ListDir, Stat, Remove, MakeDir, Upload, Download:
	default:
		return outcome{}, false, nil
	}
	ctx, done := c.cfg.Observe(ctx, a.Kind())
	trace.SpanFromContext(ctx).SetAttributes(attrs...)
	obs, err := treeOp(ctx, l.Sandbox(), a)
	done(err)
	return outcome{obs: obs}, true, err
}

func treeOp(ctx context.Context, box *sandbox.Sandbox, a Action) (Observation, error) {
	switch x := a.(type) {
	case ListDir:
		entries, truncated, err := box.ListDir(ctx, x.Path, x.Depth, x.MaxEntries)
		return Observation{ListDir: &ListDirResult{Entries: entries, Truncated: truncated}}, err
	case Stat:
		fi, ok, err := box.Stat(ctx, x.Path)
		return Observation{Stat: &StatResult{Exists: ok, Info: fi}}, err
	case Remove:
		n, err := box.Remove(ctx, x.Path, x.Recursive)
		return Observation{Remove: &RemoveResult{Removed: n}}, err
	case MakeDir:
		created, err := box.MakeDir(ctx, x.Path, x.Mode, x.Parents)
		return Observation{MakeDir: &MakeDirResult{Created: created}}, err
	case Upload:
		st, err := box.Upload(ctx, x.Path, x.Tar)
		return Observation{Upload: &st}, err
	case Download:
		b, files, err := box.Download(ctx, x.Path, x.MaxBytes)
		return Observation{Download: &DownloadResult{Tar: b, Files: files}}, err
	}
	return Observation{}, fmt.Errorf("unknown action kind: %w", ErrInvalid)
}

// treeActionProto is a's API form; nil for another kind.
func treeActionProto(a Action) *deltagymv1.Action {
	switch x := a.(type) {
	case ListDir:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_ListDir{ListDir: &deltagymv1.ListDirAction{Path: x.Path,
			Depth: int32(x.Depth), MaxEntries: int32(x.MaxEntries)}}}
	case Stat:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Stat{Stat: &deltagymv1.StatAction{Path: x.Path}}}
	case Remove:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Remove{Remove: &deltagymv1.RemoveAction{Path: x.Path, Recursive: x.Recursive}}}
	case MakeDir:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_MakeDir{MakeDir: &deltagymv1.MakeDirAction{Path: x.Path,
			Mode: ModeBits(x.Mode), Parents: x.Parents}}}
	case Upload:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Upload{Upload: &deltagymv1.UploadAction{Path: x.Path, Tar: x.Tar}}}
	case Download:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Download{Download: &deltagymv1.DownloadAction{Path: x.Path, MaxBytes: x.MaxBytes}}}
	}
	return nil
}

// ModeBits is m as the API's mode: permission bits with setuid (04000), setgid (02000) and
// sticky (01000) as in chmod.
func ModeBits(m os.FileMode) uint32 {
	b := uint32(m.Perm())
	if m&os.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

// FileMode is the API's mode b (ModeBits) as an os.FileMode; bits past 07777 are kept as
// other bits of os.FileMode, which validation refuses.
func FileMode(b uint32) os.FileMode {
	m := os.FileMode(b & 0o777)
	if b&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if b&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if b&0o1000 != 0 {
		m |= os.ModeSticky
	}
	if b&^0o7777 != 0 {
		m |= os.ModeDevice // not a mode a directory takes: refused
	}
	return m
}

// treeObservationProto is o's API form for a tree action's result; nil for another.
func treeObservationProto(o Observation) *deltagymv1.Observation {
	switch {
	case o.ListDir != nil:
		r := &deltagymv1.ListDirResult{Truncated: o.ListDir.Truncated, Entries: make([]*deltagymv1.FileInfo, len(o.ListDir.Entries))}
		for i, e := range o.ListDir.Entries {
			r.Entries[i] = fileInfoProto(e)
		}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_ListDir{ListDir: r}}
	case o.Stat != nil:
		r := &deltagymv1.StatResult{Exists: o.Stat.Exists}
		if o.Stat.Exists {
			r.Info = fileInfoProto(o.Stat.Info)
		}
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Stat{Stat: r}}
	case o.Remove != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Remove{Remove: &deltagymv1.RemoveResult{Removed: o.Remove.Removed}}}
	case o.MakeDir != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_MakeDir{MakeDir: &deltagymv1.MakeDirResult{Created: o.MakeDir.Created}}}
	case o.Upload != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Upload{Upload: &deltagymv1.UploadResult{Files: o.Upload.Files, Bytes: o.Upload.Bytes}}}
	case o.Download != nil:
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Download{Download: &deltagymv1.DownloadResult{Tar: o.Download.Tar, Files: o.Download.Files}}}
	}
	return nil
}

var fileTypes = map[sandbox.FileType]deltagymv1.FileType{
	sandbox.TypeFile:    deltagymv1.FileType_FILE_TYPE_FILE,
	sandbox.TypeDir:     deltagymv1.FileType_FILE_TYPE_DIRECTORY,
	sandbox.TypeSymlink: deltagymv1.FileType_FILE_TYPE_SYMLINK,
	sandbox.TypeOther:   deltagymv1.FileType_FILE_TYPE_OTHER,
}

// FileTypeProto is t's API form (unspecified for none).
func FileTypeProto(t sandbox.FileType) deltagymv1.FileType { return fileTypes[t] }

// fileInfoProto is fi's API form.
func fileInfoProto(fi sandbox.FileInfo) *deltagymv1.FileInfo {
	return &deltagymv1.FileInfo{Path: fi.Path, Type: fileTypes[fi.Type], Size: fi.Size, Mode: fi.Mode,
		ModifyTimeSeconds: float64(fi.ModTime.UnixNano()) / float64(time.Second), SymlinkTarget: fi.Target}
}
