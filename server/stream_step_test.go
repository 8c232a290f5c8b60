package server_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// streamed is what a StreamStep sent: its output per stream, the number of output messages and
// the step's response.
type streamed struct {
	out    map[deltagymv1.OutputStream]*bytes.Buffer
	chunks int
	resp   *deltagymv1.StepResponse
}

// streamStep calls StreamStep over Connect; each chunk is given to seen as it comes.
func streamStep(ctx context.Context, b *bundle, req *deltagymv1.StepRequest, seen func(*deltagymv1.OutputChunk)) (streamed, error) {
	got := streamed{out: map[deltagymv1.OutputStream]*bytes.Buffer{deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT: {}, deltagymv1.OutputStream_OUTPUT_STREAM_STDERR: {}}}
	st, err := b.connect.StreamStep(ctx, connect.NewRequest(&deltagymv1.StreamStepRequest{Step: req}))
	if err != nil {
		return got, err
	}
	defer st.Close()
	for st.Receive() {
		m := st.Msg()
		if got.resp != nil {
			return got, errors.New("a message after the step's response")
		}
		switch {
		case m.GetOutput() != nil:
			c := m.GetOutput()
			got.out[c.GetStream()].Write(c.GetData())
			got.chunks++
			if seen != nil {
				seen(c)
			}
		case m.GetStep() != nil:
			got.resp = m.GetStep()
		default:
			return got, errors.New("an empty message")
		}
	}
	if err := st.Err(); err != nil {
		return got, err
	}
	if got.resp == nil {
		return got, errors.New("no step response")
	}
	return got, nil
}

