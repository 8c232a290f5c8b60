package loadtest

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// FullCopyConfig configures MeasureFullCopy, the baseline of rolling back by copying files
// instead of swapping an overlay layer.
type FullCopyConfig struct {
	// Dir is a scratch directory (created, then removed). As root the copies are made in a
	// private tmpfs mounted on it, the medium the server keeps its layers on (a mount
	// namespace of the measuring thread's own, so nothing is left mounted whatever happens to
	// the process); otherwise on Dir's own filesystem, and the result says which.
	Dir string
	// Files is the number of files of the image. Default 10,000.
	Files int
	// FileSize is the size of an unchanged file. Default 4 KiB.
	FileSize int
	// Changed is the number of files changed since the checkpoint. Default 1,000.
	Changed int
	// ChangedBytes is the total size of the changed files. Default 50 MB.
	ChangedBytes int64
	// Rounds is the number of timed rollbacks of each kind; the median is reported. Default 5.
	Rounds int
}

// Validate checks the config and fills in defaults.
func (c *FullCopyConfig) Validate() error {
	if c.Dir == "" {
		return fmt.Errorf("full copy needs a scratch dir: %w", ErrInvalid)
	}
	if c.Files == 0 {
		c.Files = 10_000
	}
	if c.FileSize == 0 {
		c.FileSize = 4096
	}
	if c.Changed == 0 {
		c.Changed = 1000
	}
	if c.ChangedBytes == 0 {
		c.ChangedBytes = 50_000_000
	}
	if c.Rounds == 0 {
		c.Rounds = 5
	}
	if c.Changed > c.Files || c.Files < 1 || c.Rounds < 1 {
		return fmt.Errorf("full copy: %d changed of %d files, %d rounds: %w", c.Changed, c.Files, c.Rounds, ErrInvalid)
	}
	return nil
}

// FullCopyResult is the baseline: how long a rollback takes by copying the whole root back
// from a saved copy, and by copying back only the changed files (an "upper-only" copy).
type FullCopyResult struct {
	Files        int   `json:"files"`
	Changed      int   `json:"changed_files"`
	ChangedBytes int64 `json:"changed_bytes"`
	RootBytes    int64 `json:"root_bytes"`
	// Medium is the filesystem the copies were made on: "tmpfs" (as the server's layers), or
	// Dir's own when no tmpfs could be mounted.
	Medium        string    `json:"medium"`
	WholeRootMs   float64   `json:"whole_root_copy_ms"`
	UpperOnlyMs   float64   `json:"upper_only_copy_ms"`
	WholeRootRuns []float64 `json:"whole_root_copy_runs_ms"`
	UpperOnlyRuns []float64 `json:"upper_only_copy_runs_ms"`
	// SoloRestoreP50Ms is the p50 of Restore with one sandbox and no other load from this
	// run (measured right after the copies): the service time the copies compare with.
	SoloRestoreP50Ms float64 `json:"solo_restore_p50_ms,omitempty"`
	SoloRestoreP99Ms float64 `json:"solo_restore_p99_ms,omitempty"`
	// WholeRootRatio and UpperOnlyRatio are the copy times over SoloRestoreP50Ms.
	WholeRootRatio float64 `json:"whole_root_over_restore,omitempty"`
	UpperOnlyRatio float64 `json:"upper_only_over_restore,omitempty"`
}

// SetSoloRestore records the unloaded restore latency and the ratios against it.
func (fc *FullCopyResult) SetSoloRestore(p50, p99 float64) {
	fc.SoloRestoreP50Ms, fc.SoloRestoreP99Ms = p50, p99
	if p50 > 0 {
		fc.WholeRootRatio, fc.UpperOnlyRatio = fc.WholeRootMs/p50, fc.UpperOnlyMs/p50
	}
}

// MeasureFullCopy builds the image, a saved checkpoint (whole root) and its changed files,
// then times rollbacks by copy. Page cache is warm for both kinds (the fair, fast case).
func MeasureFullCopy(ctx context.Context, cfg FullCopyConfig) (*FullCopyResult, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	scratch, err := os.MkdirTemp(cfg.Dir, "fullcopy-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(scratch)
	type result struct {
		res *FullCopyResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		// The thread is left locked: it ends with the goroutine, and its mount namespace
		// (with the tmpfs) with it.
		runtime.LockOSThread()
		medium := onTmpfs(scratch, 4*(int64(cfg.Files)*int64(cfg.FileSize)+cfg.ChangedBytes))
		res, err := copyRollbacks(ctx, cfg, scratch)
		if res != nil {
			res.Medium = medium
		}
		done <- result{res, err}
	}()
	r := <-done
	return r.res, r.err
}

// onTmpfs mounts a tmpfs of up to size bytes on dir in a mount namespace of the calling
// thread's own, and returns the filesystem dir is then on.
func onTmpfs(dir string, size int64) string {
	if unix.Unshare(unix.CLONE_NEWNS) == nil && unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "") == nil &&
		unix.Mount("dg-fullcopy", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, fmt.Sprintf("size=%d,mode=0755", size)) == nil {
		return "tmpfs"
	}
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return "unknown"
	}
	switch st.Type {
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4 (no tmpfs: not root)"
	}
	return fmt.Sprintf("filesystem 0x%x (no tmpfs: not root)", st.Type)
}

