package sandbox_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// CopyFrom copies regular files and directories between sandboxes, replacing what the
// destination has, owned by the destination's user with the source's permission bits; it
// refuses symlinks (at or on the way to a path), FIFOs, sockets, devices and copies past its
// caps, and skips what the source lacks. CopyDirIn copies a host directory the same way.
func TestCopy(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	src, dst, user := b.create(t, sandbox.Spec{}), b.create(t, sandbox.Spec{}), b.create(t, sandbox.Spec{UID: 1000, GID: 1000})
	sh(t, src, "mkdir -p /work/tree/a/b && echo hi > /work/tree/a/b/f && chmod 4751 /work/tree/a/b/f && echo top > /work/top && chmod 700 /work/tree/a")
	sh(t, dst, "mkdir -p /work/tree/old /work/keep && echo old > /work/tree/old/x && echo kept > /work/keep/k")
	st, err := dst.CopyFrom(ctx, src, []string{"/work/tree", "/work/top", "/work/missing", "/work/keep/k/none"}, sandbox.CopyLimits{})
	if err != nil || st.Entries != 5 || st.Bytes != 7 {
		t.Fatalf("copy: %+v, %v", st, err)
	}
	if out := sh(t, dst, "find /work | sort; stat -c '%a %u %g' /work/tree/a /work/tree/a/b/f; cat /work/tree/a/b/f /work/top /work/keep/k"); out !=
		"/work\n/work/keep\n/work/keep/k\n/work/top\n/work/tree\n/work/tree/a\n/work/tree/a/b\n/work/tree/a/b/f\n700 0 0\n751 0 0\nhi\ntop\nkept\n" {
		t.Fatalf("the copy in the destination:\n%s", out)
	}
	secret := filepath.Join(b.dir, "host-secret")
	if err := os.WriteFile(secret, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	sh(t, src, "ln -s /etc/passwd /work/link; mkdir -p /work/d && ln -s /work/top /work/d/l; ln -s /work/tree /work/via; mkfifo /work/fifo; ln -s "+secret+" /work/host")
	for _, tc := range []struct{ path, why string }{
		{"/work/link", "a symbolic link"},
		{"/work/d", "/work/d/l is a symbolic link"},
		{"/work/via/a", "symbolic link or another filesystem on its way"},
		{"/work/fifo", "a FIFO"},
		{"/work/host", "a symbolic link"},
		{"/dev/null", "on its way"}, // /dev is a mount of its own
	} {
		_, err := dst.CopyFrom(ctx, src, []string{tc.path}, sandbox.CopyLimits{})
		if !errors.Is(err, sandbox.ErrUncopyable) || !strings.Contains(err.Error(), tc.why) {
			t.Errorf("copy of %s: %v, want a refusal saying %q", tc.path, err, tc.why)
		}
	}
	if _, err := dst.CopyFrom(ctx, src, []string{"/work/tree"}, sandbox.CopyLimits{MaxBytes: 2}); !errors.Is(err, sandbox.ErrUncopyable) {
		t.Errorf("copy past the byte cap: %v", err)
	}
	if _, err := dst.CopyFrom(ctx, src, []string{"/work/tree"}, sandbox.CopyLimits{MaxEntries: 3}); !errors.Is(err, sandbox.ErrUncopyable) {
		t.Errorf("copy past the entry cap: %v", err)
	}
	for _, p := range []string{"work", "/", "/work/../etc", "/work/"} {
		if _, err := dst.CopyFrom(ctx, src, []string{p}, sandbox.CopyLimits{}); !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("copy of %q: %v, want ErrInvalid", p, err)
		}
	}
	host := t.TempDir()
	if err := os.WriteFile(filepath.Join(host, "check.sh"), []byte("echo 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	dir, err := os.Open(host)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	if _, err := user.CopyDirIn(ctx, dir, "/opt/verifier", sandbox.CopyLimits{}); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, user, "stat -c '%a %u' /opt/verifier/check.sh; sh /opt/verifier/check.sh"); out != "755 1000\n1\n" {
		t.Fatalf("the host directory in the sandbox: %q", out)
	}
}
