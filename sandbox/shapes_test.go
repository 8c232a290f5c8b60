package sandbox_test

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/sandbox"
)

// The conformance matrix of process shapes: each shape an agent makes is
// started in a sandbox of the default image, checkpointed, changed,
// restored in place, forked three times and restored after a restart of
// the runtime, and the state its probes report (sandbox/testdata/probe) is
// checked against the checkpoint's each time. docs/PROCESS-SHAPES.md holds
// the same table (TestProcessShapesDoc).

// threaded is how a checkpoint takes a multi-threaded process that is not
// part of a tree, and what its restores and forks bring back: the cells of
// both threaded rows.
var threaded = template

// Cell values of the matrix. A checkpoint's method is "template", "CRIU"
// or "refused: <what the error says>". A restore, fork or restore after a
// restart is "yes" (every probe reports the checkpoint's state, by the
// rules of compareReports), "differs: <keys>" (the reports' keys that
// differ from the checkpoint's, space-separated, sorted) or "fails: <what
// the error says>".
const yes = "yes"

// processShape is one row of the matrix.
type processShape struct {
	name    string // the row's name in the doc
	started string // how it is started, as the doc says
	// start starts the shape in s, whose /tmp/probe is empty.
	start func(t *testing.T, s *sandbox.Sandbox)
	// roles are the roles of the probes the shape runs.
	roles []string
	cells
	// copied: a tree restored in place by a copy of its templates, not
	// from its images (procstate/tree.go).
	copied bool
}

// cells are the expected cells of a row: the checkpoint's method, a
// restore in place, a fork, a restore after a restart.
type cells struct{ method, inPlace, fork, restart string }

// Cells shared by rows.
var (
	// template is a single process copied from a template: in place, a
	// copy; in a fork or after a restart, a CRIU image of a copy.
	template = cells{"template", yes, yes, yes}
	// templateLeftover is template for a process whose session and group
	// leader (the shell that started it) is gone: an image of it is
	// restored leading its own session and group, as criu restores only
	// a tree whose leaders it holds (criu.leadOwnSession).
	templateLeftover = cells{"template", yes, "differs: leads_group leads_session", "differs: leads_group leads_session"}
	// criuTree is a tree whose probes run below its root.
	criuTree = cells{"CRIU", yes, yes, yes}
	// criuRoot is a tree or process whose root is a probe: restored as a
	// child of the server (criu's rst_sibling), outside the sandbox's pid
	// namespace, it sees parent pid 0.
	criuRoot = cells{"CRIU", "differs: ppid ppid_comm", "differs: ppid ppid_comm", "differs: ppid ppid_comm"}
)

// shapes is the matrix. The probes of every row but the last two hold no
// established TCP connection (-T): criu saves one only in TCP repair mode,
// which restoring needs CAP_NET_ADMIN over the sandbox's network namespace,
// which its processes lack (the namespace belongs to the host's user
// namespace). Those two rows show what one does.
var shapes = []processShape{
	row("single process", "background exec of `probe`", execBackground("probe -T"), template, "main"),
	row("a line ending in a program", "background exec of `cd /tmp && probe`", execBackground("cd /tmp && probe -T"), template, "main"),
	row("`&`", "plain exec of `probe &`", execPlain("probe -T &"), templateLeftover, "main"),
	row("`nohup … &`", "plain exec of `nohup probe &`", execPlain("nohup probe -T &"), templateLeftover, "main"),
	row("double-forked daemon", "plain exec of `probe -d`", execPlain("probe -T -d"), templateLeftover, "main"),
	row("`setsid`", "background exec of `setsid probe`", execBackground("setsid probe -T"), template, "main"),
	copiedTree(row("shell → child", "background exec of `sh -c 'probe; echo done'`", execBackground("sh -c 'probe -T; echo done'"), criuTree, "main")),
	row("parent with 3 workers", "background exec of `probe -w 3`", execBackground("probe -T -w 3 -n parent"), criuRoot,
		"parent", "worker1", "worker2", "worker3"),
	row("pipeline", "background exec of `probe -o | probe -i`", execBackground("probe -T -o -n writer | probe -T -i -n reader"), criuTree,
		"writer", "reader"),
	row("multi-threaded C", "background exec of `probe -t 4`", execBackground("probe -T -t 4"), threaded, "main"),
	row("Python threads", "background exec of `python3 probe.py 4`", execBackground("python3 /usr/local/bin/probe.py 4 main -T"), threaded, "main"),
	row("session shell with a job", "session command `probe &`", execSession("probe -T &"), criuTree, "main"),
	row("single process, TCP connection", "background exec of `probe`, connected to itself", execBackground("probe"),
		cells{"template", "differs: tcp_conn", "differs: tcp_conn", "differs: tcp_conn"}, "main"),
	row("shell → child, TCP connection", "background exec of `sh -c 'probe; echo done'`, connected to itself",
		execBackground("sh -c 'probe; echo done'"), cells{method: "refused: Connected TCP socket"}, "main"),
}

