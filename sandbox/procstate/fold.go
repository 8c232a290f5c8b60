package procstate

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Templates in huge pages.
//
// A copy forked from a template gets a copy of the template's page tables:
// one entry per 4 KiB page of private memory. For a 100 MB process that is
// 25,600 entries, most of a restore's time (the fork, and as much again for
// the previous copy's exit). Memory mapped by 2 MiB transparent huge pages
// takes one entry per 2 MiB instead: a 512th of the entries to copy at the
// fork and to free at the exit.
//
// So on the first in-place restore of a checkpoint, a background worker
// folds its templates' anonymous memory into huge pages with
// process_madvise(MADV_COLLAPSE) (Linux 6.1), which works whatever the
// machine's THP setting is short of "never". The template is frozen; the
// kernel copies each 2 MiB range into a fresh huge page and swaps the page
// table under the template's mmap lock, so a restore forking from the
// template meanwhile is safe (it waits for at most one range). Copies share
// the huge pages copy-on-write; a copy writing into one gets its own 4 KiB
// page (the kernel splits the copy's mapping of that 2 MiB range, the first
// time only).
//
// Why the first restore, not the checkpoint: a template shares its memory
// with the live process it was cloned from, and folding gives it memory of
// its own. After a restore the live process is gone, and the small pages
// the template held go when the copies forked before the fold end (at the
// next restore): folding a restored template costs memory only while
// templates of other checkpoints still share its pages. Checkpoints that
// are never restored (most nodes of a search tree) are never folded.
//
// What it costs: the fold copies the memory (on a VM, most of its CPU is
// the first touch of memory new to the guest), on a thread at nice 19. Only
// ranges at least half resident are folded (an untouched reservation stays
// untouched), and only while the sandbox stays under three quarters of its
// memory limit and the machine keeps a quarter of its memory available. A
// template that cannot be folded (no huge page free, no room, a kernel
// without MADV_COLLAPSE) stays in small pages, and its copies get page
// tables of small pages.
//
// Live processes in huge pages. A checkpoint forks the live process too,
// and pays the same per-page price: the fork is most of a large process's
// checkpoint. So the first time a process is checkpointed, the worker also
// folds the live process itself. Its template keeps the small pages; every
// later checkpoint forks the huge pages, and its templates share them (they
// need no fold on restore). That costs one copy of the process's memory,
// once, while the first template lives, not one per checkpoint. Copies a
// restore forked are not folded again: they hold their template's huge
// pages already, or small ones the fold of that template replaces; folding
// a copy would copy again every 2 MiB range it wrote a byte of, at each
// restore.

const (
	hugePage = 2 << 20
	// hugeQueue bounds the templates waiting to be folded; more are left
	// in small pages.
	hugeQueue = 256
	// hugeMinResident is how many of a range's 512 small pages must be
	// resident for the range to be folded.
	hugeMinResident = 256
	// A range the kernel could not fold for the moment is tried hugeTries
	// times, hugeRetry apart.
	hugeTries = 4
	hugeRetry = 10 * time.Millisecond
)

// hugeJob is one process to fold: a template, or a live process.
type hugeJob struct {
	pidfd int
	pid   int
	sb    string // the sandbox's id
	// room returns how many more bytes the process may take.
	room func() int64
	log  string // what it is, for the log
}

// foldOnce hands the templates of c to the huge-page worker, the first time
// they are restored. Called with the sandbox's state changes serialised, after
// the copies were made (the templates are alive and ours).
func (ps *State) foldOnce(c *Checkpoint) {
	if ps.cfg.SmallPages {
		return
	}
	ps.mu.Lock()
	first := !ps.folded[c.ID]
	if first {
		if ps.folded == nil {
			ps.folded = map[string]bool{}
		}
		ps.folded[c.ID] = true
	}
	ps.mu.Unlock()
	if !first {
		return
	}
	for _, t := range c.Procs {
		ps.h.QueueFold(t.HostPid, c.ID+": template of "+t.name())
	}
}

// ForgetLive forgets the live processes seen (liveSeen): a restore ended
// them.
func (ps *State) ForgetLive() {
	ps.mu.Lock()
	ps.liveSeen = nil
	ps.mu.Unlock()
}

// foldLive hands the live processes a checkpoint just copied into templates
// (live: their records before they became the templates') to the huge-page
// worker, the first time each is checkpointed. Copies a restore made are not:
// ps.liveSeen holds them. Called with the sandbox's state changes serialised.
func (ps *State) foldLive(live []Template) {
	if ps.cfg.SmallPages {
		return
	}
	seen := make(map[int]uint64, len(live))
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range live {
		st, ok := ps.liveSeen[p.HostPid]
		seen[p.HostPid] = p.Start
		if !ok || st != 0 && st != p.Start {
			ps.h.QueueFold(p.HostPid, "live "+p.name())
		}
	}
	ps.liveSeen = seen
}

