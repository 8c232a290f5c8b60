package sandbox_test

import (
	"bytes"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// outputLog collects what ExecRequest.Output is given, per stream, and says when a stream first
// holds a string.
type outputLog struct {
	mu sync.Mutex
	// +checklocks:mu
	streams map[int]*bytes.Buffer
	want    string
	seen    chan struct{}
	once    sync.Once
}

func newOutputLog(want string) *outputLog {
	return &outputLog{streams: map[int]*bytes.Buffer{sandbox.OutputStdout: {}, sandbox.OutputStderr: {}}, want: want, seen: make(chan struct{})}
}

func (l *outputLog) add(stream int, p []byte) {
	want := l.want
	l.mu.Lock()
	l.streams[stream].Write(p)
	hit := want != "" && strings.Contains(l.streams[stream].String(), want)
	l.mu.Unlock()
	if hit {
		l.once.Do(func() { close(l.seen) })
	}
}

func (l *outputLog) get(stream int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.streams[stream].String()
}

// A command's output reaches ExecRequest.Output while it runs, cut at MaxOutput as the result
// is: for a plain command, a session's and an interactive one's.
func TestExecOutputStreams(t *testing.T) {
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: "busybox"})
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/bin/bash", []byte("#!/bin/sh\nexec /bin/busybox ash\n"), 0o755, false); err != nil {
		t.Fatal(err)
	}
	// The command waits for a file that the test writes once it has seen the command's first
	// line: the line came before the command ended.
	for _, session := range []string{"", "main"} {
		gate := "/tmp/go-" + session
		cmd := `echo ready; while [ ! -e ` + gate + ` ]; do sleep 0.01; done; echo done >&2; echo end`
		log := newOutputLog("ready")
		go func() {
			select {
			case <-log.seen:
				_ = s.WriteFile(ctx, gate, nil, 0o644, false)
			case <-time.After(20 * time.Second):
			}
		}()
		res, err := s.Exec(ctx, sandbox.ExecRequest{Command: cmd, Session: session, Timeout: 30 * time.Second, Output: log.add})
		if err != nil {
			t.Fatalf("session %q: %v", session, err)
		}
		if res.TimedOut || res.ExitCode != 0 {
			t.Fatalf("session %q: the output did not come while the command ran: %+v", session, res)
		}
		if got := log.get(sandbox.OutputStdout); got != string(res.Stdout) || got != "ready\nend\n" {
			t.Fatalf("session %q: stdout streamed %q, result %q", session, got, res.Stdout)
		}
		if got := log.get(sandbox.OutputStderr); got != string(res.Stderr) || got != "done\n" {
			t.Fatalf("session %q: stderr streamed %q, result %q", session, got, res.Stderr)
		}
		// Cut at the cap as the result is.
		log = newOutputLog("")
		res, err = s.Exec(ctx, sandbox.ExecRequest{Command: "seq 1 1000; seq 1 1000 >&2", Session: session, MaxOutput: 10, Output: log.add})
		if err != nil {
			t.Fatal(err)
		}
		if got := log.get(sandbox.OutputStdout); got != string(res.Stdout) || len(got) != 10 || !res.StdoutTruncated {
			t.Fatalf("session %q: capped stdout streamed %q, result %q", session, got, res.Stdout)
		}
		if got := log.get(sandbox.OutputStderr); got != string(res.Stderr) || len(got) != 10 {
			t.Fatalf("session %q: capped stderr streamed %q, result %q", session, got, res.Stderr)
		}
	}

	// Interactive: what was streamed begins with the result's output and never shows the
	// session's sentinel.
	expect := &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(`> `)}}
	log := newOutputLog("")
	res, err := s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: `printf 'hello> '; read -r l; echo "got $l"`, Interact: expect,
		Timeout: 10 * time.Second, Output: log.add})
	if err != nil || res.Matched != "> " || !res.Running {
		t.Fatalf("interactive start: %+v %v", res, err)
	}
	if got := log.get(sandbox.OutputStdout); !strings.HasPrefix(got, string(res.Stdout)) || string(res.Stdout) != "hello" {
		t.Fatalf("interactive: streamed %q, result %q", got, res.Stdout)
	}
	log = newOutputLog("")
	res, err = s.Exec(ctx, sandbox.ExecRequest{Session: "main", Command: "x", Interact: expect, Timeout: 10 * time.Second, Output: log.add})
	if err != nil || res.ExitCode != 0 || res.Running {
		t.Fatalf("interactive end: %+v %v", res, err)
	}
	if got := log.get(sandbox.OutputStdout); !strings.HasPrefix(got, string(res.Stdout)) || !strings.Contains(got, "got x") || strings.Contains(got, "__DG_") {
		t.Fatalf("interactive end: streamed %q, result %q", got, res.Stdout)
	}
}
