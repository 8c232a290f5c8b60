package server_test

import (
	"context"
	"encoding/binary"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// report adds p50 and p99 of ds (in ms) to b.
func report(b *testing.B, prefix string, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, prefix+"p50_ms")
	b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds())/1000, prefix+"p99_ms")
}

// benchBundle is a server without a ledger; DELTAGYM_BENCH_NO_AUTH=1 turns its auth off, to
// measure what the token costs a call (the client sending it, the server checking it).
func benchBundle(b *testing.B) (*bundle, context.Context) {
	bb := setup(b, func(c *server.Config) { c.NoLedger = true; c.NoAuth = os.Getenv("DELTAGYM_BENCH_NO_AUTH") == "1" })
	return bb, context.Background()
}

// BenchmarkReset: warm resets at steady state (each sandbox closed after, and the pool given
// time to refill so refill cost is not hidden behind an empty pool). Client-observed gRPC
// latency, and the server's own time.
func BenchmarkReset(b *testing.B) {
	bb, ctx := benchBundle(b)
	env, err := bb.srv.Pools().Env("plain")
	must(b, err)
	var client, srv []time.Duration
	for b.Loop() {
		b.StopTimer()
		for env.Warm() < 4 {
			time.Sleep(time.Millisecond) // wait for the refill: steady state
		}
		b.StartTimer()
		start := time.Now()
		r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
		client = append(client, time.Since(start))
		must(b, err)
		secs, _ := strconv.ParseFloat(r.GetInfo()["server_seconds"], 64)
		srv = append(srv, time.Duration(secs*float64(time.Second)))
		b.StopTimer()
		_, err = bb.grpc.Close(ctx, &deltagymv1.CloseRequest{SandboxId: r.GetSandboxId()})
		must(b, err)
		b.StartTimer()
	}
	report(b, "client_", client)
	report(b, "server_", srv)
}

// BenchmarkStepTrue: Step exec `true`, without the ledger (BenchmarkStepLedger compares
// with and without it). On this VM the `true` itself costs about 1 ms: glibc's start-up
// probes the caches with CPUID, which traps to the hypervisor (perf: intel_check_word,
// handle_intel). The nolibc variant runs a 129-byte static binary that only exits, so it
// shows what deltagym itself adds to a step.
func BenchmarkStepTrue(b *testing.B) {
	b.Run("ledger=off", func(b *testing.B) { bb, ctx := benchBundle(b); benchStep(b, bb, ctx, "true") })
	if runtime.GOARCH != "amd64" {
		return
	}
	b.Run("nolibc/ledger=off", func(b *testing.B) { bb, ctx := benchBundle(b); benchStep(b, bb, ctx, "/bin/noop") })
}

// BenchmarkStepLedger: the same Step load, one client, against a server without its ledger,
// one with it (a step answers once its rows are written to the spool) and one with
// --ledger-sync (once they are fsynced), in the same run: blocks of stepBlock steps rotate
// between the three, so that the VM's speed, which drifts by a third within minutes here,
// weighs on all alike. A pause after each block lets the ledger's deliveries of that block
// (Postgres's COPY, the writer) finish before the next server's block starts; within a block
// they run as they would under a steady load. The nolibc command shows deltagym's own part of
// a step.
func BenchmarkStepLedger(b *testing.B) {
	cmds := []string{"true"}
	if runtime.GOARCH == "amd64" {
		cmds = append(cmds, "/bin/noop")
	}
	off, _ := benchBundle(b)
	// DELTAGYM_LEDGER_BENCH_VACUUM_STEPS sets the ledger servers' --ledger-vacuum-steps (-1:
	// none), as it sets BenchmarkWriterSteps's.
	vacuumSteps, _ := strconv.Atoi(os.Getenv("DELTAGYM_LEDGER_BENCH_VACUUM_STEPS"))
	on := setup(b, func(c *server.Config) { c.LedgerVacuumSteps = vacuumSteps })
	synced := setup(b, func(c *server.Config) { c.LedgerVacuumSteps = vacuumSteps; c.LedgerSync = true })
	for _, cmd := range cmds {
		name := "cmd=true"
		if cmd != "true" {
			name = "cmd=nolibc"
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			clients := [...]*bundle{off, on, synced}
			var reqs [len(clients)]*deltagymv1.StepRequest
			for k, c := range clients {
				reqs[k] = stepRequest(b, c, ctx, cmd)
			}
			var ds [len(clients)][]time.Duration
			const stepBlock = 50
			i := 0
			for b.Loop() {
				k := (i / stepBlock) % len(clients)
				start := time.Now()
				_, err := clients[k].grpc.Step(ctx, reqs[k])
				ds[k] = append(ds[k], time.Since(start))
				must(b, err)
				if i++; i%stepBlock == 0 {
					b.StopTimer()
					time.Sleep(150 * time.Millisecond)
					b.StartTimer()
				}
			}
			for k, prefix := range []string{"off_", "on_", "sync_"} {
				report(b, prefix, ds[k])
			}
		})
	}
}

