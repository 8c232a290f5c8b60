package server_test

import (
	"math"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// expiresIn returns how far in the future sandbox sb's lease expires, by GetSandbox.
func expiresIn(t testing.TB, c api, sb string) time.Duration {
	t.Helper()
	g, err := c.GetSandbox(t.Context(), &deltagymv1.GetSandboxRequest{SandboxId: sb})
	must(t, err)
	return time.Until(g.GetSandbox().GetLeaseExpireTime().AsTime())
}

// within fails t unless d is in (lo, hi].
func within(t testing.TB, what string, d, lo, hi time.Duration) {
	t.Helper()
	if d <= lo || d > hi {
		t.Fatalf("%s expires in %v, want within (%v, %v]", what, d, lo, hi)
	}
}

// TestLeaseTTLRefused checks, over Connect and gRPC, that a lease TTL out of range is refused
// before anything changes: no sandbox is leased, no lease renewed.
func TestLeaseTTLRefused(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.Lease.MaxTTL = time.Hour })
	for _, cl := range b.clients() {
		t.Run(cl.name, func(t *testing.T) {
			c, ctx := cl.c, t.Context()
			rr, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", LeaseTtlSeconds: 30})
			must(t, err)
			sb := rr.GetSandboxId()
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: sb})
			within(t, "a sandbox reset with a TTL of 30s", time.Until(rr.GetLeaseExpireTime().AsTime()), 25*time.Second, 30*time.Second)
			before, err := c.ListSandboxes(ctx, &deltagymv1.ListSandboxesRequest{})
			must(t, err)
			for _, ttl := range []float64{-1, math.NaN(), math.Inf(1), math.Inf(-1), 3601, 1e300} {
				_, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", LeaseTtlSeconds: ttl})
				if codeOf(err) != connect.CodeInvalidArgument {
					t.Fatalf("Reset with lease_ttl_seconds %v: %v", ttl, err)
				}
				_, err = c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 1, LeaseTtlSeconds: ttl})
				if codeOf(err) != connect.CodeInvalidArgument {
					t.Fatalf("Fork with lease_ttl_seconds %v: %v", ttl, err)
				}
				_, err = c.Heartbeat(ctx, &deltagymv1.HeartbeatRequest{SandboxIds: []string{sb}, LeaseTtlSeconds: ttl})
				if codeOf(err) != connect.CodeInvalidArgument {
					t.Fatalf("Heartbeat with lease_ttl_seconds %v: %v", ttl, err)
				}
			}
			after, err := c.ListSandboxes(ctx, &deltagymv1.ListSandboxesRequest{})
			must(t, err)
			if len(after.GetSandboxes()) != len(before.GetSandboxes()) {
				t.Fatalf("refused calls leased sandboxes: %d before, %d after", len(before.GetSandboxes()), len(after.GetSandboxes()))
			}
			// The refused Heartbeats left the lease's TTL as it was (30s, not the server's minute).
			_, err = c.Heartbeat(ctx, &deltagymv1.HeartbeatRequest{SandboxIds: []string{sb}})
			must(t, err)
			within(t, "the sandbox after refused heartbeats", expiresIn(t, c, sb), 25*time.Second, 30*time.Second)
			// A fork's children take the fork's TTL.
			fr, err := c.Fork(ctx, &deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_SandboxId{SandboxId: sb}, N: 1, LeaseTtlSeconds: 3000})
			must(t, err)
			child := fr.GetSandboxIds()[0]
			defer c.Close(ctx, &deltagymv1.CloseRequest{SandboxId: child})
			within(t, "a child forked with a TTL of 3000s", expiresIn(t, c, child), 2990*time.Second, 3000*time.Second)
		})
	}
}

// TestLeaseTTLPerSandbox checks that the reaper honours each sandbox's TTL: a sandbox with a
// TTL of 2s is reaped while one with a long TTL is not, and a Heartbeat with a TTL changes
// the expiry and the TTL that later calls renew the lease for.
func TestLeaseTTLPerSandbox(t *testing.T) {
	b := setup(t, nil) // the server's TTL is a minute
	c, ctx := api(connectAPI{b.connect, b.ledger}), t.Context()
	short, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", LeaseTtlSeconds: 2})
	must(t, err)
	long, err := c.Reset(ctx, &deltagymv1.ResetRequest{Env: "plain", LeaseTtlSeconds: 600})
	must(t, err)
	within(t, "the short-lived sandbox", expiresIn(t, c, short.GetSandboxId()), 0, 2*time.Second)
	within(t, "the long-lived sandbox", expiresIn(t, c, long.GetSandboxId()), 590*time.Second, 600*time.Second)

	// A heartbeat with a TTL sets it; one without renews for it. Both on the long-lived one.
	hb, err := c.Heartbeat(ctx, &deltagymv1.HeartbeatRequest{SandboxIds: []string{long.GetSandboxId()}, LeaseTtlSeconds: 120})
	must(t, err)
	within(t, "the heartbeat's lease", time.Until(hb.GetLeases()[0].GetExpireTime().AsTime()), 110*time.Second, 120*time.Second)
	_, err = c.Step(ctx, &deltagymv1.StepRequest{SandboxId: long.GetSandboxId(), Action: execAction("true")})
	must(t, err)
	within(t, "the long-lived sandbox after a step", expiresIn(t, c, long.GetSandboxId()), 110*time.Second, 120*time.Second)

	// The short-lived sandbox is reaped (its lease unrenewed), the other is not.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := c.GetSandbox(ctx, &deltagymv1.GetSandboxRequest{SandboxId: short.GetSandboxId()})
		if err != nil {
			wantReason(t, "GetSandbox of the reaped sandbox", err, connect.CodeFailedPrecondition, "SANDBOX_CLOSED")
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a sandbox with a TTL of 2s not reaped within 30s")
		}
		time.Sleep(50 * time.Millisecond) // polling interval, not synchronisation
	}
	within(t, "the long-lived sandbox", expiresIn(t, c, long.GetSandboxId()), 60*time.Second, 120*time.Second)
	ep := b.episode(t, short.GetEpisodeId())
	if ep.GetEpisode().GetStatus() != deltagymv1.EpisodeStatus_EPISODE_STATUS_TRUNCATED {
		t.Fatalf("the reaped sandbox's episode is %v, want truncated", ep.GetEpisode().GetStatus())
	}
}
