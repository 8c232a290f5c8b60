package sandbox_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// fileErrno is err's errno when it is a *sandbox.FileError (the agent's), else 0.
func fileErrno(err error) unix.Errno {
	var fe *sandbox.FileError
	if errors.As(err, &fe) {
		return fe.Errno
	}
	return 0
}

func TestListDirAndStat(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "mkdir -p /l/d/e /l/z; echo hi > /l/d/f; ln -s / /l/root; ln -s /l/d /l/dlink; mkfifo /l/fifo; chmod 4750 /l/d/f; touch /l/z/1 /l/z/2 /l/z/3")

	entries, truncated, err := s.ListDir(ctx, "/l", 1, 0)
	if err != nil || truncated {
		t.Fatalf("ListDir /l: %v, truncated %v", err, truncated)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Path)
	}
	if got := strings.Join(names, " "); got != "d dlink fifo root z" {
		t.Fatalf("ListDir /l depth 1: %q", got)
	}
	if e := entries[3]; e.Type != sandbox.TypeSymlink || e.Target != "/" {
		t.Errorf("the symlink to /: %+v", e)
	}
	if e := entries[2]; e.Type != sandbox.TypeOther {
		t.Errorf("the FIFO: %+v", e)
	}

	// Depth 3 lists the tree below, never through the symlinks.
	entries, _, err = s.ListDir(ctx, "/l", 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	names = names[:0]
	for _, e := range entries {
		names = append(names, e.Path)
		if e.Path == "d/f" && (e.Type != sandbox.TypeFile || e.Size != 3 || e.Mode != 0o4750) {
			t.Errorf("d/f: %+v", e)
		}
	}
	if got := strings.Join(names, " "); got != "d d/e d/f dlink fifo root z z/1 z/2 z/3" {
		t.Fatalf("ListDir /l depth 3: %q", got)
	}

	// max_entries cuts and says so.
	entries, truncated, err = s.ListDir(ctx, "/l", 3, 4)
	if err != nil || !truncated || len(entries) != 4 {
		t.Fatalf("ListDir max 4: %d entries, truncated %v, %v", len(entries), truncated, err)
	}

	// A final symlink of the listed path resolves in the root; a file is ENOTDIR; a missing path ENOENT.
	if entries, _, err = s.ListDir(ctx, "/l/dlink", 1, 0); err != nil || len(entries) != 2 {
		t.Errorf("ListDir /l/dlink: %v, %v", entries, err)
	}
	if _, _, err = s.ListDir(ctx, "/l/d/f", 1, 0); fileErrno(err) != unix.ENOTDIR {
		t.Errorf("ListDir of a file: %v, want ENOTDIR", err)
	}
	if _, _, err = s.ListDir(ctx, "/nope", 1, 0); fileErrno(err) != unix.ENOENT {
		t.Errorf("ListDir of a missing path: %v, want ENOENT", err)
	}
	if _, _, err = s.ListDir(ctx, "/", 1, 0); err != nil {
		t.Errorf("ListDir /: %v", err)
	}
	if _, _, err = s.ListDir(ctx, "/l", -1, 0); !errors.Is(err, sandbox.ErrInvalid) || fileErrno(err) != 0 {
		t.Errorf("negative depth: %v, want ErrInvalid", err)
	}

	for _, tc := range []struct {
		path   string
		exists bool
		typ    sandbox.FileType
	}{
		{"/l/root", true, sandbox.TypeSymlink}, {"/l/d", true, sandbox.TypeDir}, {"/l/d/f", true, sandbox.TypeFile},
		{"/l/nope", false, 0}, {"/l/d/f/below", false, 0}, {"/", true, sandbox.TypeDir}, {"/l/dlink/f", true, sandbox.TypeFile},
	} {
		fi, ok, err := s.Stat(ctx, tc.path)
		if err != nil || ok != tc.exists || fi.Type != tc.typ {
			t.Errorf("Stat %s: %+v, %v, %v; want exists %v type %v", tc.path, fi, ok, err, tc.exists, tc.typ)
		}
	}
	// A path ending in . or .. is the directory it resolves to.
	d, _, _ := s.Stat(ctx, "/l/d")
	sh(t, s, "chmod 700 /l/d/e")
	if fi, ok, err := s.Stat(ctx, "/l/d/e/.."); err != nil || !ok || fi.Type != sandbox.TypeDir || fi.Mode != d.Mode || fi.Size != d.Size {
		t.Errorf("Stat /l/d/e/..: %+v, %v, %v; want /l/d's %+v", fi, ok, err, d)
	}
}

