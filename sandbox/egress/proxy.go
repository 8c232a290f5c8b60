package egress

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ProxyPort is the port the proxy listens on at 127.0.0.1 inside a sandbox.
const ProxyPort = 3128

// ProxyURL is the proxy's address as the sandbox's HTTP_PROXY and HTTPS_PROXY give it.
var ProxyURL = "http://127.0.0.1:" + strconv.Itoa(ProxyPort)

// Resolver looks names up; *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// Record is one connection through the proxy, allowed or refused.
type Record struct {
	Env, Sandbox string
	// Host and Port are the destination the sandbox asked for.
	Host string
	Port uint16
	// Addr is the address dialled or refused (invalid when the name did not resolve).
	Addr    netip.Addr
	Allowed bool
	// Reason says why the connection was refused, or why it failed once allowed.
	Reason string
	// BytesUp went from the sandbox to the destination, BytesDown back.
	BytesUp, BytesDown int64
	Start              time.Time
	Duration           time.Duration
}

// Recorder takes each connection's record once it ends. It must not block for long: the
// connection's goroutine calls it.
type Recorder interface {
	Egress(r Record)
}

// Config configures a Proxy.
type Config struct {
	// Resolver resolves names (default net.DefaultResolver).
	Resolver Resolver
	// Recorder takes each connection's record (default: none).
	Recorder Recorder
	// Own reports whether an address is the server's own, refused unless listed (default: the
	// addresses of the host's interfaces when New runs).
	Own func(netip.Addr) bool
	// DialTimeout bounds resolving and dialling a destination (default 10 s).
	DialTimeout time.Duration
	// HeaderTimeout bounds reading a request's header (default 30 s).
	HeaderTimeout time.Duration
	// Limits are the server's limits of each sandbox, which an env may lower (Limits.Within).
	// The zero Limits bound nothing.
	Limits Limits
	Log    *slog.Logger
}

// Proxy serves the egress listeners of sandboxes. Its methods are safe for concurrent use.
type Proxy struct {
	cfg Config
}

// New returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	if cfg.Own == nil {
		own, err := hostAddrs()
		if err != nil {
			return nil, err
		}
		cfg.Own = own
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.HeaderTimeout <= 0 {
		cfg.HeaderTimeout = 30 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Proxy{cfg: cfg}, nil
}

// Limits returns the server's limits of each sandbox (Config.Limits).
func (p *Proxy) Limits() Limits { return p.cfg.Limits }

// hostAddrs returns a test for the addresses of the host's interfaces.
func hostAddrs() (func(netip.Addr) bool, error) {
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("listing the host's addresses: %w", err)
	}
	set := map[netip.Addr]bool{}
	for _, a := range ifaddrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			set[p.Addr().Unmap()] = true
		}
	}
	return func(a netip.Addr) bool { return set[a] }, nil
}

// Target is whom a listener serves: a sandbox of an env, under the env's policy and limits
// (Limits.Within of the proxy's and the env's).
type Target struct {
	Env, Sandbox string
	Policy       Policy
	Limits       Limits
}

// Refusals are recorded at most refusalRecordRate a second (a burst of refusalRecordBurst)
// for each sandbox; the count of those not recorded rides on the next one that is. Refusals
// are answered by at most refuseSlots goroutines a sandbox, each waiting at most
// refuseHeaderTimeout for the request it refuses; a connection beyond them is closed
// unanswered. So a sandbox that connects in a loop costs the server a bounded number of
// goroutines and ledger rows.
const (
	refusalRecordRate   = 10
	refusalRecordBurst  = 50
	refuseSlots         = 4
	refuseHeaderTimeout = 2 * time.Second
)