func row(name, started string, start func(*testing.T, *sandbox.Sandbox), c cells, roles ...string) processShape {
	return processShape{name: name, started: started, start: start, roles: roles, cells: c}
}

// copiedTree marks r a tree restored in place by a copy of its templates.
func copiedTree(r processShape) processShape {
	r.copied = true
	return r
}

// probeEnv is the environment every shape's probes start with.
var probeEnv = []string{"PROBE_TAG=shape"}

func execBackground(cmd string) func(*testing.T, *sandbox.Sandbox) {
	return func(t *testing.T, s *sandbox.Sandbox) {
		t.Helper()
		if _, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: cmd, Env: probeEnv, Background: true}); err != nil {
			t.Fatal(err)
		}
	}
}

func execPlain(cmd string) func(*testing.T, *sandbox.Sandbox) {
	return func(t *testing.T, s *sandbox.Sandbox) {
		t.Helper()
		res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: cmd, Env: probeEnv})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("exec %q: %v %+v", cmd, err, res)
		}
	}
}

func execSession(cmd string) func(*testing.T, *sandbox.Sandbox) {
	return func(t *testing.T, s *sandbox.Sandbox) {
		t.Helper()
		inSession(t, s, "export PROBE_TAG=shape")
		inSession(t, s, cmd)
	}
}

// probeBinary returns the probe `make probe` builds (bin/dg-probe), or
// skips.
func probeBinary(t testing.TB) []byte {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(filepath.Dir(strings.TrimSpace(string(out))), "bin", "dg-probe")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Skipf("the probe is not built (make probe): %v", err)
	}
	return b
}

// installProbes copies the probes into s.
func installProbes(t testing.TB, s *sandbox.Sandbox, bin []byte) {
	t.Helper()
	py, err := os.ReadFile("testdata/probe/probe.py")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := s.WriteFile(ctx, "/usr/local/bin/probe", bin, 0o755, false); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(ctx, "/usr/local/bin/probe.py", py, 0o644, false); err != nil {
		t.Fatal(err)
	}
}

// probeReport is one probe's report: key → value.
type probeReport map[string]string

