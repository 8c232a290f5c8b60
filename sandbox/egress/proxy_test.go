package egress_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox/egress"
)

func TestParseEntry(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{
		{"pypi.org:443", "pypi.org:443", true},
		{"PyPI.org.:443", "pypi.org:443", true},
		{"127.0.0.1:8000", "127.0.0.1:8000", true},
		{"[::1]:80", "[::1]:80", true},
		{"[::ffff:10.0.0.1]:80", "10.0.0.1:80", true},
		{"pypi.org", "", false},
		{"pypi.org:0", "", false},
		{"pypi.org:65536", "", false},
		{"pypi.org:http", "", false},
		{":443", "", false},
		{"a b:1", "", false},
		{"-x.org:1", "", false},
		{"1.2.3:80", "", false},
		{"[fe80::1%eth0]:80", "", false},
		{"*.org:443", "", false},
	} {
		e, err := egress.ParseEntry(tc.in)
		if tc.ok != (err == nil) {
			t.Errorf("ParseEntry(%q): %v", tc.in, err)
			continue
		}
		if err != nil {
			if !errors.Is(err, egress.ErrBadEntry) || !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("ParseEntry(%q): error %v is not ErrBadEntry", tc.in, err)
			}
			continue
		}
		if e.String() != tc.want {
			t.Errorf("ParseEntry(%q) = %s, want %s", tc.in, e, tc.want)
		}
	}
	if _, err := egress.ParsePolicy(make([]string, egress.MaxEntries+1)); !errors.Is(err, egress.ErrBadEntry) {
		t.Errorf("an allow-list of %d entries: %v", egress.MaxEntries+1, err)
	}
}

// hosts is a resolver from a table; names not in it do not resolve.
type hosts map[string][]netip.Addr

func (h hosts) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := h[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// records collects the proxy's records; each connection records once its goroutine ends,
// after the client has had its answer.
type records struct {
	ch chan egress.Record
}

func (r *records) Egress(rec egress.Record) { r.ch <- rec }

// wait returns the next n records.
func (r *records) wait(t *testing.T, n int) []egress.Record {
	t.Helper()
	var rs []egress.Record
	watchdog := time.After(10 * time.Second)
	for len(rs) < n {
		select {
		case rec := <-r.ch:
			rs = append(rs, rec)
		case <-watchdog:
			t.Fatalf("%d records after 10 s, want %d", len(rs), n)
		}
	}
	return rs
}

type bundle struct {
	index   *httptest.Server // stands in for a package index, on 127.0.0.1
	port    int
	proxy   string // the proxy's address
	srv     *egress.Server
	records *records
}

// bigBody is what the index serves at /big/<n>: n bytes.
func bigBody(n int) string { return strings.Repeat("x", n) }

// setup serves a proxy on 127.0.0.1 for a target whose policy is allow, with ${PORT} replaced
// by the index's port.
func setup(t *testing.T, res egress.Resolver, own func(netip.Addr) bool, allow ...string) *bundle {
	t.Helper()
	return setupLimits(t, res, own, egress.Limits{}, allow...)
}

// setupLimits is setup with the target's limits.
func setupLimits(t *testing.T, res egress.Resolver, own func(netip.Addr) bool, lim egress.Limits, allow ...string) *bundle {
	t.Helper()
	b := &bundle{records: &records{ch: make(chan egress.Record, 256)}}
	b.index = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, ok := strings.CutPrefix(r.URL.Path, "/big/"); ok {
			size, _ := strconv.Atoi(n)
			io.WriteString(w, bigBody(size))
			return
		}
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "index %s %s %s", r.Method, r.URL.Path, body)
	}))
	t.Cleanup(b.index.Close)
	b.port = b.index.Listener.Addr().(*net.TCPAddr).Port
	for i, a := range allow {
		allow[i] = strings.ReplaceAll(a, "${PORT}", strconv.Itoa(b.port))
	}
	pol, err := egress.ParsePolicy(allow)
	if err != nil {
		t.Fatal(err)
	}
	if own == nil {
		own = func(netip.Addr) bool { return false }
	}
	p, err := egress.New(egress.Config{Resolver: res, Recorder: b.records, Own: own})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b.proxy = ln.Addr().String()
	b.srv = p.Serve(ln, egress.Target{Env: "e", Sandbox: "sb-1", Policy: pol, Limits: lim})
	t.Cleanup(func() {
		if err := b.srv.Close(); err != nil {
			t.Error(err)
		}
		if err := b.srv.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	})
	return b
}

// get fetches url through the proxy as an absolute-URI request.
func (b *bundle) get(t *testing.T, u string) (int, string) {
	t.Helper()
	proxy, _ := url.Parse("http://" + b.proxy)
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(proxy)}}
	defer c.CloseIdleConnections()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// tunnel opens a CONNECT tunnel to hostport and returns it once the proxy answered 200, or
