package procstate

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// procInfo is what inspecting a live process found.
type procInfo struct {
	tpl    Template
	ppid   int
	reason string // why it cannot be a template, if it cannot
	// deleted names an open deleted file: neither path takes it (criu's
	// ghost files fail to restore across the sandbox's mount namespace).
	deleted string
	// sockets are the keys ("socket:[inode]") of the sockets it holds.
	sockets []string
}

// shareListeners keeps shared, among procs, each listening socket another
// process holds too: a copy of one holder listening anew would shut the
// others' copies out of its address (private.go). So does one that
// templates hold (held): a checkpoint's, shared then, which keeps the
// address as long as it is kept.
func shareListeners(procs []procInfo, held func(key string) bool) {
	holders := map[string]int{}
	for _, pi := range procs {
		for _, l := range slices.Compact(slices.Sorted(slices.Values(pi.sockets))) {
			holders[l]++
		}
	}
	for i := range procs {
		for j, p := range procs[i].tpl.Private {
			if p.listensAnew() && (holders[p.link] > 1 || held(p.link)) {
				procs[i].tpl.Private[j] = Private{Kind: "listen", FD: p.FD, Flags: p.Flags, link: p.link}
			}
		}
	}
}

// inspect reads what a template of pid needs. rootMnt is the mount id of
// the sandbox's root.
func inspect(pid int, rootMnt uint64) (procInfo, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	var pi procInfo
	stat, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return pi, err
	}
	// comm is in parentheses and may hold spaces; fields follow the last ')'.
	open, end := strings.IndexByte(string(stat), '('), strings.LastIndexByte(string(stat), ')')
	if open < 0 || end < open {
		return pi, fmt.Errorf("parsing %s/stat", dir)
	}
	pi.tpl.Comm = string(stat[open+1 : end])
	f := strings.Fields(string(stat[end+1:]))
	if len(f) < 20 {
		return pi, fmt.Errorf("parsing %s/stat", dir)
	}
	pi.ppid, _ = strconv.Atoi(f[1])
	pi.tpl.Leader = f[3] == strconv.Itoa(pid)
	pi.tpl.Start, _ = strconv.ParseUint(f[19], 10, 64)
	pi.tpl.HostPid = pid
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return pi, err
	}
	readStatus(string(status), &pi.tpl)
	if mnt, err := mntID(dir + "/root"); err != nil {
		return pi, err
	} else if mnt != rootMnt && pi.reason == "" {
		pi.reason = "it has a root of its own"
	}
	if pi.tpl.Cwd, err = os.Readlink(dir + "/cwd"); err != nil {
		return pi, err
	}
	if mnt, err := mntID(dir + "/cwd"); err != nil {
		return pi, err
	} else if mnt != rootMnt && pi.reason == "" {
		pi.reason = "its working directory " + pi.tpl.Cwd + " is outside the sandbox's root filesystem"
	}
	specials, err := inspectFiles(pid, dir, rootMnt, &pi)
	if err != nil {
		return pi, err
	}
	if err := inspectPrivate(pid, specials, &pi); err != nil {
		return pi, err
	}
	why, removed, err := sharedWritableMap(dir)
	pi.reason = cmp.Or(pi.reason, why)
	pi.tpl.Shares = removed
	return pi, err
}

// inspectFiles records the regular files pi's process has open in the
// sandbox's root, and returns its fds that are not paths (pipes, sockets,
// anonymous inodes) for inspectPrivate.
// readStatus records in t what a /proc/<pid>/status file tells of it.
func readStatus(status string, t *Template) {
	for line := range strings.Lines(status) {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "NSpid":
			ns := strings.Fields(v)
			t.NSPid, _ = strconv.Atoi(ns[len(ns)-1])
		case "SigCgt", "SigIgn", "SigBlk":
			// SIGALRM (14) handled, ignored or blocked: it may have
			// an interval timer running, which a fork does not keep.
			if m, err := strconv.ParseUint(v, 16, 64); err == nil && m&(1<<13) != 0 {
				t.alarm = true
			}
		case "Threads":
			if n, _ := strconv.Atoi(v); n > 1 {
				t.Threads = n
			}
		}
	}
}

