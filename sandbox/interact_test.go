package sandbox_test

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// An interactive session command reads the session's input while the session goes on: it is
// answered at a match of its patterns, sent input, interrupted, and ended by a plain command.
func TestSessionInteract(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	// busybox has no bash; sessions start one, so stand ash in for it.
	if err := s.WriteFile(t.Context(), "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	prompt := regexp.MustCompile(`> `)
	run := func(cmd string, it *sandbox.Interact, timeout time.Duration) sandbox.ExecResult {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: cmd, Interact: it, Timeout: timeout})
		if err != nil {
			t.Fatalf("session %q: %v", cmd, err)
		}
		return res
	}
	expect := &sandbox.Interact{Expect: []*regexp.Regexp{prompt}}

	// A reader of its input that prompts twice before the first line: the text past the first
	// match is the start of the next answer.
	res := run(`sh -c 'printf "one> two> "; while read -r l; do echo "got $l" >&2; printf "> "; done'`, expect, 5*time.Second)
	if string(res.Stdout) != "one" || res.Matched != "> " || res.TimedOut {
		t.Fatalf("start: %q matched %q timed out %v", res.Stdout, res.Matched, res.TimedOut)
	}
	if res := run("hello", expect, 5*time.Second); string(res.Stdout) != "two" || res.Matched != "> " {
		t.Fatalf("the output past the first match: %q matched %q", res.Stdout, res.Matched)
	}
	// Its stderr comes with its stdout; each answer ends at the next match (the first line's
	// prompt: the second line's waits in the output).
	if res := run("hello", expect, 5*time.Second); string(res.Stdout) != "got hello\n" || res.Matched != "> " {
		t.Fatalf("input: %q matched %q", res.Stdout, res.Matched)
	}
	// A plain command ends it first.
	if res := run("echo after; echo $((1+1))", nil, 5*time.Second); string(res.Stdout) != "after\n2\n" || res.ExitCode != 0 {
		t.Fatalf("plain command after an interactive one: %q exit %d", res.Stdout, res.ExitCode)
	}

	// A command that ends before any match answers with its status.
	res = run("echo a; echo b >&2; echo c; exit_with() { return $1; }; exit_with 3", expect, 5*time.Second)
	if string(res.Stdout) != "a\nb\nc\n" || res.ExitCode != 3 || res.Matched != "" {
		t.Fatalf("ended: %q exit %d matched %q", res.Stdout, res.ExitCode, res.Matched)
	}

	// A timeout leaves it running; an interrupt ends it (SIGINT).
	res = run("echo started; sleep 100", expect, 300*time.Millisecond)
	if !res.TimedOut || string(res.Stdout) != "started\n" || res.Signal != "" {
		t.Fatalf("timeout: %+v", res)
	}
	res = run("\x03", &sandbox.Interact{Interrupt: true}, 5*time.Second)
	if res.TimedOut || res.ExitCode != -1 || res.Signal != "SIGINT" {
		t.Fatalf("interrupt: %+v", res)
	}
	// With nothing attached, an interrupt has nothing to do.
	if res := run("\x03", &sandbox.Interact{Interrupt: true}, 5*time.Second); res.ExitCode != 0 || len(res.Stdout) != 0 {
		t.Fatalf("interrupt of nothing: %+v", res)
	}
	// A program that ignores SIGINT is killed once the interrupt's timeout passes.
	run(`sh -c 'trap "" INT; echo ready; sleep 100'`, &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile("ready")}}, 5*time.Second)
	res = run("\x03", &sandbox.Interact{Interrupt: true}, 200*time.Millisecond)
	if res.ExitCode != -1 || res.Signal != "SIGKILL" {
		t.Fatalf("interrupt of a program that ignores it: %+v", res)
	}
	if res := run("pwd", nil, 5*time.Second); string(res.Stdout) != "/\n" {
		t.Fatalf("session after the interrupts: %q", res.Stdout)
	}

	// A pattern that matches the empty string is refused.
	_, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: "cat", Interact: &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile("x*")}}})
	if !errors.Is(err, sandbox.ErrInvalid) {
		t.Fatalf("empty-matching pattern: %v", err)
	}
}

