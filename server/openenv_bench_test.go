package server_test

import (
	"bytes"
	"encoding/json"
	"runtime"
	"testing"
	"time"

	"github.com/coder/websocket"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// BenchmarkStepWebSocket: the same step (a command that only exits) through an OpenEnv
// WebSocket and through a Connect StepStream, one client each on one server, in blocks that
// alternate, so that the VM's drift weighs on both alike. ws_ and stream_ are each one's
// client-observed latency; the difference is what the OpenEnv front end adds to a step.
func BenchmarkStepWebSocket(b *testing.B) {
	if runtime.GOARCH != "amd64" {
		b.Skip("the step runs a static x86-64 program")
	}
	bb, ctx := benchBundle(b)
	cmd := "/bin/noop"
	// The stream's sandbox.
	req := stepRequest(b, bb, ctx, cmd)
	req.Action = execAction(cmd)
	stream := bb.connect.StepStream(ctx)
	defer stream.CloseRequest()
	// The socket's sandbox.
	o := dialOpenEnv(b, bb, "plain")
	r := o.do("reset", nil)
	box, err := bb.srv.Runtime().Get(r.Metadata.SandboxID)
	must(b, err)
	must(b, box.WriteFile(ctx, cmd, noopELF(), 0o755, false))
	frame, _ := json.Marshal(map[string]any{"type": "step", "data": map[string]any{"command": cmd}})
	var answer bytes.Buffer // the client reads into a buffer of its own, as the stream's reads into its own
	wsStep := func() {
		if err := o.c.Write(ctx, websocket.MessageText, frame); err != nil {
			b.Fatal(err)
		}
		_, r, err := o.c.Reader(ctx)
		if err == nil {
			answer.Reset()
			_, err = answer.ReadFrom(r)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	var id uint64
	streamStep := func() {
		id++
		must(b, stream.Send(&deltagymv1.StepStreamRequest{RequestId: id, Step: req}))
		resp, err := stream.Receive()
		must(b, err)
		if resp.GetError() != nil {
			b.Fatal(resp.GetError().GetMessage())
		}
	}
	wsStep() // the first of each pays for connections and caches
	streamStep()
	var ws, st []time.Duration
	const block = 25
	i := 0
	for b.Loop() {
		start := time.Now()
		if (i/block)%2 == 0 {
			wsStep()
			ws = append(ws, time.Since(start))
		} else {
			streamStep()
			st = append(st, time.Since(start))
		}
		i++
	}
	report(b, "ws_", ws)
	report(b, "stream_", st)
}
