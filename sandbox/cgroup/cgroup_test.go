package cgroup

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestValidation(t *testing.T) {
	t.Parallel()
	configs := []struct {
		cfg  Config
		want error
	}{
		{Config{}, nil},
		{Config{Root: "dg_1-x"}, nil},
		{Config{Root: "a/b"}, ErrInvalidConfig},
		{Config{Root: ".."}, ErrInvalidConfig},
		{Config{WaitTimeout: -1}, ErrInvalidConfig},
	}
	for _, tc := range configs {
		t.Run("config "+tc.cfg.Root, func(t *testing.T) {
			if err := tc.cfg.Validate(); !errors.Is(err, tc.want) {
				t.Fatalf("Validate(%+v) = %v, want %v", tc.cfg, err, tc.want)
			}
		})
	}
	names := map[string]bool{"sb-1": true, "A_b-9": true, "": false, "a/b": false, ".": false,
		"..": false, ".x": false, "a.b": false, "tasks": false, "a b": false, strings.Repeat("x", 129): false}
	for name, ok := range names {
		t.Run("name "+name, func(t *testing.T) {
			err := validName(name)
			if ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidName)) {
				t.Fatalf("validName(%q) = %v", name, err)
			}
		})
	}
	limits := map[Limits]bool{{}: true, {MemoryBytes: 1 << 20, Pids: 5, CPUQuota: 0.5}: true,
		{MemoryBytes: -1}: false, {Pids: -1}: false, {CPUQuota: -0.1}: false,
		{CPUQuota: math.NaN()}: false, {CPUQuota: math.Inf(1)}: false,
		{CPUWeight: 1}: true, {CPUWeight: 10000}: true, {CPUWeight: -1}: false, {CPUWeight: 10001}: false}
	for lim, ok := range limits {
		err := lim.Validate()
		if ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalidLimits)) {
			t.Errorf("Validate(%+v) = %v", lim, err)
		}
	}
}

func TestCreateErrors(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			if _, err := m.Create("a/b", Limits{}); !errors.Is(err, ErrInvalidName) {
				t.Errorf("Create(a/b) = %v, want ErrInvalidName", err)
			}
			if _, err := m.Create("x", Limits{Pids: -3}); !errors.Is(err, ErrInvalidLimits) {
				t.Errorf("Create with negative pids = %v, want ErrInvalidLimits", err)
			}
			c := create(t, m, "dup", Limits{})
			if _, err := m.Create("dup", Limits{}); !errors.Is(err, ErrExist) {
				t.Errorf("second Create(dup) = %v, want ErrExist", err)
			}
			if _, err := c.Sub("s"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Sub("s"); !errors.Is(err, ErrExist) {
				t.Errorf("second Sub(s) = %v, want ErrExist", err)
			}
			if !m.hasLimits() {
				if _, err := m.Create("lim", Limits{MemoryBytes: 1 << 25}); !errors.Is(err, ErrControllerUnavailable) {
					t.Errorf("Create with memory limit = %v, want ErrControllerUnavailable", err)
				}
			}
			// The failed Create must not have left a half-made group.
			if names, err := m.List(); err != nil || len(names) != 1 || names[0] != "dup" {
				t.Errorf("List = %v, %v; want [dup]", names, err)
			}
			if err := c.Delete(); err != nil {
				t.Fatal(err)
			}
			if err := c.Freeze(); !errors.Is(err, ErrNotExist) {
				t.Errorf("Freeze after Delete = %v, want ErrNotExist", err)
			}
			if err := c.Add(os.Getpid()); !errors.Is(err, ErrNotExist) {
				t.Errorf("Add after Delete = %v, want ErrNotExist", err)
			}
		})
	}
}

// limitFiles reads back the limit files of c.
func limitFiles(t *testing.T, c *Cgroup) map[string]string {
	t.Helper()
	out := map[string]string{}
	read := func(ctrl, file string) {
		b, err := os.ReadFile(filepath.Join(c.limit[ctrl], file))
		if err != nil {
			t.Fatal(err)
		}
		out[file] = strings.TrimSpace(string(b))
	}
	if c.m.l.ctrlV2[ctrlMemory] {
		read(ctrlMemory, "memory.max")
	} else {
		read(ctrlMemory, "memory.limit_in_bytes")
		read(ctrlMemory, "memory.memsw.limit_in_bytes")
	}
	read(ctrlPids, "pids.max")
	if c.m.l.ctrlV2[ctrlCPU] {
		read(ctrlCPU, "cpu.max")
	} else {
		read(ctrlCPU, "cpu.cfs_quota_us")
		read(ctrlCPU, "cpu.cfs_period_us")
	}
	return out
}