// Server is one listener's service. Close ends it and its connections.
type Server struct {
	p      *Proxy
	ln     net.Listener
	target Target
	wg     sync.WaitGroup
	once   sync.Once
	// done is closed by Close: it ends waits for a byte rate.
	done chan struct{}
	// up and down are the sandbox's traffic each way, for its totals and rates.
	up   *way
	down *way
	// refusing holds a token for each refusal being answered.
	refusing chan struct{}
	// recRate bounds the refusals recorded; suppressed counts those it left out since the
	// last one recorded.
	recRate    *bucket
	suppressed atomic.Int64

	mu sync.Mutex
	// connRate admits connections (Limits.ConnsPerSecond).
	// +checklocks:mu
	connRate *bucket
	// conns are the open connections, served or being refused.
	// +checklocks:mu
	conns map[net.Conn]struct{}
	// served counts the connections of conns being served (not refused), against
	// Limits.MaxConns.
	// +checklocks:mu
	served int
	// +checklocks:mu
	closed bool
}

// Serve accepts connections on ln for t until the returned Server is closed; it owns ln.
func (p *Proxy) Serve(ln net.Listener, t Target) *Server {
	l := t.Limits
	s := &Server{p: p, ln: ln, target: t, conns: map[net.Conn]struct{}{}, done: make(chan struct{}),
		connRate: newBucket(l.ConnsPerSecond, float64(max(l.ConnBurst, 1))),
		up:       newWay("up", l.MaxBytesUp, l.BytesPerSecondUp), down: newWay("down", l.MaxBytesDown, l.BytesPerSecondDown),
		refusing: make(chan struct{}, refuseSlots), recRate: newBucket(refusalRecordRate, refusalRecordBurst)}
	s.wg.Add(1)
	go s.accept()
	return s
}

// Close stops accepting, ends the open connections and waits for their goroutines. It is
// idempotent.
func (s *Server) Close() error {
	var err error
	s.once.Do(func() {
		err = s.ln.Close()
		close(s.done)
		s.mu.Lock()
		s.closed = true
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.p.cfg.Log.Warn("accepting egress connection", "sandbox", s.target.Sandbox, "err", err)
			}
			return
		}
		why, ok := s.admit(c)
		if !ok {
			_ = c.Close()
			return
		}
		if why == "" {
			s.wg.Go(func() {
				rec := s.handle(c)
				s.untrack(c, true)
				s.record(rec)
			})
			continue
		}
		select {
		case s.refusing <- struct{}{}:
			s.wg.Go(func() {
				rec := s.refuse(c, why)
				s.untrack(c, false)
				<-s.refusing
				s.record(rec)
			})
		default:
			s.untrack(c, false)
		}
	}
}

// admit tracks c and says why it is refused ("" when it is served) under the limits on
// connections; ok is false once the server is closed.
func (s *Server) admit(c net.Conn) (why string, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return "", false
	}
	s.conns[c] = struct{}{}
	l := s.target.Limits
	switch {
	case l.MaxConns > 0 && s.served >= l.MaxConns:
		return fmt.Sprintf("%d connections open at once (egress.limits.max_connections)", l.MaxConns), true
	case !s.connRate.take():
		return fmt.Sprintf("more than %v new connections a second, %d at once (egress.limits.connections_per_second, connection_burst)",
			l.ConnsPerSecond, max(l.ConnBurst, 1)), true
	}
	s.served++
	return "", true
}

func (s *Server) untrack(c net.Conn, served bool) {
	_ = c.Close()
	s.mu.Lock()
	delete(s.conns, c)
	if served {
		s.served--
	}
	s.mu.Unlock()
}

// record hands rec to the recorder: every allowed connection, and the refused ones within
// recRate.
func (s *Server) record(rec Record) {
	r := s.p.cfg.Recorder
	if r == nil || rec.Host == "" && rec.Reason == "" {
		return // nothing was asked for
	}
	if !rec.Allowed {
		if !s.recRate.take() {
			s.suppressed.Add(1)
			return
		}
		if n := s.suppressed.Swap(0); n > 0 {
			rec.Reason += fmt.Sprintf(" (and %d refusals before it not recorded)", n)
		}
	}
	r.Egress(rec)
}

