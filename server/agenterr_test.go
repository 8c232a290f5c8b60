package server_test

import (
	"errors"
	"fmt"
	"math"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox/fscred"
)

func readFileAction(path string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_ReadFile{ReadFile: &deltagymv1.ReadFileAction{Path: path}}}
}

func writeFileAction(path string, content []byte) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: path, Content: content}}}
}

func argvAction(x *deltagymv1.ExecAction) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: x}}
}

// nextStep returns the index of sb's next step and whether its episode is still going.
func nextStep(t *testing.T, c api, sb string) (int32, bool) {
	t.Helper()
	g, err := c.GetSandbox(t.Context(), &deltagymv1.GetSandboxRequest{SandboxId: sb})
	must(t, err)
	return g.GetSandbox().GetNextStepIndex(), g.GetSandbox().GetState() == deltagymv1.SandboxState_SANDBOX_STATE_READY
}

// stepsRecorded returns the observations of episode ep's steps in the ledger, by index.
func stepsRecorded(t *testing.T, c api, ep string) (map[int32]*deltagymv1.Observation, deltagymv1.EpisodeStatus) {
	t.Helper()
	tr, err := c.GetTrajectory(t.Context(), &deltagymv1.GetTrajectoryRequest{EpisodeId: ep})
	must(t, err)
	obs := map[int32]*deltagymv1.Observation{}
	for _, s := range tr.GetSteps() {
		obs[s.GetStepIndex()] = s.GetObservation()
	}
	return obs, tr.GetEpisode().GetStatus()
}

// A file action or an argv that the sandbox's own state refuses (a FIFO, a socket, a running
// binary, a directory or nothing at the path; a program missing or not executable; a missing
// working directory) is the agent's: the step answers with the observation's error (errno, its
// name, a message), is recorded in the ledger with it, the episode goes on, and the next step
// works. Through the real server over Connect and gRPC.
func TestAgentStateIsObserved(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c := cl.c
			rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
			st, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb,
				Action: execAction("mkfifo /tmp/fifo && cp /bin/busybox /tmp/sleep && mkdir /tmp/dir")})
			must(t, err)
			if code := st.GetObservation().GetExec().GetExitCode(); code != 0 {
				t.Fatalf("preparing the sandbox: exit %d, %s", code, st.GetObservation().GetExec().GetStderr())
			}
			// A copy of busybox kept running, so that its file is busy.
			_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb,
				Action: argvAction(&deltagymv1.ExecAction{Argv: []string{"/tmp/sleep", "1000"}, Background: true})})
			must(t, err)
			// A unix socket in the sandbox's filesystem, bound from outside through the init's root.
			box, err := b.srv.Runtime().Get(sb)
			must(t, err)
			// It is made with the host ids of the sandbox's root (those of its /tmp), which its
			// idmapped layers can store.
			tmp := filepath.Join(fmt.Sprintf("/proc/%d/root", box.InitPid()), "tmp")
			var owner unix.Stat_t
			must(t, unix.Stat(tmp, &owner))
			must(t, fscred.Run(int(owner.Uid), int(owner.Gid), true, func() error {
				ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(tmp, "sock"), Net: "unix"})
				if err != nil {
					return err
				}
				ln.SetUnlinkOnClose(false)
				return errors.Join(ln.Close(), unix.Chmod(filepath.Join(tmp, "sock"), 0o777))
			}))
			cases := []struct {
				name   string
				action *deltagymv1.Action
				errno  unix.Errno
			}{
				{"write to a FIFO with no reader", writeFileAction("/tmp/fifo", []byte("x")), unix.ENXIO},
				{"read a FIFO", readFileAction("/tmp/fifo"), unix.EINVAL},
				{"read a unix socket", readFileAction("/tmp/sock"), unix.ENXIO},
				{"write to a unix socket", writeFileAction("/tmp/sock", []byte("x")), unix.ENXIO},
				{"write to a running binary", writeFileAction("/tmp/sleep", []byte("x")), unix.ETXTBSY},
				{"read a directory", readFileAction("/tmp/dir"), unix.EISDIR},
				{"read a missing file", readFileAction("/no/such/file"), unix.ENOENT},
				{"read through /proc", readFileAction("/proc/1/environ"), unix.EXDEV},
				{"write through /proc", writeFileAction("/proc/1/root/x", []byte("x")), unix.EXDEV},
				{"exec a missing program", argvAction(&deltagymv1.ExecAction{Argv: []string{"/no/such/program"}}), unix.ENOENT},
				{"exec a FIFO", argvAction(&deltagymv1.ExecAction{Argv: []string{"/tmp/fifo"}}), unix.EACCES},
				{"exec in a missing directory", argvAction(&deltagymv1.ExecAction{Argv: []string{"true"}, Cwd: "/no/such/dir"}), unix.ENOENT},
			}
			want := map[int32]unix.Errno{}
			for _, tc := range cases {
				idx, _ := nextStep(t, c, sb)
				st, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: tc.action})
				if err != nil {
					t.Fatalf("%s: %v (%v), want an observation error %s", tc.name, err, codeOf(err), unix.ErrnoName(tc.errno))
				}
				e := st.GetObservation().GetError()
				if e.GetErrno() != int32(tc.errno) || e.GetErrnoName() != unix.ErrnoName(tc.errno) || e.GetMessage() == "" ||
					st.GetObservation().GetKind() != nil {
					t.Fatalf("%s: observation %v, want only an error %s", tc.name, st.GetObservation(), unix.ErrnoName(tc.errno))
				}
				if st.GetStepIndex() != idx || st.GetTerminated() || st.GetTruncated() {
					t.Fatalf("%s: step %d (terminated %v, truncated %v), want step %d going on", tc.name, st.GetStepIndex(), st.GetTerminated(), st.GetTruncated(), idx)
				}
				want[idx] = tc.errno
				// The episode goes on: the next step works.
				ok, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo ok")})
				if err != nil || stdout(t, ok) != "ok\n" {
					t.Fatalf("%s: the next step: %v", tc.name, err)
				}
			}
			recorded, status := stepsRecorded(t, c, ep)
			if status != deltagymv1.EpisodeStatus_EPISODE_STATUS_RUNNING {
				t.Fatalf("episode status %v, want running", status)
			}
			for idx, errno := range want {
				if got := recorded[idx].GetError(); got.GetErrno() != int32(errno) || got.GetMessage() == "" {
					t.Errorf("ledger step %d: observation %v, want the error %s", idx, recorded[idx], unix.ErrnoName(errno))
				}
			}
		})
	}
}

