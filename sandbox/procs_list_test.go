package sandbox_test

import (
	"errors"
	"os/exec"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// findProc returns the process of ps with pid.
func findProc(ps []sandbox.Process, pid int) (sandbox.Process, bool) {
	i := slices.IndexFunc(ps, func(p sandbox.Process) bool { return p.Pid == pid })
	if i < 0 {
		return sandbox.Process{}, false
	}
	return ps[i], true
}

// waitProcs waits until s's processes satisfy ok, and returns them.
func waitProcs(t *testing.T, s *sandbox.Sandbox, ok func([]sandbox.Process) bool) []sandbox.Process {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ps, err := s.ListProcesses(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if ok(ps) {
			return ps
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes: %+v", ps)
		}
		time.Sleep(10 * time.Millisecond) // polling /proc: a fork's exec has no event to wait on here
	}
}

// waitProcGone waits until no process of s has pid (or it is a zombie).
func waitProcGone(t *testing.T, s *sandbox.Sandbox, pid int) {
	t.Helper()
	waitProcs(t, s, func(ps []sandbox.Process) bool {
		p, ok := findProc(ps, pid)
		return !ok || p.State == "Z"
	})
}

// ListProcesses shows the sandbox's processes by their pids inside it, with their sessions;
// Signal reaches them, and nothing else.
func TestListAndSignalProcesses(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	ps, err := s.ListProcesses(ctx)
	if err != nil || len(ps) != 0 {
		t.Fatalf("a fresh sandbox's processes: %+v %v", ps, err)
	}
	bg, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sleep", "1000"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "sleep 1001 &"}); err != nil {
		t.Fatal(err)
	}
	// The forked job execs sleep soon after its shell returns.
	ps = waitProcs(t, s, func(ps []sandbox.Process) bool {
		return slices.ContainsFunc(ps, func(q sandbox.Process) bool { return slices.Equal(q.Argv, []string{"sleep", "1001"}) })
	})
	p, ok := findProc(ps, bg.Pid)
	if !ok || !slices.Equal(p.Argv, []string{"sleep", "1000"}) || p.Pgid != bg.Pid || p.Sid != bg.Pid || p.Session != "" ||
		p.State != "S" || p.Age < 0 || p.Age > time.Minute {
		t.Fatalf("the background command %d: %+v in %+v", bg.Pid, p, ps)
	}
	var job sandbox.Process
	for _, q := range ps {
		if q.Pid == 1 {
			t.Fatalf("the init is listed: %+v", ps)
		}
		if slices.Equal(q.Argv, []string{"sleep", "1001"}) {
			job = q
		}
	}
	shell, ok := findProc(ps, job.PPid)
	if job.Session != "main" || !ok || shell.Session != "main" {
		t.Fatalf("the session's job %+v and shell %+v in %+v", job, shell, ps)
	}

	// The attacker's requests: the init, pids that are not, signals that are not, a host pid.
	for _, c := range []struct {
		pid int
		sig unix.Signal
	}{{1, unix.SIGKILL}, {0, unix.SIGKILL}, {-1, unix.SIGKILL}, {-bg.Pid, unix.SIGKILL}, {bg.Pid, 65}, {bg.Pid, -9}} {
		if err := s.Signal(ctx, c.pid, c.sig, false); !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("signal %d to %d: %v, want ErrInvalid", c.sig, c.pid, err)
		}
	}
	if err := s.Signal(ctx, 1, unix.SIGKILL, true); !errors.Is(err, sandbox.ErrInvalid) {
		t.Errorf("signal to the init's group: %v", err)
	}
	host := exec.Command("sleep", "1000")
	if err := host.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = host.Process.Kill(); _ = host.Wait() }()
	var pe *sandbox.ProcError
	for _, pid := range []int{host.Process.Pid, 99999, 4194304} {
		if err := s.Signal(ctx, pid, unix.SIGKILL, false); !errors.As(err, &pe) || pe.Errno != unix.ESRCH {
			t.Errorf("signal to %d, not the sandbox's: %v, want ESRCH", pid, err)
		}
		if err := s.Signal(ctx, pid, unix.SIGKILL, true); !errors.As(err, &pe) || pe.Errno != unix.ESRCH {
			t.Errorf("signal to group %d, not the sandbox's: %v, want ESRCH", pid, err)
		}
	}
	if err := host.Process.Signal(unix.Signal(0)); err != nil {
		t.Fatalf("the host's process was signalled: %v", err)
	}
	if ps, _ := s.ListProcesses(ctx); len(ps) < 3 {
		t.Fatalf("the refused signals ended processes of the sandbox: %+v", ps)
	}

	// Signal 0 is SIGTERM; a process group takes its members.
	if err := s.Signal(ctx, bg.Pid, 0, false); err != nil {
		t.Fatal(err)
	}
	waitProcGone(t, s, bg.Pid)
	if err := s.Signal(ctx, bg.Pid, unix.SIGKILL, false); !errors.As(err, &pe) || pe.Errno != unix.ESRCH {
		t.Fatalf("signal to a process gone: %v", err)
	}
	grp, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1002 & sleep 1003 & wait", Background: true})
	if err != nil {
		t.Fatal(err)
	}
	var members []int
	waitProcs(t, s, func(ps []sandbox.Process) bool {
		members = nil
		for _, q := range ps {
			if q.Pgid == grp.Pid && len(q.Argv) > 0 && q.Argv[0] == "sleep" {
				members = append(members, q.Pid)
			}
		}
		return len(members) == 2
	})
	members = append(members, grp.Pid)
	if err := s.Signal(ctx, grp.Pid, unix.SIGKILL, true); err != nil {
		t.Fatal(err)
	}
	for _, m := range members {
		waitProcGone(t, s, m)
	}
	if ps, _ := s.ListProcesses(ctx); len(ps) != 2 { // the session's shell and its job
		t.Fatalf("after the signals: %+v", ps)
	}
}
