package imagetest

import (
	"archive/tar"
	"debug/elf"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BusyboxPath is where Debian's busybox-static installs its binary.
const BusyboxPath = "/bin/busybox"

// AgentUID and AgentGID are the ids of the unprivileged user "agent" in Busybox's /etc/passwd.
const AgentUID, AgentGID = 1000, 1000

// Busybox returns a fresh root filesystem directory in t.TempDir holding Debian's static
// busybox as /bin/busybox with a symlink in /bin for every applet (sh, ls, cat, mount, …);
// /proc /dev /tmp /etc /root /run /sys /home; and /etc/passwd and /etc/group naming root (0)
// and agent (1000). Run as root, everything is owned by root except /home/agent. If the
// static busybox is missing, it runs scripts/deps.sh image to install it.
func Busybox(t testing.TB) string {
	t.Helper()
	bin := staticBusybox(t)
	root := t.TempDir()
	mustDo(t, os.Chmod(root, 0o755))
	for _, d := range []struct {
		name string
		mode uint32
	}{
		{"bin", 0o755}, {"proc", 0o555}, {"dev", 0o755}, {"tmp", 0o1777}, {"etc", 0o755},
		{"root", 0o700}, {"run", 0o755}, {"sys", 0o555}, {"home", 0o755}, {"home/agent", 0o755},
		{"usr", 0o755}, {"usr/bin", 0o755}, {"var", 0o755}, {"var/tmp", 0o1777},
	} {
		p := filepath.Join(root, d.name)
		mustDo(t, os.Mkdir(p, 0o700))
		mustDo(t, unix.Chmod(p, d.mode)) // past the umask; unix modes keep the sticky bit
	}
	data, err := os.ReadFile(bin)
	mustDo(t, err)
	mustDo(t, os.WriteFile(filepath.Join(root, "bin/busybox"), data, 0o755))
	for _, applet := range applets(t, bin) {
		if applet == "busybox" {
			continue
		}
		mustDo(t, os.Symlink("busybox", filepath.Join(root, "bin", applet)))
	}
	mustDo(t, os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(
		"root:x:0:0:root:/root:/bin/sh\n"+
			"agent:x:1000:1000:agent:/home/agent:/bin/sh\n"+
			"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"), 0o644))
	mustDo(t, os.WriteFile(filepath.Join(root, "etc/group"), []byte(
		"root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n"), 0o644))
	mustDo(t, os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("sandbox\n"), 0o644))
	if os.Geteuid() == 0 {
		mustDo(t, os.Chown(filepath.Join(root, "home/agent"), AgentUID, AgentGID))
	}
	return root
}

// staticBusybox returns the path of a statically linked busybox, installing it if needed.
func staticBusybox(t testing.TB) string {
	t.Helper()
	if isStatic(BusyboxPath) {
		return BusyboxPath
	}
	_, file, _, _ := runtime.Caller(0)
	deps := filepath.Join(filepath.Dir(file), "..", "..", "..", "scripts", "deps.sh")
	out, err := exec.Command(deps, "image").CombinedOutput()
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("static busybox missing and cannot be installed without root (run scripts/deps.sh image): %s", out)
		}
		t.Fatalf("installing busybox-static with %s: %v\n%s", deps, err, out)
	}
	if !isStatic(BusyboxPath) {
		t.Fatalf("%s is not a statically linked busybox after scripts/deps.sh image", BusyboxPath)
	}
	return BusyboxPath
}

func isStatic(p string) bool {
	f, err := elf.Open(p)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return false
		}
	}
	return true
}

func applets(t testing.TB, bin string) []string {
	t.Helper()
	out, err := exec.Command(bin, "--list").Output()
	if err != nil {
		t.Fatalf("listing busybox applets: %v", err)
	}
	var names []string
	for _, n := range strings.Fields(string(out)) {
		if n != "" && !strings.ContainsAny(n, "/.") {
			names = append(names, n)
		}
	}
	return names
}

// LayerFromDir returns the files below root as an uncompressed layer, keeping owners, modes,
// times, symlinks, hardlinks, device nodes and fifos. Use it to make an image of Busybox.
func LayerFromDir(t testing.TB, root string) Layer {
	t.Helper()
	var l Layer
	seen := map[[2]uint64]string{}
	err := filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		e := Entry{Name: filepath.ToSlash(rel), Mode: int64(st.Mode & 0o7777), UID: int(st.Uid), GID: int(st.Gid)}
		e.ModTime = timeOf(st.Mtim)
		typ := st.Mode & unix.S_IFMT
		if typ != unix.S_IFDIR && st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := seen[key]; ok {
				l.Entries = append(l.Entries, Entry{Name: e.Name, Type: tar.TypeLink, Linkname: first})
				return nil
			}
			seen[key] = e.Name
		}
		switch typ {
		case unix.S_IFDIR:
			e.Type = tar.TypeDir
		case unix.S_IFREG:
			e.Type = tar.TypeReg
			if e.Data, err = os.ReadFile(p); err != nil {
				return err
			}
		case unix.S_IFLNK:
			e.Type = tar.TypeSymlink
			if e.Linkname, err = os.Readlink(p); err != nil {
				return err
			}
		case unix.S_IFCHR, unix.S_IFBLK:
			e.Type = tar.TypeChar
			if typ == unix.S_IFBLK {
				e.Type = tar.TypeBlock
			}
			e.Major, e.Minor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
		case unix.S_IFIFO:
			e.Type = tar.TypeFifo
		default:
			return nil
		}
		l.Entries = append(l.Entries, e)
		return nil
	})
	if err != nil {
		t.Fatalf("reading %s into a layer: %v", root, err)
	}
	return l
}

func mustDo(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func timeOf(ts unix.Timespec) time.Time { return time.Unix(ts.Unix()) }