// StreamStep sends a command's output while it runs, then the step's response, which the
// ledger records as Step's; other actions send only the response; its errors are Step's.
func TestStreamStep(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	c := connectAPI{b.connect, b.ledger}
	rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(t, err)
	sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
	defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
	box, err := b.srv.Runtime().Get(sb)
	must(t, err)

	// The command waits for a file the test writes once the first line has come: the line came
	// while the command ran.
	cmd := `echo ready; while [ ! -e /tmp/go ]; do sleep 0.01; done; echo done >&2; seq 1 3`
	gate := make(chan struct{}, 1)
	got, err := streamStep(ctx, b, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction(cmd)}, func(ch *deltagymv1.OutputChunk) {
		if bytes.Contains(ch.GetData(), []byte("ready")) {
			must(t, box.WriteFile(ctx, "/tmp/go", nil, 0o644, false))
			gate <- struct{}{}
		}
	})
	must(t, err)
	select {
	case <-gate:
	default:
		t.Fatal("the output did not come before the step's response")
	}
	x := got.resp.GetObservation().GetExec()
	if x.GetExitCode() != 0 || string(x.GetStdout()) != "ready\n1\n2\n3\n" || string(x.GetStderr()) != "done\n" {
		t.Fatalf("the step: %v", got.resp)
	}
	if got.out[deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT].String() != string(x.GetStdout()) ||
		got.out[deltagymv1.OutputStream_OUTPUT_STREAM_STDERR].String() != string(x.GetStderr()) {
		t.Fatalf("streamed %q and %q", got.out[deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT], got.out[deltagymv1.OutputStream_OUTPUT_STREAM_STDERR])
	}
	// A session's output streams too, without its sentinels (busybox has no bash: ash stands in).
	must(t, box.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false))
	got, err = streamStep(ctx, b, &deltagymv1.StepRequest{SandboxId: sb, Action: argvAction(&deltagymv1.ExecAction{Command: "echo in; echo err >&2", Session: "s"})}, nil)
	must(t, err)
	if s := got.out[deltagymv1.OutputStream_OUTPUT_STREAM_STDOUT].String(); s != "in\n" || s != string(got.resp.GetObservation().GetExec().GetStdout()) {
		t.Fatalf("session: streamed %q, response %v", s, got.resp)
	}
	// Other actions send the response alone.
	got, err = streamStep(ctx, b, &deltagymv1.StepRequest{SandboxId: sb, Action: writeFileAction("/tmp/f", []byte("x"))}, nil)
	must(t, err)
	if got.chunks != 0 || got.resp.GetObservation().GetWriteFile().GetSize() != 1 {
		t.Fatalf("write_file: %d chunks, %v", got.chunks, got.resp)
	}
	// The ledger records the steps as Step's.
	obs, _ := stepsRecorded(t, c, ep)
	if len(obs) != 3 || string(obs[0].GetExec().GetStdout()) != "ready\n1\n2\n3\n" || obs[2].GetWriteFile().GetSize() != 1 {
		t.Fatalf("recorded: %v", obs)
	}

	// A client that reads nothing holds the command up in nothing: the step ends (and counts)
	// with megabytes of output unread, far more than the client's HTTP/2 window (64 KiB here)
	// and the sockets' buffers hold, which then all come.
	n0, _ := nextStep(t, c, sb)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	small := &http.Client{Transport: &http.Transport{Protocols: &protos,
		HTTP2: &http.HTTP2Config{MaxReceiveBufferPerConnection: 64 << 10, MaxReceiveBufferPerStream: 64 << 10}}}
	slow := deltagymv1connect.NewEnvServiceClient(small, "http://"+b.addr, connect.WithInterceptors(bearer(b.token)))
	us, err := slow.StreamStep(ctx, connect.NewRequest(&deltagymv1.StreamStepRequest{Step: &deltagymv1.StepRequest{SandboxId: sb,
		Action: execAction("seq 1 400000; seq 1 400000 >&2")}}))
	must(t, err)
	deadline := time.Now().Add(30 * time.Second)
	for n, _ := nextStep(t, c, sb); n != n0+1; n, _ = nextStep(t, c, sb) {
		if time.Now().After(deadline) {
			t.Fatal("the step waits for its client to read its output")
		}
		time.Sleep(10 * time.Millisecond) // the server's progress has no event the client sees
	}
	var outBytes, errBytes int
	var last *deltagymv1.StepResponse
	for us.Receive() {
		if o := us.Msg().GetOutput(); o.GetStream() == deltagymv1.OutputStream_OUTPUT_STREAM_STDERR {
			errBytes += len(o.GetData())
		} else {
			outBytes += len(o.GetData())
		}
		last = us.Msg().GetStep()
	}
	must(t, us.Err())
	us.Close()
	if x := last.GetObservation().GetExec(); !x.GetStdoutTruncated() || outBytes != len(x.GetStdout()) || errBytes != len(x.GetStderr()) || outBytes < 1<<20 {
		t.Fatalf("unread output: %d and %d bytes streamed, response %d and %d", outBytes, errBytes, len(x.GetStdout()), len(x.GetStderr()))
	}

	// Errors are Step's, as the call's error.
	if _, err := streamStep(ctx, b, &deltagymv1.StepRequest{SandboxId: "nope", Action: execAction("true")}, nil); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown sandbox: %v", err)
	}
	if _, err := streamStep(ctx, b, nil, nil); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("no step: %v", err)
	}
	if _, err := streamStep(ctx, b, &deltagymv1.StepRequest{SandboxId: sb}, nil); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("no action: %v", err)
	}

	// Cancelling the call cuts the step short: the command ends, and the step counts.
	before, _ := nextStep(t, c, sb)
	cctx, cancel := context.WithCancel(ctx)
	start := time.Now()
	_, err = streamStep(cctx, b, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo started; exec sleep 100")}, func(ch *deltagymv1.OutputChunk) {
		if strings.Contains(string(ch.GetData()), "started") {
			cancel()
		}
	})
	cancel()
	if connect.CodeOf(err) != connect.CodeCanceled || time.Since(start) > 30*time.Second {
		t.Fatalf("cancelled: %v after %v", err, time.Since(start))
	}
	// The server notices the client left, ends the command and counts the step.
	deadline = time.Now().Add(30 * time.Second)
	for {
		if after, _ := nextStep(t, c, sb); after == before+1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the cancelled step did not end")
		}
		time.Sleep(20 * time.Millisecond) // the server's side of a cancelled call has no event the client sees
	}
	st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_ListProcesses{ListProcesses: &deltagymv1.ListProcessesAction{}}}})
	must(t, err)
	for _, p := range st.GetObservation().GetListProcesses().GetProcesses() {
		if slices.Contains(p.GetArgv(), "100") {
			t.Fatalf("the cancelled command still runs: %v", p)
		}
	}
}