// An interrupt reaches a program that waits for its input, as a person's Ctrl-C at its prompt
// does, even when it comes between the prompt's write and the read: a shell whose trap only
// notes the signal, for its read to see, would note one that comes before its read blocks
// and wait on, deaf to it, as this program (which ignores SIGINT until it reads) would be. A
// program that never waits, busy on the CPU, still gets it at once.
func TestSessionInterruptAtThePrompt(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	if err := s.WriteFile(t.Context(), "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	// Between its prompt and its read, some milliseconds of CPU: far less than a busy program
	// runs before its interrupt goes anyway, far more than the call's way back from the prompt.
	const repl = `trap '' INT
printf 'ask> '
i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done
trap 'intr=1; printf "interrupted\nask> "' INT
while :; do
  intr=0; read -r l; st=$?
  if [ $st -eq 0 ]; then echo "got $l"; printf 'ask> '; elif [ $intr -eq 0 ]; then exit; fi
done
`
	if err := s.WriteFile(t.Context(), "/tmp/repl.sh", []byte(repl), 0o644, false); err != nil {
		t.Fatal(err)
	}
	prompt := &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(`ask> $`)}}
	run := func(cmd string, it *sandbox.Interact, timeout time.Duration) sandbox.ExecResult {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: cmd, Interact: it, Timeout: timeout})
		if err != nil {
			t.Fatalf("session %q: %v", cmd, err)
		}
		return res
	}
	interrupt := &sandbox.Interact{Interrupt: true, Expect: prompt.Expect}
	for i := range 3 {
		if res := run("sh /tmp/repl.sh", prompt, 5*time.Second); res.Matched == "" || !res.Running {
			t.Fatalf("start %d: %+v", i, res)
		}
		res := run("\x03", interrupt, 5*time.Second)
		if res.Matched == "" || !res.Running || string(res.Stdout) != "interrupted\n" {
			t.Fatalf("interrupt %d at the prompt: %q matched %q running %v signal %q", i, res.Stdout, res.Matched, res.Running, res.Signal)
		}
		if res := run("again", prompt, 5*time.Second); string(res.Stdout) != "got again\n" {
			t.Fatalf("input %d after the interrupt: %+v", i, res)
		}
		if res := run("echo plain", nil, 5*time.Second); string(res.Stdout) != "plain\n" {
			t.Fatalf("plain command %d: %+v", i, res)
		}
	}

	// A program busy on the CPU gets its interrupt once it has run a little, long before the
	// call's time is half spent.
	run(`sh -c 'echo ready; while :; do :; done'`, &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile("ready")}}, 5*time.Second)
	start := time.Now()
	res := run("\x03", &sandbox.Interact{Interrupt: true}, 20*time.Second)
	if res.Signal != "SIGINT" || time.Since(start) > 10*time.Second {
		t.Fatalf("interrupt of a busy program: %+v after %v", res, time.Since(start))
	}
}

// However costly its patterns and however fast its output, an interactive command's call ends
// at its timeout, or when the search for its patterns used its budget, saying so; the session
// goes on. Patterns past the bounds are refused.
func TestSessionInteractCostlyPatterns(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	if err := s.WriteFile(t.Context(), "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	// Every byte starts a match attempt that runs 1000 bytes on: about 1000 steps a byte each.
	costly := &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(`(?:.{100}){10}q`), regexp.MustCompile(`(?:[a-z]{100}){9}Q`)}}
	call := func(cmd string, it *sandbox.Interact, timeout time.Duration) (sandbox.ExecResult, time.Duration, error) {
		start := time.Now()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: cmd, Interact: it, Timeout: timeout, MaxOutput: 1 << 16})
		return res, time.Since(start), err
	}
	res, took, err := call("yes abcdefgh", costly, time.Second)
	if err != nil && !errors.Is(err, sandbox.ErrExpectBudget) || err == nil && !res.TimedOut {
		t.Fatalf("a costly search with a timeout of 1s: %+v, %v", res.TimedOut, err)
	}
	if took > 3*time.Second {
		t.Fatalf("a costly search with a timeout of 1s took %v", took)
	}
	_, took, err = call("", costly, time.Minute)
	if !errors.Is(err, sandbox.ErrExpectBudget) || took > 5*time.Second {
		t.Fatalf("a costly search with a timeout of 1m: %v after %v, want ErrExpectBudget within its budget", err, took)
	}
	if res, _, err := call("\x03", &sandbox.Interact{Interrupt: true}, 5*time.Second); err != nil || res.Signal != "SIGINT" {
		t.Fatalf("interrupt after the search's budget: %+v, %v", res, err)
	}
	if res, _, err := call("pwd", nil, 5*time.Second); err != nil || string(res.Stdout) != "/\n" {
		t.Fatalf("session after the search's budget: %q, %v", res.Stdout, err)
	}

	many := make([]*regexp.Regexp, sandbox.MaxExpect+1)
	for i := range many {
		many[i] = regexp.MustCompile("p" + strconv.Itoa(i))
	}
	large := []*regexp.Regexp{regexp.MustCompile(`(?:.{100}){10}q`), regexp.MustCompile(`(?:.{100}){10}r`)}
	for _, tc := range []struct {
		expect []*regexp.Regexp
		words  string
	}{
		{many, "17 expect patterns, more than 16"},
		{[]*regexp.Regexp{regexp.MustCompile(strings.Repeat("a", sandbox.MaxExpectBytes+1))}, "1025 bytes, more than 1024"},
		{large, "more than 2000 instructions"},
		{[]*regexp.Regexp{regexp.MustCompile("a\x00b")}, "pattern 0 holds a NUL byte"},
	} {
		_, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: "cat", Interact: &sandbox.Interact{Expect: tc.expect}})
		if !errors.Is(err, sandbox.ErrInvalid) || !strings.Contains(err.Error(), tc.words) {
			t.Fatalf("patterns past the bounds: %v, want ErrInvalid with %q", err, tc.words)
		}
	}
}

