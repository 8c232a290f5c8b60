package sandbox

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox/layers"
	"github.com/deltagym/deltagym/sandbox/procstate"
)

// The processes digest covers what a checkpoint's capture describes stably, process by
// process in the capture's order (templates first, then the CRIU trees' processes): the
// command (a live template's whole command line, else its name), its working directory, its
// open files with their flags and offsets, its session, and its memory: a template's private
// writable mappings, their pages of their own (memWalk) read through /proc/PID/mem while it is
// held frozen, within the checkpoint's procBudget, but for the bytes
// the kernel wrote that are not the program's (procstate.Template.KernelWrites: each thread's
// rseq CPU and node fields, the time left an interrupted sleep or select wrote back), so that a
// process at rest checkpointed twice hashes alike; or, for a CRIU tree and for a template whose
// process is no longer held, the contents of its CRIU images (which hold its memory, registers
// and the parent links of the tree) but for criu's statistics and logs. Pids are not hashed for
// templates (a copy comes back with another); a CRIU tree's are part of its images, as it comes
// back with them.

// procInput is what the processes digest reads of one captured process.
type procInput struct {
	pid     int
	comm    string
	cwd     string
	session string
	files   []procstate.File
	// hostPid and start name a template held frozen (0: none to read);
	// masks are the ranges of its memory the kernel wrote, left out.
	hostPid int
	start   uint64
	masks   []procstate.Span
	// images is the directory of the CRIU images that hold the process ("": none); unit
	// tells the processes of one tree apart.
	images string
	unit   int
}

// procSum is one process as a diff compares it.
type procSum struct {
	pid                int
	command, cwd, file string
	mem                [32]byte
}

// procInputs lists c's processes; live says the sandbox holding its templates is alive.
// Called with Runtime.mu held (TplImages may change).
func procInputs(c *checkpoint, live bool) []procInput {
	var out []procInput
	for i, t := range c.Procs {
		p := procInput{pid: t.NSPid, comm: t.Comm, cwd: t.Cwd, session: t.Session, files: slices.Clone(t.Files), unit: -1}
		if live {
			p.hostPid, p.start, p.masks = t.HostPid, t.Start, t.KernelWrites
		}
		if i < len(c.TplImages) && c.TplImages[i].Dir != "" {
			p.images = c.TplImages[i].Dir
		}
		out = append(out, p)
	}
	for ui, u := range c.Images {
		for _, up := range u.Procs {
			out = append(out, procInput{pid: up.NSPid, comm: up.Comm, session: u.Session, images: u.Dir, unit: ui})
		}
	}
	return out
}

// processDigest summarises each process and returns the digest over them ("" for none). Past
// b, it returns errOverBudget with the summaries and a digest that equals no other
// (unequalDigest): the processes left unhashed get memory sums that equal no other either.
func processDigest(in []procInput, b *procBudget, canceled func() error) ([]procSum, string, error) {
	if len(in) == 0 {
		return nil, "", nil
	}
	h := sha256.New()
	io.WriteString(h, "deltagym-processes-3\n")
	sums := make([]procSum, 0, len(in))
	imgs := map[string][32]byte{}
	var over error
	for i, p := range in {
		if err := canceled(); err != nil {
			return nil, "", err
		}
		s := procSum{pid: p.pid, command: p.comm, cwd: p.cwd}
		var files strings.Builder
		for _, f := range slices.SortedFunc(slices.Values(p.files), func(a, b procstate.File) int { return a.FD - b.FD }) {
			fmt.Fprintf(&files, "%d %d:%s flags=%#o pos=%d\n", f.FD, len(f.Path), f.Path, f.Flags, f.Pos)
		}
		s.file = files.String()
		var mem [32]byte
		var cmd string
		ok := false
		if over == nil {
			var err error
			mem, cmd, ok, err = templateMemory(p.hostPid, p.start, p.masks, b, canceled)
			switch {
			case errors.Is(err, errOverBudget):
				over = err
			case err != nil:
				return nil, "", err
			}
		}
		switch {
		case over != nil:
			_, _ = rand.Read(s.mem[:])
		case ok:
			s.mem = mem
			if cmd != "" {
				s.command = cmd
			}
		case p.images != "":
			sum, seen := imgs[p.images]
			if !seen {
				var err error
				if sum, err = imagesHash(p.images); err != nil {
					_, _ = rand.Read(sum[:]) // unread: equal to no other
				}
				imgs[p.images] = sum
			}
			s.mem = sum
		default:
			// Nothing to read it from: equal to no other, so that no
			// dedupe takes one process for another.
			_, _ = rand.Read(s.mem[:])
		}
		fmt.Fprintf(h, "%d\x00%d\x00%q\x00%q\x00%q\x00%q\x00", i, p.unit, s.command, s.cwd, p.session, s.file)
		h.Write(s.mem[:])
		sums = append(sums, s)
	}
	if over != nil {
		return sums, unequalDigest(), over
	}
	return sums, layers.DigestOf(h), nil
}

