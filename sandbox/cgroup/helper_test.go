package cgroup

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	cgroups "github.com/containerd/cgroups/v3"

	"github.com/deltagym/deltagym/internal/testenv"
)

// helperEnv selects a helper mode when the test binary runs as a child.
const helperEnv = "DELTAGYM_CGROUP_HELPER"

func TestMain(m *testing.M) {
	mode := os.Getenv(helperEnv)
	if mode != "" {
		os.Exit(runHelper(mode, os.Args[1:]))
	}
	dir, err := exposeBinary()
	if err != nil {
		fmt.Fprintln(os.Stderr, "exposing the test binary:", err)
		os.Exit(1)
	}
	code := m.Run()
	if dir != "" {
		_ = os.RemoveAll(dir)
	}
	os.Exit(code)
}

// exposedBin is a copy of the test binary that uids other than root can run
// (go test keeps the binary in a directory only root can search).
var exposedBin string

// exposeBinary makes exposedBin, before any test runs: copying it while
// other tests fork would let a child inherit the open file and make exec
// fail with ETXTBSY.
func exposeBinary() (string, error) {
	if os.Geteuid() != 0 {
		return "", nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp("", "dgcgroup-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return dir, err
	}
	bin := filepath.Join(dir, "helper")
	data, err := os.ReadFile(self)
	if err != nil {
		return dir, err
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		return dir, err
	}
	exposedBin = bin
	return dir, nil
}

// runHelper is the body of a helper child process.
func runHelper(mode string, args []string) int {
	gate := func() {
		var b [1]byte
		_, _ = os.Stdin.Read(b[:])
	}
	switch mode {
	case "count":
		// Count forever, storing the counter at offset 0 of args[0].
		f, err := os.OpenFile(args[0], os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		for i := 1; ; i++ {
			if _, err := f.WriteAt([]byte(fmt.Sprintf("%20d", i)), 0); err != nil {
				return 1
			}
		}
	case "alloc":
		// Allocate and touch 8 MiB once let go, say so, then wait: memory
		// it touches after joining a group is charged to it on v1 too,
		// where a joining task's earlier pages stay with its old group.
		gate()
		b := make([]byte, 8<<20)
		for j := 0; j < len(b); j += 4096 {
			b[j] = 1
		}
		fmt.Println("allocated")
		gate()
		runtime.KeepAlive(b)
		return 0
	case "hog":
		gate()
		var keep [][]byte
		for i := 0; i < 256; i++ {
			b := make([]byte, 1<<20)
			for j := 0; j < len(b); j += 4096 {
				b[j] = 1
			}
			keep = append(keep, b)
		}
		fmt.Println("survived", len(keep))
		return 0
	case "tree":
		// Start a sleeper in its own session and a plain one, print their
		// pids, then wait to be killed.
		gate()
		a := exec.Command("sleep", "1000")
		a.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		b := exec.Command("sleep", "1000")
		for _, c := range []*exec.Cmd{a, b} {
			if err := c.Start(); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
		fmt.Println(a.Process.Pid, b.Process.Pid)
		_, _ = io.Copy(io.Discard, os.Stdin)
		return 0
	case "join":
		// Move into a cgroup through inherited cgroup.procs fds (3...), and
		// check that opening args[1] (a cgroup.procs path) directly fails.
		n, _ := strconv.Atoi(args[0])
		res := joinResult{UID: os.Getuid()}
		for fd := 3; fd < 3+n; fd++ {
			_, err := unix.Write(fd, []byte("0"))
			res.Writes = append(res.Writes, errString(err))
		}
		_, err := os.OpenFile(args[1], os.O_WRONLY, 0)
		res.DirectOpen = errString(err)
		cg, _ := os.ReadFile("/proc/self/cgroup")
		res.ProcCgroup = string(cg)
		// A cgroup namespace made after joining has the group as root.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
			res.Unshare = err.Error()
		}
		cg, _ = os.ReadFile("/proc/thread-self/cgroup")
		res.AfterUnshare = string(cg)
		out, _ := json.Marshal(res)
		fmt.Println(string(out))
		_, _ = io.Copy(io.Discard, os.Stdin)
		return 0
	}
	fmt.Fprintln(os.Stderr, "unknown helper mode", mode)
	return 2
}

type joinResult struct {
	UID          int
	Writes       []string
	DirectOpen   string
	ProcCgroup   string
	Unshare      string
	AfterUnshare string
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// helper is a running helper child.
type helper struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout *bufio.Reader
	stderr syncBuffer
	waited func()
}

// startHelper starts the test binary in a helper mode; prep may adjust the
// command first. The process is killed and reaped at the end of the test.
func startHelper(t testing.TB, mode string, prep func(*exec.Cmd), args ...string) *helper {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: exec.Command(self, args...)}
	h.cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	h.cmd.Stderr = &h.stderr
	if prep != nil {
		prep(h.cmd)
	}
	return h.start(t)
}

// startCmd starts an arbitrary command like startHelper.
func startCmd(t testing.TB, name string, args ...string) *helper {
	t.Helper()
	h := &helper{cmd: exec.Command(name, args...)}
	h.cmd.Stderr = &h.stderr
	return h.start(t)
}

func (h *helper) start(t testing.TB) *helper {
	t.Helper()
	var err error
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := h.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	h.stdout = bufio.NewReader(out)
	if err := h.cmd.Start(); err != nil {
		t.Fatalf("starting %v: %v", h.cmd.Args, err)
	}
	done := false
	t.Cleanup(func() {
		if !done {
			_ = h.cmd.Process.Kill()
			_ = h.cmd.Wait()
		}
	})
	h.waited = func() { done = true }
	return h
}

// open lets a gated helper go on.
func (h *helper) open(t testing.TB) {
	t.Helper()
	if _, err := h.stdin.Write([]byte("\n")); err != nil {
		t.Fatal(err)
	}
}

func (h *helper) line(t testing.TB) string {
	t.Helper()
	s, err := h.stdout.ReadString('\n')
	if err != nil {
		t.Fatalf("reading from helper: %v (stderr %q)", err, h.stderr.String())
	}
	return strings.TrimSpace(s)
}

// wait reaps the helper and returns its wait status.
func (h *helper) wait(t testing.TB) syscall.WaitStatus {
	t.Helper()
	_ = h.stdin.Close()
	err := h.cmd.Wait()
	h.waited()
	if err != nil {
		if _, ok := err.(*exec.ExitError); !ok {
			t.Fatal(err)
		}
	}
	return h.cmd.ProcessState.Sys().(syscall.WaitStatus)
}

func (h *helper) pid() int { return h.cmd.Process.Pid }

// syncBuffer collects a child's stderr while the test may read it.
type syncBuffer struct {
	mu sync.Mutex
	// +checklocks:mu
	b strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var testSeq atomic.Int64

// requireRoot skips tests that need to create cgroups.
// sleeperIn makes the sub-group name of c with a sleeping process in it.
func sleeperIn(t testing.TB, c *Cgroup, name string) (*Cgroup, *helper) {
	t.Helper()
	sub, err := c.Sub(name)
	if err != nil {
		t.Fatal(err)
	}
	h := startCmd(t, "sleep", "1000")
	if err := sub.Add(h.pid()); err != nil {
		t.Fatal(err)
	}
	return sub, h
}

func requireRoot(t testing.TB) {
	t.Helper()
	testenv.Privileged(t, "creating cgroups needs root (run the tests as root; CI does)")
}

// layouts lists the layouts the tests can run on this host: the detected
// one, legacy (v1 freezer, kill loop) where v1 hierarchies exist, and unified
// (on the hybrid host's cgroup2 hierarchy, without limit controllers).
func layouts(t testing.TB) []Mode {
	t.Helper()
	requireRoot(t)
	var out []Mode
	switch cgroups.Mode() {
	case cgroups.Unified:
		out = []Mode{ModeUnified}
	case cgroups.Hybrid:
		out = []Mode{ModeHybrid, ModeUnified}
		if findV1(ctrlFreezer) != "" {
			out = append(out, ModeLegacy)
		}
	case cgroups.Legacy:
		out = []Mode{ModeLegacy}
	default:
		t.Skip("no cgroup hierarchy is mounted here")
	}
	return out
}

// hasLimits reports whether every limit controller is available in mode.
func (m *Manager) hasLimits() bool {
	return len(m.l.ctrl) == len(limitControllers)
}

// newManager makes a Manager with a Root of its own and, at the end of the
// test, checks that no group is left and removes the Root.
func newManager(t testing.TB, mode Mode) *Manager {
	t.Helper()
	requireRoot(t)
	root := fmt.Sprintf("dgtest-%d-%d", os.Getpid(), testSeq.Add(1))
	m, err := New(Config{Root: root, WaitTimeout: 20 * time.Second, force: mode})
	if err != nil {
		t.Fatalf("New(%s): %v", mode, err)
	}
	t.Cleanup(func() {
		left, err := m.List()
		if err != nil {
			t.Error(err)
		}
		for _, n := range left {
			t.Errorf("cgroup %s left behind", n)
			if err := m.Remove(n); err != nil {
				t.Error(err)
			}
		}
		if err := m.RemoveBase(); err != nil {
			t.Error(err)
		}
		dirs := []string{m.heldDir()}
		for _, r := range m.l.roots() {
			dirs = append(dirs, filepath.Join(r, root))
		}
		for _, d := range dirs {
			if _, err := os.Stat(d); d != "" && !os.IsNotExist(err) {
				t.Errorf("%s left behind (%v)", d, err)
			}
		}
	})
	return m
}

// create makes a group that the test deletes at its end.
func create(t testing.TB, m *Manager, name string, lim Limits) *Cgroup {
	t.Helper()
	c, err := m.Create(name, lim)
	if err != nil {
		t.Fatalf("Create(%s, %+v): %v", name, lim, err)
	}
	t.Cleanup(func() {
		if err := c.Delete(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// waitFor polls cond until it holds or the deadline passes. It is for
// conditions no notification exists for (another process's progress).
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// counter reads the value a "count" helper stores in path.
func counter(t testing.TB, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return 0 // not started yet
	}
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSpace(string(b))
	if s == "" {
		return 0
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("counter %q: %v", s, err)
	}
	return v
}

// gone reports whether pid has exited (it may still be a zombie).
func gone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && (s[i+2] == 'Z' || s[i+2] == 'X')
}

// inProcs reports whether pid is listed in dir/cgroup.procs.
func inProcs(t testing.TB, dir string, pid int) bool {
	t.Helper()
	pids, err := readPids(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pids {
		if p == pid {
			return true
		}
	}
	return false
}

// isFrozen reads the group's own freezer setting.
func (c *Cgroup) isFrozen() (bool, error) {
	if c.trackV2 {
		v, err := readInt(filepath.Join(c.track, "cgroup.freeze"))
		return v == 1, err
	}
	v, err := readInt(filepath.Join(c.track, "freezer.self_freezing"))
	return v == 1, err
}
