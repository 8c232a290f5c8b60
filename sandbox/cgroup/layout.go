package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	cgroups "github.com/containerd/cgroups/v3"
	"golang.org/x/sys/unix"
)

// mountRoot is where cgroup hierarchies are mounted on every supported host.
const mountRoot = "/sys/fs/cgroup"

// Controller names handled by the package.
const (
	ctrlMemory  = "memory"
	ctrlPids    = "pids"
	ctrlCPU     = "cpu"
	ctrlFreezer = "freezer"
)

// limitControllers are the controllers that carry Limits, in the order in
// which their groups are created.
var limitControllers = []string{ctrlMemory, ctrlPids, ctrlCPU}

// Mode is the cgroup layout a Manager works with.
type Mode int

const (
	// ModeLegacy is cgroup v1 only: v1 freezer, kill by freeze+SIGKILL.
	ModeLegacy Mode = iota + 1
	// ModeHybrid is v1 controllers plus a cgroup2 hierarchy used for
	// membership, freeze and kill.
	ModeHybrid
	// ModeUnified is pure cgroup v2.
	ModeUnified
)

// String returns the layout's name.
func (m Mode) String() string {
	switch m {
	case ModeLegacy:
		return "legacy"
	case ModeHybrid:
		return "hybrid"
	case ModeUnified:
		return "unified"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// layout is what New detects once: where each hierarchy is and which one
// serves which purpose.
type layout struct {
	mode Mode
	// v2 is the cgroup2 mount point used for tracking, freeze and kill, or
	// "" when none is used.
	v2 string
	// ctrl maps each limit controller to its mount point; v2 when the
	// controller is enabled in the unified hierarchy. A missing key means
	// the controller is unavailable.
	ctrl map[string]string
	// ctrlV2 tells which limit controllers live in v2.
	ctrlV2 map[string]bool
	// freezer is the v1 freezer mount point in legacy mode, else "".
	freezer string
	// swapAccounted tells whether v1 memory groups have
	// memory.memsw.limit_in_bytes.
	swapAccounted bool
}

// trackRoot is the mount point of the hierarchy that tracks membership.
func (l *layout) trackRoot() string {
	if l.v2 != "" {
		return l.v2
	}
	return l.freezer
}

// roots returns every mount point the manager creates groups in, the
// tracking hierarchy first, without duplicates.
func (l *layout) roots() []string {
	out := []string{l.trackRoot()}
	for _, c := range limitControllers {
		if r, ok := l.ctrl[c]; ok && !contains(out, r) {
			out = append(out, r)
		}
	}
	return out
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func isFS(path string, magic int64) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return int64(st.Type) == magic
}

// findV1 returns the mount point of the v1 hierarchy that carries ctrl, or "".
func findV1(ctrl string) string {
	p := filepath.Join(mountRoot, ctrl)
	if !isFS(p, unix.CGROUP_SUPER_MAGIC) || !hasV1Option(p, ctrl) {
		return ""
	}
	return p
}

// hasV1Option reports whether the cgroup v1 mount at path has the controller
// opt among its super options, from /proc/thread-self/mountinfo: not
// /proc/self, which shows the main thread's mount namespace, and a locked
// goroutine of the sandbox runtime may have moved the main thread elsewhere.
func hasV1Option(path, opt string) bool {
	opts, err := superOptions(path, "cgroup")
	return err == nil && slices.Contains(opts, opt)
}

// superOptions returns the super options of the mount of file system type
// fstype at path, from /proc/thread-self/mountinfo (the last such mount
// there: the one on top).
func superOptions(path, fstype string) ([]string, error) {
	data, err := os.ReadFile("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, err
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		real = path
	}
	var opts []string
	found := false
	for _, line := range bytes.Split(data, []byte("\n")) {
		f := strings.Fields(string(line))
		if len(f) < 10 || f[4] != real {
			continue
		}
		for i, x := range f {
			if x != "-" || i+3 >= len(f) {
				continue
			}
			if f[i+1] == fstype {
				opts, found = strings.Split(f[i+3], ","), true
			}
			break
		}
	}
	if !found {
		return nil, fmt.Errorf("no %s mount at %s in /proc/thread-self/mountinfo", fstype, path)
	}
	return opts, nil
}

// v2Controllers returns the controllers a cgroup2 mount offers at its root.
func v2Controllers(root string) map[string]bool {
	out := map[string]bool{}
	data, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return out
	}
	for _, c := range strings.Fields(string(data)) {
		out[c] = true
	}
	return out
}

// detect works out the layout for groups below /base. force, when non-zero, restricts it (tests use
// it to run the legacy path on a hybrid host, or the unified path on the
// hybrid host's cgroup2 hierarchy).
func detect(base string, force Mode) (*layout, error) {
	l := &layout{ctrl: map[string]string{}, ctrlV2: map[string]bool{}}
	v2root, err := l.detectMode(base, force)
	if err != nil {
		return nil, err
	}
	l.v2 = v2root
	avail := map[string]bool{}
	if v2root != "" {
		avail = v2Controllers(v2root)
	}
	for _, c := range limitControllers {
		switch {
		case avail[c]:
			l.ctrl[c], l.ctrlV2[c] = v2root, true
		case l.mode == ModeUnified:
			// A unified host has no v1 hierarchies.
		default:
			if p := findV1(c); p != "" {
				l.ctrl[c] = p
			}
		}
	}
	if r, ok := l.ctrl[ctrlMemory]; ok && !l.ctrlV2[ctrlMemory] {
		_, err := os.Stat(filepath.Join(r, "memory.memsw.limit_in_bytes"))
		l.swapAccounted = err == nil
	}
	if v2root == "" {
		l.freezer = findV1(ctrlFreezer)
		if l.freezer == "" {
			return nil, fmt.Errorf("no cgroup2 hierarchy and no v1 freezer: %w", ErrNoCgroups)
		}
	}
	return l, nil
}

// detectMode sets l.mode, the host's layout as force restricts it, and
// returns the root of the cgroup2 hierarchy the layout uses ("" for none:
// legacy, or a cgroup2 without cgroup.kill on a hybrid host).
func (l *layout) detectMode(base string, force Mode) (v2root string, err error) {
	switch cgroups.Mode() {
	case cgroups.Unified:
		v2root = mountRoot
		l.mode = ModeUnified
	case cgroups.Hybrid:
		v2root = filepath.Join(mountRoot, "unified")
		l.mode = ModeHybrid
	case cgroups.Legacy:
		l.mode = ModeLegacy
	default:
		return "", fmt.Errorf("detecting cgroup layout: %w", ErrNoCgroups)
	}
	if force != 0 {
		switch {
		case force == ModeLegacy:
			v2root = ""
		case force == ModeUnified && v2root != "":
		case force == l.mode:
		default:
			return "", fmt.Errorf("forcing layout %s on a %s host: %w", force, l.mode, ErrNoCgroups)
		}
		l.mode = force
	}
	if v2root != "" && !supportsKill(v2root, base) {
		if l.mode == ModeUnified && force == 0 {
			return "", fmt.Errorf("cgroup2 at %s lacks cgroup.kill (kernel < 5.14): %w", v2root, ErrNoCgroups)
		}
		v2root, l.mode = "", ModeLegacy
	}
	return v2root, nil
}

// supportsKill reports whether non-root groups of the cgroup2 mount at root
// have cgroup.kill and cgroup.freeze, by looking into the group base, which
// it creates (and removes again if the answer is no and it made it).
func supportsKill(root, base string) bool {
	dir := filepath.Join(root, base)
	made := true
	if err := os.Mkdir(dir, 0o755); errors.Is(err, os.ErrExist) {
		made = false
	} else if err != nil {
		return false
	}
	for _, f := range []string{"cgroup.kill", "cgroup.freeze"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			if made {
				_ = os.Remove(dir)
			}
			return false
		}
	}
	return true
}