// refuse answers a connection the limits refuse with 429 and why, once it has sent its
// request (or refuseHeaderTimeout has passed).
func (s *Server) refuse(c net.Conn, why string) Record {
	rec := Record{Env: s.target.Env, Sandbox: s.target.Sandbox, Start: time.Now(), Reason: fmt.Sprintf("%v: %s", ErrCapped, why)}
	_ = c.SetReadDeadline(time.Now().Add(refuseHeaderTimeout))
	if req, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
		rec.Host = req.Host
		if host, port, err := target(req); err == nil {
			rec.Host, rec.Port = host, port
		}
	}
	reply(c, http.StatusTooManyRequests, why)
	rec.Duration = time.Since(rec.Start)
	return rec
}

// handle serves one connection: one CONNECT tunnel, or one absolute-URI HTTP request.
func (s *Server) handle(c net.Conn) Record {
	rec := Record{Env: s.target.Env, Sandbox: s.target.Sandbox, Start: time.Now()}
	s.serve(c, &rec)
	rec.Duration = time.Since(rec.Start)
	return rec
}

func (s *Server) serve(c net.Conn, rec *Record) {
	in := &idleReader{r: c, conn: c, act: &activity{}}
	_ = c.SetReadDeadline(time.Now().Add(s.p.cfg.HeaderTimeout))
	br := bufio.NewReader(in)
	req, err := http.ReadRequest(br)
	if err != nil {
		return // not HTTP, or gone before its header: nothing was asked for
	}
	_ = c.SetReadDeadline(time.Time{})
	in.idle = s.target.Limits.IdleTimeout
	in.act.touch()
	host, port, err := target(req)
	if err != nil {
		rec.Host, rec.Reason = req.Host, err.Error()
		reply(c, http.StatusBadRequest, err.Error())
		return
	}
	rec.Host, rec.Port = host, port
	dest := net.JoinHostPort(host, strconv.Itoa(int(port)))
	if why := cmp.Or(s.up.spent(), s.down.spent()); why != "" {
		rec.Reason = fmt.Sprintf("%v: %s", ErrCapped, why)
		reply(c, http.StatusForbidden, fmt.Sprintf("%s: %s", dest, why))
		return
	}
	up, status, err := s.dial(req.Context(), rec)
	if err != nil {
		rec.Reason = err.Error()
		reply(c, status, fmt.Sprintf("%s: %v", dest, err))
		return
	}
	defer up.Close()
	rec.Allowed = true
	fromUp := &idleReader{r: up, conn: up, idle: in.idle, act: in.act}
	toUp := &meter{conn: up, idle: in.idle, way: s.up, act: in.act, done: s.done}
	toSandbox := &meter{conn: c, idle: in.idle, way: s.down, act: in.act, done: s.done}
	if req.Method == http.MethodConnect {
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			return
		}
		err = pipe(c, up, io.MultiReader(io.LimitReader(br, int64(br.Buffered())), in), fromUp, toUp, toSandbox)
	} else {
		err = forward(req, fromUp, toUp, toSandbox)
	}
	rec.BytesUp, rec.BytesDown = toUp.n.Load(), toSandbox.n.Load()
	if cut := (errCut{}); errors.As(err, &cut) {
		rec.Reason = cut.why
	}
}