// noopELF is an x86-64 executable that calls exit(0) and nothing else: one ELF header, one
// loadable segment, and `mov eax, 60; xor edi, edi; syscall`.
func noopELF() []byte {
	const base, hdr, ph = 0x400000, 64, 56
	code := []byte{0xb8, 60, 0, 0, 0, 0x31, 0xff, 0x0f, 0x05}
	size := uint64(hdr + ph + len(code))
	le := binary.LittleEndian
	b := []byte{0x7f, 'E', 'L', 'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	b = le.AppendUint16(b, 2)    // ET_EXEC
	b = le.AppendUint16(b, 0x3e) // x86-64
	b = le.AppendUint32(b, 1)
	b = le.AppendUint64(b, base+hdr+ph) // entry
	b = le.AppendUint64(b, hdr)         // program headers
	b = le.AppendUint64(b, 0)           // no section headers
	b = le.AppendUint32(b, 0)
	b = le.AppendUint16(b, hdr)
	b = le.AppendUint16(b, ph)
	b = le.AppendUint16(b, 1)
	b = le.AppendUint16(b, 0)
	b = le.AppendUint16(b, 0)
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, 1) // PT_LOAD
	b = le.AppendUint32(b, 5) // R+X
	b = le.AppendUint64(b, 0)
	b = le.AppendUint64(b, base)
	b = le.AppendUint64(b, base)
	b = le.AppendUint64(b, size)
	b = le.AppendUint64(b, size)
	b = le.AppendUint64(b, 0x1000)
	return append(b, code...)
}

// stepRequest resets a sandbox of bb and returns a Step of cmd in it (writing /bin/noop
// first if that is cmd).
func stepRequest(b *testing.B, bb *bundle, ctx context.Context, cmd string) *deltagymv1.StepRequest {
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	if cmd == "/bin/noop" {
		box, err := bb.srv.Runtime().Get(r.GetSandboxId())
		must(b, err)
		must(b, box.WriteFile(ctx, cmd, noopELF(), 0o755, false))
	}
	return &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(), Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Argv: []string{cmd}}}}}
}

func benchStep(b *testing.B, bb *bundle, ctx context.Context, cmd string) {
	req := stepRequest(b, bb, ctx, cmd)
	var ds []time.Duration
	for b.Loop() {
		start := time.Now()
		_, err := bb.grpc.Step(ctx, req)
		ds = append(ds, time.Since(start))
		must(b, err)
	}
	report(b, "", ds)
}

func BenchmarkRestore(b *testing.B) {
	bb, ctx := benchBundle(b)
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	ck, err := bb.grpc.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: r.GetSandboxId()})
	must(b, err)
	req := &deltagymv1.RestoreRequest{SandboxId: r.GetSandboxId(), CheckpointId: ck.GetCheckpointId()}
	var ds []time.Duration
	for b.Loop() {
		start := time.Now()
		_, err := bb.grpc.Restore(ctx, req)
		ds = append(ds, time.Since(start))
		must(b, err)
	}
	report(b, "", ds)
}

