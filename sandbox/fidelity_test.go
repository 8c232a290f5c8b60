package sandbox_test

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// The restore-fidelity test runs the model-based file operations of
// TestModelFileOps in a sandbox of the default image while background
// writers of every process shape an agent makes run beside them. Each
// writer appends numbered records ("N EPOCH") to files of its own,
// keeping the count in its memory (for trees, in one process, the records
// passing through a pipe to the one that writes them). Among the random
// operations the sandbox is checkpointed, restored in place to its last
// checkpoint and to an older one, and forked; after each restore and fork:
//   - the files under /w equal the model at that checkpoint;
//   - every writer live at the checkpoint runs with its processes and
//     threads, and each of its files holds records 1..k, no gap, no
//     duplicate, then goes on from k+1: a file and the processes writing
//     it are of one instant;
//   - k is at least what the test saw before the checkpoint, and no record
//     is from after the checkpoint: the test bumps /fid/epoch, which every
//     record carries, after each checkpoint and right after each restore,
//     so a restored file holds only epochs up to the checkpoint's and the
//     restore's own;
//   - every writer that was not live at the checkpoint is gone, processes
//     and files.
//
// The file operations run under busybox (copied to /fid/bin), as in
// TestModelFileOps, so that the model's shell semantics are the same.

// bugForkImageLiveRoot names a known fidelity bug: the CRIU image a fork
// (or a restore elsewhere, or after a restart) restores a template's
// process from is dumped from a copy of the template fixed up in the
// sandbox's live root (procstate.stoppedCopies), not in the checkpoint's
// files. A file the template has open that has been removed since the
// checkpoint fails the fork (the copy's reopen finds no file).
const bugForkImageLiveRoot = "known bug: the CRIU images of templates are made in the live root, not the checkpoint's (procstate.stoppedCopies): " +
	"a fork fails when a file a template has open was removed since the checkpoint"

