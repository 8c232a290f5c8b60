package server_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
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