func TestRemoveAndMakeDir(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	canary := filepath.Join(b.dir, "canary")
	if err := os.MkdirAll(filepath.Join(canary, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "mkdir -p /r/tree/a/b /r/empty; touch /r/file /r/tree/a/b/f /r/tree/g; ln -s / /r/root; ln -s "+canary+" /r/host; ln -s / /r/tree/a/root")

	for _, tc := range []struct {
		path      string
		recursive bool
		removed   int64
		errno     unix.Errno
	}{
		{"/r/file", false, 1, 0},
		{"/r/empty", false, 1, 0},
		{"/r/tree", false, 0, unix.ENOTEMPTY},
		{"/r/root", true, 1, 0}, // the link, not what it points to
		{"/r/host/", true, 1, 0},
		{"/r/tree", true, 6, 0},
		{"/r/missing", true, 0, 0},
		{"/r/missing/below", true, 0, 0},
	} {
		n, err := s.Remove(ctx, tc.path, tc.recursive)
		if n != tc.removed || fileErrno(err) != tc.errno || (tc.errno == 0 && err != nil) {
			t.Errorf("Remove %s recursive %v: %d, %v; want %d, errno %v", tc.path, tc.recursive, n, err, tc.removed, tc.errno)
		}
	}
	if out := sh(t, s, "ls /r; ls /bin/busybox"); out != "/bin/busybox\n" {
		t.Errorf("after the removals: %q", out)
	}
	if _, err := os.Stat(filepath.Join(canary, "sub")); err != nil {
		t.Errorf("the host's directory behind a symlink: %v", err)
	}
	for _, p := range []string{"/", "//", "/r/..", "/r/."} {
		if _, err := s.Remove(ctx, p, true); !errors.Is(err, sandbox.ErrInvalid) || fileErrno(err) != 0 {
			t.Errorf("Remove %q: %v, want ErrInvalid", p, err)
		}
	}
	if _, err := s.Remove(ctx, "/proc", true); fileErrno(err) == 0 {
		t.Errorf("Remove /proc (a mount): %v, want a FileError", err)
	}

	for _, tc := range []struct {
		path    string
		mode    os.FileMode
		parents bool
		created bool
		errno   unix.Errno
		perm    string
	}{
		{"/m", 0, false, true, 0, "755"},
		{"/m", 0, false, false, unix.EEXIST, ""},
		{"/m", 0, true, false, 0, "755"},
		{"/m/a/b/c", 0o700, true, true, 0, "700"},
		{"/m/x/y", 0, false, false, unix.ENOENT, ""},
		{"/m/s", 0o777 | os.ModeSticky, false, true, 0, "1777"},
		{"/bin/busybox", 0, true, false, unix.EEXIST, ""},
		{"/bin/busybox/d", 0, true, false, unix.ENOTDIR, ""},
	} {
		created, err := s.MakeDir(ctx, tc.path, tc.mode, tc.parents)
		if created != tc.created || fileErrno(err) != tc.errno || (tc.errno == 0 && err != nil) {
			t.Errorf("MakeDir %s parents %v: %v, %v; want %v, errno %v", tc.path, tc.parents, created, err, tc.created, tc.errno)
			continue
		}
		if tc.perm != "" {
			if out := strings.TrimSpace(sh(t, s, "stat -c %a "+tc.path)); out != tc.perm {
				t.Errorf("MakeDir %s: mode %s, want %s", tc.path, out, tc.perm)
			}
		}
	}
	if _, err := s.MakeDir(ctx, "/m/u", os.ModeSetuid|0o755, false); !errors.Is(err, sandbox.ErrInvalid) {
		t.Errorf("MakeDir with setuid: %v, want ErrInvalid", err)
	}
}

// fileswap builds testdata/fileswap, installs it in s as /fileswap and starts it swapping
// pairs of dir/dK and dir/sK, a directory tree and a symlink to one of targets; the test ends it.
func fileswap(t *testing.T, s *sandbox.Sandbox, dir string, pairs int, targets ...string) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "fileswap")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/fileswap")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building fileswap: %v\n%s", err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(t.Context(), "/fileswap", data, 0o755, false); err != nil {
		t.Fatal(err)
	}
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Argv: append([]string{"/fileswap", dir, strconv.Itoa(pairs)}, targets...), Background: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = s.Exec(context.Background(), sandbox.ExecRequest{Command: "kill " + strconv.Itoa(res.Pid)})
	})
	// Ready once its last pair is there.
	last := dir + "/s" + strconv.Itoa(pairs-1)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if _, ok, err := s.Stat(t.Context(), last); err != nil || ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fileswap did not start")
		}
		runtime.Gosched()
	}
}

// A process of the sandbox that keeps swapping a directory being removed for a symlink (to
// the sandbox's root, and to a directory of the host) makes the removal fail or remove the
// symlink itself: nothing is removed through the symlink.
func TestRemoveRacesSymlinkSwap(t *testing.T) {
	b := setup(t, filesOnly)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	canary := filepath.Join(b.dir, "canary")
	if err := os.MkdirAll(filepath.Join(canary, "keep", "x", "keep"), 0o777); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "mkdir -p /canary/keep/x/keep && touch /canary/keep/f")
	fileswap(t, s, "/v", 64, "/", "/canary", canary)
	removed, failed := 0, 0
	for range 300 {
		n, err := s.Remove(ctx, "/v", true)
		if err != nil && fileErrno(err) == 0 {
			t.Fatalf("Remove /v: %v, want success or a FileError", err)
		}
		if err != nil {
			failed++
		}
		removed += int(n)
	}
	t.Logf("removed %d paths; %d removals failed", removed, failed)
	if removed == 0 {
		t.Fatal("nothing was removed: the race was not run")
	}
	if out := sh(t, s, "ls /bin/busybox; find /canary | sort"); out != "/bin/busybox\n/canary\n/canary/keep\n/canary/keep/f\n/canary/keep/x\n/canary/keep/x/keep\n" {
		t.Errorf("the sandbox's own files after the race: %q", out)
	}
	if _, err := os.Stat(filepath.Join(canary, "keep", "x", "keep")); err != nil {
		t.Errorf("the host's directory after the race: %v", err)
	}
}