func TestLimits(t *testing.T) {
	const unlimitedV1 = "9223372036854771712" // v1 memory: -1, page-rounded
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			if !m.hasLimits() {
				t.Skipf("the %s layout here has no limit controllers", mode)
			}
			c := create(t, m, "lim", Limits{MemoryBytes: 64 << 20, Pids: 50, CPUQuota: 0.5})
			steps := []struct {
				lim    Limits
				v1, v2 map[string]string
			}{
				{Limits{MemoryBytes: 64 << 20, Pids: 50, CPUQuota: 0.5},
					map[string]string{"memory.limit_in_bytes": "67108864", "memory.memsw.limit_in_bytes": "67108864", "pids.max": "50", "cpu.cfs_quota_us": "50000", "cpu.cfs_period_us": "100000"},
					map[string]string{"memory.max": "67108864", "pids.max": "50", "cpu.max": "50000 100000"}},
				// Raising memory needs memsw first on v1.
				{Limits{MemoryBytes: 256 << 20, Pids: 7, CPUQuota: 1.5},
					map[string]string{"memory.limit_in_bytes": "268435456", "memory.memsw.limit_in_bytes": "268435456", "pids.max": "7", "cpu.cfs_quota_us": "150000", "cpu.cfs_period_us": "100000"},
					map[string]string{"memory.max": "268435456", "pids.max": "7", "cpu.max": "150000 100000"}},
				{Limits{MemoryBytes: 32 << 20, CPUQuota: 0.001},
					map[string]string{"memory.limit_in_bytes": "33554432", "memory.memsw.limit_in_bytes": "33554432", "pids.max": "max", "cpu.cfs_quota_us": "1000", "cpu.cfs_period_us": "100000"},
					map[string]string{"memory.max": "33554432", "pids.max": "max", "cpu.max": "1000 100000"}},
				{Limits{},
					map[string]string{"memory.limit_in_bytes": unlimitedV1, "memory.memsw.limit_in_bytes": unlimitedV1, "pids.max": "max", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
					map[string]string{"memory.max": "max", "pids.max": "max", "cpu.max": "max 100000"}},
			}
			for i, s := range steps {
				if i > 0 {
					if err := c.SetLimits(s.lim); err != nil {
						t.Fatalf("SetLimits(%+v): %v", s.lim, err)
					}
				}
				got := limitFiles(t, c)
				for file, v := range got {
					want, ok := s.v1[file]
					if m.l.ctrlV2[strings.SplitN(file, ".", 2)[0]] {
						want, ok = s.v2[file]
					}
					if !ok || v != want {
						t.Errorf("step %d %+v: %s = %q, want %q", i, s.lim, file, v, want)
					}
				}
			}
			sub, err := c.Sub("exec")
			if err != nil {
				t.Fatal(err)
			}
			if err := sub.SetLimits(Limits{Pids: 3}); !errors.Is(err, ErrSubGroup) {
				t.Errorf("SetLimits on a sub-group = %v, want ErrSubGroup", err)
			}
		})
	}
}

func TestOOMKill(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			if !m.hasLimits() {
				t.Skipf("the %s layout here has no limit controllers", mode)
			}
			const limit = 32 << 20
			c := create(t, m, "oom", Limits{MemoryBytes: limit})
			h := startHelper(t, "hog", nil)
			if err := c.Add(h.pid()); err != nil {
				t.Fatal(err)
			}
			h.open(t)
			ws := h.wait(t)
			if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("hog of 256 MiB in a 32 MiB group ended with %v, want SIGKILL (stderr %q)", ws, h.stderr.String())
			}
			st, err := c.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if st.OOMKills < 1 {
				t.Errorf("Stats.OOMKills = %d, want ≥ 1", st.OOMKills)
			}
			if st.MemoryPeakBytes != 0 && (st.MemoryPeakBytes < limit/2 || st.MemoryPeakBytes > limit+1<<20) {
				t.Errorf("Stats.MemoryPeakBytes = %d, want about the limit %d", st.MemoryPeakBytes, limit)
			}
			t.Logf("stats after OOM: %+v", st)
		})
	}
}

func TestPidsLimit(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			if !m.hasLimits() {
				t.Skipf("the %s layout here has no limit controllers", mode)
			}
			c := create(t, m, "forks", Limits{Pids: 20})
			h := startCmd(t, "sh", "-c", `read x; i=0; while [ $i -lt 200 ]; do sleep 1000 >/dev/null 2>&1 & i=$((i+1)); done; echo all forked`)
			if err := c.Add(h.pid()); err != nil {
				t.Fatal(err)
			}
			h.open(t)
			ws := h.wait(t)
			if ws.ExitStatus() == 0 {
				t.Fatalf("200 forks under pids.max 20 succeeded")
			}
			if !strings.Contains(strings.ToLower(h.stderr.String()), "fork") {
				t.Errorf("stderr %q does not tell of a failed fork", h.stderr.String())
			}
			st, err := c.Stats()
			if err != nil {
				t.Fatal(err)
			}
			pids, err := c.Pids()
			if err != nil {
				t.Fatal(err)
			}
			if st.PidsLimitHits < 1 || st.Pids > 20 || len(pids) == 0 || len(pids) > 20 {
				t.Errorf("Stats %+v, %d pids; want limit hits ≥ 1 and 1..20 pids", st, len(pids))
			}
			// The sleeps are idle: the count holds still.
			if cur, err := c.PidsCurrent(); err != nil || cur != st.Pids {
				t.Errorf("PidsCurrent = %d, %v; Stats said %d", cur, err, st.Pids)
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			if pids, err := c.Pids(); err != nil || len(pids) != 0 {
				t.Fatalf("after Kill: pids %v, %v", pids, err)
			}
		})
	}
}