// templateMemory hashes the private writable mappings of template hostPid (started at start):
// their ranges, names and pages of their own (memWalk), but the bytes of masks
// (procstate.Template.KernelWrites, which the kernel wrote and the program did not: the ranges
// are hashed, their contents read as zeros), and its command line, which it returns; ok is
// false if it is not there. err is b's (errOverBudget) or canceled's.
func templateMemory(hostPid int, start uint64, masks []procstate.Span, b *procBudget, canceled func() error) (sum [32]byte, cmdline string, ok bool, err error) {
	if hostPid <= 0 {
		return sum, "", false, nil
	}
	if st, err := procstate.StartTime(hostPid); err != nil || st != start {
		return sum, "", false, nil
	}
	base := "/proc/" + strconv.Itoa(hostPid)
	cl, err := os.ReadFile(base + "/cmdline")
	if err != nil {
		return sum, "", false, nil
	}
	maps, err := os.ReadFile(base + "/maps")
	if err != nil {
		return sum, "", false, nil
	}
	mem, err := os.Open(base + "/mem")
	if err != nil {
		return sum, "", false, nil
	}
	defer mem.Close()
	pagemap, err := os.Open(base + "/pagemap")
	if err != nil {
		return sum, "", false, nil
	}
	defer pagemap.Close()
	h := sha256.New()
	var rec [16]byte
	binary.LittleEndian.PutUint64(rec[:], uint64(len(cl)))
	h.Write(rec[:8])
	h.Write(cl)
	binary.LittleEndian.PutUint64(rec[:], uint64(len(masks)))
	h.Write(rec[:8])
	for _, m := range masks {
		binary.LittleEndian.PutUint64(rec[:], m.Addr)
		binary.LittleEndian.PutUint64(rec[8:], m.Len)
		h.Write(rec[:])
	}
	w := newMemWalk(h, mem, pagemap, masks, b, canceled)
	sc := bufio.NewScanner(bytes.NewReader(maps))
	for sc.Scan() {
		if err := w.mapping(sc.Text()); err != nil {
			if errors.Is(err, errOverBudget) || canceled() != nil {
				return sum, "", false, err
			}
			return sum, "", false, nil
		}
	}
	if st, err := procstate.StartTime(hostPid); err != nil || st != start {
		return sum, "", false, nil
	}
	h.Sum(sum[:0])
	return sum, strings.TrimRight(strings.ReplaceAll(string(cl), "\x00", " "), " "), true, nil
}

// imagesHash hashes the files of a CRIU images directory, sorted by name, but criu's
// statistics and logs (times of the dump, not state).
func imagesHash(dir string) ([32]byte, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return [32]byte{}, err
	}
	h := sha256.New()
	for _, e := range ents {
		n := e.Name()
		if !e.Type().IsRegular() || strings.HasPrefix(n, "stats-") || strings.HasSuffix(n, ".log") {
			continue
		}
		fd, err := unix.Open(filepath.Join(dir, n), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return [32]byte{}, err
		}
		f := os.NewFile(uintptr(fd), n)
		fh := sha256.New()
		_, err = io.Copy(fh, f)
		f.Close()
		if err != nil {
			return [32]byte{}, err
		}
		fmt.Fprintf(h, "%q\x00", n)
		h.Write(fh.Sum(nil))
	}
	var out [32]byte
	h.Sum(out[:0])
	return out, nil
}