func listProcessesAction() *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_ListProcesses{ListProcesses: &deltagymv1.ListProcessesAction{}}}
}

func signalAction(pid, sig int32, group bool) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Signal{Signal: &deltagymv1.SignalAction{Pid: pid, Signal: sig, ProcessGroup: group}}}
}

// The process actions list the sandbox's processes and signal them, never its init nor anything
// outside it; over Connect and gRPC, recorded in the ledger.
func TestProcessActions(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			bg, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: argvAction(&deltagymv1.ExecAction{Argv: []string{"sleep", "1000"}, Background: true})})
			must(t, err)
			pid := bg.GetObservation().GetExec().GetPid()
			st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: listProcessesAction()})
			must(t, err)
			ps := st.GetObservation().GetListProcesses().GetProcesses()
			i := slices.IndexFunc(ps, func(p *deltagymv1.ProcessInfo) bool { return p.GetPid() == pid })
			if i < 0 || !slices.Equal(ps[i].GetArgv(), []string{"sleep", "1000"}) || ps[i].GetPpid() != 1 || ps[i].GetPgid() != pid {
				t.Fatalf("processes %v, the background command %d", ps, pid)
			}
			// The caller's mistakes change nothing and are not steps.
			n, _ := nextStep(t, c, sb)
			for _, a := range []*deltagymv1.Action{signalAction(1, 9, false), signalAction(1, 9, true), signalAction(0, 9, false),
				signalAction(-pid, 9, false), signalAction(pid, 65, false), signalAction(pid, -1, false)} {
				if _, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: a}); connect.CodeOf(err) != connect.CodeInvalidArgument &&
					!strings.Contains(err.Error(), "InvalidArgument") {
					t.Fatalf("%v: %v, want InvalidArgument", a, err)
				}
			}
			if m, _ := nextStep(t, c, sb); m != n {
				t.Fatalf("refused signals counted as steps: %d then %d", n, m)
			}
			// A pid no process of the sandbox has (this server's own, say) is the agent's ESRCH.
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: signalAction(int32(unix.Getpid()), 9, false)})
			must(t, err)
			if e := st.GetObservation().GetError(); e.GetErrnoName() != "ESRCH" {
				t.Fatalf("a pid outside: %v", st.GetObservation())
			}
			// Signal 0 is SIGTERM.
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: signalAction(pid, 0, false)})
			must(t, err)
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("while kill -0 " + strconv.Itoa(int(pid)) + " 2>/dev/null && ! grep -q Z /proc/" + strconv.Itoa(int(pid)) + "/stat; do sleep 0.01; done; echo gone")})
			must(t, err)
			if stdout(t, st) != "gone\n" {
				t.Fatalf("after SIGTERM: %v", st)
			}
			// The ledger holds the actions as sent.
			tr, err := c.GetTrajectory(ctx, &deltagymv1.GetTrajectoryRequest{EpisodeId: ep})
			must(t, err)
			var sig *deltagymv1.SignalAction
			for _, s := range tr.GetSteps() {
				if x := s.GetAction().GetSignal(); x != nil && x.GetPid() == pid {
					sig = x
				}
			}
			if sig == nil || sig.GetSignal() != 0 || sig.GetProcessGroup() {
				t.Fatalf("recorded: %v", tr.GetSteps())
			}
		})
	}
}