func TestFreezeThaw(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "freeze", Limits{})
			dir := t.TempDir()
			in, out := filepath.Join(dir, "in"), filepath.Join(dir, "out")
			frozen := startHelper(t, "count", nil, in)
			if err := c.Add(frozen.pid()); err != nil {
				t.Fatal(err)
			}
			// A process left frozen by the v1 freezer could not be
			// killed by the helper's cleanup, which runs before this.
			t.Cleanup(func() { _ = c.Thaw() })
			waitFor(t, "the counter in the group to run", func() bool { return counter(t, in) > 100 })
			// Freezing twice is harmless.
			for range 2 {
				if err := c.Freeze(); err != nil {
					t.Fatal(err)
				}
			}
			before := counter(t, in)
			// A second counter outside the group makes a known amount
			// of progress while the first must make none.
			free := startHelper(t, "count", nil, out)
			waitFor(t, "the counter outside to run", func() bool { return counter(t, out) > 20000 })
			if after := counter(t, in); after != before {
				t.Fatalf("frozen counter moved from %d to %d", before, after)
			}
			if err := c.Thaw(); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the thawed counter to move", func() bool { return counter(t, in) > before })
			_ = free
		})
	}
}

// startTree starts a "tree" helper in c and returns it and its two children,
// the first of which called setsid.
func startTree(t *testing.T, c *Cgroup) (*helper, int, int) {
	t.Helper()
	h := startHelper(t, "tree", nil)
	if err := c.Add(h.pid()); err != nil {
		t.Fatal(err)
	}
	h.open(t)
	f := strings.Fields(h.line(t))
	a, _ := strconv.Atoi(f[0])
	b, _ := strconv.Atoi(f[1])
	if sid, err := unix.Getsid(a); err != nil || sid != a {
		t.Fatalf("getsid(%d) = %d, %v; want a session of its own", a, sid, err)
	}
	return h, a, b
}

func TestKillTree(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "tree", Limits{})
			h, a, b := startTree(t, c)
			pids, err := c.Pids()
			if err != nil || len(pids) != 3 {
				t.Fatalf("Pids = %v, %v; want the helper and its 2 children", pids, err)
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			if ws := h.wait(t); ws.Signal() != syscall.SIGKILL {
				t.Errorf("helper ended with %v, want SIGKILL", ws)
			}
			for _, p := range []int{a, b} {
				if !gone(p) {
					t.Errorf("child %d survived Kill", p)
				}
			}
			if pids, err := c.Pids(); err != nil || len(pids) != 0 {
				t.Errorf("Pids after Kill = %v, %v", pids, err)
			}
			// The group is usable again, and Kill works on a frozen
			// group, which stays frozen.
			h2, _, _ := startTree(t, c)
			t.Cleanup(func() { _ = c.Thaw() })
			if err := c.Freeze(); err != nil {
				t.Fatal(err)
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			if ws := h2.wait(t); ws.Signal() != syscall.SIGKILL {
				t.Errorf("frozen helper ended with %v, want SIGKILL", ws)
			}
			if frozen, err := c.isFrozen(); err != nil || !frozen {
				t.Errorf("after Kill of a frozen group: frozen %v, %v", frozen, err)
			}
			if err := c.Thaw(); err != nil {
				t.Fatal(err)
			}
			h3, _, _ := startTree(t, c)
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			h3.wait(t)
		})
	}
}

func TestSubKill(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "top", Limits{})
			keep := startCmd(t, "sleep", "1000")
			if err := c.Add(keep.pid()); err != nil {
				t.Fatal(err)
			}
			sub, err := c.Sub("exec-1")
			if err != nil {
				t.Fatal(err)
			}
			if sub.Path() != c.Path()+"/exec-1" || sub.Name() != "exec-1" {
				t.Errorf("sub Path %q Name %q", sub.Path(), sub.Name())
			}
			h, a, b := startTree(t, sub)
			for _, d := range sub.Dirs()[1:] {
				// Limit groups are the top group's: the exec is counted
				// against the sandbox's limits.
				if !inProcs(t, d, h.pid()) {
					t.Errorf("sub-group process %d not in %s", h.pid(), d)
				}
			}
			all, err := c.Pids()
			if err != nil || len(all) != 4 {
				t.Fatalf("top Pids = %v, %v; want 4 (its own and the sub-group's)", all, err)
			}
			if err := sub.Kill(); err != nil {
				t.Fatal(err)
			}
			h.wait(t)
			for _, p := range []int{a, b} {
				if !gone(p) {
					t.Errorf("sub-group process %d survived", p)
				}
			}
			if gone(keep.pid()) {
				t.Fatalf("Kill of the sub-group killed the top group's process")
			}
			if left, err := c.Pids(); err != nil || len(left) != 1 || left[0] != keep.pid() {
				t.Errorf("top Pids after sub Kill = %v, %v; want [%d]", left, err, keep.pid())
			}
			for range 2 {
				if err := sub.Delete(); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := os.Stat(sub.Dirs()[0]); !os.IsNotExist(err) {
				t.Errorf("sub-group directory still there: %v", err)
			}
			// A sub-group left in place is removed (and killed) with its parent.
			sub2, err := c.Sub("exec-2")
			if err != nil {
				t.Fatal(err)
			}
			h2, _, _ := startTree(t, sub2)
			if err := c.Delete(); err != nil {
				t.Fatal(err)
			}
			h2.wait(t)
			if ws := keep.wait(t); ws.Signal() != syscall.SIGKILL {
				t.Errorf("top process ended with %v", ws)
			}
		})
	}
}

