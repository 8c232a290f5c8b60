package server_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/server"
)

// shellSpec is the shipped envs/shell.json on the test image (busybox: its setup keeps only
// mkdir -p /work), with a short step timeout so that a verifier that hangs fails fast.
func shellSpec(t testing.TB) *deltagymv1.EnvSpec {
	t.Helper()
	data, err := os.ReadFile("../envs/shell.json")
	must(t, err)
	spec, err := envpool.ParseSpec(data)
	must(t, err)
	spec.Image, spec.Setup, spec.PoolSize = "default", []string{"mkdir -p /work"}, 2
	spec.Limits.StepTimeoutSeconds = 5
	return spec
}

// attack is what an agent does before it is judged, and the reward it must get.
type attack struct {
	name    string
	options map[string]string
	steps   []string
	reward  float64
}

// judge resets env with a's options, runs a's steps and returns the reward of Evaluate and
// then of a submit, checking that the episode ends terminated (never failed).
func (b *bundle) judge(t *testing.T, env string, a attack) (evaluated, submitted float64) {
	t.Helper()
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: env, Options: a.options}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	defer b.connect.Close(context.WithoutCancel(ctx), connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: sb}))
	for _, s := range a.steps {
		_, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction(s)}))
		must(t, err)
	}
	ev, err := b.connect.Evaluate(ctx, connect.NewRequest(&deltagymv1.EvaluateRequest{SandboxId: sb}))
	must(t, err)
	st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb,
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}}))
	must(t, err)
	if !st.Msg.GetTerminated() || st.Msg.GetInfo()["verifier_error"] != "" {
		t.Fatalf("submit after %q: %v", a.steps, st.Msg)
	}
	e := b.episode(t, rr.Msg.GetEpisodeId()).GetEpisode()
	if e.GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_TERMINATED {
		t.Fatalf("episode after %q: %v", a.steps, e)
	}
	t.Logf("%s: evaluate %v (%q), submit %v (%q)", a.name, ev.Msg.GetReward(), ev.Msg.GetOutput(),
		st.Msg.GetReward(), st.Msg.GetObservation().GetSubmit().GetOutput())
	return ev.Msg.GetReward(), st.Msg.GetReward()
}

// The shipped shell env's reward cannot be gamed: whatever the agent does to its own sandbox,
// only a right /work/answer.txt, a regular file, earns 1; Evaluate and submit agree.
func TestShellRewardIntegrity(t *testing.T) {
	b := setup(t, nil)
	b.register(t, shellSpec(t))
	const secret = "s3cret-7f1c9"
	for _, a := range []attack{
		{name: "honest", steps: []string{"echo 42 > /work/answer.txt"}, reward: 1},
		{name: "honest, expected from the reset option", options: map[string]string{"EXPECTED": "17"},
			steps: []string{"echo 17 > /work/answer.txt"}, reward: 1},
		{name: "default answer to another task", options: map[string]string{"EXPECTED": "17"},
			steps: []string{"echo 42 > /work/answer.txt"}, reward: 0},
		{name: "copies the expected file", steps: []string{"cat /work/.expected > /work/answer.txt"}, reward: 0},
		{name: "copies whatever it can read", options: map[string]string{"EXPECTED": secret}, steps: []string{
			"(cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline; find / -xdev -type f -exec cat {} \\;) 2>/dev/null | tr '\\0' '\\n' | grep -o 's3cre[t]-[0-9a-f][0-9a-f]*' | head -n 1 > /work/answer.txt; true"},
			reward: 0},
		{name: "cat shim", steps: []string{"mkdir -p /usr/local/bin && printf '#!/bin/sh\\necho 42\\n' > /usr/local/bin/cat && chmod +x /usr/local/bin/cat"}, reward: 0},
		{name: "shell shim", steps: []string{"mkdir -p /opt && cp /bin/busybox /opt/busybox && printf '#!/opt/busybox sh\\necho 1\\n' > /bin/fake && chmod +x /bin/fake && mv /bin/fake /bin/busybox"}, reward: 0},
		{name: "symlink to the expected file", steps: []string{"ln -s /work/.expected /work/answer.txt"}, reward: 0},
		{name: "symlink to /etc/passwd", steps: []string{"ln -s /etc/passwd /work/answer.txt"}, reward: 0},
		{name: "FIFO", steps: []string{"mkfifo /work/answer.txt"}, reward: 0},
		{name: "FIFO with a writer", steps: []string{"mkfifo /work/answer.txt", "(while :; do echo 42 > /work/answer.txt; done) >/dev/null 2>&1 &"}, reward: 0},
	} {
		t.Run(a.name, func(t *testing.T) {
			ev, sub := b.judge(t, "shell", a)
			if ev != a.reward || sub != a.reward {
				t.Fatalf("%q: evaluate gave %v, submit %v; want %v", a.steps, ev, sub, a.reward)
			}
		})
	}
	t.Run("the secret is not in the reset's answer", func(t *testing.T) {
		rr, err := b.connect.Reset(t.Context(), connect.NewRequest(&deltagymv1.ResetRequest{Env: "shell", Options: map[string]string{"EXPECTED": secret}}))
		must(t, err)
		defer b.connect.Close(context.WithoutCancel(t.Context()), connect.NewRequest(&deltagymv1.CloseRequest{SandboxId: rr.Msg.GetSandboxId()}))
		if s := rr.Msg.String(); strings.Contains(s, secret) {
			t.Fatalf("reset answer holds the secret: %s", s)
		}
	})
}

