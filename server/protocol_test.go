package server_test

import (
	"net/http"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server"
)

// TestProtocolsOnOnePort calls the one port with Connect JSON, gRPC-Web, gRPC health and gRPC
// reflection (Connect binary and gRPC are covered by TestEveryRPC).
func TestProtocolsOnOnePort(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	base := "http://" + b.addr
	for name, opts := range map[string][]connect.ClientOption{
		"connect-json": {connect.WithProtoJSON()},
		"grpc-web":     {connect.WithGRPCWeb()},
	} {
		t.Run(name, func(t *testing.T) {
			c := deltagymv1connect.NewEnvServiceClient(http.DefaultClient, base, append(opts, connect.WithInterceptors(bearer(b.token)))...)
			r, err := c.ListEnvs(t.Context(), connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
			must(t, err)
			if len(r.Msg.GetEnvs()) != len(testEnvs) {
				t.Fatalf("%d envs", len(r.Msg.GetEnvs()))
			}
		})
	}
	t.Run("health", func(t *testing.T) {
		h, err := grpc_health_v1.NewHealthClient(b.conn).Check(t.Context(), &grpc_health_v1.HealthCheckRequest{Service: deltagymv1connect.EnvServiceName})
		must(t, err)
		if h.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
			t.Fatalf("health %v", h.GetStatus())
		}
	})
	t.Run("reflection", func(t *testing.T) {
		st, err := reflectionpb.NewServerReflectionClient(b.conn).ServerReflectionInfo(t.Context())
		must(t, err)
		must(t, st.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
		resp, err := st.Recv()
		must(t, err)
		names := map[string]bool{}
		for _, s := range resp.GetListServicesResponse().GetService() {
			names[s.GetName()] = true
		}
		if !names[deltagymv1connect.EnvServiceName] || !names[deltagymv1connect.LedgerServiceName] {
			t.Fatalf("reflection lists %v", names)
		}
		must(t, st.CloseSend())
	})
}