func TestDeleteTwice(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c, err := m.Create("del", Limits{Pids: boolInt(m.hasLimits(), 10)})
			if err != nil {
				t.Fatal(err)
			}
			h := startCmd(t, "sleep", "1000")
			if err := c.Add(h.pid()); err != nil {
				t.Fatal(err)
			}
			for i := range 2 {
				if err := c.Delete(); err != nil {
					t.Fatalf("Delete #%d: %v", i+1, err)
				}
			}
			if ws := h.wait(t); ws.Signal() != syscall.SIGKILL {
				t.Errorf("process ended with %v, want SIGKILL", ws)
			}
			for _, d := range c.Dirs() {
				if _, err := os.Stat(d); !os.IsNotExist(err) {
					t.Errorf("%s still there: %v", d, err)
				}
			}
		})
	}
}

func boolInt(b bool, v int64) int64 {
	if b {
		return v
	}
	return 0
}

func TestListRemoveLeftovers(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			var hs []*helper
			for _, n := range []string{"a", "b", "c"} {
				c, err := m.Create(n, Limits{})
				if err != nil {
					t.Fatal(err)
				}
				h := startCmd(t, "sleep", "1000")
				hs = append(hs, h)
				switch n {
				case "a":
					err = c.Add(h.pid())
				case "b":
					// A server that crashed in the middle of Add: the
					// process is in the last limit group only.
					err = writeFile(filepath.Join(c.dirs[len(c.dirs)-1], "cgroup.procs"), strconv.Itoa(h.pid()))
					_, _ = c.Sub("exec-1")
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			// A new manager, as after a restart, finds and removes them.
			m2, err := New(m.cfg)
			if err != nil {
				t.Fatal(err)
			}
			names, err := m2.List()
			if err != nil || strings.Join(names, ",") != "a,b,c" {
				t.Fatalf("List = %v, %v; want [a b c]", names, err)
			}
			for _, n := range names {
				if err := m2.Remove(n); err != nil {
					t.Fatalf("Remove(%s): %v", n, err)
				}
			}
			if err := m2.Remove("never-made"); err != nil {
				t.Errorf("Remove of a missing group = %v", err)
			}
			if names, err := m2.List(); err != nil || len(names) != 0 {
				t.Errorf("List after Remove = %v, %v", names, err)
			}
			for _, h := range hs[:2] {
				if ws := h.wait(t); ws.Signal() != syscall.SIGKILL {
					t.Errorf("leftover process ended with %v, want SIGKILL", ws)
				}
			}
			// A base with a group stays; an empty one goes.
			if _, err := m2.Create("kept", Limits{}); err != nil {
				t.Fatal(err)
			}
			if err := m2.RemoveBase(); err != nil {
				t.Fatalf("RemoveBase with a group left: %v", err)
			}
			if err := m2.Remove("kept"); err != nil {
				t.Fatal(err)
			}
			if err := m2.RemoveBase(); err != nil {
				t.Fatal(err)
			}
			for _, r := range m2.l.roots() {
				if _, err := os.Stat(filepath.Join(r, m2.cfg.Root)); !os.IsNotExist(err) {
					t.Errorf("base in %s after RemoveBase: %v", r, err)
				}
			}
		})
	}
}

