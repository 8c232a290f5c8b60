//go:build linux && amd64

package ptfork

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// threadsSource is a process of four threads. Each thread has its own TLS
// value, blocks a signal of its own and has a name of its own; each prints
// "pid id tls blocked name count" lines to stdout, one write each. Once
// the file <argv[1]>.<pid> exists, the main thread stops the others,
// pthread_joins them (which waits on the address the kernel clears at a
// thread's exit) and prints "pid joined".
const threadsSource = `
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static __thread long tls;
static volatile int quit;

static void report(long id, long n) {
	sigset_t cur;
	pthread_sigmask(SIG_BLOCK, NULL, &cur);
	char name[16] = {0};
	pthread_getname_np(pthread_self(), name, sizeof name);
	char line[128];
	int len = snprintf(line, sizeof line, "%d %ld %ld %d %s %ld\n", getpid(), id, tls,
		sigismember(&cur, SIGRTMIN + (int)id), name, n);
	if (write(1, line, len) != len) _exit(3);
}

static void *worker(void *arg) {
	long id = (long)arg;
	tls = 1000 * id;
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGRTMIN + (int)id);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
	char name[16];
	snprintf(name, sizeof name, "worker%ld", id);
	pthread_setname_np(pthread_self(), name);
	for (long n = 1; !quit; n++) {
		report(id, n);
		usleep(2000);
	}
	return (void *)(id + 41);
}

int main(int argc, char **argv) {
	pthread_t th[3];
	tls = 7;
	for (long i = 0; i < 3; i++)
		if (pthread_create(&th[i], NULL, worker, (void *)(i + 1)) != 0) return 1;
	char path[4096];
	for (long n = 1;; n++) {
		snprintf(path, sizeof path, "%s.%d", argv[1], getpid());
		if (access(path, F_OK) == 0) break;
		report(0, n);
		usleep(2000);
	}
	quit = 1;
	for (int i = 0; i < 3; i++) {
		void *r;
		if (pthread_join(th[i], &r) != 0 || (long)r != i + 42) return 2;
	}
	char line[64];
	int len = snprintf(line, sizeof line, "%d joined\n", getpid());
	return write(1, line, len) == len ? 0 : 3;
}
`

// threadLine is one line of threadsSource's output.
type threadLine struct {
	pid, id, tls, blocked int
	name                  string
	n                     int
}

// threadLines parses path's complete lines from *off on; "joined" lines
// are returned in joined.
func threadLines(t *testing.T, path string, off *int64, joined map[int]bool) []threadLine {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []threadLine
	for {
		i := bytes.IndexByte(b[*off:], '\n')
		if i < 0 {
			return out
		}
		f := strings.Fields(string(b[*off : *off+int64(i)]))
		*off += int64(i) + 1
		if len(f) == 2 && f[1] == "joined" {
			p, _ := strconv.Atoi(f[0])
			joined[p] = true
			continue
		}
		if len(f) != 6 {
			t.Fatalf("malformed line %q", f)
		}
		var l threadLine
		l.name = f[4]
		for j, v := range []*int{&l.pid, &l.id, &l.tls, &l.blocked, nil, &l.n} {
			if v != nil {
				*v, _ = strconv.Atoi(f[j])
			}
		}
		out = append(out, l)
	}
}

