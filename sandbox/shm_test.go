package sandbox_test

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// shmListing describes the sandbox's /dev/shm as the host sees it, one line
// an entry, sorted: the name (quoted), type, mode, owner relative to the
// sandbox's id range, modification time, and a regular file's size and
// digest or a symlink's target. The root's own mode and owner come first.
func shmListing(t testing.TB, s *sandbox.Sandbox) []string {
	t.Helper()
	base := fmt.Sprintf("/proc/%d/root/dev/shm", s.InitPid())
	um, err := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", s.InitPid()))
	if err != nil {
		t.Fatal(err)
	}
	hostID, _ := strconv.Atoi(strings.Fields(string(um))[1])
	var out []string
	err = filepath.WalkDir(base, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		line := fmt.Sprintf("%q %v %d:%d", strings.TrimPrefix(p, base), fi.Mode(), int(st.Uid)-hostID, int(st.Gid)-hostID)
		if p != base {
			line += fmt.Sprintf(" mtime=%d", fi.ModTime().UnixNano())
		}
		switch {
		case fi.Mode().IsRegular():
			sum, err := dataDigest(p)
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" size=%d blocks=%d data=%s", fi.Size(), st.Blocks, sum)
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + target
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// dataDigest digests the data regions of file p (a sparse file's holes
// are not read), with their offsets.
func dataDigest(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	for off := int64(0); ; {
		data, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return fmt.Sprintf("%x", h.Sum(nil)), nil
		}
		if err != nil {
			return "", err
		}
		hole, err := unix.Seek(int(f.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "@%d:", data)
		if _, err := io.Copy(h, io.NewSectionReader(f, data, hole-data)); err != nil {
			return "", err
		}
		off = hole
	}
}

func sameListing(t testing.TB, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("%s: /dev/shm is\n%s\nwant\n%s", what, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// shmFill makes a /dev/shm of every kind of entry a checkpoint carries, as
// the sandbox's processes would: files of several owners and modes (one its
// user cannot read), a directory tree, a symlink, a FIFO, a sparse file of
// a terabyte, names with a newline and with bytes that are not UTF-8.
const shmFill = `set -e
cd /dev/shm
printf 'segment A' > seg
dd if=/dev/urandom of=rand bs=1k count=300 2>/dev/null
mkdir -p d/e
printf x > d/e/f
chown 1000:1001 d/e/f d
chmod 640 seg
chmod 711 d
printf secret > unreadable
chown 1000 unreadable
chmod 000 unreadable
ln -s /etc/passwd link
mkfifo fifo
dd if=/dev/zero of=sparse bs=1 count=0 seek=1099511627776 2>/dev/null
printf 'tail' >> sparse
printf nl > "$(printf 'new\nline')"
printf odd > "$(printf 'odd\001\377')"
`

// shmMutate changes every entry of shmFill's and adds more.
const shmMutate = `set -e
cd /dev/shm
printf 'segment B' | dd of=seg conv=notrunc 2>/dev/null
rm -rf d rand
ln -s /tmp d
rm fifo
printf 'was a fifo' > fifo
rm link
mkdir link
printf new > link/inside
chmod 644 unreadable
chown 0:0 "$(printf 'new\nline')"
mkdir -p added/deeper
printf x > added/deeper/x
chmod 700 /dev/shm
`

// The sandbox's /dev/shm is part of its checkpoints: a restore in place, a
// restore into another sandbox, a fork and a restore after a restart give
// the sandbox exactly the checkpoint's (files added since removed, changed
// ones back); a checkpoint of an empty /dev/shm has no copy of it.
func TestShmCheckpointRestore(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "touch /f")
	empty, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if l := b.rt.CheckpointShm(empty.ID); l != "" {
		t.Fatalf("a checkpoint of an empty /dev/shm has a copy of it: %s", l)
	}
	emptyListing := shmListing(t, s)
	sh(t, s, shmFill)
	want := shmListing(t, s)
	t.Logf("/dev/shm:\n%s", strings.Join(want, "\n"))
	full, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if b.rt.CheckpointShm(full.ID) == "" {
		t.Fatal("a checkpoint of a full /dev/shm has no copy of it")
	}
	// Once in place: the copy holds what the sandbox had.
	sameListing(t, "after the checkpoint", shmListing(t, s), want)
	for i := range 2 {
		sh(t, s, shmMutate)
		if err := s.Restore(ctx, full.ID); err != nil {
			t.Fatal(err)
		}
		sameListing(t, fmt.Sprintf("restore %d in place", i), shmListing(t, s), want)
	}
	if err := s.Restore(ctx, empty.ID); err != nil {
		t.Fatal(err)
	}
	sameListing(t, "restore of the empty checkpoint", shmListing(t, s), emptyListing)
	other := b.create(t, sandbox.Spec{})
	sh(t, other, "printf mine > /dev/shm/mine")
	if err := other.Restore(ctx, full.ID); err != nil {
		t.Fatal(err)
	}
	sameListing(t, "restore into another sandbox", shmListing(t, other), want)
	kids, err := b.rt.Fork(ctx, full.ID, 2, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range kids {
		t.Cleanup(func() { _ = k.Destroy(ctx) })
		sameListing(t, fmt.Sprintf("fork %d", i), shmListing(t, k), want)
	}
	// The fork's files are its own.
	sh(t, kids[0], "rm -rf /dev/shm/*")
	sameListing(t, "the other fork", shmListing(t, kids[1]), want)
	b.restart(t)
	after := b.create(t, sandbox.Spec{Checkpoint: full.ID})
	sameListing(t, "a sandbox of the checkpoint after a restart", shmListing(t, after), want)
	sh(t, after, shmMutate)
	if err := after.Restore(ctx, full.ID); err != nil {
		t.Fatal(err)
	}
	sameListing(t, "a restore after a restart", shmListing(t, after), want)
}

// A checkpoint taken while processes run has their /dev/shm of the same
// instant as their files, and a checkpoint with nothing changed since
// shares the earlier one's copy.
func TestShmLiveProcesses(t *testing.T) {
	b := setup(t, filesOnly)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	// A counter written to /dev/shm/n, then to /tmp/n (each replaced
	// whole): at any instant /dev/shm/n is /tmp/n or one more.
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Background: true,
		Command: "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/t; mv /dev/shm/t /dev/shm/n; echo $i > /tmp/t; mv /tmp/t /tmp/n; done"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -s /tmp/n ]")
	for range 5 {
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		k := b.create(t, sandbox.Spec{Checkpoint: ck.ID})
		shm, _ := strconv.Atoi(strings.TrimSpace(sh(t, k, "cat /dev/shm/n")))
		tmp, _ := strconv.Atoi(strings.TrimSpace(sh(t, k, "cat /tmp/n")))
		if shm != tmp && shm != tmp+1 {
			t.Fatalf("checkpoint %s: /dev/shm/n holds %d, /tmp/n %d: not of one instant", ck.ID, shm, tmp)
		}
		_ = k.Destroy(ctx)
	}
	if err := s.Restore(ctx, s.Head()); err != nil {
		t.Fatal(err)
	}
	// Nothing ran since the restore: the next checkpoints share its copy.
	head := s.Head()
	for range 2 {
		ck, err := s.Checkpoint(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := b.rt.CheckpointShm(ck.ID), b.rt.CheckpointShm(head); got != want || got == "" {
			t.Fatalf("checkpoint %s has /dev/shm copy %q, want %s's %q", ck.ID, got, head, want)
		}
	}
}

// A sandbox that does its worst on /dev/shm neither breaks the checkpoint
// or the restore nor reaches out of it: symlinks and FIFOs are not followed
// or opened, device nodes are not carried, a tree nested too deep is
// refused and still removed, and /dev/shm's bounds bound the copy.
func TestShmHostile(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	victim := t.TempDir()
	sh(t, s, "mkdir /dev/shm/d && printf in > /dev/shm/d/f && printf a > /dev/shm/a && mkfifo /dev/shm/fifo")
	base, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := shmListing(t, s)
	// The directory and file become symlinks to the host's victim
	// directory (which the sandbox's own root does not have), the file a
	// FIFO, and device nodes are tried (a whiteout may be allowed).
	sh(t, s, fmt.Sprintf(`cd /dev/shm && rm -r d a && ln -s %[1]s d && mkfifo a && ln -s %[1]s/x ln
mknod null c 1 3 || true; mknod wh c 0 0 || true; ls -la /dev/shm`, victim))
	mid, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	sameListing(t, "restore over symlinks and FIFOs", shmListing(t, s), want)
	if err := s.Restore(ctx, mid.ID); err != nil {
		t.Fatal(err)
	}
	for _, l := range shmListing(t, s) {
		if strings.Contains(l, " Dc") {
			t.Errorf("a device node came back: %s", l)
		}
	}
	if ents, _ := os.ReadDir(victim); len(ents) > 0 {
		t.Fatalf("the host's directory behind a symlink was written: %v", ents)
	}
	// Nested deeper than a checkpoint copies: refused, and removed by a
	// restore all the same.
	sh(t, s, "cd /dev/shm && for i in $(seq 200); do mkdir d$i && cd d$i; done && echo deep > f")
	if _, err := s.Checkpoint(ctx); !errors.Is(err, sandbox.ErrUncopyable) {
		t.Fatalf("checkpoint of a /dev/shm nested 200 deep: %v, want ErrUncopyable", err)
	}
	if err := s.Restore(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	sameListing(t, "restore over a deep tree", shmListing(t, s), want)
	// Full: its bytes, then its inodes.
	res, err := s.Exec(ctx, sandbox.ExecRequest{Command: "dd if=/dev/zero of=/dev/shm/fill bs=1M count=100"})
	if err != nil || res.ExitCode == 0 {
		t.Fatalf("filling /dev/shm past its 64 MiB: %v %+v", err, res)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ck.SizeBytes < 60<<20 {
		t.Fatalf("checkpoint of a full /dev/shm: %d bytes", ck.SizeBytes)
	}
	sh(t, s, "rm /dev/shm/fill")
	res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "cd /dev/shm && i=0; while true > n$i; do i=$((i+1)); done 2>/dev/null; echo $i", Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := strconv.Atoi(strings.TrimSpace(string(res.Stdout))); n < 1000 || n > 16384 {
		t.Fatalf("/dev/shm took %d files, want its bound of 16384: %+v", n, res)
	}
	start := time.Now()
	if _, err := s.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	start = time.Now()
	if err := s.Restore(ctx, base.ID); err != nil {
		t.Fatal(err)
	}
	t.Logf("a /dev/shm of %s files: checkpoint %v, restore over it %v", strings.TrimSpace(string(res.Stdout)), took, time.Since(start))
	sameListing(t, "restore over a full /dev/shm", shmListing(t, s), want)
}

// The bytes of a /dev/shm count against the checkpoint budget: a
// checkpoint they would take past it is refused before anything is made.
func TestShmCheckpointBudget(t *testing.T) {
	b := setup(t, func(c *sandbox.Config) { c.CheckpointBudgetBytes = 48 << 20 })
	s := b.create(t, sandbox.Spec{})
	ctx := t.Context()
	sh(t, s, "dd if=/dev/urandom of=/dev/shm/big bs=1M count=30 2>/dev/null")
	if _, err := s.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	if n := b.rt.CheckpointBytes(); n < 30<<20 {
		t.Fatalf("checkpoint bytes %d, want /dev/shm's 30 MiB counted", n)
	}
	sh(t, s, "printf x >> /dev/shm/big")
	mounts := b.rt.LayerMounts()
	if _, err := s.Checkpoint(ctx); !errors.Is(err, sandbox.ErrCap) {
		t.Fatalf("a second checkpoint of 30 MiB of /dev/shm within 48 MiB: %v, want ErrCap", err)
	}
	if m := b.rt.LayerMounts(); m != mounts {
		t.Fatalf("a refused checkpoint left %d layer mounts, had %d", m, mounts)
	}
}

// segPy maps /dev/shm/seg shared (POSIX shared memory as shm_open makes
// it), writes A into it, and copies what its mapping holds to /tmp/seen
// every 10 ms.
const segPy = `import mmap, os, time
fd = os.open('/dev/shm/seg', os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
m[0:1] = b'A'
while True:
    with open('/tmp/seen.new', 'wb') as f:
        f.write(m[0:1])
    os.rename('/tmp/seen.new', '/tmp/seen')
    time.sleep(0.01)
`

// seen returns what s's segPy process reads from its mapping now, and what
// /dev/shm/seg holds.
func seen(t *testing.T, s *sandbox.Sandbox) (mapped, file string) {
	t.Helper()
	sh(t, s, "rm -f /tmp/seen")
	waitFor(t, s, "[ -s /tmp/seen ]")
	return sh(t, s, "cat /tmp/seen"), sh(t, s, "head -c1 /dev/shm/seg")
}

// A process with a segment of /dev/shm mapped comes back mapping it with
// the checkpoint's contents, in the file and in its memory: restored in
// place (a template's copy, whose mapping is the very inode the restore
// rewrote), forked into other sandboxes and restored after a restart
// (CRIU, which maps the file by path), and as a CRIU tree in place.
func TestShmMappedByProcess(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", segPy}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -s /tmp/seen ]")
	change := func(s *sandbox.Sandbox) {
		sh(t, s, "printf B | dd of=/dev/shm/seg conv=notrunc 2>/dev/null")
		if m, f := seen(t, s); m != "B" || f != "B" {
			t.Fatalf("after a write: the mapping holds %q, the file %q", m, f)
		}
	}
	check := func(what string, s *sandbox.Sandbox) {
		t.Helper()
		if m, f := seen(t, s); m != "A" || f != "A" {
			t.Fatalf("%s: the mapping holds %q, the file %q, want the checkpoint's A", what, m, f)
		}
	}
	for _, mode := range []sandbox.ProcessMode{sandbox.ProcessesTemplate, sandbox.ProcessesCRIU} {
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: mode})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("process mode %d: %+v", mode, ck.Processes)
		for i := range 2 {
			change(s)
			if err := s.Restore(ctx, ck.ID); err != nil {
				t.Fatal(err)
			}
			check(fmt.Sprintf("mode %d, restore %d in place", mode, i), s)
		}
		kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = kids[0].Destroy(ctx) })
		check(fmt.Sprintf("mode %d, a fork", mode), kids[0])
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	change(s)
	b.restart(t)
	after := b.create(t, sandbox.Spec{Checkpoint: ck.ID})
	check("after a restart", after)
}

// A file of /dev/shm removed while a process holds it (Python's
// multiprocessing makes its semaphores so) is in no copy of /dev/shm, and
// criu keeps it as a ghost file, which does not restore in a sandbox: a
// durable checkpoint says the process is not saved and why, and its
// template still brings it back in place; a checkpoint in process mode
// criu is refused, saying why.
func TestShmRemovedWhileHeld(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	prog := beatPy("lock", "import multiprocessing\nl = multiprocessing.Lock()")
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -e /tmp/beat-lock ]")
	ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(ck.Processes) != 1 || ck.Processes[0].Saved || !strings.Contains(ck.Processes[0].Unsaved, "ghost file") {
		t.Fatalf("durable checkpoint of a process holding a removed /dev/shm file: %+v, want unsaved", ck.Processes)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	sh(t, s, "rm -f /tmp/beat-lock")
	waitFor(t, s, "[ -e /tmp/beat-lock ]")
	// CRIU cannot bring it back: a checkpoint in process mode criu is
	// refused, saying why, rather than taken and never restored.
	if _, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU}); !errors.Is(err, sandbox.ErrProcesses) || !strings.Contains(err.Error(), "removed while in use") {
		t.Fatalf("CRIU checkpoint of a process holding a removed /dev/shm file: %v, want it refused", err)
	}
}