// HostRoom is how much memory the machine has available beyond a quarter of
// its total.
func HostRoom() int64 {
	raw, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	var total, avail int64
	for line := range strings.Lines(string(raw)) {
		k, v, _ := strings.Cut(line, ":")
		kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		switch k {
		case "MemTotal":
			total = kb << 10
		case "MemAvailable":
			avail = kb << 10
		}
	}
	return avail - total/4
}

// Folder folds processes into huge pages, one at a time, on a thread of
// its own at the lowest priority. One serves the whole runtime.
type Folder struct {
	queue chan hugeJob
	busy  atomic.Int64 // queued or being folded
	log   *slog.Logger

	mu sync.Mutex
	// running is the job being folded, nil between jobs.
	// +checklocks:mu
	running *foldRun
}

// foldRun is a job being folded.
type foldRun struct {
	sb   string
	done chan struct{} // closed once the worker has let go of the process
}

// NewFolder returns a Folder; Run folds what it is handed.
func NewFolder(log *slog.Logger) *Folder {
	return &Folder{queue: make(chan hugeJob, hugeQueue), log: log}
}

// Busy is how many processes wait to be, or are being, folded.
func (f *Folder) Busy() int { return int(f.busy.Load()) }

// Queue hands process pid of sandbox sb to the worker, unless it is gone or
// the queue is full; room says how many more bytes it may take.
func (f *Folder) Queue(pid int, room func() int64, what, sb string) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return // gone already (a template: the next restore says so)
	}
	f.busy.Add(1)
	select {
	case f.queue <- hugeJob{pidfd: fd, pid: pid, sb: sb, room: room, log: sb + ": " + what}:
	default:
		f.busy.Add(-1)
		unix.Close(fd)
		f.log.Debug("huge pages: queue full, process left in small pages", "process", what, "sandbox", sb)
	}
}

// Run folds queued processes until done is closed.
func (f *Folder) Run(done <-chan struct{}) {
	// The thread keeps its priority until it ends: it is never unlocked
	// (a goroutine that exits locked takes its thread with it).
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, 0, 19)
	for {
		select {
		case <-done:
			for {
				select {
				case j := <-f.queue:
					unix.Close(j.pidfd)
					f.busy.Add(-1)
				default:
					return
				}
			}
		case j := <-f.queue:
			start := time.Now()
			run := &foldRun{sb: j.sb, done: make(chan struct{})}
			f.mu.Lock()
			f.running = run
			f.mu.Unlock()
			n, err := foldMemory(j.pidfd, j.pid, j.room)
			f.mu.Lock()
			f.running = nil
			f.mu.Unlock()
			close(run.done)
			unix.Close(j.pidfd)
			f.busy.Add(-1)
			if err != nil {
				f.log.Debug("huge pages: folding a process", "process", j.log, "folded_bytes", n, "err", err)
				continue
			}
			f.log.Debug("huge pages: process folded", "process", j.log, "folded_bytes", n, "took", time.Since(start))
		}
	}
}

// Folding returns a channel closed once the worker has let go of the process
// of sandbox sb it is folding, or nil if it folds none. A process the worker
// is folding can outlive none of its reads of /proc/<pid>/pagemap and
// process_madvise calls, but each holds the process's address space: if
// the process is killed meanwhile, it leaves its cgroup while its memory is
// still charged, and the worker, as the last holder, frees that memory
// (at nice 19). Jobs that start once the process has left its cgroup
// cannot reach its address space any more.
func (f *Folder) Folding(sb string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.running == nil || f.running.sb != sb {
		return nil
	}
	return f.running.done
}

// errHugeGone says the process ended before or while it was folded.
var errHugeGone = errors.New("the process ended")

// foldMemory folds the anonymous private memory of the process pid (pidfd)
// into huge pages, range by range, and returns how many bytes it folded.
func foldMemory(pidfd, pid int, room func() int64) (int64, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	maps, err := os.Open(dir + "/maps")
	if err != nil {
		return 0, errHugeGone
	}
	defer maps.Close()
	pagemap, err := os.Open(dir + "/pagemap")
	if err != nil {
		return 0, errHugeGone
	}
	defer pagemap.Close()
	// The files were opened by pid: they are the process's if it is still
	// alive now (its pid cannot have been reused while the pidfd lives and
	// the process has not ended).
	if unix.PidfdSendSignal(pidfd, 0, nil, 0) != nil {
		return 0, errHugeGone
	}
	ranges, err := anonRanges(maps)
	if err != nil {
		return 0, err
	}
	budget := room()
	if budget < hugePage {
		return 0, errors.New("no memory to spare")
	}
	f := folder{pidfd: pidfd, pagemap: pagemap, budget: budget, buf: make([]byte, 8*(hugePage/4096))}
	for _, rg := range ranges {
		if done, err := f.foldRange(rg); done || err != nil {
			return f.folded, err
		}
	}
	return f.folded, nil
}

