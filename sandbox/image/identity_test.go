package image

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The default image's build (scripts/build-default-image.sh) gives the rootfs the host name
// "sandbox" (or the one it names) and localhost entries in /etc/hosts, in place of what mmdebstrap leaves (the build
// host's name, no hosts file), keeps a hosts file the build made, and replaces a symbolic link
// at either path rather than writing through it.
func TestImageIdentity(t *testing.T) {
	script, err := filepath.Abs("../../scripts/image-identity.sh")
	if err != nil {
		t.Fatal(err)
	}
	run := func(root string) {
		t.Helper()
		if out, err := exec.Command(script, root).CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", script, root, err, out)
		}
	}
	read := func(p string) string {
		t.Helper()
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	host, _ := os.Hostname()
	// As mmdebstrap leaves it: the build host's name, no hosts.
	root := t.TempDir()
	etc := filepath.Join(root, "etc")
	check(os.Mkdir(etc, 0o755))
	check(os.WriteFile(filepath.Join(etc, "hostname"), []byte(host+"\n"), 0o644))
	run(root)
	if got := read(filepath.Join(etc, "hostname")); got != "sandbox\n" {
		t.Fatalf("/etc/hostname %q, want sandbox", got)
	}
	if got := read(filepath.Join(etc, "hosts")); got != "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n" {
		t.Fatalf("/etc/hosts %q, want the localhost entries", got)
	}
	// A hosts file of the build's own stays; links are replaced, their targets untouched.
	check(os.WriteFile(filepath.Join(etc, "hosts"), []byte("10.0.0.1 db\n"), 0o644))
	outside := filepath.Join(t.TempDir(), "outside")
	check(os.WriteFile(outside, []byte("host's\n"), 0o644))
	check(os.Remove(filepath.Join(etc, "hostname")))
	check(os.Symlink(outside, filepath.Join(etc, "hostname")))
	run(root)
	if got := read(filepath.Join(etc, "hosts")); got != "10.0.0.1 db\n" {
		t.Fatalf("/etc/hosts %q, want the build's own kept", got)
	}
	if got, fi := read(outside), must(os.Lstat(filepath.Join(etc, "hostname"))); got != "host's\n" || !fi.Mode().IsRegular() {
		t.Fatalf("a symlinked /etc/hostname was written through (%q) or kept (%v)", got, fi.Mode())
	}
	check(os.Remove(filepath.Join(etc, "hosts")))
	check(os.Symlink(outside, filepath.Join(etc, "hosts")))
	run(root)
	if got, fi := read(outside), must(os.Lstat(filepath.Join(etc, "hosts"))); got != "host's\n" || !fi.Mode().IsRegular() {
		t.Fatalf("a symlinked /etc/hosts was written through (%q) or kept (%v)", got, fi.Mode())
	}
	// A second argument names the host (the node image's root is "deltagym-node").
	if out, err := exec.Command(script, root, "deltagym-node").CombinedOutput(); err != nil {
		t.Fatalf("%s %s deltagym-node: %v\n%s", script, root, err, out)
	}
	if got := read(filepath.Join(etc, "hostname")); got != "deltagym-node\n" {
		t.Fatalf("/etc/hostname %q, want deltagym-node", got)
	}
}
