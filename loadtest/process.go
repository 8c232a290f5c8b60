package loadtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// The rollback-process scenario: per sandbox, one python3 process (single-threaded, of
// four threads, or the child of a shell: Config.ProcessShape) holds
// Config.ProcessMB MiB (every page written) and a counter, and serves them on a loopback
// TCP port of the sandbox's own network namespace. The sandbox is checkpointed once with
// the process captured (a template, or CRIU); then each iteration restores it, asks the
// process for its state (op "check": the counter must be the checkpointed one and every
// page must hold it, else ErrWrongRestore), and bumps the counter, rewriting one byte of
// every page (op "change"), so the next restore has memory to undo.

const (
	// procPort is the port the process listens on inside its sandbox.
	procPort = 7000
	// procReady is the FIFO through which the process says it listens.
	procReady = "/tmp/loadtest-proc.ready"
)

// procProgram is the process: python3 -c procProgram MIB COUNTER PORT READY_FIFO THREADS.
// Its threads beyond the first wait, as a pool's workers do.
const procProgram = `import socket, sys, threading, time
for _ in range(int(sys.argv[5]) - 1):
    threading.Thread(target=time.sleep, args=(1e9,), daemon=True).start()
P = 4096
buf = bytearray(int(sys.argv[1]) << 20)
n = len(buf) // P
c = 0
def put(v):
    global c
    c = v
    buf[::P] = bytes([v & 255]) * n
def state():
    return b"%d %d %d\n" % (c, buf[::P] == bytes([c & 255]) * n, len(buf))
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[3])))
s.listen(64)
put(int(sys.argv[2]))
with open(sys.argv[4], "w") as f:
    f.write("ready\n")
while True:
    conn, _ = s.accept()
    try:
        if conn.recv(16).startswith(b"bump"):
            put(c + 1)
        conn.sendall(state())
    finally:
        conn.close()
`

// procClient sends $1 to the process (on procPort) and prints its one-line answer. It
// waits for the process to close the connection (EOF), so that when the step returns the
// process is back in accept(): a later checkpoint captures it quiescent.
const procClient = `exec 3<>/dev/tcp/127.0.0.1/7000 && printf '%s\n' "$1" >&3 && IFS= read -r r <&3 && cat <&3 && printf '%s' "$r"`

// rollbackProcessWorker: checkpoint a sandbox with one live 8 MB process once, then
// Restore, check the process's state, change it.
type rollbackProcessWorker struct {
	base
	mb          int
	method      string
	shape       string
	ck          string
	want        int // the counter at the checkpoint
	skipRestore bool
}

// procState is what the process answers.
type procState struct {
	counter    int
	consistent bool // every page holds the counter's low byte
	bytes      int
}

func (w *rollbackProcessWorker) ask(ctx context.Context, cmd string) (procState, error) {
	r, err := w.c.Step(ctx, &deltagymv1.StepRequest{SandboxId: w.sid, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{
		Exec: &deltagymv1.ExecAction{Argv: []string{"bash", "-c", procClient, "client", cmd}, TimeoutSeconds: 20}}}})
	if err != nil {
		return procState{}, err
	}
	x := r.GetObservation().GetExec()
	if x.GetExitCode() != 0 {
		return procState{}, fmt.Errorf("no process answers on port %d (exit %d: %s; python3 processes [pid state]: %s): %w", procPort,
			x.GetExitCode(), strings.TrimSpace(string(x.GetStderr())), w.pythons(ctx), ErrWrongRestore)
	}
	f := strings.Fields(string(x.GetStdout()))
	var st procState
	var errs [3]error
	if len(f) == 3 {
		st.counter, errs[0] = strconv.Atoi(f[0])
		st.consistent = f[1] == "True" || f[1] == "1"
		st.bytes, errs[2] = strconv.Atoi(f[2])
	}
	if len(f) != 3 || errors.Join(errs[:]...) != nil {
		return procState{}, fmt.Errorf("process answered %q: %w", head(x.GetStdout()), ErrUnexpected)
	}
	return st, nil
}