func interactAction(cmd string, expect []string, interrupt bool) *deltagymv1.Action {
	return argvAction(&deltagymv1.ExecAction{Command: cmd, Session: "i", Interactive: true, Expect: expect, Interrupt: interrupt, TimeoutSeconds: 10})
}

// An interactive exec over the API: started, answered at its prompt, given input, interrupted;
// the caller's mistakes refused; the ledger records the flags and where each wait ended.
func TestInteractiveExec(t *testing.T) {
	b := setup(t, nil)
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb, ep := rr.GetSandboxId(), rr.GetEpisodeId()
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			box, err := b.srv.Runtime().Get(sb)
			must(t, err)
			must(t, box.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false))
			prompt := []string{`> $`}
			st, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: interactAction(`sh -c 'while printf "ask> "; read -r l; do echo "got $l"; done'`, prompt, false)})
			must(t, err)
			if x := st.GetObservation().GetExec(); x.GetMatched() != prompt[0] || !x.GetRunning() || string(x.GetStdout()) != "ask" {
				t.Fatalf("start: %v", st.GetObservation())
			}
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: interactAction("hello", prompt, false)})
			must(t, err)
			if x := st.GetObservation().GetExec(); !strings.Contains(string(x.GetStdout()), "got hello") || !x.GetRunning() {
				t.Fatalf("input: %v", st.GetObservation())
			}
			st, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: interactAction("", nil, true)})
			must(t, err)
			if x := st.GetObservation().GetExec(); x.GetRunning() || x.GetMatched() != "" || x.GetSignal() != int32(unix.SIGINT) || x.GetTimedOut() {
				t.Fatalf("interrupt: %v", st.GetObservation())
			}
			n, _ := nextStep(t, c, sb)
			many := make([]string, 17)
			for i := range many {
				many[i] = "x"
			}
			for name, a := range map[string]*deltagymv1.Action{
				"no session":          argvAction(&deltagymv1.ExecAction{Command: "x", Interactive: true}),
				"17 patterns":         interactAction("x", many, false),
				"a pattern too large": interactAction("x", []string{strings.Repeat("a", 1025)}, false),
				"not a pattern":       interactAction("x", []string{"(("}, false),
				"matching nothing":    interactAction("x", []string{"a*"}, false),
				"costly patterns":     interactAction("x", []string{strings.Repeat("[a-z]{1,100}", 40)}, false),
				"expect alone":        argvAction(&deltagymv1.ExecAction{Command: "x", Session: "i", Expect: []string{"x"}}),
				"interrupt alone":     argvAction(&deltagymv1.ExecAction{Session: "i", Interrupt: true}),
				"interrupt with text": interactAction("ls", nil, true),
			} {
				if _, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: a}); err == nil || !strings.Contains(err.Error(), "nvalid") {
					t.Errorf("%s: %v, want InvalidArgument", name, err)
				}
			}
			if m, _ := nextStep(t, c, sb); m != n {
				t.Fatalf("refused steps counted: %d then %d", n, m)
			}
			tr, err := c.GetTrajectory(ctx, &deltagymv1.GetTrajectoryRequest{EpisodeId: ep})
			must(t, err)
			steps := tr.GetSteps()
			if len(steps) != 3 {
				t.Fatalf("recorded %d steps", len(steps))
			}
			first, last := steps[0].GetAction().GetExec(), steps[2].GetAction().GetExec()
			if !first.GetInteractive() || !slices.Equal(first.GetExpect(), prompt) || first.GetInterrupt() ||
				!last.GetInteractive() || !last.GetInterrupt() || last.GetCommand() != "" ||
				steps[0].GetObservation().GetExec().GetMatched() != prompt[0] || !steps[0].GetObservation().GetExec().GetRunning() {
				t.Fatalf("recorded: %v", steps)
			}
		})
	}
}