// TestOpenProcsFromUserNamespace checks that a process in a new user and
// cgroup namespace, whose root is an unprivileged host uid, can move itself
// into the group through cgroup.procs fds opened by host root, and cannot
// open those files itself.
func TestOpenProcsFromUserNamespace(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "userns", Limits{Pids: boolInt(m.hasLimits(), 100)})
			files, err := c.OpenProcs()
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				for _, f := range files {
					f.Close()
				}
			}()
			if len(files) != len(c.Dirs()) {
				t.Fatalf("OpenProcs gave %d files for %d hierarchies", len(files), len(c.Dirs()))
			}
			bin := exposedBinary(t)
			const hostUID = 100000
			h := startHelper(t, "join", func(cmd *exec.Cmd) {
				cmd.Path = bin
				cmd.ExtraFiles = files
				cmd.SysProcAttr = &syscall.SysProcAttr{
					Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWCGROUP,
					UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostUID, Size: 65536}},
					GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostUID, Size: 65536}},
					// Become the namespace's root, host uid 100000.
					Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
				}
			}, strconv.Itoa(len(files)), filepath.Join(c.Dirs()[0], "cgroup.procs"))
			var res joinResult
			if err := json.Unmarshal([]byte(h.line(t)), &res); err != nil {
				t.Fatalf("helper output: %v (stderr %q)", err, h.stderr.String())
			}
			t.Logf("inside: uid %d, writes %q, direct open %q, /proc/self/cgroup %q", res.UID, res.Writes, res.DirectOpen, res.ProcCgroup)
			if res.UID != 0 {
				t.Errorf("helper uid %d inside its namespace, want 0", res.UID)
			}
			for i, e := range res.Writes {
				if e != "" {
					t.Errorf("write of 0 to %s/cgroup.procs from inside: %s", c.Dirs()[i], e)
				}
			}
			if res.DirectOpen == "" {
				t.Errorf("the helper could open cgroup.procs itself; the test proves nothing")
			}
			for _, d := range c.Dirs() {
				if !inProcs(t, d, h.pid()) {
					t.Errorf("helper %d not in %s", h.pid(), d)
				}
			}
			t.Logf("after unshare(CLONE_NEWCGROUP): %q %q", res.Unshare, res.AfterUnshare)
			for _, line := range strings.Split(strings.TrimSpace(res.AfterUnshare), "\n") {
				f := strings.SplitN(line, ":", 3)
				joined := f[1] == "" && m.l.v2 != ""
				for _, d := range c.Dirs()[1:] {
					joined = joined || (f[1] != "" && strings.Contains(d, "/"+f[1]+"/"))
				}
				if joined && f[2] != "/" {
					t.Errorf("in a cgroup namespace made after joining, %q is not the root", line)
				}
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			h.wait(t)
		})
	}
}

// exposedBinary returns the copy of the test binary that an unprivileged uid
// can run (see TestMain).
func exposedBinary(t *testing.T) string {
	t.Helper()
	if exposedBin == "" {
		t.Fatal("no copy of the test binary for unprivileged uids")
	}
	return exposedBin
}

// TestCloneIntoCgroup starts a process directly in the group's v2 directory
// with clone3 CLONE_INTO_CGROUP.
func TestCloneIntoCgroup(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "clone", Limits{})
			sub, err := c.Sub("exec")
			if err != nil {
				t.Fatal(err)
			}
			dir, err := sub.Dir()
			if mode == ModeLegacy {
				if !errors.Is(err, ErrNoV2) {
					t.Fatalf("Dir on legacy = %v, want ErrNoV2", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer dir.Close()
			cmd := exec.Command("sleep", "1000")
			cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd())}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Wait()
			pids, err := sub.Pids()
			if err != nil || len(pids) != 1 || pids[0] != cmd.Process.Pid {
				_ = cmd.Process.Kill()
				t.Fatalf("sub Pids = %v, %v; want [%d]", pids, err, cmd.Process.Pid)
			}
			if err := sub.Kill(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A new manager, as after a restart, opens the groups an earlier one made
// and tells a sub-group frozen on its own from one frozen by its parent or
// thawed.
func TestOpenAndSelfFrozen(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "top", Limits{})
			sub, h := sleeperIn(t, c, "t1")
			t.Cleanup(func() { _ = c.Thaw(); _ = sub.Thaw() })
			if err := sub.Freeze(); err != nil {
				t.Fatal(err)
			}
			m2, err := New(m.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := m2.Open("missing"); !errors.Is(err, ErrNotExist) {
				t.Fatalf("Open of a missing group = %v, want ErrNotExist", err)
			}
			c2, err := m2.Open("top")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c2.OpenSub("t2"); !errors.Is(err, ErrNotExist) {
				t.Fatalf("OpenSub of a missing group = %v, want ErrNotExist", err)
			}
			sub2, err := c2.OpenSub("t1")
			if err != nil {
				t.Fatal(err)
			}
			if pids, err := sub2.Pids(); err != nil || len(pids) != 1 || pids[0] != h.pid() {
				t.Fatalf("Pids of the reopened group = %v, %v", pids, err)
			}
			check := func(what string, want bool) {
				t.Helper()
				if got, err := sub2.SelfFrozen(); err != nil || got != want {
					t.Fatalf("%s: SelfFrozen = %v, %v; want %v", what, got, err, want)
				}
			}
			check("frozen itself", true)
			if err := sub2.Thaw(); err != nil {
				t.Fatal(err)
			}
			check("thawed", false)
			if err := c2.Freeze(); err != nil {
				t.Fatal(err)
			}
			check("frozen by its parent only", false)
			if err := c2.Thaw(); err != nil {
				t.Fatal(err)
			}
			if err := c2.Delete(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// WaitEmpty returns once a killed group's processes are gone, and times
// out while one lives.
func TestWaitEmpty(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "wait", Limits{})
			_, h := sleeperIn(t, c, "w1")
			if err := c.WaitEmpty(20 * time.Millisecond); !errors.Is(err, ErrTimeout) {
				t.Fatalf("WaitEmpty with a live process = %v, want ErrTimeout", err)
			}
			if err := unix.Kill(h.pid(), unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			if err := c.WaitEmpty(5 * time.Second); err != nil {
				t.Fatalf("WaitEmpty after the kill = %v", err)
			}
			if err := c.Delete(); err != nil {
				t.Fatal(err)
			}
			if err := c.WaitEmpty(time.Millisecond); err != nil {
				t.Fatalf("WaitEmpty of a deleted group = %v", err)
			}
		})
	}
}

// Events read through one open file follow the group: empty, a process in a
// sub-group, empty again after the kill, and empty once the group is gone;
// Close is idempotent.
func TestEvents(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "events", Limits{})
			ev, err := c.OpenEvents()
			if err != nil {
				t.Fatal(err)
			}
			if ev == nil {
				if c.trackV2 {
					t.Fatal("OpenEvents = nil on a cgroup2 tracking hierarchy")
				}
				t.Skip("cgroup v1 tracking: no cgroup.events")
			}
			t.Cleanup(func() { ev.Close() })
			populated := func() bool {
				t.Helper()
				p, err := ev.Populated()
				if err != nil {
					t.Fatal(err)
				}
				return p
			}
			if populated() {
				t.Fatal("a new group reads populated")
			}
			_, h := sleeperIn(t, c, "s")
			if !populated() {
				t.Fatal("a group with a process in a sub-group reads empty")
			}
			if err := unix.Kill(h.pid(), unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			h.wait(t)
			if err := c.WaitEmpty(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			if populated() {
				t.Fatal("a group whose process was killed reads populated")
			}
			if err := c.Delete(); err != nil {
				t.Fatal(err)
			}
			if populated() {
				t.Fatal("a deleted group reads populated")
			}
			if err := ev.Close(); err != nil {
				t.Fatal(err)
			}
			if err := ev.Close(); err != nil {
				t.Fatalf("second Close = %v", err)
			}
			if _, err := ev.Populated(); err == nil {
				t.Fatal("Populated after Close succeeded")
			}
		})
	}
}

