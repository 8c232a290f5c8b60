package server_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// otlpReceiver collects the spans of OTLP trace exports, over HTTP (protobuf) or gRPC.
type otlpReceiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu sync.Mutex
	// +checklocks:mu
	spans []*tracepb.Span
	// +checklocks:mu
	services []string // service.name of each export's resource
}

func (r *otlpReceiver) add(req *coltracepb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		r.services = append(r.services, attr(rs.GetResource().GetAttributes(), "service.name"))
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
}

// Export is the gRPC side.
func (r *otlpReceiver) Export(ctx context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	r.add(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// ServeHTTP is the HTTP side: POST /v1/traces with an ExportTraceServiceRequest.
func (r *otlpReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost || req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusBadRequest)
		return
	}
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	data, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var export coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(data, &export); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.add(&export)
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (r *otlpReceiver) named(name string) []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range r.spans {
		if s.GetName() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			v := kv.GetValue()
			switch v.GetValue().(type) {
			case *commonpb.AnyValue_IntValue:
				return strconv.FormatInt(v.GetIntValue(), 10)
			case *commonpb.AnyValue_BoolValue:
				if v.GetBoolValue() {
					return "true"
				}
				return "false"
			}
			return v.GetStringValue()
		}
	}
	return ""
}

// TestTraceExport runs an in-process OTLP receiver on loopback, points the server at it through
// the standard environment, and checks that the spans of a Reset and a Step arrive, named after
// their RPCs and sandbox operations, with their ids as attributes and the operations as children
// of the RPCs.
func TestTraceExport(t *testing.T) {
	cases := []struct {
		protocol string
		serve    func(t *testing.T, r *otlpReceiver) string // returns the endpoint URL
	}{
		{"http/protobuf", func(t *testing.T, r *otlpReceiver) string {
			hs := httptest.NewServer(r)
			t.Cleanup(hs.Close)
			return hs.URL
		}},
		{"grpc", func(t *testing.T, r *otlpReceiver) string {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			must(t, err)
			gs := grpc.NewServer()
			coltracepb.RegisterTraceServiceServer(gs, r)
			go func() { _ = gs.Serve(ln) }()
			t.Cleanup(gs.Stop)
			return "http://" + ln.Addr().String()
		}},
	}
	for _, tc := range cases {
		t.Run(tc.protocol, func(t *testing.T) {
			rcv := &otlpReceiver{}
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tc.serve(t, rcv))
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "")
			t.Setenv("OTEL_TRACES_EXPORTER", "")
			t.Setenv("OTEL_SERVICE_NAME", "")
			b := setup(t, func(c *server.Config) { c.NoLedger = true })
			ctx := t.Context()
			rr, err := b.connect.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain"}))
			must(t, err)
			sb := rr.Msg.GetSandboxId()
			_, err = b.connect.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("echo hi")}))
			must(t, err)
			// Close flushes the batch of spans to the receiver.
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			must(t, b.srv.Close(cctx))

			one := func(name string) *tracepb.Span {
				t.Helper()
				got := rcv.named(name)
				if len(got) != 1 {
					t.Fatalf("%d spans named %q, want 1", len(got), name)
				}
				return got[0]
			}
			reset := one("deltagym.v1.EnvService/Reset")
			step := one("deltagym.v1.EnvService/Step")
			for _, s := range []*tracepb.Span{reset, step} {
				if s.GetKind() != tracepb.Span_SPAN_KIND_SERVER || attr(s.GetAttributes(), "rpc.code") != "ok" ||
					attr(s.GetAttributes(), "deltagym.sandbox_id") != sb || attr(s.GetAttributes(), "deltagym.episode_id") != rr.Msg.GetEpisodeId() {
					t.Fatalf("span %s: kind %v, attributes %v", s.GetName(), s.GetKind(), s.GetAttributes())
				}
				if s.GetEndTimeUnixNano() <= s.GetStartTimeUnixNano() {
					t.Fatalf("span %s has no duration", s.GetName())
				}
			}
			if attr(reset.GetAttributes(), "deltagym.env") != "plain" || attr(reset.GetAttributes(), "deltagym.checkpoint_id") != rr.Msg.GetCheckpointId() {
				t.Fatalf("reset span attributes %v", reset.GetAttributes())
			}
			if attr(step.GetAttributes(), "deltagym.action") != "exec" || attr(step.GetAttributes(), "deltagym.step_index") != "0" {
				t.Fatalf("step span attributes %v", step.GetAttributes())
			}
			// The sandbox operations are children of their RPCs.
			for parent, name := range map[*tracepb.Span]string{reset: "sandbox.reset", step: "sandbox.exec"} {
				var child *tracepb.Span
				for _, s := range rcv.named(name) {
					if bytes.Equal(s.GetParentSpanId(), parent.GetSpanId()) && bytes.Equal(s.GetTraceId(), parent.GetTraceId()) {
						child = s
					}
				}
				if child == nil {
					t.Fatalf("no %s span under %s", name, parent.GetName())
				}
				if name == "sandbox.exec" && (attr(child.GetAttributes(), "deltagym.exec.exit_code") != "0" || attr(child.GetAttributes(), "deltagym.sandbox_id") != sb) {
					t.Fatalf("exec span attributes %v", child.GetAttributes())
				}
			}
			rcv.mu.Lock()
			defer rcv.mu.Unlock()
			for _, s := range rcv.services {
				if s != "deltagym" {
					t.Fatalf("exported with service.name %q", s)
				}
			}
		})
	}
}

// TestTraceExporterConfig checks which exporter the environment selects.
func TestTraceExporterConfig(t *testing.T) {
	cases := []struct {
		name             string
		env              map[string]string
		wantExporter     bool
		wantInvalidInput bool
	}{
		{"no endpoint", map[string]string{}, false, false},
		{"http by default", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, true, false},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}, true, false},
		{"grpc", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, true, false},
		{"exporter none", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"}, false, false},
		{"unknown exporter", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "zipkin"}, false, true},
		{"unknown protocol", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, false, true},
	}
	vars := []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
		"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_EXPORTER"}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range vars {
				t.Setenv(v, tc.env[v])
			}
			exp, err := server.TraceExporter(t.Context())
			if tc.wantInvalidInput != errors.Is(err, server.ErrInvalid) || (err != nil && !tc.wantInvalidInput) {
				t.Fatalf("err %v, want invalid input %v", err, tc.wantInvalidInput)
			}
			if (exp != nil) != tc.wantExporter {
				t.Fatalf("exporter %v, want one: %v", exp, tc.wantExporter)
			}
			if exp != nil {
				must(t, exp.Shutdown(t.Context()))
			}
		})
	}
}