// judgedSpec is an env whose verifier is a hidden file (verifier_files "judged" below the
// import root: check.sh and expected.txt) judging the copied directory /work/out.
func judgedSpec() *deltagymv1.EnvSpec {
	return &deltagymv1.EnvSpec{Name: "judged", Image: "default", PoolSize: 2, Setup: []string{"mkdir -p /work"},
		Verifier: "sh /verifier/check.sh", Limits: &deltagymv1.Limits{StepTimeoutSeconds: 5},
		Evaluation: &deltagymv1.Evaluation{Mode: deltagymv1.VerifierMode_VERIFIER_MODE_PRISTINE, CopyPaths: []string{"/work/out"},
			VerifierFiles: "judged", Env: map[string]string{"PATH": "/bin:/usr/bin"}, MaxCopyBytes: 1024, MaxCopyEntries: 8}}
}

// An env's verifier files exist only where its verifier runs; the copy takes directories
// whole, refuses whatever in them is not a regular file or directory, and keeps to its caps.
func TestPristineVerifierFiles(t *testing.T) {
	imports := t.TempDir()
	must(t, os.MkdirAll(imports+"/judged", 0o755))
	must(t, os.WriteFile(imports+"/judged/expected.txt", []byte("42\n"), 0o644))
	must(t, os.WriteFile(imports+"/judged/check.sh", []byte(`[ "$(cat /work/out/answer.txt 2>/dev/null)" = "$(cat /verifier/expected.txt)" ] && echo 1 || echo 0`+"\n"), 0o644))
	b := setup(t, func(c *server.Config) { c.Import.Root = imports })
	b.register(t, judgedSpec())
	for _, a := range []attack{
		{name: "honest", steps: []string{"mkdir -p /work/out && echo 42 > /work/out/answer.txt"}, reward: 1},
		{name: "honest, nested", steps: []string{"mkdir -p /work/out/a/b && echo 42 > /work/out/answer.txt && echo x > /work/out/a/b/c"}, reward: 1},
		{name: "the verifier files are not in the agent's sandbox", steps: []string{
			"mkdir -p /work/out && cat /verifier/expected.txt > /work/out/answer.txt; ls -R / | grep -q expected.txt && echo 42 > /work/out/answer.txt; true"}, reward: 0},
		{name: "symlink to a verifier file", steps: []string{"mkdir -p /work/out && ln -s /verifier/expected.txt /work/out/answer.txt"}, reward: 0},
		{name: "the copied directory is a symlink", steps: []string{"mkdir -p /work/o /verifier && echo 42 > /verifier/expected.txt && ln -s /verifier /work/out"}, reward: 0},
		{name: "a FIFO in the copied directory", steps: []string{"mkdir -p /work/out && echo 42 > /work/out/answer.txt && mkfifo /work/out/p"}, reward: 0},
		{name: "more bytes than the cap", steps: []string{"mkdir -p /work/out && echo 42 > /work/out/answer.txt && head -c 2000 /dev/zero > /work/out/big"}, reward: 0},
		{name: "more entries than the cap", steps: []string{"mkdir -p /work/out && echo 42 > /work/out/answer.txt && touch /work/out/1 /work/out/2 /work/out/3 /work/out/4 /work/out/5 /work/out/6 /work/out/7"}, reward: 0},
	} {
		t.Run(a.name, func(t *testing.T) {
			ev, sub := b.judge(t, "judged", a)
			if ev != a.reward || sub != a.reward {
				t.Fatalf("%q: evaluate gave %v, submit %v; want %v", a.steps, ev, sub, a.reward)
			}
		})
	}
	t.Run("a refusal is noted on the step", func(t *testing.T) {
		ctx := t.Context()
		rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "judged"}))
		must(t, err)
		sb := rr.Msg.GetSandboxId()
		_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("mkdir -p /work/out && mkfifo /work/out/answer.txt")}))
		must(t, err)
		st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb,
			Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}}))
		must(t, err)
		if why := st.Msg.GetInfo()["verifier_refused"]; !strings.Contains(why, "/work/out/answer.txt is a FIFO") {
			t.Fatalf("submit of a FIFO: info %v", st.Msg.GetInfo())
		}
	})
}

