package server_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox/egress"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// hosts is a resolver from a table, so that the test sends nothing anywhere but loopback.
type hosts map[string][]netip.Addr

func (h hosts) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := h[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// TestEgress serves an HTTP server on 127.0.0.1 standing in for a package index: a sandbox of
// an env that lists it reaches it through the proxy; the server's own port, Postgres (listed by
// a name that resolves to loopback), a name that resolves to a private address, and every
// destination of an env without egress are refused; the ledger has a row for each attempt.
func TestEgress(t *testing.T) {
	index := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "index %s", r.URL.Path)
	}))
	defer index.Close()
	idx := index.Listener.Addr().String()
	var pgPort string
	b := setup(t, func(c *server.Config) {
		c.DatabaseURL = pgtest.Start(t)
		u, err := url.Parse(c.DatabaseURL)
		if err != nil {
			t.Fatal(err)
		}
		pgPort = u.Port()
		if pgPort == "" {
			pgPort = "5432"
		}
		c.Egress.Resolver = hosts{"localhost": {netip.MustParseAddr("127.0.0.1")}, "private.test": {netip.MustParseAddr("10.0.0.7")}}
		envs := map[string]string{
			"egress.json": fmt.Sprintf(`{"name": "egress", "image": "default", "pool_size": 1,
				"egress": {"allow": [%q, "private.test:80", "localhost:%s"]}}`, idx, pgPort),
			"closed.json": `{"name": "closed", "image": "default", "pool_size": 1, "env": {"http_proxy": "http://127.0.0.1:3128"}}`,
		}
		for name, body := range envs {
			if err := os.WriteFile(filepath.Join(c.EnvsDir, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	})
	ctx := t.Context()
	c := b.connect
	rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "egress"}))
	must(t, err)
	sb, ep := rr.Msg.GetSandboxId(), rr.Msg.GetEpisodeId()
	wget := func(sandbox, u string) *deltagymv1.ExecResult {
		t.Helper()
		r, err := c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sandbox, Action: execAction("wget -q -O - " + u)}))
		must(t, err)
		return r.Msg.GetObservation().GetExec()
	}
	if o := wget(sb, "http://"+idx+"/simple/"); o.GetExitCode() != 0 || string(o.GetStdout()) != "index /simple/" {
		t.Fatalf("the listed index: exit %d, stdout %q, stderr %q", o.GetExitCode(), o.GetStdout(), o.GetStderr())
	}
	refused := []string{"http://" + b.addr + "/", "http://localhost:" + pgPort + "/", "http://private.test/"}
	for _, u := range refused {
		if o := wget(sb, u); o.GetExitCode() == 0 || !strings.Contains(string(o.GetStderr()), "403") {
			t.Errorf("%s: exit %d, stderr %q; want a 403 from the proxy", u, o.GetExitCode(), o.GetStderr())
		}
	}
	cr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "closed"}))
	must(t, err)
	if o := wget(cr.Msg.GetSandboxId(), "http://"+idx+"/"); o.GetExitCode() == 0 || len(o.GetStdout()) != 0 {
		t.Errorf("an env without egress reached the index: exit %d, stdout %q", o.GetExitCode(), o.GetStdout())
	}

	// Closing the server ends the sandboxes (and their proxy connections) and flushes the
	// ledger: every attempt has its row.
	closeCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	must(t, b.srv.Close(closeCtx))
	conn, err := pgx.Connect(ctx, b.dbURL)
	must(t, err)
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT env, sandbox, coalesce(episode_id, ''), host, port, coalesce(host(address), ''),
		allowed, coalesce(reason, ''), bytes_up, bytes_down FROM egress ORDER BY started_at`)
	must(t, err)
	type row struct {
		env, sandbox, episode, host string
		port                        int
		addr                        string
		allowed                     bool
		reason                      string
		up, down                    int64
	}
	var got []row
	for rows.Next() {
		var r row
		must(t, rows.Scan(&r.env, &r.sandbox, &r.episode, &r.host, &r.port, &r.addr, &r.allowed, &r.reason, &r.up, &r.down))
		got = append(got, r)
	}
	must(t, rows.Err())
	if len(got) != 4 {
		t.Fatalf("egress rows: %+v, want 4", got)
	}
	for i, r := range got {
		if r.env != "egress" || r.sandbox != sb || r.episode != ep {
			t.Errorf("row %d: %+v, want env egress, sandbox %s, episode %s", i, r, sb, ep)
		}
	}
	if r := got[0]; !r.allowed || r.host != "127.0.0.1" || r.addr != "127.0.0.1" || r.up == 0 || r.down == 0 {
		t.Errorf("the index's row: %+v", r)
	}
	for i, why := range []string{"not in the env's allow-list", "127.0.0.1 is a loopback address", "10.0.0.7 is a private address"} {
		if r := got[i+1]; r.allowed || !strings.Contains(r.reason, why) || r.up != 0 {
			t.Errorf("row of %s: %+v, want refused: %q", refused[i], r, why)
		}
	}
}

// TestEgressLimits: an env lowers the server's egress limits and may not raise them; a
// sandbox that passes its total bytes down is cut there, then refused with 403 naming the
// limit, and the ledger has both rows with their reasons.
func TestEgressLimits(t *testing.T) {
	index := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, strings.Repeat("x", 5000))
	}))
	defer index.Close()
	idx := index.Listener.Addr().String()
	b := setup(t, func(c *server.Config) {
		c.DatabaseURL = pgtest.Start(t)
		c.Egress.Limits = egress.Limits{MaxBytesDown: 1 << 20}
		spec := fmt.Sprintf(`{"name": "egress", "image": "default", "pool_size": 1,
			"egress": {"allow": [%q], "limits": {"max_bytes_down": 2000}}}`, idx)
		must(t, os.WriteFile(filepath.Join(c.EnvsDir, "egress.json"), []byte(spec), 0o644))
	})
	ctx := t.Context()
	c := b.connect
	_, err := c.RegisterEnv(ctx, connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: &deltagymv1.EnvSpec{Name: "greedy", Image: "default",
		Egress: &deltagymv1.Egress{Allow: []string{idx}, Limits: &deltagymv1.EgressLimits{MaxBytesDown: 2 << 20}}}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "max_bytes_down 2097152 is above the server's 1048576") ||
		!strings.Contains(err.Error(), "--egress-") {
		t.Fatalf("an env raising the server's limit: %v", err)
	}
	rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "egress"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	wget := func() *deltagymv1.ExecResult {
		t.Helper()
		r, err := c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("wget -q -O - http://" + idx + "/big")}))
		must(t, err)
		return r.Msg.GetObservation().GetExec()
	}
	if o := wget(); len(o.GetStdout()) >= 5000 {
		t.Fatalf("%d bytes through a limit of 2000: exit %d, stderr %q", len(o.GetStdout()), o.GetExitCode(), o.GetStderr())
	}
	if o := wget(); o.GetExitCode() == 0 || !strings.Contains(string(o.GetStderr()), "403") {
		t.Fatalf("past the limit: exit %d, stderr %q; want a 403 from the proxy", o.GetExitCode(), o.GetStderr())
	}
	closeCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	must(t, b.srv.Close(closeCtx))
	conn, err := pgx.Connect(ctx, b.dbURL)
	must(t, err)
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT allowed, coalesce(reason, ''), bytes_down FROM egress ORDER BY started_at`)
	must(t, err)
	var got []string
	for rows.Next() {
		var allowed bool
		var reason string
		var down int64
		must(t, rows.Scan(&allowed, &reason, &down))
		got = append(got, fmt.Sprintf("%v %d %s", allowed, down, reason))
	}
	must(t, rows.Err())
	want := []string{"true 2000 cut: the sandbox's 2000 bytes down are used up (egress.limits.max_bytes_down)",
		"false 0 egress cap: resource exhausted: the sandbox's 2000 bytes down are used up (egress.limits.max_bytes_down)"}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("egress rows:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// The --egress-* flags set the server's egress limits: a size, -1 for none.
func TestEgressFlags(t *testing.T) {
	var c server.Config
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	c.RegisterFlags(fs)
	must(t, fs.Parse([]string{"--egress-max-connections=3", "--egress-connections-per-second=0.5", "--egress-max-bytes-down=1MiB",
		"--egress-bytes-per-second-up=-1", "--egress-idle-timeout=90s"}))
	want := egress.Limits{MaxConns: 3, ConnsPerSecond: 0.5, MaxBytesDown: 1 << 20, BytesPerSecondUp: -1, IdleTimeout: 90 * time.Second}
	if c.Egress.Limits != want {
		t.Fatalf("limits %+v, want %+v", c.Egress.Limits, want)
	}
	for _, bad := range []string{"--egress-max-connections=-2", "--egress-connections-per-second=NaN", "--egress-max-bytes-up=lots", "--egress-idle-timeout=-5s"} {
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		c.RegisterFlags(fs)
		if err := fs.Parse([]string{bad}); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}