// FavorDynMods turns the option on in the cgroup2 hierarchy, keeps every
// super option it had, leaves the mount's own flags alone, and does nothing
// once the option is on.
func TestFavorDynMods(t *testing.T) {
	requireRoot(t)
	m, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if m.l.v2 == "" {
		t.Skip("no cgroup2 hierarchy on this host")
	}
	mountFlags := func() string {
		data, err := os.ReadFile("/proc/thread-self/mountinfo")
		if err != nil {
			t.Fatal(err)
		}
		for line := range strings.Lines(string(data)) {
			if f := strings.Fields(line); len(f) > 5 && f[4] == m.l.v2 {
				return f[5]
			}
		}
		t.Fatalf("no mount at %s", m.l.v2)
		return ""
	}
	before, err := superOptions(m.l.v2, "cgroup2")
	if err != nil {
		t.Fatal(err)
	}
	flags := mountFlags()
	changed, err := m.FavorDynMods()
	if err != nil {
		t.Fatal(err)
	}
	after, err := superOptions(m.l.v2, "cgroup2")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(after, "favordynmods") {
		t.Fatalf("options after FavorDynMods: %v", after)
	}
	if changed == slices.Contains(before, "favordynmods") {
		t.Fatalf("FavorDynMods said changed=%v with options %v before", changed, before)
	}
	for _, o := range before {
		if !slices.Contains(after, o) {
			t.Errorf("option %s lost: %v, then %v", o, before, after)
		}
	}
	if f := mountFlags(); f != flags {
		t.Errorf("mount flags changed: %s, then %s", flags, f)
	}
	if changed, err := m.FavorDynMods(); err != nil || changed {
		t.Fatalf("second FavorDynMods: changed=%v, err %v", changed, err)
	}
}

// TestPidList: a kept-open process list answers as Pids does while processes
// and sub-groups come and go, a sub-group removed and made again under its
// name included; the group's removal is ErrNotExist; Close is idempotent.
func TestPidList(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "pidlist", Limits{})
			l, err := c.OpenPids()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(l.Close)
			check := func(step string, want ...int) {
				t.Helper()
				got, err := l.Pids()
				if err != nil {
					t.Fatalf("%s: %v", step, err)
				}
				ref, err := c.Pids()
				if err != nil {
					t.Fatal(err)
				}
				slices.Sort(got)
				slices.Sort(ref)
				slices.Sort(want)
				if !slices.Equal(got, want) || !slices.Equal(ref, want) {
					t.Fatalf("%s: PidList %v, Pids %v, want %v", step, got, ref, want)
				}
			}
			kill := func(h *helper) {
				t.Helper()
				if err := unix.Kill(h.pid(), unix.SIGKILL); err != nil {
					t.Fatal(err)
				}
				h.wait(t)
			}
			check("empty")
			s1, h1 := sleeperIn(t, c, "s1")
			check("one sub-group", h1.pid())
			_, h2 := sleeperIn(t, c, "s2")
			check("two sub-groups", h1.pid(), h2.pid())
			_, h3 := sleeperIn(t, s1, "deep")
			check("a nested sub-group", h1.pid(), h2.pid(), h3.pid())
			h4 := startCmd(t, "sleep", "1000")
			if err := c.Add(h4.pid()); err != nil {
				t.Fatal(err)
			}
			check("a process in the group itself", h1.pid(), h2.pid(), h3.pid(), h4.pid())
			kill(h1)
			kill(h3)
			if err := s1.Delete(); err != nil {
				t.Fatal(err)
			}
			check("a sub-group removed", h2.pid(), h4.pid())
			_, h5 := sleeperIn(t, c, "s1")
			check("made again under its name", h2.pid(), h4.pid(), h5.pid())
			for _, h := range []*helper{h2, h4, h5} {
				kill(h)
			}
			if err := c.WaitEmpty(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			check("all ended")
			if err := c.Delete(); err != nil {
				t.Fatal(err)
			}
			if _, err := l.Pids(); !errors.Is(err, ErrNotExist) {
				t.Fatalf("listing a removed group: %v, want ErrNotExist", err)
			}
			l.Close()
			l.Close()
			if _, err := l.Pids(); err == nil {
				t.Fatal("Pids after Close succeeded")
			}
		})
	}
}

