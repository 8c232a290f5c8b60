package egress

import (
	"bufio"
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
	Log           *slog.Logger
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

// Target is whom a listener serves: a sandbox of an env, under the env's policy.
type Target struct {
	Env, Sandbox string
	Policy       Policy
}

// Server is one listener's service. Close ends it and its connections.
type Server struct {
	p      *Proxy
	ln     net.Listener
	target Target
	wg     sync.WaitGroup
	once   sync.Once

	mu sync.Mutex
	// +checklocks:mu
	conns map[net.Conn]struct{}
	// +checklocks:mu
	closed bool
}

// Serve accepts connections on ln for t until the returned Server is closed; it owns ln.
func (p *Proxy) Serve(ln net.Listener, t Target) *Server {
	s := &Server{p: p, ln: ln, target: t, conns: map[net.Conn]struct{}{}}
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
		if !s.track(c) {
			_ = c.Close()
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.untrack(c)
			s.handle(c)
		}()
	}
}

func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Server) untrack(c net.Conn) {
	_ = c.Close()
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// handle serves one connection: one CONNECT tunnel, or one absolute-URI HTTP request.
func (s *Server) handle(c net.Conn) {
	rec := Record{Env: s.target.Env, Sandbox: s.target.Sandbox, Start: time.Now()}
	defer func() {
		rec.Duration = time.Since(rec.Start)
		if r := s.p.cfg.Recorder; r != nil && rec.Host != "" {
			r.Egress(rec)
		}
	}()
	_ = c.SetReadDeadline(time.Now().Add(s.p.cfg.HeaderTimeout))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		return // not HTTP, or gone before its header: nothing was asked for
	}
	_ = c.SetReadDeadline(time.Time{})
	host, port, err := target(req)
	if err != nil {
		rec.Host, rec.Reason = req.Host, err.Error()
		reply(c, http.StatusBadRequest, err.Error())
		return
	}
	rec.Host, rec.Port = host, port
	up, status, err := s.dial(req.Context(), &rec)
	if err != nil {
		rec.Reason = err.Error()
		reply(c, status, fmt.Sprintf("%s: %v", net.JoinHostPort(host, strconv.Itoa(int(port))), err))
		return
	}
	defer up.Close()
	rec.Allowed = true
	var upN, downN int64
	if req.Method == http.MethodConnect {
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			return
		}
		upN, downN = pipe(c, io.MultiReader(io.LimitReader(br, int64(br.Buffered())), c), up)
	} else {
		upN, downN = forward(c, req, up)
	}
	rec.BytesUp, rec.BytesDown = upN, downN
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

// forward sends one HTTP request to up in origin form, with Connection: close, and copies the
// answer back until up closes.
func forward(c net.Conn, req *http.Request, up net.Conn) (int64, int64) {
	for _, h := range []string{"Proxy-Connection", "Proxy-Authorization", "Keep-Alive"} {
		req.Header.Del(h)
	}
	req.Close = true
	req.RequestURI = ""
	cu := &counter{w: up}
	if err := req.Write(cu); err != nil {
		return cu.n.Load(), 0
	}
	downN, _ := io.Copy(c, up)
	return cu.n.Load(), downN
}

// pipe copies both ways between the sandbox's connection (read through in) and up, passing on
// each half-close, until both directions end.
func pipe(c net.Conn, in io.Reader, up net.Conn) (int64, int64) {
	var upN int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		upN, _ = io.Copy(up, in)
		closeWrite(up)
	}()
	downN, _ := io.Copy(c, up)
	closeWrite(c)
	<-done
	return upN, downN
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// reply answers a refused or failed request and closes the exchange.
func reply(c net.Conn, status int, msg string) {
	body := "egress: " + plain(msg) + "\n"
	_, _ = fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
}

// counter counts the bytes written through it.
type counter struct {
	w io.Writer
	n atomic.Int64
}

func (c *counter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n.Add(int64(n))
	return n, err
}