func BenchmarkFork16(b *testing.B) {
	bb, ctx := benchBundle(b)
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	ck, err := bb.grpc.Checkpoint(ctx, &deltagymv1.CheckpointRequest{SandboxId: r.GetSandboxId()})
	must(b, err)
	var ds []time.Duration
	for b.Loop() {
		start := time.Now()
		f, err := bb.grpc.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.GetCheckpointId()}, N: 16})
		ds = append(ds, time.Since(start))
		must(b, err)
		b.StopTimer()
		for _, id := range f.GetSandboxIds() {
			_, err := bb.grpc.Close(ctx, &deltagymv1.CloseRequest{SandboxId: id})
			must(b, err)
		}
		b.StartTimer()
	}
	report(b, "", ds)
}

// BenchmarkHeartbeat is the RPC floor: a unary call that touches no sandbox.
func BenchmarkHeartbeat(b *testing.B) {
	bb, ctx := benchBundle(b)
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	req := &deltagymv1.HeartbeatRequest{SandboxIds: []string{r.GetSandboxId()}}
	var ds []time.Duration
	for b.Loop() {
		start := time.Now()
		_, err := bb.grpc.Heartbeat(ctx, req)
		ds = append(ds, time.Since(start))
		must(b, err)
	}
	report(b, "", ds)
}

// verifierBundle is a benchmark server with the shell env's spec in both verifier modes:
// "shell" (pristine, as shipped) and "shell-sandbox" (the verifier in the agent's sandbox).
func verifierBundle(b *testing.B) (*bundle, context.Context) {
	bb, ctx := benchBundle(b)
	bb.register(b, shellSpec(b))
	in := shellSpec(b)
	in.Name, in.Evaluation = "shell-sandbox", nil
	bb.register(b, in)
	return bb, ctx
}

// verifierModes are the envs of verifierBundle, by verifier mode.
var verifierModes = []struct{ name, env string }{{"mode=sandbox", "shell-sandbox"}, {"mode=pristine", "shell"}}

// answered resets a sandbox of env and writes the right answer; it returns the sandbox.
func answered(b *testing.B, bb *bundle, ctx context.Context, env string) string {
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: env})
	must(b, err)
	_, err = bb.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(),
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_WriteFile{WriteFile: &deltagymv1.WriteFileAction{Path: "/work/answer.txt", Content: []byte("42\n")}}}})
	must(b, err)
	return r.GetSandboxId()
}

// BenchmarkEvaluate: Evaluate of a sandbox holding the right answer, in each verifier mode:
// mode=sandbox checkpoints the sandbox and runs the verifier in a fork of it; mode=pristine
// forks the env's initial checkpoint, copies /work/answer.txt in and runs the verifier there.
func BenchmarkEvaluate(b *testing.B) {
	bb, ctx := verifierBundle(b)
	for _, m := range verifierModes {
		b.Run(m.name, func(b *testing.B) {
			req := &deltagymv1.EvaluateRequest{SandboxId: answered(b, bb, ctx, m.env)}
			var ds []time.Duration
			for b.Loop() {
				start := time.Now()
				r, err := bb.grpc.Evaluate(ctx, req)
				ds = append(ds, time.Since(start))
				must(b, err)
				if r.GetReward() != 1 {
					b.Fatalf("evaluate: %v", r)
				}
			}
			report(b, "", ds)
		})
	}
}

// BenchmarkSubmit: the Step that submits a sandbox holding the right answer, in each verifier
// mode (a new episode each time: reset and answer are not timed).
func BenchmarkSubmit(b *testing.B) {
	bb, ctx := verifierBundle(b)
	submit := &deltagymv1.Action{Kind: &deltagymv1.Action_Submit{Submit: &deltagymv1.SubmitAction{}}}
	for _, m := range verifierModes {
		b.Run(m.name, func(b *testing.B) {
			var ds []time.Duration
			for b.Loop() {
				b.StopTimer()
				sb := answered(b, bb, ctx, m.env)
				b.StartTimer()
				start := time.Now()
				r, err := bb.grpc.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: submit})
				ds = append(ds, time.Since(start))
				must(b, err)
				if r.GetReward() != 1 || !r.GetTerminated() {
					b.Fatalf("submit: %v", r)
				}
				b.StopTimer()
				_, err = bb.grpc.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
				must(b, err)
				b.StartTimer()
			}
			report(b, "", ds)
		})
	}
}