// askReports asks every probe of s to report (SIGUSR2), with sig (if any)
// sent first, and returns the reports by role once n carry the request's
// token. A signal the sandbox refuses (a template's process) is ignored.
func askReports(t testing.TB, s *sandbox.Sandbox, sig, token string, n int) map[string]probeReport {
	t.Helper()
	pre := ""
	if sig != "" {
		pre = "kill -" + sig + " $(pgrep -x 'probe|python3') 2>/dev/null\n"
	}
	script := pre + fmt.Sprintf(`echo %[1]s > /tmp/probe/token
kill -USR2 $(pgrep -x 'probe|python3') 2>/dev/null
for i in $(seq 1500); do
	[ "$(grep -lx token=%[1]s /tmp/probe/*.report 2>/dev/null | wc -l)" -ge %[2]d ] && break
	sleep 0.01
done
for f in $(grep -lx token=%[1]s /tmp/probe/*.report); do cat $f; echo; done
`, token, n)
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: script, Timeout: 30 * time.Second})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("asking for reports: %v %+v", err, res)
	}
	out := map[string]probeReport{}
	sc := bufio.NewScanner(strings.NewReader(string(res.Stdout)))
	r := probeReport{}
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			r[k] = v
			continue
		}
		if len(r) > 0 {
			out[r["role"]] = r
		}
		r = probeReport{}
	}
	if len(out) != n {
		pids, _ := s.Exec(t.Context(), sandbox.ExecRequest{Command: "ps -eo pid,ppid,pgid,sid,stat,comm"})
		t.Fatalf("%d reports with token %s, want %d: %v\nprocesses:\n%s", len(out), token, n, slices.Sorted(maps.Keys(out)), pids.Stdout)
	}
	return out
}

// Keys compareReports checks by rule, not for equality.
var (
	// timerKeys: the time left to a timer's next expiry runs on; it is in
	// (0, interval].
	timerKeys = map[string]string{"itimer_value": "itimer_interval", "timerfd_value": "timerfd_interval"}
	// pidKeys: ids a process gets anew when it is not restored with the
	// pids it had (a template's copy); whether it leads its group and
	// session (leads_group, leads_session) is compared.
	pidKeys = []string{"pid", "ppid", "pgid", "sid", "ppid_comm", "tcp_conn_peer"}
)

// changeKey reports whether a probe's change (SIGUSR1) changes key k.
func changeKey(k string) bool {
	switch k {
	case "gen", "counter", "mem_sum", "file_off", "file_sum", "cwd", "env_gen", "SigIgn", "SigCgt",
		"itimer_interval", "timerfd_interval", "sock_gen", "pipe_gen":
		return true
	}
	return strings.HasPrefix(k, "thread") && k != "threads" && k != "thread0_tls"
}

// compareReports returns how got differs from want, the reports of the
// checkpoint's probes: every key equal but the token, timerKeys by their
// rule, and pidKeys only where samePids.
func compareReports(want, got map[string]probeReport, samePids bool) []string {
	var diffs []string
	for role, w := range want {
		g, ok := got[role]
		if !ok {
			diffs = append(diffs, role+": no report")
			continue
		}
		for k, wv := range w {
			gv := g[k]
			switch {
			case k == "token":
			case timerKeys[k] != "":
				v, _ := strconv.Atoi(gv)
				iv, _ := strconv.Atoi(g[timerKeys[k]])
				if v <= 0 || v > iv {
					diffs = append(diffs, fmt.Sprintf("%s: %s=%s, not in (0, %s]", role, k, gv, g[timerKeys[k]]))
				}
			case !samePids && slices.Contains(pidKeys, k):
			case gv != wv:
				diffs = append(diffs, fmt.Sprintf("%s: %s=%s, want %s", role, k, gv, wv))
			}
		}
	}
	slices.Sort(diffs)
	return diffs
}

// differingKeys returns the keys of diffs (compareReports), sorted, once
// each.
func differingKeys(diffs []string) string {
	var keys []string
	for _, d := range diffs {
		_, kv, _ := strings.Cut(d, ": ")
		k, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return strings.Join(keys, " ")
}

// checkCell checks one cell of the matrix: err, the step's error, and the
// reports taken after it (nil if it failed) against the checkpoint's.
func checkCell(t *testing.T, what, cell string, err error, want, got map[string]probeReport, samePids bool) {
	t.Helper()
	if msg, ok := strings.CutPrefix(cell, "fails: "); ok {
		if err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: %v, the matrix says it fails: %s", what, err, msg)
		}
		return
	}
	if err != nil {
		t.Errorf("%s: %v, the matrix says %q", what, err, cell)
		return
	}
	diffs := compareReports(want, got, samePids)
	keys := differingKeys(diffs)
	switch {
	case cell == yes && len(diffs) > 0:
		t.Errorf("%s: the probes' state differs from the checkpoint's:\n%s", what, strings.Join(diffs, "\n"))
	case cell != yes && "differs: "+keys != cell:
		t.Errorf("%s: the keys %q differ from the checkpoint's, the matrix says %q:\n%s", what, keys, cell, strings.Join(diffs, "\n"))
	}
}