// expect asks the process and checks it is at counter want with every page consistent.
func (w *rollbackProcessWorker) expect(ctx context.Context, cmd string, want int, wrong error) error {
	st, err := w.ask(ctx, cmd)
	if err != nil {
		return err
	}
	if st.counter != want || !st.consistent || st.bytes != w.mb<<20 {
		return fmt.Errorf("process state after %s is counter %d (pages consistent: %v, %d bytes), want counter %d over %d bytes: %w",
			cmd, st.counter, st.consistent, st.bytes, want, w.mb<<20, wrong)
	}
	return nil
}

// pythons lists the sandbox's python3 processes and their states, for error messages.
func (w *rollbackProcessWorker) pythons(ctx context.Context) string {
	x, err := w.exec(ctx, "sh", "-c", `for d in /proc/[0-9]*; do case "$(tr '\0' ' ' < $d/cmdline 2>/dev/null)" in python3*) echo "[${d#/proc/} $(cut -d' ' -f3 $d/stat)]";; esac; done`)
	if err != nil {
		return "(listing them: " + err.Error() + ")"
	}
	return strings.Join(strings.Fields(string(x.GetStdout())), " ")
}

func (w *rollbackProcessWorker) exec(ctx context.Context, argv ...string) (*deltagymv1.ExecResult, error) {
	r, err := w.c.Step(ctx, &deltagymv1.StepRequest{SandboxId: w.sid, Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{
		Exec: &deltagymv1.ExecAction{Argv: argv, TimeoutSeconds: 20}}}})
	if err != nil {
		return nil, err
	}
	return r.GetObservation().GetExec(), nil
}

func (w *rollbackProcessWorker) setup(ctx context.Context) error {
	if err := w.reset(ctx); err != nil {
		return err
	}
	x, err := w.exec(ctx, "sh", "-c", "command -v python3 && command -v bash && mkfifo "+procReady)
	if err != nil {
		return fmt.Errorf("probing python3: %w", err)
	}
	if x.GetExitCode() != 0 {
		return fmt.Errorf("env %s has no python3 and bash (or no mkfifo): %w", w.env, ErrUnavailable)
	}
	w.want = 1000 + w.id
	argv := []string{"python3", "-c", procProgram, strconv.Itoa(w.mb), strconv.Itoa(w.want), strconv.Itoa(procPort), procReady, "1"}
	switch w.shape {
	case ShapeThreads:
		argv[len(argv)-1] = "4"
	case ShapeTree:
		argv = append([]string{"sh", "-c", `"$@"; exit`, "sh"}, argv...)
	}
	_, err = w.step(ctx, &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{
		Argv: argv, Background: true}}}, false)
	if err != nil {
		return fmt.Errorf("starting the process: %w", err)
	}
	// The process opens the FIFO for writing once it listens: cat waits for it.
	if x, err = w.exec(ctx, "sh", "-c", "cat "+procReady+" && rm "+procReady); err != nil || x.GetExitCode() != 0 {
		return fmt.Errorf("waiting for the process (exit %d: %s): %w", x.GetExitCode(), head(x.GetStderr()), errors.Join(err, ErrUnexpected))
	}
	if err := w.expect(ctx, "get", w.want, ErrUnexpected); err != nil {
		return fmt.Errorf("before the checkpoint: %w", err)
	}
	mode, method := deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE, deltagymv1.CaptureMethod_CAPTURE_METHOD_TEMPLATE
	if w.shape == ShapeTree {
		// A tree is dumped by CRIU in either mode (and gets templates
		// too: its restores in place are copies of them).
		method = deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU
	}
	if w.method == ProcessCRIU {
		mode, method = deltagymv1.ProcessMode_PROCESS_MODE_CRIU, deltagymv1.CaptureMethod_CAPTURE_METHOD_CRIU
	}
	r, err := w.c.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: w.sid, ProcessMode: mode})
	if status.Code(err) == codes.Unimplemented {
		return fmt.Errorf("checkpoint with %s: %w: server answers Unimplemented: %s", mode, ErrUnavailable, status.Convert(err).Message())
	}
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	w.ck = r.GetCheckpointId()
	w.own(w.ck)
	var seen []string
	found := false
	for _, p := range r.GetProcesses() {
		seen = append(seen, fmt.Sprintf("pid %d %s %s %s", p.GetPid(), p.GetCommand(), p.GetMethod(), p.GetReason()))
		if strings.Contains(p.GetCommand(), "python3") && p.GetMethod() == method {
			found = true
		}
	}
	if !found {
		return fmt.Errorf("checkpoint lists processes %v, want python3 captured by %s: %w", seen, method, ErrUnexpected)
	}
	return w.change(ctx, nil)
}

