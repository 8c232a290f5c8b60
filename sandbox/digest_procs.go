package sandbox

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
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
// writable mappings read through /proc/PID/mem while it is held frozen, but for the bytes
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
func procInputs(c *checkpoint, live bool, dir string) []procInput {
	var out []procInput
	for i, t := range c.Procs {
		p := procInput{pid: t.NSPid, comm: t.Comm, cwd: t.Cwd, session: t.Session, files: slices.Clone(t.Files), unit: -1}
		if live {
			p.hostPid, p.start, p.masks = t.HostPid, t.Start, t.KernelWrites
		}
		if i < len(c.TplImages) && c.TplImages[i].Dir != "" {
			p.images = filepath.Join(dir, c.TplImages[i].Dir)
		}
		out = append(out, p)
	}
	for ui, u := range c.Images {
		for _, up := range u.Procs {
			out = append(out, procInput{pid: up.NSPid, comm: up.Comm, session: u.Session, images: filepath.Join(dir, u.Dir), unit: ui})
		}
	}
	return out
}

// processDigest summarises each process and returns the digest over them ("" for none).
func processDigest(in []procInput, canceled func() error) ([]procSum, string, error) {
	if len(in) == 0 {
		return nil, "", nil
	}
	h := sha256.New()
	io.WriteString(h, "deltagym-processes-2\n")
	sums := make([]procSum, 0, len(in))
	imgs := map[string][32]byte{}
	for i, p := range in {
		if err := canceled(); err != nil {
			return nil, "", err
		}
		s := procSum{pid: p.pid, command: p.comm, cwd: p.cwd}
		var files strings.Builder
		for _, f := range slices.SortedFunc(slices.Values(p.files), func(a, b procstate.File) int { return a.FD - b.FD }) {
			fmt.Fprintf(&files, "%d %s flags=%#o pos=%d\n", f.FD, f.Path, f.Flags, f.Pos)
		}
		s.file = files.String()
		mem, cmd, ok := templateMemory(p.hostPid, p.start, p.masks, canceled)
		switch {
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
					sum = sha256.Sum256([]byte("unreadable"))
				}
				imgs[p.images] = sum
			}
			s.mem = sum
		default:
			s.mem = sha256.Sum256([]byte("unreadable"))
		}
		fmt.Fprintf(h, "%d\x00%d\x00%q\x00%q\x00%q\x00%q\x00", i, p.unit, s.command, s.cwd, p.session, s.file)
		h.Write(s.mem[:])
		sums = append(sums, s)
	}
	return sums, layers.DigestOf(h), nil
}

// templateMemory hashes the private writable mappings of template hostPid (started at start),
// their ranges and contents but the bytes of masks (procstate.Template.KernelWrites, which the
// kernel wrote and the program did not: the ranges are hashed, their contents read as zeros),
// and reads its command line; ok is false if it is not there.
func templateMemory(hostPid int, start uint64, masks []procstate.Span, canceled func() error) (sum [32]byte, cmdline string, ok bool) {
	if hostPid <= 0 {
		return sum, "", false
	}
	if st, err := procstate.StartTime(hostPid); err != nil || st != start {
		return sum, "", false
	}
	base := "/proc/" + strconv.Itoa(hostPid)
	cl, err := os.ReadFile(base + "/cmdline")
	if err != nil {
		return sum, "", false
	}
	maps, err := os.ReadFile(base + "/maps")
	if err != nil {
		return sum, "", false
	}
	mem, err := os.Open(base + "/mem")
	if err != nil {
		return sum, "", false
	}
	defer mem.Close()
	h := sha256.New()
	var rec [16]byte
	for _, m := range masks {
		binary.LittleEndian.PutUint64(rec[:], m.Addr)
		binary.LittleEndian.PutUint64(rec[8:], m.Len)
		h.Write(rec[:])
	}
	buf := make([]byte, 1<<20)
	sc := bufio.NewScanner(bytes.NewReader(maps))
	for sc.Scan() {
		if !hashMapping(h, mem, sc.Text(), buf, masks, canceled) {
			return sum, "", false
		}
	}
	if st, err := procstate.StartTime(hostPid); err != nil || st != start {
		return sum, "", false
	}
	h.Sum(sum[:0])
	return sum, strings.TrimRight(strings.ReplaceAll(string(cl), "\x00", " "), " "), true
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

// hashMapping hashes the range, name and contents of the mapping of line (of /proc/PID/maps)
// if it is private and writable, the bytes of masks as zeros; false if canceled.
func hashMapping(h hash.Hash, mem *os.File, line string, buf []byte, masks []procstate.Span, canceled func() error) bool {
	f := strings.Fields(line)
	if len(f) < 5 || f[1] != "rw-p" {
		return true
	}
	lo, hi, found := strings.Cut(f[0], "-")
	if !found {
		return true
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil || end < start {
		return true
	}
	var rec [16]byte
	binary.LittleEndian.PutUint64(rec[:], start)
	binary.LittleEndian.PutUint64(rec[8:], end)
	h.Write(rec[:])
	if len(f) >= 6 {
		io.WriteString(h, f[5])
	}
	for off := start; off < end; {
		if canceled() != nil {
			return false
		}
		n := int(min(uint64(len(buf)), end-off))
		k, err := mem.ReadAt(buf[:n], int64(off))
		if k > 0 {
			zeroMasked(buf[:k], off, masks)
			h.Write(buf[:k])
		}
		if err != nil || k < n {
			// An unreadable range: the mark stands for the rest of it.
			io.WriteString(h, "?")
			break
		}
		off += uint64(n)
	}
	return true
}

// zeroMasked zeroes the bytes of b, read at address off, that masks cover.
func zeroMasked(b []byte, off uint64, masks []procstate.Span) {
	end := off + uint64(len(b))
	for _, m := range masks {
		lo, hi := max(m.Addr, off), min(m.Addr+m.Len, end)
		if lo < hi {
			clear(b[lo-off : hi-off])
		}
	}
}