// fails with the proxy's answer.
func (b *bundle) tunnel(t *testing.T, hostport string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, br, code, body := b.tryTunnel(t, hostport)
	if code != http.StatusOK {
		t.Fatalf("CONNECT %s: %d %q", hostport, code, body)
	}
	return c, br
}

func (b *bundle) tryTunnel(t *testing.T, hostport string) (net.Conn, *bufio.Reader, int, string) {
	t.Helper()
	c, err := net.Dial("tcp", b.proxy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", hostport, hostport)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		c.Close()
		return nil, nil, resp.StatusCode, string(body)
	}
	return c, br, resp.StatusCode, ""
}

// connect opens a CONNECT tunnel to hostport and, once it is up, sends a GET through it.
func (b *bundle) connect(t *testing.T, hostport string) (int, string) {
	t.Helper()
	c, err := net.Dial("tcp", b.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", hostport, hostport)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	fmt.Fprintf(c, "GET /simple/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", hostport)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

func TestProxyAllowsListed(t *testing.T) {
	b := setup(t, nil, nil, "127.0.0.1:${PORT}")
	host := "127.0.0.1:" + strconv.Itoa(b.port)
	if code, body := b.get(t, "http://"+host+"/simple/pip/"); code != 200 || body != "index GET /simple/pip/ " {
		t.Fatalf("GET through the proxy: %d %q", code, body)
	}
	if code, body := b.connect(t, host); code != 200 || body != "index GET /simple/ " {
		t.Fatalf("CONNECT through the proxy: %d %q", code, body)
	}
	for _, r := range b.records.wait(t, 2) {
		if !r.Allowed || r.Env != "e" || r.Sandbox != "sb-1" || r.Host != "127.0.0.1" || int(r.Port) != b.port ||
			r.Addr != netip.MustParseAddr("127.0.0.1") || r.BytesUp == 0 || r.BytesDown == 0 || r.Duration <= 0 {
			t.Errorf("record %+v", r)
		}
	}
}

func TestProxyRefuses(t *testing.T) {
	res := hosts{
		"index.test":   {netip.MustParseAddr("127.0.0.1")},
		"private.test": {netip.MustParseAddr("10.1.2.3")},
		"mixed.test":   {netip.MustParseAddr("169.254.169.254"), netip.MustParseAddr("127.0.0.1")},
		"server.test":  {netip.MustParseAddr("8.8.8.8")},
	}
	own := func(a netip.Addr) bool { return a == netip.MustParseAddr("8.8.8.8") }
	for _, tc := range []struct {
		name, allow, dest, why string
		code                   int
	}{
		{"unlisted address", "127.0.0.1:1", "127.0.0.1:${PORT}", "not in the env's allow-list", 403},
		{"unlisted port", "127.0.0.1:${PORT}", "127.0.0.1:1", "not in the env's allow-list", 403},
		{"unlisted name", "127.0.0.1:${PORT}", "other.test:${PORT}", "not in the env's allow-list", 403},
		{"name to loopback", "index.test:${PORT}", "index.test:${PORT}", "127.0.0.1 is a loopback address", 403},
		{"name to private", "private.test:${PORT}", "private.test:${PORT}", "10.1.2.3 is a private address", 403},
		{"name to link-local", "mixed.test:${PORT}", "mixed.test:${PORT}", "loopback address", 403},
		{"server's own", "server.test:${PORT}", "server.test:${PORT}", "8.8.8.8 is the server's own address", 403},
		{"listed private", "10.1.2.3:1", "10.1.2.3:2", "not in the env's allow-list", 403},
		{"unresolved", "nowhere.test:${PORT}", "nowhere.test:${PORT}", "resolving nowhere.test", 502},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, res, own, tc.allow)
			dest := strings.ReplaceAll(tc.dest, "${PORT}", strconv.Itoa(b.port))
			for _, how := range []string{"GET", "CONNECT"} {
				var code int
				var body string
				if how == "GET" {
					code, body = b.get(t, "http://"+dest+"/x")
				} else {
					code, body = b.connect(t, dest)
				}
				if code != tc.code || !strings.Contains(body, tc.why) {
					t.Errorf("%s %s: %d %q, want %d and %q", how, dest, code, body, tc.code, tc.why)
				}
			}
			for _, r := range b.records.wait(t, 2) {
				if r.Allowed || r.BytesUp != 0 || !strings.Contains(r.Reason, tc.why) {
					t.Errorf("record %+v", r)
				}
			}
		})
	}
}