// copyRollbacks makes the image, a saved checkpoint and the changed files in scratch and
// times the rollbacks by copy.
func copyRollbacks(ctx context.Context, cfg FullCopyConfig, scratch string) (*FullCopyResult, error) {
	saved, upper, root := filepath.Join(scratch, "saved"), filepath.Join(scratch, "upper"), filepath.Join(scratch, "root")
	big := int(cfg.ChangedBytes / int64(cfg.Changed))
	small := make([]byte, cfg.FileSize)
	large := make([]byte, big)
	for i := range large {
		large[i] = byte(i * 7)
	}
	res := &FullCopyResult{Files: cfg.Files, Changed: cfg.Changed, ChangedBytes: int64(big) * int64(cfg.Changed)}
	for i := range cfg.Files {
		rel := fileName(i)
		data := small
		if i%(cfg.Files/cfg.Changed) == 0 && i/(cfg.Files/cfg.Changed) < cfg.Changed {
			data = large
			if err := writeFile(filepath.Join(upper, rel), data); err != nil {
				return nil, err
			}
		}
		if err := writeFile(filepath.Join(saved, rel), data); err != nil {
			return nil, err
		}
		res.RootBytes += int64(len(data))
	}
	if err := copyTree(ctx, saved, root); err != nil {
		return nil, err
	}
	for range cfg.Rounds {
		// Whole root: throw the current root away and copy the checkpoint back.
		start := time.Now()
		if err := os.RemoveAll(root); err != nil {
			return nil, err
		}
		if err := copyTree(ctx, saved, root); err != nil {
			return nil, err
		}
		res.WholeRootRuns = append(res.WholeRootRuns, float64(time.Since(start).Microseconds())/1000)
		// Upper only: copy back just the changed files over the root.
		start = time.Now()
		if err := copyTree(ctx, upper, root); err != nil {
			return nil, err
		}
		res.UpperOnlyRuns = append(res.UpperOnlyRuns, float64(time.Since(start).Microseconds())/1000)
	}
	res.WholeRootMs, res.UpperOnlyMs = median(res.WholeRootRuns), median(res.UpperOnlyRuns)
	return res, nil
}

func (fc *FullCopyResult) writeSummary(w io.Writer, r *Report) {
	fmt.Fprintf(w, "full-copy baseline (%d files, %d changed / %.0f MB, root %.0f MB, copied on %s): whole-root copy %.1f ms, upper-only copy %.1f ms\n",
		fc.Files, fc.Changed, float64(fc.ChangedBytes)/1e6, float64(fc.RootBytes)/1e6, fc.Medium, fc.WholeRootMs, fc.UpperOnlyMs)
	if fc.SoloRestoreP50Ms > 0 {
		fmt.Fprintf(w, "restore with 1 sandbox p50 %.3f ms (p99 %.3f): %.0fx faster than whole-root copy, %.0fx faster than upper-only copy\n",
			fc.SoloRestoreP50Ms, fc.SoloRestoreP99Ms, fc.WholeRootRatio, fc.UpperOnlyRatio)
	}
	if r.Throughput > 0 && fc.WholeRootMs > 0 {
		fmt.Fprintf(w, "rollbacks/s: %.0f here vs %.2f/s by whole-root copy, %.1f/s by upper-only copy (one copier)\n",
			r.Throughput, 1000/fc.WholeRootMs, 1000/fc.UpperOnlyMs)
	}
}

func fileName(i int) string {
	return filepath.Join(fmt.Sprintf("d%03d", i/100), fmt.Sprintf("f%05d", i))
}

func writeFile(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o644)
}

// copyTree copies the regular files and directories of src into dst (replacing files).
func copyTree(ctx context.Context, src, dst string) error {
	return filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		out := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(out, 0o755)
		}
		return copyFile(p, out)
	})
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copying %s: %w", src, err)
	}
	return out.Close()
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
