package server_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	deltagymv1 "github.com/deltagym/deltagym/proto/gen/go/deltagym/v1"
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

func benchBundle(b *testing.B) (*bundle, context.Context) {
	bb := setup(b, func(c *server.Config) { c.NoLedger = true })
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

func BenchmarkStepTrue(b *testing.B) {
	b.Run("ledger=off", func(b *testing.B) { bb, ctx := benchBundle(b); benchStep(b, bb, ctx) })
	b.Run("ledger=on", func(b *testing.B) { benchStep(b, setup(b, nil), context.Background()) })
}

func benchStep(b *testing.B, bb *bundle, ctx context.Context) {
	r, err := bb.grpc.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain"})
	must(b, err)
	req := &deltagymv1.StepRequest{SandboxId: r.GetSandboxId(), Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Argv: []string{"true"}}}}}
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