// A request that is wrong whatever the sandbox holds (an argv past the init's limits, a NUL
// byte in a variable, '=' in a variable's name, a timeout that is NaN, infinite or negative) is
// refused with InvalidArgument and a message that says what to change, before anything runs:
// no step is recorded or counted, and the episode goes on.
func TestCallerInputIsRefused(t *testing.T) {
	b := setup(t, nil)
	many := make([]string, 6004)
	for i := range many {
		many[i] = "x"
	}
	big := strings.Repeat("y", 70<<10)
	cases := []struct {
		name string
		exec *deltagymv1.ExecAction
		hint string
	}{
		{"argv over 200 KiB", &deltagymv1.ExecAction{Argv: []string{"true", big, big, big}}, "at most 204800"},
		{"argv of 6004 entries", &deltagymv1.ExecAction{Argv: append([]string{"true"}, many...)}, "at most 4094"},
		{"argv entry over 128 KiB", &deltagymv1.ExecAction{Argv: []string{"true", strings.Repeat("z", 150<<10)}}, "at most 131071"},
		{"NUL in an env value", &deltagymv1.ExecAction{Argv: []string{"true"}, Env: map[string]string{"A": "x\x00y"}}, "NUL"},
		{"= in an env key", &deltagymv1.ExecAction{Command: "true", Env: map[string]string{"A=B": "x"}}, "'='"},
		{"NaN timeout", &deltagymv1.ExecAction{Command: "true", TimeoutSeconds: math.NaN()}, "finite"},
		{"infinite timeout", &deltagymv1.ExecAction{Command: "true", TimeoutSeconds: math.Inf(1)}, "finite"},
		{"negative timeout", &deltagymv1.ExecAction{Command: "true", TimeoutSeconds: -1}, "finite"},
	}
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c := cl.c
			rr, err := c.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: sb})
			_, err = c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
			must(t, err)
			for _, tc := range cases {
				before, _ := nextStep(t, c, sb)
				_, err := c.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: sb, Action: argvAction(tc.exec)})
				if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), tc.hint) {
					t.Fatalf("%s: %v, want InvalidArgument saying %q", tc.name, err, tc.hint)
				}
				if after, going := nextStep(t, c, sb); after != before || !going {
					t.Fatalf("%s: next step %d (going %v), want %d going", tc.name, after, going, before)
				}
			}
			recorded, status := stepsRecorded(t, c, ep)
			if len(recorded) != 1 || status != deltagymv1.EpisodeStatus_EPISODE_STATUS_RUNNING {
				t.Fatalf("ledger: %d steps, status %v; want the one step that ran, running", len(recorded), status)
			}
		})
	}
}