// captureMethods describes how a checkpoint took its processes, in the matrix's
// words: "template", "CRIU", or both, "+"-joined, in that order.
func captureMethods(ps []sandbox.ProcessCapture) string {
	var out []string
	for _, m := range []sandbox.CaptureMethod{sandbox.CaptureTemplate, sandbox.CaptureCRIU} {
		if slices.ContainsFunc(ps, func(p sandbox.ProcessCapture) bool { return p.Method == m }) {
			out = append(out, map[sandbox.CaptureMethod]string{sandbox.CaptureTemplate: "template", sandbox.CaptureCRIU: "CRIU"}[m])
		}
	}
	return strings.Join(out, "+")
}

// shapeRun is what one shape's first phase leaves for the second.
type shapeRun struct {
	ck     string
	want   map[string]probeReport
	method string
}

// TestProcessShapes runs the matrix: every shape in a sandbox of its own,
// side by side; then the runtime restarts and each checkpoint is restored
// in a new sandbox.
func TestProcessShapes(t *testing.T) {
	needCRIU(t)
	b := setup(t)
	img := defaultImage(t, b)
	bin := probeBinary(t)
	runs := make([]*shapeRun, len(shapes))
	var mu sync.Mutex
	// The live sandboxes stay until the end: the restart stops them.
	var live []*sandbox.Sandbox
	keep := func(s *sandbox.Sandbox) {
		mu.Lock()
		defer mu.Unlock()
		live = append(live, s)
	}
	t.Cleanup(func() {
		for _, s := range live {
			_ = s.Destroy(context.Background())
		}
	})
	t.Run("live", func(t *testing.T) {
		for i, sh := range shapes {
			t.Run(sh.name, func(t *testing.T) {
				t.Parallel()
				r := runShape(t, b, img, bin, sh, keep)
				mu.Lock()
				runs[i] = r
				mu.Unlock()
			})
		}
	})
	b.restart(t)
	t.Run("restart", func(t *testing.T) {
		for i, sh := range shapes {
			if runs[i] == nil {
				continue
			}
			t.Run(sh.name, func(t *testing.T) {
				t.Parallel()
				r := runs[i]
				s, err := b.rt.Create(t.Context(), sandbox.Spec{Checkpoint: r.ck})
				var got map[string]probeReport
				if err == nil {
					t.Cleanup(func() { _ = s.Destroy(context.Background()) })
					got = askReports(t, s, "", "restart", len(sh.roles))
				}
				checkCell(t, "after a restart", sh.restart, err, r.want, got, r.method != "template")
			})
		}
	})
}