// TestProxyChecksTheAddress lists a name and the address it resolves to: the address check
// passes only because the address is listed too.
func TestProxyChecksTheAddress(t *testing.T) {
	res := hosts{"index.test": {netip.MustParseAddr("127.0.0.1")}}
	b := setup(t, res, nil, "index.test:${PORT}", "127.0.0.1:${PORT}")
	dest := "index.test:" + strconv.Itoa(b.port)
	if code, body := b.get(t, "http://"+dest+"/a"); code != 200 || body != "index GET /a " {
		t.Fatalf("GET %s: %d %q", dest, code, body)
	}
	if code, body := b.connect(t, dest); code != 200 {
		t.Fatalf("CONNECT %s: %d %q", dest, code, body)
	}
}

func TestProxyRefusesOtherRequests(t *testing.T) {
	b := setup(t, nil, nil, "127.0.0.1:${PORT}")
	c, err := net.Dial("tcp", b.proxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /relative HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n", b.port)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("a request in origin form: %d", resp.StatusCode)
	}
}

func TestLimitsWithin(t *testing.T) {
	server := egress.Limits{MaxConns: 8, ConnsPerSecond: 5, ConnBurst: 10, MaxBytesUp: 1000, MaxBytesDown: 2000,
		BytesPerSecondUp: 100, BytesPerSecondDown: 200, IdleTimeout: time.Minute}
	got, err := server.Within(egress.Limits{MaxConns: 2, ConnsPerSecond: 1, MaxBytesDown: 500, IdleTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	want := server
	want.MaxConns, want.ConnsPerSecond, want.MaxBytesDown, want.IdleTimeout = 2, 1, 500, time.Second
	if got != want {
		t.Fatalf("Within = %+v, want %+v", got, want)
	}
	if got, err := (egress.Limits{}).Within(egress.Limits{ConnsPerSecond: 3, MaxBytesUp: 1 << 40}); err != nil ||
		got.ConnBurst != 6 || got.MaxBytesUp != 1<<40 {
		t.Fatalf("within no server limits: %+v, %v", got, err)
	}
	for _, tc := range []struct {
		env  egress.Limits
		want string
	}{
		{egress.Limits{MaxConns: 9}, "max_connections 9 is above the server's 8"},
		{egress.Limits{ConnsPerSecond: 6}, "connections_per_second 6 is above the server's 5"},
		{egress.Limits{MaxBytesDown: 2001}, "max_bytes_down 2001 is above"},
		{egress.Limits{BytesPerSecondUp: -1}, "bytes_per_second_up -1 is negative"},
		{egress.Limits{IdleTimeout: time.Hour}, "idle_timeout"},
	} {
		_, err := server.Within(tc.env)
		if !errors.Is(err, egress.ErrBadLimit) || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Within(%+v): %v, want %q", tc.env, err, tc.want)
		}
	}
}

// refusedBy checks a refusal's answer and record: code, and the limit named in both.
func refusedBy(t *testing.T, code int, body string, rec egress.Record, wantCode int, limit string) {
	t.Helper()
	if code != wantCode || !strings.Contains(body, limit) {
		t.Errorf("answer %d %q, want %d naming %s", code, body, wantCode, limit)
	}
	if rec.Allowed || !strings.Contains(rec.Reason, "egress cap") || !strings.Contains(rec.Reason, limit) || rec.Host != "127.0.0.1" {
		t.Errorf("record %+v, want a refusal naming %s", rec, limit)
	}
}

// A sandbox holds at most MaxConns connections at once; the next is refused with 429 until
// one ends.
func TestProxyMaxConns(t *testing.T) {
	b := setupLimits(t, nil, nil, egress.Limits{MaxConns: 2}, "127.0.0.1:${PORT}")
	dest := "127.0.0.1:" + strconv.Itoa(b.port)
	first, _ := b.tunnel(t, dest)
	b.tunnel(t, dest)
	_, _, code, body := b.tryTunnel(t, dest)
	refusedBy(t, code, body, b.records.wait(t, 1)[0], http.StatusTooManyRequests, "max_connections")
	code, body = b.get(t, "http://"+dest+"/a")
	refusedBy(t, code, body, b.records.wait(t, 1)[0], http.StatusTooManyRequests, "max_connections")
	first.Close()
	if r := b.records.wait(t, 1)[0]; !r.Allowed {
		t.Fatalf("the first tunnel's record: %+v", r)
	}
	if code, body := b.get(t, "http://"+dest+"/a"); code != 200 {
		t.Fatalf("GET once a connection ended: %d %q", code, body)
	}
}

// New connections are admitted by a token bucket.
func TestProxyConnectionRate(t *testing.T) {
	b := setupLimits(t, nil, nil, egress.Limits{ConnsPerSecond: 0.001, ConnBurst: 2}, "127.0.0.1:${PORT}")
	u := "http://127.0.0.1:" + strconv.Itoa(b.port) + "/a"
	for i := range 2 {
		if code, body := b.get(t, u); code != 200 {
			t.Fatalf("GET %d within the burst: %d %q", i, code, body)
		}
	}
	b.records.wait(t, 2)
	code, body := b.get(t, u)
	refusedBy(t, code, body, b.records.wait(t, 1)[0], http.StatusTooManyRequests, "connections_per_second")
}

// The bytes down in all of a sandbox's connections stop at MaxBytesDown: the connection that
// passes it is cut there, and the next is refused with 403. Up likewise.
func TestProxyBytesTotal(t *testing.T) {
	b := setupLimits(t, nil, nil, egress.Limits{MaxBytesDown: 1000, MaxBytesUp: 3000}, "127.0.0.1:${PORT}")
	dest := "127.0.0.1:" + strconv.Itoa(b.port)
	c, br := b.tunnel(t, dest)
	fmt.Fprintf(c, "GET /big/5000 HTTP/1.1\r\nHost: %s\r\n\r\n", dest)
	got, _ := io.ReadAll(br)
	r := b.records.wait(t, 1)[0]
	if len(got) != 1000 || r.BytesDown != 1000 || !r.Allowed || !strings.Contains(r.Reason, "cut: the sandbox's 1000 bytes down are used up (egress.limits.max_bytes_down)") {
		t.Fatalf("%d bytes through, record %+v", len(got), r)
	}
	code, body := b.get(t, "http://"+dest+"/a")
	refusedBy(t, code, body, b.records.wait(t, 1)[0], http.StatusForbidden, "max_bytes_down")

	b = setupLimits(t, nil, nil, egress.Limits{MaxBytesUp: 3000}, "127.0.0.1:${PORT}")
	dest = "127.0.0.1:" + strconv.Itoa(b.port)
	c, _ = b.tunnel(t, dest)
	fmt.Fprintf(c, "POST /up HTTP/1.1\r\nHost: %s\r\nContent-Length: 10000\r\n\r\n%s", dest, bigBody(10000))
	r = b.records.wait(t, 1)[0]
	if r.BytesUp != 3000 || !strings.Contains(r.Reason, "max_bytes_up") {
		t.Fatalf("record %+v", r)
	}
}

// A sandbox's bytes each way go at most at their rate, and a connection that waits for the
// rate is not idle.
func TestProxyByteRate(t *testing.T) {
	const rate, size = 64 << 10, 192 << 10
	b := setupLimits(t, nil, nil, egress.Limits{BytesPerSecondDown: rate, IdleTimeout: 400 * time.Millisecond}, "127.0.0.1:${PORT}")
	dest := "127.0.0.1:" + strconv.Itoa(b.port)
	start := time.Now()
	code, body := b.get(t, "http://"+dest+"/big/"+strconv.Itoa(size))
	took := time.Since(start)
	if code != 200 || len(body) != size {
		t.Fatalf("GET: %d, %d bytes", code, len(body))
	}
	// A second's worth goes at once, the rest at the rate.
	if min := time.Duration(float64(size-rate) / rate * float64(time.Second)); took < min*9/10 {
		t.Fatalf("%d bytes at %d a second took %v, under %v", size, rate, took, min)
	}
	if r := b.records.wait(t, 1)[0]; r.Reason != "" || r.BytesDown < size {
		t.Fatalf("record %+v", r)
	}
}

// A connection through which nothing goes for IdleTimeout is closed.
func TestProxyIdleTimeout(t *testing.T) {
	b := setupLimits(t, nil, nil, egress.Limits{IdleTimeout: 200 * time.Millisecond}, "127.0.0.1:${PORT}")
	c, br := b.tunnel(t, "127.0.0.1:"+strconv.Itoa(b.port))
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second)) // watchdog
	if n, err := br.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("read from an idle tunnel: %d, %v", n, err)
	}
	if r := b.records.wait(t, 1)[0]; !r.Allowed || !strings.Contains(r.Reason, "idle for 200ms") {
		t.Fatalf("record %+v", r)
	}
}

// A sandbox connecting in a loop past its limits is answered, but its refusals are recorded
// within a rate.
func TestProxyRefusalsRecordedWithinARate(t *testing.T) {
	b := setupLimits(t, nil, nil, egress.Limits{MaxConns: 1}, "127.0.0.1:${PORT}")
	dest := "127.0.0.1:" + strconv.Itoa(b.port)
	b.tunnel(t, dest)
	const n = 120
	start := time.Now()
	for range n {
		if _, _, code, _ := b.tryTunnel(t, dest); code != http.StatusTooManyRequests {
			t.Fatalf("CONNECT past the cap: %d", code)
		}
	}
	took := time.Since(start)
	if err := b.srv.Close(); err != nil {
		t.Fatal(err)
	}
	recorded := len(b.records.ch)
	if bound := 50 + int(10*took.Seconds()) + 1 + 1; recorded > bound || recorded < 50 {
		t.Fatalf("%d refusals in %v: %d records, want 50 to %d", n, took, recorded, bound)
	}
}
