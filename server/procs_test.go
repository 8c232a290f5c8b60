package server_test

import (
	"fmt"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/locate"
	"github.com/deltagym/deltagym/server"
)

func sessionAction(cmd string) *deltagymv1.Action {
	return &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: cmd, Session: "main"}}}
}

// TestProcessCheckpointOverAPI: a session's shell is captured by a Checkpoint (reported with
// its method) and comes back on Restore with its working directory and variables; process
// mode FILESYSTEM captures none; a fork of a state with processes is refused clearly.
func TestProcessCheckpointOverAPI(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	step := func(a *deltagymv1.Action) string {
		t.Helper()
		res, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: a}))
		must(t, err)
		ex := res.Msg.GetObservation().GetExec()
		if ex.GetExitCode() != 0 {
			t.Fatalf("step: exit %d: %s", ex.GetExitCode(), ex.GetStderr())
		}
		return string(ex.GetStdout())
	}
	// busybox has no bash: stand ash in for it.
	step(execAction("printf '#!/bin/sh\\nexec /bin/busybox ash\\n' > /bin/bash && chmod +x /bin/bash"))
	step(sessionAction("mkdir -p /work && cd /work && export X=kept"))
	ck, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb}))
	must(t, err)
	ps := ck.Msg.GetProcesses()
	if len(ps) != 1 || ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE {
		t.Fatalf("captured %v", ps)
	}
	if ck.Msg.GetDurable() || ps[0].GetSaved() || !strings.Contains(ps[0].GetUnsavedReason(), "durable") {
		t.Fatalf("a checkpoint holding a template reported durable %v, %v", ck.Msg.GetDurable(), ps[0])
	}
	step(sessionAction("cd / && export X=changed"))
	_, err = b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: ck.Msg.GetCheckpointId()}))
	must(t, err)
	if got := step(sessionAction("echo $X; pwd")); got != "kept\n/work\n" {
		t.Log(step(execAction("cat /proc/*/status | grep -E 'Name|State|^Pid'; ls -l /proc/*/fd/ 2>&1; true")))
		t.Fatalf("session after restore: %q", got)
	}
	// A fork carries the session through a CRIU image of its template (without criu, it
	// starts from the files and says which process it left behind).
	_, criuErr := locate.CRIU()
	fr, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.Msg.GetCheckpointId()}, N: 1}))
	must(t, err)
	ps = fr.Msg.GetProcesses()
	switch {
	case len(ps) != 1:
		t.Fatalf("fork of a checkpoint with processes reported %v", ps)
	case criuErr != nil && (ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_NONE || !strings.Contains(ps[0].GetReason(), "CRIU")):
		t.Fatalf("fork without criu reported %v", ps)
	case criuErr == nil && ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU:
		t.Fatalf("fork reported %v", ps)
	}
	if criuErr == nil {
		res, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: fr.Msg.GetSandboxIds()[0], Action: sessionAction("echo $X; pwd")}))
		must(t, err)
		if got := string(res.Msg.GetObservation().GetExec().GetStdout()); got != "kept\n/work\n" {
			t.Fatalf("session in a fork: %q", got)
		}
		// The fork reports the pid the child has the process at: its template's.
		res, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: fr.Msg.GetSandboxIds()[0], Action: sessionAction("/bin/busybox sh -c 'echo $PPID'")}))
		must(t, err)
		if got, want := strings.TrimSpace(string(res.Msg.GetObservation().GetExec().GetStdout())), fmt.Sprint(ps[0].GetPid()); got != want {
			t.Fatalf("the session's shell in a fork is pid %s; the fork reported %s (%s)", got, want, ps[0].GetReason())
		}
	}
	fs, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb, ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_FILESYSTEM}))
	must(t, err)
	if len(fs.Msg.GetProcesses()) != 0 {
		t.Fatalf("files-only checkpoint captured %v", fs.Msg.GetProcesses())
	}
	// Fork from the sandbox itself carries its session too.
	fk, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 2, FreshEntropy: true}))
	must(t, err)
	if len(fk.Msg.GetSandboxIds()) != 2 {
		t.Fatalf("fork: %v", fk.Msg)
	}
	if criuErr != nil {
		t.Skipf("the CRIU part needs criu (make criu): %v", criuErr)
	}
	dk, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb, Durable: true}))
	must(t, err)
	if !dk.Msg.GetDurable() {
		t.Fatalf("a checkpoint asked durable reported not durable: %v", dk.Msg.GetProcesses())
	}
	for _, p := range dk.Msg.GetProcesses() {
		if !p.GetSaved() || p.GetUnsavedReason() != "" {
			t.Fatalf("a durable checkpoint reported %v", p)
		}
	}
	for _, kid := range fk.Msg.GetSandboxIds() {
		res, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: kid, Action: sessionAction("echo $X")}))
		must(t, err)
		if got := string(res.Msg.GetObservation().GetExec().GetStdout()); got != "kept\n" {
			t.Fatalf("session in a fork of the sandbox: %q", got)
		}
	}
	// A shell brought back from a template maps files of the root it was made in, a mount
	// detached since: CRIU saves it all the same, and it comes back in place and in a fork.
	cc, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb, ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_CRIU}))
	must(t, err)
	if ps := cc.Msg.GetProcesses(); len(ps) != 1 || ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU {
		t.Fatalf("CRIU checkpoint of a template copy captured %v", ps)
	}
	step(sessionAction("cd / && export X=again"))
	_, err = b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: cc.Msg.GetCheckpointId()}))
	must(t, err)
	if got := step(sessionAction("echo $X; pwd")); got != "kept\n/work\n" {
		t.Fatalf("session after restoring its CRIU image: %q", got)
	}
	fc, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: cc.Msg.GetCheckpointId()}, N: 1}))
	must(t, err)
	res, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: fc.Msg.GetSandboxIds()[0], Action: sessionAction("echo $X; pwd")}))
	must(t, err)
	if got := string(res.Msg.GetObservation().GetExec().GetStdout()); got != "kept\n/work\n" {
		t.Fatalf("session in a fork of the CRIU checkpoint: %q", got)
	}
	// A background process saved with CRIU runs in every fork of the checkpoint.
	rr2, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
	must(t, err)
	sb2 := rr2.Msg.GetSandboxId()
	_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb2,
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Argv: []string{"sleep", "1000"}, Background: true}}}}))
	must(t, err)
	ck2, err := b.connect.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb2, ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_CRIU}))
	must(t, err)
	if ps := ck2.Msg.GetProcesses(); len(ps) != 1 || ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU || ps[0].GetReason() == "" {
		t.Fatalf("CRIU checkpoint captured %v", ps)
	}
	fr2, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck2.Msg.GetCheckpointId()}, N: 2}))
	must(t, err)
	if ps := fr2.Msg.GetProcesses(); len(ps) != 1 || ps[0].GetMethod() != deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU {
		t.Fatalf("fork of a CRIU checkpoint reported %v", ps)
	}
	for _, kid := range fr2.Msg.GetSandboxIds() {
		res, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: kid, Action: execAction("grep -l '[s]leep' /proc/[0-9]*/cmdline | wc -l")}))
		must(t, err)
		if got := strings.TrimSpace(string(res.Msg.GetObservation().GetExec().GetStdout())); got != "1" {
			t.Fatalf("fork %s runs %q sleep processes, want 1", kid, got)
		}
	}
}