// TestCPUBoost raises a group's CPU weight and sets it back, and checks that
// the weight does what it is for: of two busy processes on one CPU, the one
// in the raised group gets nearly all of it.
func TestCPUBoost(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			m := newManager(t, mode)
			a := create(t, m, "boosted", Limits{})
			b := create(t, m, "plain", Limits{})
			sub, err := a.Sub("w")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = sub.Delete() })
			// Through a sub-group: the top-level group's weight is raised.
			boost, err := sub.OpenCPUBoost()
			if err != nil {
				t.Fatal(err)
			}
			if boost == nil {
				if _, ok := a.limit[ctrlCPU]; ok {
					t.Fatal("OpenCPUBoost = nil for a group with a cpu controller")
				}
				t.Skipf("the %s layout here has no cpu controller", mode)
			}
			t.Cleanup(func() { boost.Close() })
			file, want := "cpu.shares", "102400"
			if m.l.ctrlV2[ctrlCPU] {
				file, want = "cpu.weight", "10000"
			}
			weight := func() string {
				t.Helper()
				v, err := os.ReadFile(filepath.Join(a.limit[ctrlCPU], file))
				if err != nil {
					t.Fatal(err)
				}
				return strings.TrimSpace(string(v))
			}
			normal := weight()

			// Two spinning shells, one per group, on one CPU.
			var cpus unix.CPUSet
			if err := unix.SchedGetaffinity(0, &cpus); err != nil {
				t.Fatal(err)
			}
			cpu := -1
			for i := 0; i < 1024 && cpu < 0; i++ {
				if cpus.IsSet(i) {
					cpu = i
				}
			}
			var one unix.CPUSet
			one.Set(cpu)
			spin := func(g *Cgroup) int {
				h := startCmd(t, "sh", "-c", "while :; do :; done")
				if err := unix.SchedSetaffinity(h.pid(), &one); err != nil {
					t.Fatal(err)
				}
				if err := g.Add(h.pid()); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = unix.Kill(h.pid(), unix.SIGKILL); h.wait(t) })
				return h.pid()
			}
			pa, pb := spin(sub), spin(b)
			// share is pa's part of the CPU time both used over a second.
			share := func() float64 {
				t.Helper()
				a0, b0 := cpuTicks(t, pa), cpuTicks(t, pb)
				time.Sleep(time.Second)
				da, db := cpuTicks(t, pa)-a0, cpuTicks(t, pb)-b0
				if da+db == 0 {
					t.Fatal("the spinning processes used no CPU in a second")
				}
				return float64(da) / float64(da+db)
			}

			if err := boost.Set(true); err != nil {
				t.Fatal(err)
			}
			if got := weight(); got != want {
				t.Fatalf("boosted: %s = %s, want %s", file, got, want)
			}
			if err := boost.Set(true); err != nil {
				t.Fatalf("second Set(true): %v", err)
			}
			s := share()
			t.Logf("boosted: %.1f%% of the CPU", s*100)
			if s < 0.8 {
				t.Errorf("boosted, the group's process got %.0f%% of a shared CPU, want nearly all", s*100)
			}
			if err := boost.Set(false); err != nil {
				t.Fatal(err)
			}
			if got := weight(); got != normal {
				t.Fatalf("unboosted: %s = %s, want %s as found", file, got, normal)
			}
			s = share()
			t.Logf("unboosted: %.1f%% of the CPU", s*100)
			if s > 0.8 {
				t.Errorf("unboosted, the group's process still got %.0f%% of a shared CPU, want about half", s*100)
			}
			if err := boost.Close(); err != nil {
				t.Fatal(err)
			}
			if err := boost.Close(); err != nil {
				t.Fatalf("second Close = %v", err)
			}
			if err := boost.Set(true); err == nil {
				t.Fatal("Set after Close succeeded")
			}
		})
	}
}

// cpuTicks returns the user and system CPU time of pid, in clock ticks.
func cpuTicks(t testing.TB, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	// After the comm: state is field 0; utime and stime are 11 and 12.
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}