// fidRounds is DG_FID_ROUNDS, or def when it is unset or not a number.
func fidRounds(def int) int {
	if n, err := strconv.Atoi(os.Getenv("DG_FID_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return def
}

// runKnownBugs: DG_FID_KNOWN_BUGS=1 runs what the known bugs above break,
// to see them fail (and fixed).
func runKnownBugs() bool { return os.Getenv("DG_FID_KNOWN_BUGS") != "" }

// fidWriterPy is every Python writer: argv is MODE BASE MARKER; files are
// BASE.<k>. The marker is only there for the test to find the processes.
const fidWriterPy = `
import os, sys, threading, time
mode, base = sys.argv[1], sys.argv[2]
PAUSE = 0.02

def epoch():
    with open("/fid/epoch") as f:
        return f.read().strip()

def loop(path):
    # Not O_APPEND: the offset is the process's own, which a restore keeps.
    f = open(path, "w")
    n = 0
    while True:
        n += 1
        f.write("%d %s\n" % (n, epoch()))
        f.flush()
        time.sleep(PAUSE)

def sink(src, path):
    # O_APPEND, each record as it comes through the pipe.
    with open(path, "a") as f:
        for line in src:
            f.write(line)
            f.flush()

if mode == "loop":
    loop(base + ".0")
elif mode == "daemon":
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    loop(base + ".0")
elif mode == "threads":
    ts = [threading.Thread(target=loop, args=(base + ".%d" % k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
elif mode == "gen":
    n = 0
    while True:
        n += 1
        sys.stdout.write("%d %s\n" % (n, epoch()))
        sys.stdout.flush()
        time.sleep(PAUSE)
elif mode == "sink":
    sink(sys.stdin, base + ".0")
elif mode == "workers":
    pipes = []
    for k in range(2):
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(w)
            for p in pipes:
                os.close(p)
            sink(os.fdopen(r), base + ".%d" % k)
            os._exit(0)
        os.close(r)
        pipes.append(w)
    n = 0
    while True:
        n += 1
        rec = ("%d %s\n" % (n, epoch())).encode()
        for w in pipes:
            os.write(w, rec)
        time.sleep(PAUSE)
`

// fidTreeSh is the shell of the shell -> child tree ($0 the marker, $1 the
// base): it counts, and its child, a process substitution, writes. It
// waits on a FIFO no one writes to (read -t), so that it forks nothing
// else.
const fidTreeSh = `exec 3> >(exec python3 /fid/w.py sink "$1" "$0")
exec 4<> /fid/tick
i=0
while :; do
	i=$((i+1))
	read -r e < /fid/epoch
	echo "$i $e" >&3
	read -r -t 0.02 -u 4 x || true
done`

// fidShape is a process shape of a writer.
type fidShape struct {
	name string
	// procs counts the processes with the writer's marker as an argument,
	// threads their threads; files is how many files the writer writes.
	procs, threads, files int
	start                 func(id, base, marker string) sandbox.ExecRequest
}

func fidPy(mode string) func(id, base, marker string) sandbox.ExecRequest {
	return func(_, base, marker string) sandbox.ExecRequest {
		return sandbox.ExecRequest{Argv: []string{"python3", "/fid/w.py", mode, base, marker}, Background: true}
	}
}

var fidShapes = []fidShape{
	{name: "single", procs: 1, threads: 1, files: 1, start: fidPy("loop")},
	// `&` in a plain exec: the exec returns, the writer runs on.
	{name: "ampersand", procs: 1, threads: 1, files: 1, start: func(_, base, marker string) sandbox.ExecRequest {
		return sandbox.ExecRequest{Command: fmt.Sprintf("python3 /fid/w.py loop %s %s &", base, marker)}
	}},
	{name: "daemon", procs: 1, threads: 1, files: 1, start: fidPy("daemon")},
	{name: "shell-child", procs: 2, threads: 2, files: 1, start: func(_, base, marker string) sandbox.ExecRequest {
		return sandbox.ExecRequest{Argv: []string{"bash", "-c", fidTreeSh, marker, base}, Background: true}
	}},
	{name: "workers", procs: 3, threads: 3, files: 2, start: fidPy("workers")},
	{name: "pipeline", procs: 2, threads: 2, files: 1, start: func(_, base, marker string) sandbox.ExecRequest {
		return sandbox.ExecRequest{Command: fmt.Sprintf("python3 /fid/w.py gen %[1]s %[2]s | python3 /fid/w.py sink %[1]s %[2]s", base, marker), Background: true}
	}},
	{name: "threads", procs: 1, threads: 4, files: 3, start: fidPy("threads")},
	// A job of the session's shell, which says which job it runs.
	{name: "session", procs: 1, threads: 1, files: 1, start: func(id, base, marker string) sandbox.ExecRequest {
		return sandbox.ExecRequest{Session: "fid", Command: fmt.Sprintf("export FID_JOB=%s; python3 /fid/w.py loop %s %s &", id, base, marker)}
	}},
}

type fidWriter struct {
	id    string // w<n>: files /fid/out/w<n>.<k>, marker @w<n>@
	shape *fidShape
}

func (w *fidWriter) marker() string { return "@" + w.id + "@" }

func (w *fidWriter) files() []string {
	var out []string
	for k := range w.shape.files {
		out = append(out, fmt.Sprintf("/fid/out/%s.%d", w.id, k))
	}
	return out
}

func (w *fidWriter) String() string { return w.id + "(" + w.shape.name + ")" }

// fidSnap is a checkpoint with what the test knows of its instant.
type fidSnap struct {
	id    string
	m     *model
	live  []*fidWriter
	stale []*fidWriter // writers whose files are there without them
	// templated are the writers with a process the checkpoint took as a
	// template.
	templated []*fidWriter
	epoch     int            // /fid/epoch at the checkpoint
	least     map[string]int // records each file had before the checkpoint
	table     string         // the sandbox's threads at the checkpoint
}

// fidRun is the state of one run of TestRestoreFidelity.
type fidRun struct {
	t       *testing.T
	b       *bundle
	s       *sandbox.Sandbox
	seed    int64
	rng     *rand.Rand
	g       *modelGen
	m       *model
	script  strings.Builder
	live    []*fidWriter
	stale   []*fidWriter // not live, their files left (see fork)
	all     []*fidWriter // every writer started, live or not
	snaps   []fidSnap
	epoch   int            // the value in the sandbox's /fid/epoch
	seen    map[string]int // records each live file had at its last check
	journal []string
	target  *fidSnap // the checkpoint being restored or forked, for diagnose
	stats   map[string]int
	methods map[string]int // processes captured, by method
}

func (f *fidRun) note(format string, args ...any) {
	f.journal = append(f.journal, fmt.Sprintf(format, args...))
}

func (f *fidRun) fatalf(format string, args ...any) {
	f.t.Helper()
	msg := fmt.Sprintf(format, args...)
	tail := f.journal[max(0, len(f.journal)-40):]
	f.t.Fatalf("seed %d (DG_FID_SEED=%d to replay): %s\nlive writers %v\nlast steps:\n  %s\n%s", f.seed, f.seed, msg, f.live, strings.Join(tail, "\n  "), f.diagnose(msg))
}

// diagnose returns the end of the CRIU log msg names, which goes with the
// test's directory, and the sandbox's processes and threads.
func (f *fidRun) diagnose(msg string) string {
	var out strings.Builder
	if _, rest, ok := strings.Cut(msg, "criu's log: "); ok {
		name, _, _ := strings.Cut(rest, ")")
		if log, err := os.ReadFile(name); err == nil {
			lines := strings.Split(strings.TrimSpace(string(log)), "\n")
			fmt.Fprintf(&out, "the end of %s:\n  %s\n", name, strings.Join(lines[max(0, len(lines)-40):], "\n  "))
		}
	}
	if f.target != nil {
		fmt.Fprintf(&out, "the threads of checkpoint %s:\n%s", f.target.id, f.target.table)
	}
	fmt.Fprintf(&out, "the sandbox's threads:\n%s", threadTable(f.s))
	return out.String()
}

// threadTable lists the threads of sb's pid namespace: tgid/task/tid,
// then comm, state, ppid, process group and session.
func threadTable(sb *sandbox.Sandbox) string {
	var out strings.Builder
	procDir := fmt.Sprintf("/proc/%d/root/proc", sb.InitPid())
	last, _ := os.ReadFile(procDir + "/sys/kernel/ns_last_pid")
	fmt.Fprintf(&out, "  ns_last_pid %s", last)
	tasks, _ := filepath.Glob(procDir + "/[0-9]*/task/[0-9]*")
	for _, task := range tasks {
		st, _ := os.ReadFile(task + "/stat")
		if i := strings.LastIndexByte(string(st), ')'); i > 0 && len(st) > i+2 {
			f := strings.Fields(string(st[i+2:]))
			fmt.Fprintf(&out, "  %s %s %s\n", strings.TrimPrefix(task, procDir+"/"), st[:i+1], strings.Join(f[:min(4, len(f))], " "))
		}
	}
	return out.String()
}

func (f *fidRun) exec(sb *sandbox.Sandbox, req sandbox.ExecRequest) string {
	f.t.Helper()
	if req.Timeout == 0 {
		req.Timeout = time.Minute
	}
	res, err := sb.Exec(f.t.Context(), req)
	if err != nil || !req.Background && res.ExitCode != 0 {
		f.fatalf("exec %q %q: %v exit %d signal %q\nstderr: %s", req.Argv, req.Command, err, res.ExitCode, res.Signal, res.Stderr)
	}
	return string(res.Stdout)
}

// setEpoch writes n to sb's /fid/epoch, atomically for the writers.
func (f *fidRun) setEpoch(sb *sandbox.Sandbox, n int) {
	f.t.Helper()
	f.exec(sb, sandbox.ExecRequest{Command: fmt.Sprintf("echo %d > /fid/epoch.new && mv -f /fid/epoch.new /fid/epoch", n)})
}

// prepare puts busybox, the xattr helper and the writers' programs into
// the sandbox.
func (f *fidRun) prepare() {
	t, ctx := f.t, f.t.Context()
	bb, err := os.ReadFile(filepath.Join(f.b.root, "bin/busybox"))
	if err != nil {
		t.Fatal(err)
	}
	xa, err := os.ReadFile(xattrHelper(t))
	if err != nil {
		t.Fatal(err)
	}
	f.exec(f.s, sandbox.ExecRequest{Command: "mkdir -p /fid/bin /fid/out /usr/local/bin /w && mkfifo /fid/tick && echo 1 > /fid/epoch"})
	for _, w := range []struct {
		path string
		data []byte
		mode os.FileMode
	}{{"/fid/bin/busybox", bb, 0o755}, {modelXA, xa, 0o755}, {"/fid/w.py", []byte(fidWriterPy), 0o644}} {
		if err := f.s.WriteFile(ctx, w.path, w.data, w.mode, false); err != nil {
			t.Fatal(err)
		}
	}
	f.exec(f.s, sandbox.ExecRequest{Argv: []string{"/fid/bin/busybox", "--install", "-s", "/fid/bin"}})
	f.epoch = 1
}

// flush runs the generated file operations under busybox.
func (f *fidRun) flush() {
	f.t.Helper()
	f.script.WriteString(f.g.script.String())
	f.g.script.Reset()
	if f.script.Len() == 0 {
		return
	}
	text := "PATH=/fid/bin:$PATH\nset -e\numask 022\n" + f.script.String()
	f.script.Reset()
	res, err := f.s.Exec(f.t.Context(), sandbox.ExecRequest{Argv: []string{"/fid/bin/sh"}, Stdin: []byte(text), Timeout: time.Minute})
	if err != nil || res.ExitCode != 0 {
		f.fatalf("batch failed: %v exit %d signal %q\nstderr: %s\nscript:\n%s", err, res.ExitCode, res.Signal, res.Stderr, text)
	}
	f.note("%d lines of file operations", strings.Count(text, "\n")-3)
}

// checkFiles compares the tree under /w of sb with m.
func (f *fidRun) checkFiles(sb *sandbox.Sandbox, m *model, when string) {
	f.t.Helper()
	res, err := sb.Exec(f.t.Context(), sandbox.ExecRequest{Argv: []string{"/fid/bin/sh", "-c", "PATH=/fid/bin:$PATH\n" + listScript}, MaxOutput: 16 << 20, Timeout: time.Minute})
	if err != nil || res.ExitCode != 0 || res.StdoutTruncated {
		f.fatalf("%s: listing: %v exit %d truncated %v\n%s", when, err, res.ExitCode, res.StdoutTruncated, res.Stderr)
	}
	got, err := parseListing(string(res.Stdout))
	if err != nil {
		f.fatalf("%s: %v", when, err)
	}
	if d := diffTree(m, got); len(d) > 0 {
		f.fatalf("%s: the tree under /w differs from the model:\n%s", when, strings.Join(d[:min(len(d), 30)], "\n"))
	}
	f.stats["tree checks"]++
}

// fidProcs are the processes of a sandbox's work group that carry a
// writer's marker: for each marker given as an argument, the processes
// and their threads; for each marker anywhere in the command line, the
// processes. Templates and copies forked ahead are frozen in groups of
// their own, outside the work group, and not counted.
type fidProcs struct {
	exact, threads, anywhere map[string]int
	nsPids                   map[int]string // pid in the sandbox -> marker
}

func (f *fidRun) procs(sb *sandbox.Sandbox) fidProcs {
	f.t.Helper()
	p := fidProcs{exact: map[string]int{}, threads: map[string]int{}, anywhere: map[string]int{}, nsPids: map[int]string{}}
	root := sb.CommandGroup()
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.Name() != "cgroup.procs" {
			return nil // groups come and go as commands end
		}
		raw, _ := os.ReadFile(path)
		for _, pid := range strings.Fields(string(raw)) {
			cmd, _ := os.ReadFile("/proc/" + pid + "/cmdline")
			args := strings.Split(strings.TrimSuffix(string(cmd), "\x00"), "\x00")
			seen := map[string]bool{}
			for _, a := range args {
				for _, w := range f.all {
					mk := w.marker()
					if a == mk {
						p.exact[mk]++
						th, ns := statusOf(pid)
						p.threads[mk] += th
						p.nsPids[ns] = mk
					}
					if strings.Contains(a, mk) && !seen[mk] {
						seen[mk] = true
						p.anywhere[mk]++
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		f.fatalf("listing the processes of %s: %v", root, err)
	}
	return p
}

// statusOf returns the threads of host pid and its pid in its sandbox.
func statusOf(pid string) (threads, nsPid int) {
	st, _ := os.ReadFile("/proc/" + pid + "/status")
	for line := range strings.Lines(string(st)) {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			threads, _ = strconv.Atoi(strings.TrimSpace(v))
		}
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			nsPid, _ = strconv.Atoi(f[len(f)-1])
		}
	}
	return threads, nsPid
}

// fidFile is what a writer's file holds: records 1..n, their epochs in
// runs (epoch, count), or bad, the first record out of order.
type fidFile struct {
	n    int
	runs [][2]int
	bad  string
}

func parseRecords(data []byte) fidFile {
	var out fidFile
	lines := strings.Split(string(data), "\n")
	// The last line may be partial: a write that crosses a page is seen a
	// page at a time.
	for i, line := range lines[:len(lines)-1] {
		var n, e int
		if _, err := fmt.Sscanf(line, "%d %d", &n, &e); err != nil || n != i+1 || line != fmt.Sprintf("%d %d", n, e) {
			from := max(0, i-2)
			out.bad = fmt.Sprintf("record %d is %q (records %d.. are %q)", i+1, line, from+1, lines[from:min(len(lines), i+3)])
			return out
		}
		out.n = n
		if k := len(out.runs); k > 0 && out.runs[k-1][0] == e {
			out.runs[k-1][1]++
		} else {
			out.runs = append(out.runs, [2]int{e, 1})
		}
	}
	return out
}

func (f *fidRun) readRecords(sb *sandbox.Sandbox, path string) (fidFile, bool) {
	data, _, err := sb.ReadFile(f.t.Context(), path, 0, 0)
	if err != nil {
		return fidFile{}, false
	}
	return parseRecords(data), true
}

// checkWriters checks the writers of sb against live. After a restore or
// fork of snap, it first sets the sandbox's epoch to a new one, so that
// records from after that checkpoint are told from records written since.
func (f *fidRun) checkWriters(sb *sandbox.Sandbox, live []*fidWriter, snap *fidSnap, when string) {
	f.t.Helper()
	ctx := f.t.Context()
	own := f.epoch
	if snap != nil {
		f.epoch++
		own = f.epoch
		f.setEpoch(sb, own)
	}
	first := map[string]fidFile{}
	for _, w := range live {
		for _, p := range w.files() {
			r, ok := f.readRecords(sb, p)
			if !ok && snap != nil {
				f.fatalf("%s: %s of writer %s, live at the checkpoint, is missing", when, p, w)
			}
			first[p] = r
		}
	}
	// The writers go on: each file gains two records, and the processes
	// are those of each shape (a daemon's parents have exited).
	deadline := time.Now().Add(30 * time.Second)
	var pr fidProcs
	for {
		grown := true
		for _, w := range live {
			for _, p := range w.files() {
				r, _ := f.readRecords(sb, p)
				grown = grown && r.bad == "" && r.n >= first[p].n+2
			}
		}
		pr = f.procs(sb)
		ok := grown
		for _, w := range live {
			ok = ok && pr.exact[w.marker()] == w.shape.procs && pr.threads[w.marker()] == w.shape.threads
		}
		if ok || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			f.fatalf("%s: %v", when, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	for _, w := range live {
		mk := w.marker()
		if pr.exact[mk] != w.shape.procs || pr.threads[mk] != w.shape.threads {
			f.fatalf("%s: writer %s runs %d processes with %d threads, want %d with %d", when, w, pr.exact[mk], pr.threads[mk], w.shape.procs, w.shape.threads)
		}
		for _, p := range w.files() {
			r, _ := f.readRecords(sb, p)
			f.checkRecords(w, p, first[p], r, snap, own, when)
			f.seen[p] = r.n
		}
	}
	for _, w := range f.all {
		if slices.Contains(live, w) {
			continue
		}
		if n := pr.anywhere[w.marker()]; n != 0 {
			f.fatalf("%s: writer %s, not live at the checkpoint, runs %d processes", when, w, n)
		}
		for _, p := range w.files() {
			if _, _, err := sb.ReadFile(ctx, p, 0, 0); err == nil && !slices.Contains(f.stale, w) {
				f.fatalf("%s: %s of writer %s, not live at the checkpoint, exists", when, p, w)
			}
		}
	}
	if err := f.checkSession(sb, live, when); err != "" {
		f.fatalf("%s", err)
	}
	f.stats["writer checks"]++
}

func (f *fidRun) checkRecords(w *fidWriter, p string, first, r fidFile, snap *fidSnap, own int, when string) {
	f.t.Helper()
	switch {
	case first.bad != "":
		f.fatalf("%s: writer %s, %s: %s", when, w, p, first.bad)
	case r.bad != "":
		f.fatalf("%s: writer %s, %s, once it went on from record %d: %s", when, w, p, first.n, r.bad)
	case r.n < first.n+2:
		f.fatalf("%s: writer %s, %s, does not go on: %d records, then %d", when, w, p, first.n, r.n)
	case snap != nil && first.n < snap.least[p]:
		f.fatalf("%s: writer %s, %s: %d records after the restore, fewer than the %d seen before the checkpoint", when, w, p, first.n, snap.least[p])
	}
	for i, run := range r.runs {
		e := run[0]
		if i > 0 && e <= r.runs[i-1][0] {
			f.fatalf("%s: writer %s, %s: epochs out of order %v", when, w, p, r.runs)
		}
		if e > own || snap != nil && e > snap.epoch && e != own {
			f.fatalf("%s: writer %s, %s: records of epoch %d, after the checkpoint's %d (this sandbox's is %d): epochs %v (epoch, records)", when, w, p, e, epochOf(snap), own, r.runs)
		}
	}
}

func epochOf(snap *fidSnap) int {
	if snap == nil {
		return 0
	}
	return snap.epoch
}

// checkSession checks that the session's shell runs the session writer
// as its job, if one is live.
func (f *fidRun) checkSession(sb *sandbox.Sandbox, live []*fidWriter, when string) string {
	for _, w := range live {
		if w.shape.name != "session" {
			continue
		}
		out := f.exec(sb, sandbox.ExecRequest{Session: "fid", Command: "echo $FID_JOB; jobs -rp", Timeout: 20 * time.Second})
		lines := strings.Fields(out)
		if len(lines) != 2 || lines[0] != w.id {
			return fmt.Sprintf("%s: the session's shell says %q, want %s and the pid of its one running job", when, out, w.id)
		}
	}
	return ""
}

func (f *fidRun) startWriter(shape *fidShape) {
	f.t.Helper()
	w := &fidWriter{id: fmt.Sprintf("w%d", len(f.all)+1), shape: shape}
	f.all = append(f.all, w)
	f.exec(f.s, shape.start(w.id, "/fid/out/"+w.id, w.marker()))
	f.live = append(f.live, w)
	f.note("start writer %s", w)
	f.checkWriters(f.s, f.live, nil, "after starting writer "+w.String())
	f.stats["writers started"]++
}

func (f *fidRun) stopWriter(w *fidWriter) {
	f.t.Helper()
	mk := w.marker()
	// The pattern does not match its own shell's command line.
	f.exec(f.s, sandbox.ExecRequest{Command: fmt.Sprintf("pkill -KILL -f '%s[@]' || true", strings.TrimSuffix(mk, "@"))})
	// Polled until the kernel has reaped them, the deadline a watchdog.
	deadline := time.Now().Add(20 * time.Second)
	for f.procs(f.s).anywhere[mk] != 0 {
		if time.Now().After(deadline) {
			f.fatalf("writer %s still runs 20 s after SIGKILL", w)
		}
		select {
		case <-f.t.Context().Done():
			f.fatalf("stopping writer %s: %v", w, f.t.Context().Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	f.exec(f.s, sandbox.ExecRequest{Command: "rm -f " + strings.Join(w.files(), " ")})
	f.live = slices.DeleteFunc(slices.Clone(f.live), func(x *fidWriter) bool { return x == w })
	for _, p := range w.files() {
		delete(f.seen, p)
	}
	f.note("stop writer %s", w)
	f.stats["writers stopped"]++
}

func (f *fidRun) checkpoint() {
	f.t.Helper()
	least := map[string]int{}
	for _, w := range f.live {
		for _, p := range w.files() {
			least[p] = f.seen[p]
		}
	}
	ck, err := f.s.Checkpoint(f.t.Context())
	if err != nil {
		f.fatalf("checkpoint with writers %v: %v", f.live, err)
	}
	byPid := f.procs(f.s).nsPids
	var templated []*fidWriter
	for _, p := range ck.Processes {
		f.methods[p.Method.String()]++
		if i := slices.IndexFunc(f.live, func(w *fidWriter) bool { return w.marker() == byPid[p.Pid] }); i >= 0 && p.Method == sandbox.CaptureTemplate {
			templated = append(templated, f.live[i])
		}
	}
	f.snaps = append(f.snaps, fidSnap{id: ck.ID, m: f.m.clone(), live: slices.Clone(f.live), stale: slices.Clone(f.stale),
		templated: templated, epoch: f.epoch, least: least, table: threadTable(f.s)})
	f.epoch++
	f.setEpoch(f.s, f.epoch)
	f.note("checkpoint %s (epoch %d): %s", ck.ID, f.epoch-1, methods(ck.Processes))
	f.stats["checkpoints"]++
}

// goTo makes the sandbox's state that of snap, as a restore or fork
// leaves it.
func (f *fidRun) goTo(snap fidSnap) {
	f.m = snap.m.clone()
	f.g.m = f.m
	f.live = slices.Clone(snap.live)
	f.stale = slices.Clone(snap.stale)
	f.seen = map[string]int{}
}

func (f *fidRun) restore(i int, kind string) {
	f.t.Helper()
	snap := f.snaps[i]
	f.target = &snap
	defer func() { f.target = nil }()
	if err := f.s.Restore(f.t.Context(), snap.id); err != nil {
		f.fatalf("%s %s: %v", kind, snap.id, err)
	}
	f.goTo(snap)
	f.note("%s %s (checkpoint %d of %d)", kind, snap.id, i+1, len(f.snaps))
	when := fmt.Sprintf("after %s %s", kind, snap.id)
	f.checkFiles(f.s, f.m, when)
	f.checkWriters(f.s, f.live, &snap, when)
	f.stats[kind]++
}

func (f *fidRun) fork(i int) {
	f.t.Helper()
	ctx := f.t.Context()
	snap := f.snaps[i]
	f.target = &snap
	defer func() { f.target = nil }()
	// The images forks restore templates from are not of the checkpoint's
	// instant (bugForkImageLiveRoot): unless asked, forks start without
	// the templates' processes, leaving their writers' files behind.
	spec := sandbox.Spec{SkipTemplates: !runKnownBugs()}
	kids, err := f.b.rt.Fork(ctx, snap.id, 2, spec)
	if err != nil {
		f.fatalf("fork of %s: %v", snap.id, err)
	}
	for _, k := range kids {
		f.t.Cleanup(func() { _ = k.Destroy(context.Background()) })
	}
	f.note("fork of %s (checkpoint %d of %d, templates skipped %v: %v)", snap.id, i+1, len(f.snaps), spec.SkipTemplates, snap.templated)
	f.goTo(snap)
	if spec.SkipTemplates {
		f.live = slices.DeleteFunc(f.live, func(w *fidWriter) bool { return slices.Contains(snap.templated, w) })
		f.stale = append(f.stale, snap.templated...)
	}
	when := "in a fork of " + snap.id
	f.checkFiles(kids[1], snap.m, when)
	f.checkWriters(kids[1], f.live, &snap, when)
	if err := kids[1].Destroy(ctx); err != nil {
		f.t.Fatal(err)
	}
	if spec.SkipTemplates {
		// Restores in the fork that goes on would bring the templates of
		// the sandbox left behind back from the same images.
		f.snaps = slices.DeleteFunc(f.snaps, func(sn fidSnap) bool {
			if len(sn.templated) == 0 {
				return false
			}
			if err := f.b.rt.ReleaseCheckpoint(sn.id); err != nil {
				f.fatalf("release %s: %v", sn.id, err)
			}
			f.note("release %s (templates of the sandbox left behind)", sn.id)
			return true
		})
	}
	if err := f.s.Destroy(ctx); err != nil {
		f.t.Fatal(err)
	}
	f.s = kids[0]
	when = "in the fork of " + snap.id + " that goes on"
	f.checkFiles(f.s, f.m, when)
	f.checkWriters(f.s, f.live, &snap, when)
	f.stats["forks"]++
}

// release drops an old checkpoint (never the last), so that templates do
// not pile up.
func (f *fidRun) release() {
	f.t.Helper()
	i := f.rng.Intn(len(f.snaps) - 1)
	if err := f.b.rt.ReleaseCheckpoint(f.snaps[i].id); err != nil {
		f.fatalf("release %s: %v", f.snaps[i].id, err)
	}
	f.note("release %s", f.snaps[i].id)
	f.snaps = slices.Delete(f.snaps, i, i+1)
}

// startOrStop starts a writer of a shape not running, or stops one.
func (f *fidRun) startOrStop() {
	f.t.Helper()
	switch r := f.rng.Intn(100); {
	case r < 30:
		var idle []*fidShape
		for i := range fidShapes {
			if !slices.ContainsFunc(f.live, func(w *fidWriter) bool { return w.shape == &fidShapes[i] }) {
				idle = append(idle, &fidShapes[i])
			}
		}
		if len(idle) > 0 {
			f.startWriter(idle[f.rng.Intn(len(idle))])
		}
	case r < 45 && len(f.live) > 0:
		f.stopWriter(f.live[f.rng.Intn(len(f.live))])
	}
}

// round runs one batch of file operations, maybe starts or stops a
// writer, then checkpoints, restores, forks or checks.
func (f *fidRun) round() {
	f.t.Helper()
	n := 1 + f.rng.Intn(20)
	for i := 0; i < n; {
		if f.g.step() {
			i++
		}
	}
	f.stats["file operations"] += n
	f.flush()
	f.startOrStop()
	last := len(f.snaps) - 1
	switch r := f.rng.Intn(100); {
	case r < 40 || last < 0:
		f.checkpoint()
		if len(f.snaps) > 6 {
			f.release()
		}
	case r < 60:
		f.restore(last, "restore of the last checkpoint")
	case r < 78 && last > 0:
		f.restore(f.rng.Intn(last), "restore of an older checkpoint")
	case r < 88:
		f.fork(f.rng.Intn(last + 1))
	default:
		f.checkFiles(f.s, f.m, "after a batch")
		f.checkWriters(f.s, f.live, nil, "after a batch")
	}
}

// TestRestoreFidelity runs the model's random file operations with
// background writers of every process shape (see the comment at the top
// of this file): DG_FID_ROUNDS rounds (40 by default), seeded by
// DG_FID_SEED (the time by default; a failure prints it).
func TestRestoreFidelity(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	img := defaultImage(t, b)
	seed := time.Now().UnixNano()
	if v := os.Getenv("DG_FID_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseInt(v, 10, 64); err != nil {
			t.Fatal(err)
		}
	}
	rounds := fidRounds(40)
	t.Logf("seed %d (DG_FID_SEED=%d to replay), %d rounds (DG_FID_ROUNDS)", seed, seed, rounds)
	rng := rand.New(rand.NewSource(seed))
	f := &fidRun{t: t, b: b, s: b.create(t, sandbox.Spec{Image: img}), seed: seed, rng: rng, m: newModel(),
		seen: map[string]int{}, stats: map[string]int{}, methods: map[string]int{}}
	f.g = &modelGen{rng: rng, m: f.m}
	f.g.write = func(p string, data []byte, mode os.FileMode, appendTo bool) {
		f.flush()
		if err := f.s.WriteFile(t.Context(), p, data, mode, appendTo); err != nil {
			f.fatalf("WriteFile %s: %v", p, err)
		}
		f.note("WriteFile %s (%d bytes, append %v)", p, len(data), appendTo)
	}
	f.prepare()
	start := time.Now()
	for i := range fidShapes {
		f.startWriter(&fidShapes[i])
	}
	f.checkpoint()
	for range rounds {
		f.round()
	}
	// Every kind of restore at least once.
	for _, kind := range []string{"restore of the last checkpoint", "restore of an older checkpoint", "forks"} {
		if f.stats[kind] > 0 {
			continue
		}
		if len(f.snaps) < 2 {
			f.checkpoint()
		}
		switch kind {
		case "forks":
			f.fork(0)
		case "restore of an older checkpoint":
			f.restore(0, kind)
		default:
			f.restore(len(f.snaps)-1, kind)
		}
	}
	var kinds []string
	for k, v := range f.stats {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(kinds)
	t.Logf("%s; processes captured: %v; %v", strings.Join(kinds, ", "), f.methods, time.Since(start).Round(time.Millisecond))
}

// A fork of a checkpoint gets its templates' processes from CRIU images
// made from copies of the templates, and a copy's files are of the
// checkpoint's instant: a file a template has open that has changed since
// (grown, shrunk, removed) restores in the fork as the checkpoint had it,
// and the process goes on from there.
func TestForkTemplateOfChangedFile(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	img := defaultImage(t, b)
	ctx := t.Context()
	for _, c := range []struct {
		name, mode, change string
		bug                string
	}{
		{"grown", "w", "echo more >> /tmp/f", ""},
		{"shrunk", "w", "truncate -s 1 /tmp/f", ""},
		{"appended to", "a", "echo more >> /tmp/f", ""},
		{"removed", "w", "rm /tmp/f", bugForkImageLiveRoot},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.bug != "" && !runKnownBugs() {
				t.Skip(c.bug + " (DG_FID_KNOWN_BUGS=1 runs it)")
			}
			s := b.create(t, sandbox.Spec{Image: img})
			prog := `import sys, time
f = open("/tmp/f", sys.argv[1])
f.write("at the checkpoint\n"); f.flush()
open("/tmp/ready", "w").close()
for line in open("/tmp/ctl"):
    f.write(line); f.flush()
`
			sh(t, s, "mkfifo /tmp/ctl")
			if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "-c", prog, c.mode}, Background: true}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, s, "[ -e /tmp/ready ]")
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got := methods(ck.Processes); got != "python3:template" {
				t.Fatalf("captured %q, want the writer as a template", got)
			}
			sh(t, s, c.change)
			kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
			if err != nil {
				t.Fatalf("fork after the file was %s: %v", c.name, err)
			}
			t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
			sh(t, kids[0], "echo next > /tmp/ctl")
			waitFor(t, kids[0], "grep -q next /tmp/f")
			if got := sh(t, kids[0], "cat /tmp/f"); got != "at the checkpoint\nnext\n" {
				t.Fatalf("the fork's file after the writer went on: %q", got)
			}
		})
	}
}

// A multi-threaded process saved by CRIU comes back from checkpoint after
// checkpoint, each restored in place right after it was taken: rounds of
// checkpoint, a command, restore; each restore waits for the ids of the
// threads the restore killed to be free, which criu gives back
// (DG_FID_ROUNDS rounds, 60 by default, about 12 s).
func TestCRIURestoreThreadedInPlace(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	s := b.create(t, sandbox.Spec{Image: defaultImage(t, b)})
	ctx := t.Context()
	sh(t, s, "mkdir -p /fid/out && echo 1 > /fid/epoch")
	if err := s.WriteFile(ctx, "/fid/w.py", []byte(fidWriterPy), 0o644, false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"python3", "/fid/w.py", "threads", "/fid/out/t", "@t@"}, Background: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, s, "[ -s /fid/out/t.2 ]")
	var prev string
	for round := range fidRounds(60) {
		ck, err := s.CheckpointWith(ctx, sandbox.CheckpointOptions{Processes: sandbox.ProcessesCRIU})
		if err != nil {
			t.Fatalf("round %d: checkpoint: %v", round, err)
		}
		if prev != "" {
			if err := b.rt.ReleaseCheckpoint(prev); err != nil {
				t.Fatal(err)
			}
		}
		prev = ck.ID
		sh(t, s, "true")
		if err := s.Restore(ctx, ck.ID); err != nil {
			t.Fatalf("round %d: restore: %v\nthe sandbox's threads:\n%s", round, err, threadTable(s))
		}
	}
	waitFor(t, s, "[ $(ls /proc/$(pgrep -f '[@]t@')/task | wc -l) = 4 ]")
}