func inspectFiles(pid int, dir string, rootMnt uint64, pi *procInfo) ([]special, error) {
	ents, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return nil, err
	}
	var specials []special
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		link, err := os.Readlink(dir + "/fd/" + e.Name())
		if err != nil {
			continue // closed meanwhile
		}
		info, err := os.ReadFile(dir + "/fdinfo/" + e.Name())
		if err != nil {
			continue
		}
		if !strings.HasPrefix(link, "/") {
			fl, _ := strconv.ParseInt(fdinfoField(string(info), "flags"), 8, 64)
			specials = append(specials, special{pid: pid, fd: fd, link: link, flags: int(fl), info: string(info)})
			continue
		}
		var tf File
		var mnt uint64
		tf.FD, tf.Path = fd, link
		for _, line := range strings.Split(string(info), "\n") {
			k, v, _ := strings.Cut(line, ":")
			v = strings.TrimSpace(v)
			switch k {
			case "pos":
				tf.Pos, _ = strconv.ParseInt(v, 10, 64)
			case "flags":
				fl, _ := strconv.ParseInt(v, 8, 64)
				tf.Flags = int(fl)
			case "mnt_id":
				mnt, _ = strconv.ParseUint(v, 10, 64)
			}
		}
		if mnt != rootMnt {
			continue // /dev, /proc, the host's /dev/null: shared
		}
		if strings.HasSuffix(link, " (deleted)") {
			if pi.deleted == "" {
				pi.deleted = fmt.Sprintf("it holds the deleted file %s open (fd %d)", strings.TrimSuffix(link, " (deleted)"), fd)
			}
			if pi.reason == "" {
				pi.reason = pi.deleted
			}
			continue
		}
		pi.tpl.Files = append(pi.tpl.Files, tf)
	}
	markDups(pid, pi.tpl.Files)
	return specials, nil
}

// markDups sorts files, process pid's, by descriptor and marks each that
// is the same open file as a lower one (DupOf).
func markDups(pid int, files []File) {
	slices.SortFunc(files, func(a, b File) int { return a.FD - b.FD })
	for i := range files {
		for j := range i {
			if files[j].DupOf != 0 || files[j].Path != files[i].Path {
				continue
			}
			const kcmpFile = 0
			r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(pid), uintptr(pid), kcmpFile, uintptr(files[j].FD), uintptr(files[i].FD), 0)
			if e == 0 && r == 0 {
				files[i].DupOf = files[j].FD + 1
				break
			}
		}
	}
}

// sharedWritableMap names a file the process maps shared and writable: a
// copy would write through to the live state's file, not its own. It asks
// the kernel for such mappings only (PROCMAP_QUERY, Linux 6.11), or else
// reads and parses the whole maps file, which costs many times more.
func sharedWritableMap(dir string) (why, removed string, err error) {
	f, err := os.Open(dir + "/maps")
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	why, removed, err = sharedWritableQuery(f)
	if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) {
		return sharedWritableScan(f)
	}
	return why, removed, err
}

// procmapQuery is struct procmap_query of linux/fs.h.
type procmapQuery struct {
	Size, QueryFlags, QueryAddr                        uint64
	VMAStart, VMAEnd, VMAFlags, VMAPageSize, VMAOffset uint64
	Inode                                              uint64
	DevMajor, DevMinor, VMANameSize, BuildIDSize       uint32
	VMANameAddr, BuildIDAddr                           uint64
}

// sharedWritableQuery finds the shared, writable, file-backed mappings
// (anonymous shared memory is backed by a file of the kernel's) of an open
// maps file with PROCMAP_QUERY, and says why the first one that counts
// keeps the process from being a template (sharedWhy).
func sharedWritableQuery(maps *os.File) (why, removed string, err error) {
	name := make([]byte, unix.PathMax)
	for addr := uint64(0); ; {
		q := procmapQuery{
			Size:        uint64(unsafe.Sizeof(procmapQuery{})),
			QueryFlags:  procmapCoveringOrNext | procmapWritable | procmapShared | procmapFileBacked,
			QueryAddr:   addr,
			VMANameSize: uint32(len(name)),
			VMANameAddr: uint64(uintptr(unsafe.Pointer(&name[0]))),
		}
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, maps.Fd(), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
		runtime.KeepAlive(name)
		if errno == unix.ENOENT {
			return "", removed, nil // no more
		}
		if errno != 0 {
			return "", "", errno
		}
		why, shm := sharedWhy(string(name[:max(int(q.VMANameSize)-1, 0)])) // the size counts the NUL
		if why != "" {
			return why, removed, nil
		}
		removed = cmp.Or(removed, shm)
		addr = q.VMAEnd
	}
}

// sharedWritableScan is sharedWritableQuery by reading the maps file.
func sharedWritableScan(maps *os.File) (why, removed string, err error) {
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 6 || len(fl[1]) < 4 || fl[1][1] != 'w' || fl[1][3] != 's' {
			continue
		}
		why, shm := sharedWhy(strings.Join(fl[5:], " "))
		if why != "" {
			return why, removed, nil
		}
		removed = cmp.Or(removed, shm)
	}
	return "", removed, sc.Err()
}

