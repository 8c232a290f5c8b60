package server_test

import (
	"errors"
	"io"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// errorInfo decodes the google.rpc.ErrorInfo of an error of either client: a Connect error's
// details, or a grpc-go status's (grpc-status-details-bin). nil when it has none.
func errorInfo(t testing.TB, err error) *errdetails.ErrorInfo {
	t.Helper()
	var ce *connect.Error
	if errors.As(err, &ce) {
		for _, d := range ce.Details() {
			v, derr := d.Value()
			if derr != nil {
				t.Fatalf("decoding a detail of %v: %v", err, derr)
			}
			if info, ok := v.(*errdetails.ErrorInfo); ok {
				return info
			}
		}
		return nil
	}
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info
		}
	}
	return nil
}

// wantReason checks that err has code and an ErrorInfo of reason whose metadata hold meta.
func wantReason(t testing.TB, what string, err error, code connect.Code, reason string, meta ...string) {
	t.Helper()
	if codeOf(err) != code {
		t.Fatalf("%s: %v, want code %v", what, err, code)
	}
	info := errorInfo(t, err)
	if info.GetReason() != reason || info.GetDomain() != server.ErrorDomain {
		t.Fatalf("%s: %v: error info %v, want reason %s in domain %s", what, err, info, reason, server.ErrorDomain)
	}
	for i := 0; i+1 < len(meta); i += 2 {
		if got := info.GetMetadata()[meta[i]]; got != meta[i+1] {
			t.Fatalf("%s: metadata %s = %q, want %q (%v)", what, meta[i], got, meta[i+1], info.GetMetadata())
		}
	}
}

// TestErrorReasons checks the reasons the server attaches to its errors, as a Connect client
// and a grpc-go client decode them, and on StepStream's error statuses.
func TestErrorReasons(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Admission.Sandboxes = 32 })
	b.register(t, &deltagymv1.EnvSpec{Name: "noimage", Image: "no-such-image", PoolSize: 1})
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			_, err := c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: "sb_nope"})
			wantReason(t, "GetSandbox of an unknown sandbox", err, connect.CodeNotFound, "SANDBOX_NOT_FOUND", "sandbox_id", "sb_nope")
			_, err = c.Reset(ctx, &deltagymv1.ResetRequest{Env: "nope"})
			wantReason(t, "Reset of an unknown env", err, connect.CodeNotFound, "ENV_NOT_FOUND", "env", "nope")
			_, err = c.Reset(ctx, &deltagymv1.ResetRequest{Env: "noimage"})
			wantReason(t, "Reset of an env whose image is missing", err, connect.CodeFailedPrecondition, "IMAGE_NOT_FOUND",
				"env", "noimage", "image", "no-such-image")
			_, err = c.ReleaseCheckpoint(ctx, &deltagymv1.ReleaseCheckpointRequest{CheckpointId: "ck_nope"})
			wantReason(t, "ReleaseCheckpoint of an unknown checkpoint", err, connect.CodeNotFound, "CHECKPOINT_NOT_FOUND", "checkpoint_id", "ck_nope")
			_, err = c.GetTrajectory(ctx, &deltagymv1.GetTrajectoryRequest{EpisodeId: "ep_nope"})
			wantReason(t, "GetTrajectory of an unknown episode", err, connect.CodeNotFound, "EPISODE_NOT_FOUND", "episode_id", "ep_nope")

			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "short"})
			must(t, err)
			sb := rr.GetSandboxId()
			_, err = c.Restore(ctx, &deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: "ck_gone"})
			wantReason(t, "Restore of an unknown checkpoint", err, connect.CodeNotFound, "CHECKPOINT_NOT_FOUND", "checkpoint_id", "ck_gone")
			_, err = c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 1000})
			wantReason(t, "Fork past --max-sandboxes", err, connect.CodeResourceExhausted, "NO_CAPACITY")
			for range 2 {
				_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
				must(t, err)
			}
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
			wantReason(t, "Step of an ended episode", err, connect.CodeFailedPrecondition, "EPISODE_ENDED", "sandbox_id", sb, "episode_id", rr.GetEpisodeId())
			_, err = c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			must(t, err)
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")})
			wantReason(t, "Step in a closed sandbox", err, connect.CodeFailedPrecondition, "SANDBOX_CLOSED", "sandbox_id", sb)
			// An invalid request has no reason of its own: its code and message say it.
			_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: sb})
			if codeOf(err) != connect.CodeInvalidArgument || errorInfo(t, err) != nil {
				t.Fatalf("Step without an action: %v, info %v", err, errorInfo(t, err))
			}
		})
	}

	// StepStream's error statuses carry the reason.
	s := b.connect.StepStream(t.Context())
	must(t, s.Send(&deltagymv1.StepStreamRequest{RequestId: 1, Step: &deltagymv1.StepRequest{SandboxId: "sb_nope", Action: execAction("true")}}))
	must(t, s.CloseRequest())
	var got []*deltagymv1.ErrorStatus
	for {
		r, err := s.Receive()
		if errors.Is(err, io.EOF) {
			break
		}
		must(t, err)
		got = append(got, r.GetError())
	}
	must(t, s.CloseResponse())
	if len(got) != 1 || got[0].GetReason() != "SANDBOX_NOT_FOUND" || got[0].GetCode() != int32(connect.CodeNotFound) {
		t.Fatalf("StepStream's error statuses: %v", got)
	}
}
