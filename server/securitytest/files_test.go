package securitytest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/clients/go/deltagym"
)

// hostTargets are a host file that file actions must not read and a host directory they must
// not write into, and what the host's own /proc/self shows (the test process: the server runs
// in it), which a file action resolved on the host would read.
type hostTargets struct {
	secret, landing string
	cmdline         []byte
}

func newHostTargets(t *testing.T) hostTargets {
	t.Helper()
	dir := t.TempDir()
	h := hostTargets{secret: filepath.Join(dir, "host-secret"), landing: filepath.Join(dir, "landing")}
	if err := os.WriteFile(h.secret, []byte("host-only"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(h.landing, 0o777); err != nil {
		t.Fatal(err)
	}
	cmdline, err := os.ReadFile("/proc/self/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	h.cmdline, _, _ = bytes.Cut(cmdline, []byte{0})
	return h
}

// leaked reports whether data a file action read came from the host.
func (h hostTargets) leaked(data []byte) bool {
	return bytes.Contains(data, []byte("host-only")) || bytes.Contains(data, h.cmdline)
}

// check fails t if a write reached the host's landing directory or changed the secret.
func (h hostTargets) check(t *testing.T) {
	t.Helper()
	if entries, err := os.ReadDir(h.landing); err != nil || len(entries) > 0 {
		t.Errorf("writes landed on the host: %v %v", entries, err)
	}
	if data, _ := os.ReadFile(h.secret); string(data) != "host-only" {
		t.Errorf("the host's file changed: %q", data)
	}
}

// refused tells a file action's refusal: an error the caller or the agent can act on
// (invalid_argument, not_found, failed_precondition, permission), never an internal one.
func refused(err error) bool {
	// The sandbox's own filesystem refused it (no such file there, it leaves the filesystem, a
	// permission): an observation of the step.
	var ae *deltagym.ActionError
	if errors.As(err, &ae) {
		return true
	}
	switch connect.CodeOf(err) {
	case connect.CodeInvalidArgument, connect.CodeNotFound, connect.CodeFailedPrecondition, connect.CodePermissionDenied:
		return true
	}
	return false
}

// Path traversal: read_file and write_file with .., absolute paths of the host, symlinks to the
// root, up the tree, and through /proc's magic links all resolve inside the sandbox's root (or
// are refused), on a sandbox with a running root and on one whose root a restore left pending.
func TestAttackPathTraversal(t *testing.T) {
	s := begin(t)
	h := newHostTargets(t)
	sb := s.sandbox(t)
	s.sh(t, sb, "mkdir -p /esc; ln -s / /esc/root; ln -s ../../../../../../../.. /esc/up; "+
		"ln -s /proc/1/root /esc/magic; ln -s /proc/self/root /esc/self; ln -s "+h.secret+" /esc/abs; "+
		"ln -s "+h.landing+" /esc/land")
	var reads, writes []string
	for _, prefix := range []string{"", "../../../../../../../..", "/../../..", "/esc/root", "/esc/up", "/esc/magic",
		"/esc/self", "/proc/self/root", "/proc/1/root", "/proc/self/cwd/../../../..", "/work/../../../.."} {
		reads = append(reads, prefix+h.secret)
		writes = append(writes, prefix+h.landing+"/f")
	}
	reads = append(reads, "/esc/abs", "/proc/self/cmdline", "/proc/self/environ", "/proc/1/environ",
		"/proc/self/fd/0", "/proc/self/exe", "/proc/thread-self/comm", "/dev/zero", "/sys/kernel/hostname")
	writes = append(writes, "/esc/land/f", "/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger",
		"/proc/self/mem", "/proc/self/fd/1", "/dev/null/x", "/sys/kernel/uevent_helper")
	attempt := func(t *testing.T, sb *deltagym.Sandbox) {
		for _, p := range reads {
			res, err := sb.ReadFile(t.Context(), p)
			switch {
			case err == nil && h.leaked(res.Content):
				t.Errorf("ReadFile %s reached the host: %.80q", p, res.Content)
			case err != nil && !refused(err):
				t.Errorf("ReadFile %s: %v, want a refusal or a file of the sandbox", p, err)
			}
		}
		for _, p := range writes {
			_, err := sb.WriteFile(t.Context(), p, []byte("|/tmp/escaped"))
			if err != nil && !refused(err) {
				t.Errorf("WriteFile %s: %v, want a refusal or a write inside", p, err)
			}
		}
		h.check(t)
		// The plain host path was written inside, as the sandbox's own file.
		if res, err := sb.ReadFile(t.Context(), h.landing+"/f"); err != nil || string(res.Content) != "|/tmp/escaped" {
			t.Errorf("the sandbox's %s/f: %v %q", h.landing, err, content(res))
		}
	}
	// Each way in: Connect and gRPC, on a running root and on one a restore with no process to
	// bring back left pending.
	for _, api := range []struct {
		name string
		sb   *deltagym.Sandbox
	}{{"connect", sb}, {"grpc", s.grpc.Sandbox(sb.ID())}} {
		t.Run(api.name+"/running root", func(t *testing.T) { attempt(t, api.sb) })
		s.reset(t, sb)
		s.sh(t, sb, "true")
		if _, err := sb.Restore(t.Context(), sb.StartCheckpointID()); err != nil {
			t.Fatal(err)
		}
		t.Run(api.name+"/pending root", func(t *testing.T) { attempt(t, api.sb) })
		s.sh(t, sb, "true")
	}
}

// Symlink swap: while a loop in the sandbox swaps a symlink between a directory of the sandbox
// and the root, a host path, /proc/self/root and a path up the tree, read_file and write_file
// through it only ever reach files of the sandbox.
func TestAttackSymlinkSwap(t *testing.T) {
	s := begin(t)
	h := newHostTargets(t)
	sb := s.sandbox(t)
	// The host's paths exist inside too (as directories of the sandbox): a write through a
	// swap to them lands inside, where it is looked for.
	s.sh(t, sb, "mkdir -p /race/dir "+h.landing+" /race"+h.landing+"; ln -s /race/dir /race/l; echo inside > /race/dir/host-secret")
	// Each swap renames over the link, so /race/l always exists.
	flip := "while :; do for t in /race/dir " + h.landing + " / /proc/self/root ../../../../..; do ln -sfn $t /race/n && mv -fT /race/n /race/l; done; done"
	s.exec(t, sb, flip, deltagym.InBackground())
	const rounds = 300
	wrote, refusedN := 0, 0
	for i := range rounds {
		name := fmt.Sprintf("/race/l/f%d", i%8)
		_, err := sb.WriteFile(t.Context(), name, []byte("race"))
		switch {
		case err == nil:
			wrote++
		case refused(err):
			refusedN++
		default:
			t.Fatalf("WriteFile %s: %v", name, err)
		}
		for _, p := range []string{"/race/l" + h.secret, "/race/l/host-secret"} {
			res, err := sb.ReadFile(t.Context(), p)
			if err == nil && h.leaked(res.Content) {
				t.Fatalf("ReadFile %s through the swapping link reached the host", p)
			}
			if err != nil && !refused(err) {
				t.Fatalf("ReadFile %s: %v", p, err)
			}
		}
	}
	s.checkCanary(t) // while the swaps go on
	h.check(t)
	if wrote == 0 {
		t.Fatalf("no write went through the swapping link (%d refused): the race was not run", refusedN)
	}
	out := s.sh(t, sb, "ls /race/dir "+h.landing+" / | grep -c '^f[0-7]$' || true")
	if strings.TrimSpace(out) == "0" {
		t.Errorf("%d writes went through, none inside the sandbox", wrote)
	}
	s.reset(t, sb) // ends the swapping loop
	t.Logf("%d writes through the swapping link landed inside, %d were refused", wrote, refusedN)
}

func content(r *deltagym.ReadResult) []byte {
	if r == nil {
		return nil
	}
	return r.Content
}