// A session copied from a checkpoint (its shell a template's copy, with pipes of its own) takes
// an interactive command as the session it was: the wait for it ends at its timeout.
func TestSessionInteractAfterRestore(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "cd /tmp"}); err != nil {
		t.Fatal(err)
	}
	ck, err := s.Checkpoint(ctx)
	must(t, err)
	must(t, s.Restore(ctx, ck.ID))
	wctx, cancel := context.WithTimeout(ctx, time.Minute) // a watchdog past the command's timeout
	defer cancel()
	it := &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(`never`)}}
	res, err := s.Exec(wctx, sandbox.ExecRequest{Session: "main", Command: "echo hi; sleep 100", Interact: it, Timeout: 2 * time.Second})
	if err != nil || !res.TimedOut || string(res.Stdout) != "hi\n" {
		t.Fatalf("an interactive command after a restore: %+v, %v", res, err)
	}
	res, err = s.Exec(wctx, sandbox.ExecRequest{Session: "main", Command: "pwd", Timeout: 10 * time.Second})
	if err != nil || string(res.Stdout) != "/tmp\n" {
		t.Fatalf("a command after it: %+v, %v", res, err)
	}
}

// A restore or a fork of a checkpoint taken while a session is attached to an interactive
// program is attached to that program as it was: its input goes to the program, an interrupt
// ends it, a plain command ends it first, and the end of a program that ended before the
// checkpoint is seen. So too for a durable checkpoint after a restart (CRIU's images).
func TestSessionInteractCheckpoint(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	if err := s.WriteFile(t.Context(), "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	expect := &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(`> `)}}
	run := func(s *sandbox.Sandbox, cmd string, it *sandbox.Interact) sandbox.ExecResult {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Session: "main", Command: cmd, Interact: it, Timeout: 5 * time.Second, MaxOutput: 1 << 16})
		if err != nil || res.TimedOut {
			t.Fatalf("session %q: %+v, %v", cmd, res, err)
		}
		return res
	}
	input := func(s *sandbox.Sandbox, line, want string) {
		t.Helper()
		if res := run(s, line, expect); string(res.Stdout) != want || res.Matched != "> " {
			t.Fatalf("input %q: %q matched %q, want %q", line, res.Stdout, res.Matched, want)
		}
	}
	// A counter of its input lines; "quit" says bye and ends it with status 7.
	const counter = `sh -c 'n=0; printf "> "; while read -r l; do [ "$l" = quit ] && { printf "bye> "; exit 7; }; n=$((n+1)); echo "got $l $n"; printf "> "; done'`
	run(s, counter, expect)
	input(s, "a", "got a 1\n")
	ck, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	input(s, "b", "got b 2\n")
	if err := s.Restore(t.Context(), ck.ID); err != nil {
		t.Fatal(err)
	}
	input(s, "c", "got c 2\n")
	if res := run(s, "\x03", &sandbox.Interact{Interrupt: true}); res.Signal != "SIGINT" {
		t.Fatalf("interrupt in the restored session: %+v", res)
	}
	if res := run(s, "echo $((1+1))", nil); string(res.Stdout) != "2\n" {
		t.Fatalf("plain command in the restored session: %q", res.Stdout)
	}

	kids, err := b.rt.Fork(t.Context(), ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
	input(kids[0], "d", "got d 2\n")
	if res := run(kids[0], "echo plain", nil); string(res.Stdout) != "plain\n" || res.ExitCode != 0 {
		t.Fatalf("plain command in the fork: %+v", res)
	}

	// The program ends before the checkpoint, its end unread: the restore sees it.
	if err := s.Restore(t.Context(), ck.ID); err != nil {
		t.Fatal(err)
	}
	if res := run(s, "quit", expect); string(res.Stdout) != "bye" || res.Matched != "> " {
		t.Fatalf("quit: %q matched %q", res.Stdout, res.Matched)
	}
	// The checkpoint is taken once the program has ended (it exits just after its last prompt).
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) { // a watchdog's poll
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "ps | grep -c '[n]=0' || true"})
		if err == nil && string(res.Stdout) == "0\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the program did not end: %+v, %v", res, err)
		}
	}
	ended, err := s.Checkpoint(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(t.Context(), ended.ID); err != nil {
		t.Fatal(err)
	}
	if res := run(s, "", expect); res.ExitCode != 7 || res.Matched != "" {
		t.Fatalf("the end of a program that ended before the checkpoint: %+v", res)
	}

	// A durable checkpoint, with CRIU's images, after a restart.
	run(s, counter, expect)
	input(s, "e", "got e 1\n")
	durable, err := s.CheckpointWith(t.Context(), sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU, Durable: true})
	if err != nil {
		t.Fatal(err)
	}
	b.restart(t)
	s2 := b.create(t, sandbox.Spec{Checkpoint: durable.ID})
	input(s2, "f", "got f 2\n")
	if res := run(s2, "quit", expect); res.Matched != "> " {
		t.Fatalf("quit after the restart: %+v", res)
	}
	if res := run(s2, "echo $((6*7))", nil); string(res.Stdout) != "42\n" {
		t.Fatalf("plain command after the restart: %q", res.Stdout)
	}
}