// sharedWhy says why a process that maps name shared and writable is not
// copied: the copy would share that memory with its template and with the
// live process, and what one wrote the others would read. A file of
// /dev/shm removed while mapped (a POSIX semaphore: Python's
// multiprocessing removes its own at once) is the exception, "": CRIU
// cannot restore such a file in a sandbox, so a template, sharing it, is
// the only way the process comes back.
func sharedWhy(name string) (why, removedShm string) {
	switch {
	case strings.HasPrefix(name, "/dev/shm/") && strings.HasSuffix(name, " (deleted)"):
		return "", strings.TrimSuffix(name, " (deleted)")
	case name == "/dev/zero (deleted)" || name == "":
		return "it maps anonymous memory shared and writable", ""
	case strings.HasPrefix(name, "/SYSV"):
		return "it attaches System V shared memory", ""
	}
	return "it maps " + strings.TrimSuffix(name, " (deleted)") + " shared and writable", ""
}

func mntID(path string) (uint64, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("statx %s: %w", path, err)
	}
	return st.Mnt_id, nil
}

// criuCapturable fails if CRIU cannot capture tree t in a way a restore
// brings back.
func (t procTree) criuCapturable() error {
	for _, p := range t.procs {
		if p.deleted != "" {
			return fmt.Errorf("%w: %s cannot be captured: %s, which neither template copies nor CRIU can bring back in a sandbox; close it, end the process, or checkpoint files only (process mode filesystem)",
				ErrProcesses, p.tpl.name(), p.deleted)
		}
		if p.tpl.Shares != "" {
			return fmt.Errorf("%w: %s cannot be captured by CRIU: it maps %s, a file of /dev/shm removed while in use (a POSIX semaphore, or multiprocessing's shared memory), which CRIU cannot bring back in a sandbox; a process alone (not a tree) is taken as a template in process mode template, else checkpoint files only (process mode filesystem)",
				ErrProcesses, p.tpl.name(), p.tpl.Shares)
		}
		if p.tpl.Session != "" && p.tpl.HostPid != t.procs[0].tpl.HostPid {
			return fmt.Errorf("%w: session %q cannot be captured: its shell %s is not the root of its process tree; end it, or checkpoint files only (process mode filesystem)",
				ErrProcesses, p.tpl.Session, p.tpl.name())
		}
	}
	return nil
}

// procTree is one process tree of the command group: a process whose
// parent is outside the group (the init, or the server for a tree criu
// restored), and its descendants.
type procTree struct {
	procs []procInfo // the root first
	why   string
}

// splitTrees groups procs into trees, in the order of their roots.
func splitTrees(procs []procInfo) []procTree {
	byPid := map[int]int{}
	for i, p := range procs {
		byPid[p.tpl.HostPid] = i
	}
	rootOf := func(i int) int {
		for n := 0; n < len(procs); n++ {
			j, ok := byPid[procs[i].ppid]
			if !ok {
				break
			}
			i = j
		}
		return i
	}
	var roots []int
	members := map[int][]procInfo{}
	for i := range procs {
		r := rootOf(i)
		if _, ok := members[r]; !ok {
			roots = append(roots, r)
			members[r] = []procInfo{procs[r]}
		}
		if r != i {
			members[r] = append(members[r], procs[i])
		}
	}
	out := make([]procTree, len(roots))
	for k, r := range roots {
		out[k] = procTree{procs: members[r]}
	}
	return out
}

// criuReason says why t takes the general path, or "" for a template.
func (t procTree) criuReason(allCRIU bool) string {
	switch {
	case allCRIU:
		return "process mode criu"
	case len(t.procs) > 1:
		return fmt.Sprintf("in the process tree of %s, with %s a child of it: of process trees only a root with one child "+
			"(a shell and the program it runs) is copied from templates (a background command line that ends in its program, "+
			"such as `cd /srv && python3 app.py`, runs as one process, which is; docs/PROCESS-SHAPES.md)", t.procs[0].tpl.name(), t.procs[1].tpl.name())
	default:
		return t.procs[0].reason
	}
}

// StartTime returns when pid started (clock ticks since boot), or an error
// if it is gone or dying (a zombie).
func StartTime(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	end := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[end+1:]))
	if len(f) < 20 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", pid)
	}
	if f[0] == "Z" || f[0] == "X" {
		return 0, fmt.Errorf("pid %d has exited", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// dying reports whether pid is exiting (a template killed just now cannot
// be seized: EPERM) or gone, waiting up to 200 ms for it to get there.
func dying(pid int) bool {
	for range 20 {
		if _, err := StartTime(pid); err != nil {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

const (
	procmapQueryIoctl     = 0xC0686611 // _IOWR(0x66, 17, struct procmap_query)
	procmapWritable       = 0x02
	procmapShared         = 0x08
	procmapCoveringOrNext = 0x10
	procmapFileBacked     = 0x20
)
