package sandbox_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
)

// FuzzFilePath runs ReadFile and WriteFile on untrusted paths in a sandbox laid out with the
// ways out an attacker would plant (symlinks to the root, up the tree, to a host path, through
// /proc's magic links). @SECRET@ and @LANDING@ in a path stand for a host file the sandbox must
// not read and a host directory it must not write into (each also exists inside the sandbox,
// where it may). Whatever the path, the host is untouched, and an error is one of the file
// actions' classes (ErrInvalid, ErrNotFound, ErrBudget), never a raw errno.
func FuzzFilePath(f *testing.F) {
	b := setup(f)
	s := b.create(f, sandbox.Spec{})
	secret := filepath.Join(b.dir, "host-secret")
	landing := filepath.Join(b.dir, "landing")
	if err := os.WriteFile(secret, []byte("host-only"), 0o600); err != nil {
		f.Fatal(err)
	}
	if err := os.Mkdir(landing, 0o755); err != nil {
		f.Fatal(err)
	}
	sh(f, s, "mkdir -p /esc/d "+landing+"; echo inside > /esc/d/file; ln -s / /esc/root; "+
		"ln -s ../../../../../../../.. /esc/up; ln -s /proc/1/root /esc/magic; ln -s /proc/self/root /esc/self; "+
		"ln -s "+secret+" /esc/abs; ln -s "+landing+" /esc/land; ln -s loop /esc/loop; mkfifo /esc/fifo")
	f.Fuzz(func(t *testing.T, path string, write bool) {
		path = strings.ReplaceAll(path, "@SECRET@", secret)
		path = strings.ReplaceAll(path, "@LANDING@", landing)
		var err error
		if write {
			err = s.WriteFile(t.Context(), path, []byte("fuzz"), 0, false)
		} else {
			var data []byte
			data, _, err = s.ReadFile(t.Context(), path, 0, 4096)
			if bytes.Contains(data, []byte("host-only")) {
				t.Fatalf("ReadFile %q reached the host's file", path)
			}
		}
		if err != nil && !errors.Is(err, sandbox.ErrInvalid) && !errors.Is(err, sandbox.ErrNotFound) && !errors.Is(err, sandbox.ErrBudget) {
			t.Fatalf("%q (write %v): %v, want ErrInvalid, ErrNotFound or ErrBudget", path, write, err)
		}
		if entries, err := os.ReadDir(landing); err != nil || len(entries) > 0 {
			t.Fatalf("%q (write %v) landed on the host: %v %v", path, write, entries, err)
		}
		if data, _ := os.ReadFile(secret); string(data) != "host-only" {
			t.Fatalf("%q (write %v) changed the host's file: %q", path, write, data)
		}
	})
}