// TestForkThreads copies a four-thread process, then the copy (as a
// restore copies a template): each copy has the four threads, each thread
// going on from where it stopped with its own TLS value, signal mask and
// name, and pthread_join works in it.
func TestForkThreads(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	bin, out, quit := buildC(t, dir, "th", threadsSource, "-pthread"), filepath.Join(dir, "out"), filepath.Join(dir, "quit")
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, quit)
	cmd.Stdout = f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	pid := cmd.Process.Pid
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	var off int64
	joined := map[int]bool{}
	last := map[int]int{} // thread id -> last count
	if !poll(func() bool {
		for _, l := range threadLines(t, out, &off, joined) {
			last[l.id] = l.n
		}
		return len(last) == 4 && last[1] >= 5 && last[2] >= 5 && last[3] >= 5
	}) {
		t.Fatalf("the threads got to %v", last)
	}
	s := NewSession()
	p, err := s.Attach(pid)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	if p.Threads() != 4 {
		s.Close()
		t.Fatalf("seized %d threads, want 4", p.Threads())
	}
	for _, l := range threadLines(t, out, &off, joined) {
		last[l.id] = l.n // stopped: these are the last
	}
	c1, _, err := p.Fork()
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	c2, _, err := c1.Fork() // a copy of a copy that never ran
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	copies := []int{c1.Pid, c2.Pid}
	for _, c := range []*Proc{c1, c2} {
		if n, err := tasks(c.Pid); err != nil || len(n) != 4 {
			s.Close()
			t.Fatalf("copy %d has threads %v (%v), want 4", c.Pid, n, err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, c := range copies {
			_ = unix.Kill(c, unix.SIGKILL)
			var ws unix.WaitStatus
			_, _ = unix.Wait4(c, &ws, 0, nil)
		}
	})

	first := map[[2]int]threadLine{}
	if !poll(func() bool {
		for _, l := range threadLines(t, out, &off, joined) {
			k := [2]int{l.pid, l.id}
			if _, ok := first[k]; !ok {
				first[k] = l
			}
		}
		return len(first) >= 12
	}) {
		t.Fatalf("only %d of 12 threads printed after the copies: %v", len(first), first)
	}
	for _, p := range append([]int{pid}, copies...) {
		for id := range 4 {
			l, ok := first[[2]int{p, id}]
			want := threadLine{pid: p, id: id, tls: 1000 * id, blocked: 1, name: fmt.Sprintf("worker%d", id), n: last[id] + 1}
			if id == 0 {
				want.tls, want.blocked, want.name = 7, 0, "th"
			}
			if !ok || l != want {
				t.Errorf("process %d thread %d went on with %+v, want %+v", p, id, l, want)
			}
		}
	}
	// pthread_join in each copy: the kernel clears each thread's id at
	// its exit, where the copy's threads were told to.
	for _, c := range copies {
		if err := os.WriteFile(quit+"."+strconv.Itoa(c), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		var ws unix.WaitStatus
		if _, err := unix.Wait4(c, &ws, 0, nil); err != nil || !ws.Exited() || ws.ExitStatus() != 0 {
			t.Errorf("copy %d ended with %v (%v), want exit 0 after joining its threads", c, ws, err)
		}
	}
	threadLines(t, out, &off, joined)
	for _, c := range copies {
		if !joined[c] {
			t.Errorf("copy %d did not report its threads joined", c)
		}
	}
}

// BenchmarkForkThreads copies a process of four threads (threadsSource)
// and kills the copy: from=process reads the threads' states each time, as
// a checkpoint does from the live process; from=template copies a copy
// that has not run, whose states are known (States), as a restore does.
func BenchmarkForkThreads(b *testing.B) {
	needRoot(b)
	dir := b.TempDir()
	cmd := exec.Command(buildC(b, dir, "th", threadsSource, "-pthread"), filepath.Join(dir, "quit"))
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if !poll(func() bool { n, _ := tasks(cmd.Process.Pid); return len(n) == 4 }) {
		b.Fatal("the helper did not start its threads")
	}
	for _, from := range []string{"process", "template"} {
		b.Run("from="+from, func(b *testing.B) {
			// A session's requests come from its goroutine's thread.
			s := NewSession()
			defer s.Close()
			p, err := s.Attach(cmd.Process.Pid)
			if err != nil {
				b.Fatal(err)
			}
			if from == "template" {
				if p, _, err = p.Fork(); err != nil {
					b.Fatal(err)
				}
				defer p.Kill()
			}
			for b.Loop() {
				if from == "process" {
					for _, t := range p.threads {
						t.state = nil
					}
				}
				c, _, err := p.Fork()
				if err != nil {
					b.Fatal(err)
				}
				c.Kill()
				var ws unix.WaitStatus
				_, _ = unix.Wait4(c.Pid, &ws, 0, nil)
			}
		})
	}
}