// change bumps the process's counter past the checkpointed one.
func (w *rollbackProcessWorker) change(ctx context.Context, rec *recorder) error {
	call := func() error { return w.expect(ctx, "bump", w.want+1, ErrUnexpected) }
	if rec == nil {
		return call()
	}
	return rec.op("change", call)
}

func (w *rollbackProcessWorker) iterate(ctx context.Context, rec *recorder) error {
	if !w.skipRestore {
		if err := rec.op("restore", func() error { return w.restore(ctx, w.ck) }); err != nil {
			return err
		}
	}
	if err := rec.op("check", func() error { return w.expect(ctx, "get", w.want, ErrWrongRestore) }); err != nil {
		return err
	}
	return w.change(ctx, rec)
}

// ProcessVariant is one way of capturing processes in the rollback-process comparison:
// its figures when the server offers it, or why it is not available.
type ProcessVariant struct {
	Method       string  `json:"method"`
	Available    bool    `json:"available"`
	Reason       string  `json:"reason,omitempty"`
	Concurrency  int     `json:"concurrency,omitempty"`
	Throughput   float64 `json:"rollbacks_per_second,omitempty"`
	RestoreP50Ms float64 `json:"restore_p50_ms,omitempty"`
	RestoreP99Ms float64 `json:"restore_p99_ms,omitempty"`
	Errors       int64   `json:"errors,omitempty"`
}

// MeasureProcessCRIU runs the rollback-process scenario with the CRIU process mode (cfg
// otherwise as given; ProcessMethod is overridden) for the side-by-side comparison. A
// server that answers Unimplemented yields Available false and the server's reason, not
// an error; other failures are returned.
func MeasureProcessCRIU(ctx context.Context, cfg Config) (*ProcessVariant, error) {
	cfg.Scenario, cfg.ProcessMethod, cfg.Progress = "rollback-process", ProcessCRIU, nil
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	v := &ProcessVariant{Method: ProcessCRIU, Concurrency: cfg.Concurrency}
	// One sandbox first: an Unimplemented answer then costs one setup, not Concurrency.
	probe := cfg
	probe.Concurrency, probe.Duration, probe.Warmup = 1, time.Millisecond, time.Millisecond
	if _, err := Run(ctx, probe); errors.Is(err, ErrUnavailable) {
		v.Reason = err.Error()
		if i := strings.LastIndex(v.Reason, ErrUnavailable.Error()+": "); i >= 0 {
			v.Reason = v.Reason[i+len(ErrUnavailable.Error())+2:]
		}
		return v, nil
	} else if err != nil {
		return nil, fmt.Errorf("probing the CRIU process mode: %w", err)
	}
	rep, err := Run(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("rollback-process with CRIU: %w", err)
	}
	v.Available, v.Throughput, v.Errors = true, rep.Throughput, rep.ErrorCount
	v.RestoreP50Ms, v.RestoreP99Ms = rep.Ops["restore"].P50Ms, rep.Ops["restore"].P99Ms
	return v, nil
}

// writeSummary prints the CRIU line of a rollback-process report.
func (v *ProcessVariant) writeSummary(w io.Writer, r *Report) {
	if !v.Available {
		fmt.Fprintf(w, "process rollback by %s: not available (%s)\n", v.Method, v.Reason)
		return
	}
	fmt.Fprintf(w, "process rollback by %s: %.0f rollbacks/s with %d sandboxes, restore p50 %.3f ms p99 %.3f ms, %d errors",
		v.Method, v.Throughput, v.Concurrency, v.RestoreP50Ms, v.RestoreP99Ms, v.Errors)
	if t := r.Ops["restore"].P50Ms; t > 0 && v.RestoreP50Ms > 0 {
		fmt.Fprintf(w, "; template restore is %.1fx faster (p50)", v.RestoreP50Ms/t)
	}
	fmt.Fprintln(w)
}