// folder folds the memory of one process within a budget of bytes.
type folder struct {
	pidfd   int
	pagemap *os.File
	budget  int64
	folded  int64
	buf     []byte // one huge page's pagemap entries
}

// foldRange folds the dense runs of range rg, within the budget. done says
// the budget is spent.
func (f *folder) foldRange(rg [2]uintptr) (done bool, err error) {
	for a := rg[0]; a < rg[1]; {
		end, err := f.denseRun(a, rg[1])
		if err != nil {
			return true, err
		}
		if end > a {
			n, errno := collapseRetrying(f.pidfd, a, end)
			switch {
			case errno == unix.ESRCH:
				return true, errHugeGone
			case errno == unix.EINVAL && f.folded+n == 0:
				f.folded = 0
				return true, fmt.Errorf("process_madvise(MADV_COLLAPSE): %w (transparent huge pages are off, or the kernel is older than 6.1)", errno)
			}
			f.folded += n
			// Ranges still failing (no huge page to be had, or a range
			// the kernel would not take) stay in small pages.
		}
		if f.folded+hugePage > f.budget {
			return true, nil
		}
		a = max(end, a) + hugePage
	}
	return false, nil
}

// denseRun returns the end of the longest run of dense huge-page ranges
// from a, below limit and within the budget (a itself if there is none).
func (f *folder) denseRun(a, limit uintptr) (uintptr, error) {
	end := a
	for end < limit && f.folded+int64(end-a)+hugePage <= f.budget {
		ok, err := dense(f.pagemap, end, f.buf)
		if err != nil {
			return end, err
		}
		if !ok {
			break
		}
		end += hugePage
	}
	return end, nil
}

// collapseRetrying is collapse of [start, end), and if a range was busy (a
// page locked, or held by a process exiting: the previous template, say)
// or no huge page was free, of each huge-page range again, a few times. It
// returns the bytes folded and the error of the last range tried.
func collapseRetrying(pidfd int, start, end uintptr) (int64, unix.Errno) {
	n, errno := collapse(pidfd, start, end)
	if errno != unix.EAGAIN && errno != unix.ENOMEM {
		return n, errno
	}
	n, errno = 0, 0
	for r := start; r < end && errno != unix.ESRCH; r += hugePage {
		for try := 1; ; try++ {
			m, e := collapse(pidfd, r, r+hugePage)
			if e == 0 {
				n += m
			}
			if e != unix.EAGAIN && e != unix.ENOMEM || try == hugeTries {
				errno = e
				break
			}
			time.Sleep(hugeRetry)
		}
	}
	return n, errno
}

// collapse asks the kernel to fold [start, end) of the process pidfd into
// huge pages, and returns how many bytes it took (all of them, or none: an
// error is returned if any 2 MiB range failed, though the others were
// folded).
func collapse(pidfd int, start, end uintptr) (int64, unix.Errno) {
	// struct iovec, for an address in the process, not ours.
	iov := [2]uint64{uint64(start), uint64(end - start)}
	n, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&iov)), 1, unix.MADV_COLLAPSE, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int64(n), 0
}

// anonRanges lists the 2 MiB-aligned parts of the anonymous private writable
// mappings in a /proc/<pid>/maps file (the heap and mmap'd memory; not the
// stack, which is small and grows down).
func anonRanges(maps io.Reader) ([][2]uintptr, error) {
	var out [][2]uintptr
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 5 || f[1] != "rw-p" || f[4] != "0" || (len(f) > 5 && f[5] != "[heap]") {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		s := (start + hugePage - 1) &^ (hugePage - 1)
		e := end &^ (hugePage - 1)
		if s < e {
			out = append(out, [2]uintptr{uintptr(s), uintptr(e)})
		}
	}
	return out, sc.Err()
}

// dense says whether at least hugeMinResident of the small pages of the
// 2 MiB range at addr are resident (or swapped), from /proc/<pid>/pagemap.
func dense(pagemap *os.File, addr uintptr, buf []byte) (bool, error) {
	if _, err := pagemap.ReadAt(buf, int64(addr/4096)*8); err != nil {
		if errors.Is(err, unix.ESRCH) || errors.Is(err, io.EOF) {
			return false, errHugeGone
		}
		return false, fmt.Errorf("reading pagemap: %w", err)
	}
	n := 0
	for i := 0; i < len(buf); i += 8 {
		// Bit 63: present; bit 62: swapped.
		if buf[i+7]&0xc0 != 0 {
			n++
		}
	}
	return n >= hugeMinResident, nil
}
