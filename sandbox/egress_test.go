package sandbox_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/egress"
)

// egressServer serves sandboxes' egress listeners under one policy and counts the services
// ended.
type egressServer struct {
	proxy  *egress.Proxy
	policy egress.Policy
	limits egress.Limits
	closed atomic.Int32
}

type closeCount struct {
	c io.Closer
	n *atomic.Int32
}

func (c closeCount) Close() error { c.n.Add(1); return c.c.Close() }

func (e *egressServer) ServeEgress(ln net.Listener, id string) io.Closer {
	return closeCount{e.proxy.Serve(ln, egress.Target{Env: "t", Sandbox: id, Policy: e.policy, Limits: e.limits}), &e.closed}
}

// TestEgress serves an HTTP server on the host's 127.0.0.1, standing in for a package index,
// and reaches it from a sandbox through the proxy listening in the sandbox's namespace.
func TestEgress(t *testing.T) {
	b := setup(t)
	index := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "index %s", r.URL.Path)
	}))
	defer index.Close()
	host := index.Listener.Addr().String()
	pol, err := egress.ParsePolicy([]string{host})
	if err != nil {
		t.Fatal(err)
	}
	p, err := egress.New(egress.Config{Own: func(netip.Addr) bool { return false }})
	if err != nil {
		t.Fatal(err)
	}
	srv := &egressServer{proxy: p, policy: pol}
	proxyEnv := []string{"http_proxy=" + egress.ProxyURL}

	s := b.create(t, sandbox.Spec{Egress: srv, Env: proxyEnv})
	if got := sh(t, s, "wget -q -O - http://"+host+"/simple/"); got != "index /simple/" {
		t.Fatalf("through the proxy: %q", got)
	}
	other := strings.Replace(host, "127.0.0.1", "127.0.0.2", 1)
	res, err := s.Exec(t.Context(), sandbox.ExecRequest{Command: "wget -q -O - http://" + other + "/"})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "403") {
		t.Fatalf("an unlisted destination: exit %d, stderr %q", res.ExitCode, res.Stderr)
	}

	// A sandbox without egress has no proxy and no route: both ways are refused.
	plain := b.create(t, sandbox.Spec{Env: proxyEnv})
	for _, cmd := range []string{"wget -q -O - http://" + host + "/", "env -u http_proxy wget -q -O - http://" + host + "/"} {
		res, err := plain.Exec(t.Context(), sandbox.ExecRequest{Command: cmd})
		if err != nil {
			t.Fatal(err)
		}
		if res.ExitCode == 0 || strings.Contains(string(res.Stdout), "index") {
			t.Fatalf("%s in a sandbox without egress: exit %d, stdout %q", cmd, res.ExitCode, res.Stdout)
		}
	}

	if err := s.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := srv.closed.Load(); n != 1 {
		t.Fatalf("egress service closed %d times by Destroy, want 1", n)
	}
}

// BenchmarkCreateEgress creates sandboxes from a checkpoint, without egress and with it
// (interleaved), and reports each kind's Create latency: a sandbox whose env allows no egress
// pays nothing for it.
func BenchmarkCreateEgress(b *testing.B) {
	bb := setup(b)
	ctx := context.Background()
	s := bb.create(b, sandbox.Spec{})
	ck, err := s.Checkpoint(ctx)
	must(b, err)
	pol, err := egress.ParsePolicy([]string{"127.0.0.1:1"})
	must(b, err)
	p, err := egress.New(egress.Config{Own: func(netip.Addr) bool { return false }})
	must(b, err)
	srv := &egressServer{proxy: p, policy: pol, limits: egress.DefaultLimits()}
	var plain, withEgress lat
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, kind := range []struct {
			l    *lat
			spec sandbox.Spec
		}{{&plain, sandbox.Spec{Checkpoint: ck.ID}}, {&withEgress, sandbox.Spec{Checkpoint: ck.ID, Egress: srv}}} {
			var sb *sandbox.Sandbox
			kind.l.time(func() { sb, err = bb.rt.Create(ctx, kind.spec) })
			must(b, err)
			b.StopTimer()
			must(b, sb.Destroy(ctx))
			b.StartTimer()
		}
	}
	plain.report(b, "create-")
	withEgress.report(b, "create-egress-")
}