// runShape starts sh, checks its checkpoint's method, restores it in place
// and forks it, and returns what the restart phase needs.
func runShape(t *testing.T, b *bundle, img string, bin []byte, sh processShape, keep func(*sandbox.Sandbox)) *shapeRun {
	ctx := t.Context()
	s, err := b.rt.Create(ctx, sandbox.Spec{Image: img})
	if err != nil {
		t.Fatal(err)
	}
	keep(s)
	installProbes(t, s, bin)
	sh.start(t, s)
	for _, role := range sh.roles {
		waitFor(t, s, "[ -e /tmp/probe/"+role+".ready ]")
	}
	n := len(sh.roles)
	want := askReports(t, s, "", "checkpoint", n)
	ck, err := s.Checkpoint(ctx)
	if refused, ok := strings.CutPrefix(sh.method, "refused: "); ok {
		if err == nil || !strings.Contains(err.Error(), refused) {
			t.Fatalf("checkpoint: %v, want refused: %s", err, refused)
		}
		return nil
	}
	if err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	method := captureMethods(ck.Processes)
	if method != sh.method {
		t.Errorf("checkpoint method %s (%s), want %s", method, methods(ck.Processes), sh.method)
	}
	// The change reaches every probe and every kind of state, so that a
	// restore that brings back the checkpoint's could fail to.
	changed := askReports(t, s, "USR1", "changed", n)
	for role, w := range want {
		for k, v := range w {
			if changeKey(k) && changed[role][k] == v {
				t.Fatalf("%s: the change left %s=%s", role, k, v)
			}
		}
	}
	samePids := method != "template"
	var got map[string]probeReport
	copies := s.TreeCopies()
	err = s.Restore(ctx, ck.ID)
	if err == nil {
		got = askReports(t, s, "", "restored", n)
	}
	checkCell(t, "restore in place", sh.inPlace, err, want, got, samePids)
	if copied := s.TreeCopies() > copies; copied != sh.copied {
		t.Errorf("restore in place: a tree copied from templates: %v, want %v", copied, sh.copied)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 3, sandbox.Spec{})
	if err != nil {
		checkCell(t, "fork", sh.fork, err, want, nil, samePids)
	}
	for i, k := range kids {
		t.Cleanup(func() { _ = k.Destroy(context.Background()) })
		checkCell(t, fmt.Sprintf("fork %d", i), sh.fork, nil, want, askReports(t, k, "", "forked", n), samePids)
	}
	return &shapeRun{ck: ck.ID, want: want, method: method}
}

// TestProcessShapesDoc: the table of docs/PROCESS-SHAPES.md, section
// "Shapes", is the matrix TestProcessShapes asserts, row for row, but for
// its last column (what differs and why), which is prose.
func TestProcessShapesDoc(t *testing.T) {
	doc, err := os.ReadFile("../docs/PROCESS-SHAPES.md")
	if err != nil {
		t.Fatal(err)
	}
	rows, err := markdownTable(string(doc), "## Shapes")
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{{"Shape", "Started", "Checkpoint", "Restore in place", "Fork", "After restart"}}
	for _, sh := range shapes {
		want = append(want, []string{sh.name, sh.started, sh.method, dash(sh.inPlace), dash(sh.fork), dash(sh.restart)})
	}
	if len(rows) != len(want) {
		t.Fatalf("the doc's table has %d rows (with its header), the matrix %d", len(rows), len(want))
	}
	for i, w := range want {
		if got := rows[i]; len(got) != len(w)+1 || !slices.Equal(got[:len(w)], w) {
			t.Errorf("row %d of the doc's table:\n  %q\nthe matrix's:\n  %q (and what differs)", i, got, w)
		}
	}
}

// dash is how the doc writes a cell the matrix leaves empty (a step after
// a refused checkpoint).
func dash(cell string) string {
	if cell == "" {
		return "—"
	}
	return cell
}

// markdownTable returns the cells of the first table after the line
// heading in doc, its header first (the delimiter row left out), with
// escaped pipes ("\|") unescaped.
func markdownTable(doc, heading string) ([][]string, error) {
	_, after, ok := strings.Cut(doc, "\n"+heading+"\n")
	if !ok {
		return nil, fmt.Errorf("no section %q", heading)
	}
	var rows [][]string
	for _, line := range strings.Split(after, "\n") {
		if !strings.HasPrefix(line, "|") {
			if len(rows) > 0 || strings.HasPrefix(line, "#") {
				break
			}
			continue
		}
		line = strings.ReplaceAll(strings.TrimSpace(line), `\|`, "\x00")
		var cells []string
		for _, c := range strings.Split(strings.Trim(line, "|"), "|") {
			cells = append(cells, strings.ReplaceAll(strings.TrimSpace(c), "\x00", "|"))
		}
		if strings.Trim(strings.Join(cells, ""), "-: ") == "" {
			continue // the delimiter row
		}
		rows = append(rows, cells)
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("no table in section %q", heading)
	}
	return rows, nil
}