// target returns the destination of a CONNECT or absolute-URI HTTP request.
func target(req *http.Request) (string, uint16, error) {
	hostport := req.RequestURI
	if req.Method != http.MethodConnect {
		if req.URL == nil || req.URL.Scheme != "http" || req.URL.Host == "" {
			return "", 0, errors.New("the proxy takes CONNECT host:port, or an http:// URL")
		}
		hostport = req.URL.Host
		if req.URL.Port() == "" {
			hostport = net.JoinHostPort(req.URL.Hostname(), "80")
		}
	}
	h, p, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", 0, fmt.Errorf("destination %q is not host:port", hostport)
	}
	n, err := strconv.ParseUint(p, 10, 16)
	if err != nil || n == 0 {
		return "", 0, fmt.Errorf("destination %q has no valid port", hostport)
	}
	if ip, ok := parseIP(h); ok {
		return ip.String(), uint16(n), nil
	}
	return strings.ToLower(strings.TrimSuffix(h, ".")), uint16(n), nil
}

// dial checks rec's destination against the policy, resolves it and dials the address it
// checked. On refusal it returns the HTTP status to answer.
func (s *Server) dial(ctx context.Context, rec *Record) (net.Conn, int, error) {
	pol := s.target.Policy
	if !pol.names(rec.Host, rec.Port) {
		return nil, http.StatusForbidden, fmt.Errorf("%w: not in the env's allow-list", ErrRefused)
	}
	ctx, cancel := context.WithTimeout(ctx, s.p.cfg.DialTimeout)
	defer cancel()
	var addrs []netip.Addr
	if ip, ok := parseIP(rec.Host); ok {
		addrs = []netip.Addr{ip}
	} else {
		var err error
		if addrs, err = s.p.cfg.Resolver.LookupNetIP(ctx, "ip", rec.Host); err != nil {
			return nil, http.StatusBadGateway, fmt.Errorf("resolving %s: %w", rec.Host, err)
		}
	}
	addr, why := pol.choose(addrs, rec.Port, s.p.cfg.Own)
	if why != "" {
		if len(addrs) > 0 {
			rec.Addr = addrs[len(addrs)-1].Unmap()
		}
		return nil, http.StatusForbidden, fmt.Errorf("%w: %s", ErrRefused, why)
	}
	rec.Addr = addr
	var d net.Dialer
	up, err := d.DialContext(ctx, "tcp", netip.AddrPortFrom(addr, rec.Port).String())
	if err != nil {
		return nil, http.StatusBadGateway, fmt.Errorf("connecting to %s: %w", addr, errors.Unwrap(err))
	}
	return up, 0, nil
}

// forward sends one HTTP request to the destination (through toUp) in origin form, with
// Connection: close, and copies the answer back (from fromUp) until the destination closes.
func forward(req *http.Request, fromUp io.Reader, toUp, toSandbox io.Writer) error {
	for _, h := range []string{"Proxy-Connection", "Proxy-Authorization", "Keep-Alive"} {
		req.Header.Del(h)
	}
	req.Close = true
	req.RequestURI = ""
	if err := req.Write(toUp); err != nil {
		return err
	}
	_, err := io.Copy(toSandbox, fromUp)
	return err
}

// pipe copies both ways between the sandbox's connection c (read through fromSandbox) and
// up, passing on each half-close, until both directions end. A direction cut by a limit
// closes both connections; the cut is returned.
func pipe(c, up net.Conn, fromSandbox, fromUp io.Reader, toUp, toSandbox io.Writer) error {
	errc := make(chan error, 1)
	go func() {
		_, err := io.Copy(toUp, fromSandbox)
		end(err, c, up)
		errc <- err
	}()
	_, err := io.Copy(toSandbox, fromUp)
	end(err, up, c)
	if cut := (errCut{}); errors.As(err, &cut) {
		<-errc
		return err
	}
	return <-errc
}

// end ends a direction of a tunnel from src to dst: half-closes dst, or closes both when a
// limit cut it.
func end(err error, src, dst net.Conn) {
	if cut := (errCut{}); errors.As(err, &cut) {
		_ = src.Close()
		_ = dst.Close()
		return
	}
	closeWrite(dst)
}

// reply answers a refused or failed request and closes the exchange.
func reply(c net.Conn, status int, msg string) {
	body := "egress: " + plain(msg) + "\n"
	_, _ = fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}