// Threads lists every thread of the group and its sub-groups: all of a
// multithreaded process's, and a sub-group's process. MemoryCurrent reads
// the group's charge.
func TestThreadsAndMemoryCurrent(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			var lim Limits
			if m.hasLimits() {
				lim.MemoryBytes = 256 << 20
			}
			c := create(t, m, "threads", lim)
			// The helper is a Go program: it runs several threads.
			h := startHelper(t, "count", nil, filepath.Join(t.TempDir(), "n"))
			if err := c.Add(h.pid()); err != nil {
				t.Fatal(err)
			}
			_, sleeper := sleeperIn(t, c, "sub")
			// The Go runtime starts threads as it goes: compare until
			// both listings agree, with more than one helper thread.
			var got, want []int
			waitFor(t, "Threads to list the helper's threads and the sleeper", func() bool {
				ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", h.pid()))
				if err != nil {
					t.Fatal(err)
				}
				want = []int{sleeper.pid()}
				for _, e := range ents {
					tid, _ := strconv.Atoi(e.Name())
					want = append(want, tid)
				}
				if got, err = c.Threads(); err != nil {
					t.Fatal(err)
				}
				slices.Sort(got)
				slices.Sort(want)
				return len(want) > 2 && slices.Equal(got, want)
			})
			if pids, _ := c.Pids(); len(pids) != 2 {
				t.Errorf("Pids = %v, want the 2 processes", pids)
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
			if got, err := c.Threads(); err != nil || len(got) != 0 {
				t.Errorf("after Kill: Threads = %v, %v", got, err)
			}
			if !m.hasLimits() {
				return
			}
			// Memory a member touches is charged to the group. (On v1 a
			// joining task's earlier pages stay with its old group, so
			// the helper allocates only once it is in.)
			a := startHelper(t, "alloc", nil)
			if err := c.Add(a.pid()); err != nil {
				t.Fatal(err)
			}
			a.open(t)
			if s := a.line(t); s != "allocated" {
				t.Fatalf("alloc helper said %q", s)
			}
			if n, err := c.MemoryCurrent(); err != nil || n < 8<<20 {
				t.Errorf("MemoryCurrent = %d, %v; want ≥ 8 MiB", n, err)
			}
			if err := c.Kill(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A Control kept open does what the group's methods do: freezes and thaws
// through cgroup.freeze, moves a process in through cgroup.procs, kills
// through cgroup.kill. Once the group is removed its writes fail with
// ErrNotExist, and once closed with os.ErrClosed.
func TestControl(t *testing.T) {
	for _, mode := range layouts(t) {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			m := newManager(t, mode)
			c := create(t, m, "control", Limits{})
			if !c.trackV2 {
				if _, err := c.OpenControl("cgroup.freeze"); !errors.Is(err, ErrNoV2) {
					t.Fatalf("OpenControl on cgroup v1 tracking = %v, want ErrNoV2", err)
				}
				t.Skip("cgroup v1 tracking: the group's methods serve")
			}
			sub, err := c.Sub("moved")
			if err != nil {
				t.Fatal(err)
			}
			open := func(g *Cgroup, name string) *Control {
				t.Helper()
				k, err := g.OpenControl(name)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { k.Close() })
				return k
			}
			freeze, procs, kill := open(c, "cgroup.freeze"), open(sub, "cgroup.procs"), open(sub, "cgroup.kill")
			_, h := sleeperIn(t, c, "s")
			if err := freeze.Write("1"); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the group to freeze", func() bool { f, err := c.isFrozen(); return err == nil && f })
			if err := freeze.Write("0"); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "the group to thaw", func() bool { f, err := c.isFrozen(); return err == nil && !f })
			if err := procs.Write(strconv.Itoa(h.pid())); err != nil {
				t.Fatal(err)
			}
			if !inProcs(t, sub.track, h.pid()) {
				t.Fatalf("pid %d is not in %s after the write", h.pid(), sub.track)
			}
			if err := kill.Write("1"); err != nil {
				t.Fatal(err)
			}
			if st := h.wait(t); st.Signal() != unix.SIGKILL {
				t.Fatalf("the sleeper ended with %v, want SIGKILL", st)
			}
			if err := sub.Delete(); err != nil {
				t.Fatal(err)
			}
			if err := kill.Write("1"); !errors.Is(err, ErrNotExist) {
				t.Fatalf("a write to a removed group's cgroup.kill = %v, want ErrNotExist", err)
			}
			if err := freeze.Close(); err != nil {
				t.Fatal(err)
			}
			if err := freeze.Close(); err != nil {
				t.Fatalf("second Close = %v", err)
			}
			if err := freeze.Write("1"); !errors.Is(err, os.ErrClosed) {
				t.Fatalf("a write after Close = %v, want os.ErrClosed", err)
			}
			if f, err := c.isFrozen(); err != nil || f {
				t.Fatalf("the group reads frozen %v (%v) after a write to a closed Control", f, err)
			}
			if _, err := sub.OpenControl("cgroup.procs"); !errors.Is(err, ErrNotExist) {
				t.Fatalf("OpenControl of a removed group = %v, want ErrNotExist", err)
			}
		})
	}
}
