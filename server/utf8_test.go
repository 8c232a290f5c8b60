package server_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// Names a sandbox chose that are not UTF-8 — a file named b"/tmp/bad\xff\nname", a process
// named b"ev\xff\xfeil", an argument b"ar\xffg" — break no call: Checkpoint, Step (ListDir,
// ListProcesses), DiffCheckpoints at each detail and Fork answer, with each such byte as
// U+FFFD, over Connect (binary and JSON) and gRPC; the ledger records the observations so too.
func TestNamesNotUTF8(t *testing.T) {
	b := setup(t, nil)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	h2c := &http.Client{Transport: &http.Transport{Protocols: &protos}}
	opts := []connect.ClientOption{connect.WithProtoJSON(), connect.WithInterceptors(bearer(b.token))}
	clients := append(b.clients(), struct {
		name string
		c    api
	}{"connect-json", connectAPI{deltagymv1connect.NewEnvServiceClient(h2c, "http://"+b.addr, opts...),
		deltagymv1connect.NewLedgerServiceClient(h2c, "http://"+b.addr, opts...)}})
	const (
		file    = "/tmp/bad\uFFFD\nname"
		process = "ev\uFFFD\uFFFDil"
		arg     = "ar\uFFFDg"
	)
	for _, cl := range clients {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
			must(t, err)
			sb := rr.GetSandboxId()
			step := func(a *deltagymv1.Action) *deltagymv1.StepResponse {
				t.Helper()
				r, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: a})
				must(t, err)
				if ex := r.GetObservation().GetExec(); ex != nil && ex.GetExitCode() != 0 {
					t.Fatalf("exit %d: %s", ex.GetExitCode(), ex.GetStderr())
				}
				return r
			}
			// busybox has no bash: stand ash in for it, with an argument that is not UTF-8 (its
			// byte in the script itself: a command substitution would fork while the session
			// looks for its one shell). The session's shell renames itself.
			step(writeFileAction("/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash -s 'ar\xffg'\n")))
			step(execAction(`chmod +x /bin/bash && touch "$(printf '/tmp/bad\377\nname')" && rm /tmp/plain`))
			step(sessionAction(`printf 'ev\377\376il' > /proc/$$/comm`))

			ls := step(&deltagymv1.Action{Kind: &deltagymv1.Action_ListDir{ListDir: &deltagymv1.ListDirAction{Path: "/tmp"}}})
			var names []string
			for _, e := range ls.GetObservation().GetListDir().GetEntries() {
				names = append(names, e.GetPath())
			}
			if !slices.Contains(names, "bad\uFFFD\nname") {
				t.Fatalf("ListDir /tmp: %q", names)
			}
			lp := step(&deltagymv1.Action{Kind: &deltagymv1.Action_ListProcesses{ListProcesses: &deltagymv1.ListProcessesAction{}}})
			found := false
			for _, p := range lp.GetObservation().GetListProcesses().GetProcesses() {
				found = found || slices.Contains(p.GetArgv(), arg)
			}
			if !found {
				t.Fatalf("ListProcesses: %v", lp.GetObservation().GetListProcesses().GetProcesses())
			}

			ck, err := c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: sb})
			must(t, err)
			var commands []string
			for _, p := range ck.GetProcesses() {
				commands = append(commands, p.GetCommand())
			}
			if ck.GetCheckpointId() == "" || !slices.Contains(commands, process) {
				t.Fatalf("Checkpoint: %v", ck)
			}
			// The same through a step that checkpoints.
			sr, err := c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Checkpoint: true, Action: execAction("true")})
			must(t, err)
			if sr.GetCheckpointId() == "" {
				t.Fatalf("Step with checkpoint: %v", sr)
			}

			for _, detail := range []deltagymv1.DiffDetail{deltagymv1.DiffDetail_DIFF_DETAIL_PATHS, deltagymv1.DiffDetail_DIFF_DETAIL_LINES,
				deltagymv1.DiffDetail_DIFF_DETAIL_UNIFIED} {
				d, err := c.DiffCheckpoints(ctx, &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: rr.GetCheckpointId(),
					CheckpointId: ck.GetCheckpointId(), Detail: detail})
				must(t, err)
				var paths, procs []string
				for _, p := range d.GetPaths() {
					paths = append(paths, p.GetPath()+" "+p.GetKind().String())
				}
				for _, p := range d.GetProcesses() {
					procs = append(procs, p.GetCommand()+" "+p.GetKind().String())
				}
				if !slices.Contains(paths, file+" CHANGE_KIND_ADDED") || !slices.Contains(paths, "/tmp/plain CHANGE_KIND_REMOVED") {
					t.Fatalf("%s: paths %q", detail, paths)
				}
				if !slices.Contains(procs, "/bin/busybox ash -s "+arg+" CHANGE_KIND_ADDED") {
					t.Fatalf("%s: processes %q", detail, procs)
				}
				// And the other way, where it is removed.
				back, err := c.DiffCheckpoints(ctx, &deltagymv1.DiffCheckpointsRequest{BaseCheckpointId: ck.GetCheckpointId(),
					CheckpointId: rr.GetCheckpointId(), Detail: detail, Path: "/tmp"})
				must(t, err)
				if len(back.GetPaths()) == 0 || !strings.HasPrefix(back.GetPaths()[0].GetPath(), "/tmp/") {
					t.Fatalf("%s: reverse diff %v", detail, back.GetPaths())
				}
			}

			fr, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.GetCheckpointId()}, N: 1})
			must(t, err)
			commands = commands[:0]
			for _, p := range fr.GetProcesses() {
				commands = append(commands, p.GetCommand())
			}
			if len(fr.GetSandboxIds()) != 1 || !slices.Contains(commands, process) {
				t.Fatalf("Fork: %v", fr)
			}
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: fr.GetSandboxIds()[0]})
			must(t, err)

			// The ledger holds the observations as the API sent them.
			obs, _ := stepsRecorded(t, c, rr.GetEpisodeId())
			if got := obs[ls.GetStepIndex()].GetListDir().GetEntries(); len(got) != len(names) {
				t.Fatalf("the ledger's ListDir: %v, want %q", got, names)
			}
			if got := obs[lp.GetStepIndex()].GetListProcesses().GetProcesses(); len(got) == 0 {
				t.Fatalf("the ledger's ListProcesses: %v", got)
			}
		})
	}
}