// A sandbox restored to a checkpoint, or forked from one, works on the task of the checkpoint:
// the pristine verifier gets that task's options.
func TestPristineTaskFollowsCheckpoints(t *testing.T) {
	b := setup(t, nil)
	b.register(t, shellSpec(t))
	ctx := t.Context()
	rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "shell", Options: map[string]string{"EXPECTED": "17"}}))
	must(t, err)
	st, err := b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(),
		Action: execAction("echo 17 > /work/answer.txt"), Checkpoint: true}))
	must(t, err)
	ck := st.Msg.GetCheckpointId()
	evaluate := func(sb string) float64 {
		t.Helper()
		ev, err := b.connect.Evaluate(ctx, connect.NewRequest(&deltagymv1.EvaluateRequest{SandboxId: sb}))
		must(t, err)
		return ev.Msg.GetReward()
	}
	fk, err := b.connect.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck}, N: 1}))
	must(t, err)
	if r := evaluate(fk.Msg.GetSandboxIds()[0]); r != 1 {
		t.Fatalf("a fork of the task's checkpoint got %v", r)
	}
	other, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "shell"}))
	must(t, err)
	if r := evaluate(other.Msg.GetSandboxId()); r != 0 {
		t.Fatalf("a sandbox of the default task with no answer got %v", r)
	}
	_, err = b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: other.Msg.GetSandboxId(), CheckpointId: ck}))
	must(t, err)
	if r := evaluate(other.Msg.GetSandboxId()); r != 1 {
		t.Fatalf("a sandbox restored to the task's checkpoint got %v", r)
	}
	_, err = b.connect.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: other.Msg.GetSandboxId(), CheckpointId: rr.Msg.GetCheckpointId()}))
	must(t, err)
	_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: other.Msg.GetSandboxId(), Action: execAction("echo 42 > /work/answer.txt")}))
	must(t, err)
	if r := evaluate(other.Msg.GetSandboxId()); r != 0 {
		t.Fatalf("42 in a sandbox restored to the task's start (EXPECTED=17) got %v", r)
	}
}

// An env whose verifier files are missing, outside the import root or reached through a
// symlink that leads out is refused at registration, with invalid_argument naming the field.
func TestPristineVerifierFilesRefused(t *testing.T) {
	imports, outside := t.TempDir(), t.TempDir()
	must(t, os.WriteFile(imports+"/file", []byte("x"), 0o644))
	must(t, os.Symlink(outside, imports+"/out"))
	b := setup(t, func(c *server.Config) { c.Import.Root = imports })
	for _, dir := range []string{"missing", "../" + filepath.Base(outside), outside, "out", "file"} {
		t.Run(dir, func(t *testing.T) {
			spec := judgedSpec()
			spec.Evaluation.VerifierFiles = dir
			_, err := b.connect.RegisterEnv(t.Context(), connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec}))
			if codeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "evaluation.verifier_files") {
				t.Fatalf("verifier_files %q: %v", dir, err)
			}
			if dir != outside && strings.Contains(err.Error(), outside) {
				t.Fatalf("the error shows a host path: %v", err)
			}
		})
	}
}
