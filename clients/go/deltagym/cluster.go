package deltagym

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
)

// DefaultRefresh is how often a Cluster discovers its nodes again and asks each for its report,
// unless WithRefreshInterval sets it.
const DefaultRefresh = 10 * time.Second

// probeTimeout bounds one refresh: the discovery, then every node's GetNode, in parallel.
const probeTimeout = 3 * time.Second

// WithRefreshInterval sets how often a Cluster discovers its nodes again and asks each for its
// report (default DefaultRefresh). Dial ignores it.
func WithRefreshInterval(d time.Duration) Option { return func(c *config) { c.refresh = d } }

// WithResolver sets the resolver a Cluster of a dns: target looks its name up with (default
// net.DefaultResolver). Dial ignores it.
func WithResolver(r *net.Resolver) Option { return func(c *config) { c.resolver = r } }

// withNode makes a Client's calls go through m, innermost.
func withNode(m *member) Option { return func(c *config) { c.node = m } }

// IsClusterTarget reports whether addr names a cluster, a dns:NAME:PORT target or a
// comma-separated list of addresses, rather than one server.
func IsClusterTarget(addr string) bool {
	return strings.HasPrefix(addr, "dns:") || strings.Contains(addr, ",")
}

// CheckClusterTarget returns an error wrapping ErrBadAddress when target cannot name a cluster
// (see DialCluster), without contacting anything.
func CheckClusterTarget(target string) error {
	_, err := parseTarget(target)
	return err
}

// clusterTarget is a parsed target: a DNS name and port, or a static list of addresses.
type clusterTarget struct {
	name, port string
	static     []string
}

func parseTarget(target string) (clusterTarget, error) {
	if rest, ok := strings.CutPrefix(target, "dns:"); ok {
		rest = strings.TrimPrefix(rest, "///") // gRPC's spelling, dns:///NAME:PORT
		host, port, err := net.SplitHostPort(rest)
		if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			return clusterTarget{}, fmt.Errorf("%w %q: want dns:NAME:PORT, as dns:deltagym.deltagym.svc.cluster.local:8080", ErrBadAddress, target)
		}
		return clusterTarget{name: host, port: port}, nil
	}
	var t clusterTarget
	for a := range strings.SplitSeq(target, ",") {
		a = strings.TrimSpace(a)
		if a == "" || slices.Contains(t.static, a) {
			continue
		}
		if _, err := BaseURL(a); err != nil {
			return clusterTarget{}, fmt.Errorf("in cluster %q: %w", target, err)
		}
		t.static = append(t.static, a)
	}
	if len(t.static) == 0 {
		return clusterTarget{}, fmt.Errorf("%w %q: want dns:NAME:PORT or a comma-separated list of host:port", ErrBadAddress, target)
	}
	return t, nil
}

// addrs returns the addresses of the target's nodes, sorted.
func (t clusterTarget) addrs(ctx context.Context, r *net.Resolver) ([]string, error) {
	if t.name == "" {
		return t.static, nil
	}
	ips, err := r.LookupIPAddr(ctx, t.name)
	if err != nil {
		return nil, fmt.Errorf("looking up the nodes of %s: %w", t.name, err)
	}
	out := make([]string, 0, len(ips))
	for _, ip := range ips {
		out = append(out, net.JoinHostPort(ip.IP.String(), t.port))
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// Cluster is a client of every node of a deltagym cluster, with no router between them: it
// discovers the nodes, asks each for its report (NodeService.GetNode) at every refresh, places
// new sandboxes by load, and sends every call on a sandbox or checkpoint to the node its ID
// names (NodeOf). It is safe for concurrent use. Close it to stop the refreshes and close the
// nodes' Clients.
//
// Nodes are keyed by the name they report. A node is live while its last GetNode answered;
// it takes new sandboxes while it is live, listed by the last discovery and not draining.
// A node that stops answering (its GetNode, or a call's connection, fails) takes none, and
// calls on its sandboxes and checkpoints fail at once with an Unavailable error whose cause,
// a *NodeError, names it, until a refresh finds it answering again. A node the discovery no
// longer lists stays known while it answers, so that the sandboxes of a draining node, which
// leaves a Kubernetes Service's endpoints as its drain starts, finish their episodes; it is
// forgotten once it no longer answers, and its IDs then fail as those of an unreachable node.
type Cluster struct {
	// Set by DialCluster, then only read.
	target    string
	where     clusterTarget
	resolver  *net.Resolver
	dialOpts  []Option // every node's Dial's: the caller's options, with the token resolved once
	onRefresh func()

	kick       chan struct{}      // a call found a node unreachable: refresh now
	stop       context.CancelFunc // ends the refresh loop
	done       chan struct{}      // closed when the refresh loop returns
	refreshing sync.Mutex         // one refresh at a time

	// Lock order: mu, then a member's mu.
	mu sync.Mutex
	// members are the nodes by the address they are reached at: every address the last
	// discovery listed, and those it no longer lists that still answer.
	// +checklocks:mu
	members map[string]*member
	// byName is the member that serves each node's IDs: one that answers, listed first, else
	// the last that did.
	// +checklocks:mu
	byName map[string]*member
	// retired are the members no longer in members or byName, whose Clients handles of their
	// sandboxes may still hold; Close closes them.
	// +checklocks:mu
	retired []*member
	// discoverErr is why the last discovery failed; nil when it listed the nodes.
	// +checklocks:mu
	discoverErr error
	// clashes are the names that answering addresses advertising different addresses report
	// alike, with those addresses: two nodes given one name, or one posing as another. Calls on
	// their IDs and placements on them fail until the last refresh finds one address again.
	// +checklocks:mu
	clashes map[string][]string
	// +checklocks:mu
	closed bool
}

// member is one address of a Cluster and its node's state there. It watches the calls of its
// Client (its connect.Interceptor methods): a call's transport failure marks it unreachable.
type member struct {
	cl     *Cluster
	addr   string
	client *Client // set once, before the member is shared

	mu sync.Mutex
	// name is the node's name, from its first report; "" until then.
	// +checklocks:mu
	name string
	// info is its last report; nil before the first.
	// +checklocks:mu
	info *deltagymv1.NodeInfo
	// err is why it is unreachable (its last GetNode or a call's transport error); nil while
	// it answers.
	// +checklocks:mu
	err error
	// listed: the last discovery listed addr.
	// +checklocks:mu
	listed bool
	// +checklocks:mu
	checked time.Time
	// placed counts the sandboxes placed on the node since its last report, which the report
	// did not count.
	// +checklocks:mu
	placed int
}

// DialCluster returns a Cluster of the nodes target names, after a first refresh:
//
//   - "dns:NAME:PORT" (or gRPC's "dns:///NAME:PORT"): every A and AAAA record of NAME is a
//     node, at PORT; a Kubernetes headless Service's name lists its ready pods so. NAME is
//     looked up again at every refresh (WithResolver sets the resolver).
//   - a comma-separated list of addresses, each as Dial takes it (host:port or an http(s)://
//     URL).
//
// An empty target means $DELTAGYM_ADDR, or DefaultAddr when that is unset. Every node's Client
// is dialled with opts (the token is resolved once, as Dial resolves it); WithRefreshInterval
// sets how often the nodes are discovered and asked again.
//
// DialCluster fails only on a target it cannot parse, or when ctx ends before the first
// refresh does; nodes that do not answer, or a name that does not resolve, leave a Cluster
// that says so in Nodes and in the errors of its calls, and refreshes on.
func DialCluster(ctx context.Context, target string, opts ...Option) (*Cluster, error) {
	if target == "" {
		target = cmp.Or(os.Getenv(EnvAddr), DefaultAddr)
	}
	where, err := parseTarget(target)
	if err != nil {
		return nil, err
	}
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	dialOpts := slices.Clone(opts)
	if !cfg.tokenSet {
		tok, err := ResolveToken()
		if err != nil {
			return nil, err
		}
		dialOpts = append(dialOpts, WithToken(tok))
	}
	interval := cfg.refresh
	if interval <= 0 {
		interval = DefaultRefresh
	}
	c := &Cluster{target: target, where: where, resolver: cmp.Or(cfg.resolver, net.DefaultResolver), dialOpts: dialOpts,
		onRefresh: cfg.onRefresh, kick: make(chan struct{}, 1), done: make(chan struct{}),
		members: make(map[string]*member), byName: make(map[string]*member)}
	_ = c.Refresh(ctx) // nodes that do not answer are no error: Nodes tells of them
	if ctx.Err() != nil {
		_ = c.closeClients()
		return nil, fmt.Errorf("discovering the nodes of %s: %w", target, ctx.Err())
	}
	loopCtx, stop := context.WithCancel(context.Background())
	c.stop = stop
	go c.loop(loopCtx, interval)
	return c, nil
}

// Target returns the target the Cluster was dialled with.
func (c *Cluster) Target() string { return c.target }

// loop refreshes every interval, and at once when a call found a node unreachable, until ctx
// ends.
func (c *Cluster) loop(ctx context.Context, interval time.Duration) {
	defer close(c.done)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-c.kick:
		}
		_ = c.Refresh(ctx)
	}
}

// kickRefresh asks the loop for a refresh now.
func (c *Cluster) kickRefresh() {
	select {
	case c.kick <- struct{}{}:
	default: // one is due already
	}
}

// Refresh discovers the nodes and asks each for its report now, as the periodic refresh does,
// within ctx and at most a few seconds. It returns the discovery's error: nodes that do not
// answer are no error of Refresh (Nodes tells of them).
func (c *Cluster) Refresh(ctx context.Context) error {
	where, resolver, dialOpts, onRefresh := c.where, c.resolver, c.dialOpts, c.onRefresh // set once
	c.refreshing.Lock()
	defer c.refreshing.Unlock()
	caller := ctx
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	addrs, derr := where.addrs(ctx, resolver)

	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClientClosed
	}
	if derr == nil {
		for _, a := range addrs {
			if c.members[a] != nil {
				continue
			}
			if m := c.knownMember(a); m != nil {
				c.members[a] = m // back at its address: the handles bound to it work again
				continue
			}
			m, err := c.newMember(a, dialOpts)
			if err != nil {
				derr = errors.Join(derr, err)
				continue
			}
			c.members[a] = m
		}
		for a, m := range c.members {
			m.setListed(slices.Contains(addrs, a))
		}
	}
	c.discoverErr = derr
	probe := make([]*member, 0, len(c.members))
	for _, m := range c.members {
		probe = append(probe, m)
	}
	c.mu.Unlock()

	var wg sync.WaitGroup
	for _, m := range probe {
		wg.Go(func() { m.probe(ctx, caller) })
	}
	wg.Wait()

	c.mu.Lock()
	c.regroup()
	c.mu.Unlock()
	if onRefresh != nil {
		onRefresh()
	}
	return derr
}

// newMember dials the node at addr with opts.
func (c *Cluster) newMember(addr string, opts []Option) (*member, error) {
	m := &member{cl: c, addr: addr}
	client, err := Dial(addr, append(slices.Clip(opts), withNode(m))...)
	if err != nil {
		return nil, err
	}
	m.client = client
	return m, nil
}

// knownMember returns the member of addr that the cluster still knows, having forgotten it as
// an address (a node's last member, or a retired one); nil when there is none.
//
// +checklocks:c.mu
func (c *Cluster) knownMember(addr string) *member {
	for _, m := range c.byName {
		if m.addr == addr {
			return m
		}
	}
	for i, m := range c.retired {
		if m.addr == addr {
			c.retired = slices.Delete(c.retired, i, i+1)
			return m
		}
	}
	return nil
}

// regroup forgets the members that are neither listed nor answering, and chooses each node's
// member anew.
//
// +checklocks:c.mu
func (c *Cluster) regroup() {
	byName := make(map[string]*member, len(c.byName))
	advertised := map[string][]string{}
	var dropped []*member
	for addr, m := range c.members {
		st := m.status()
		if !st.Listed && st.Err != nil {
			delete(c.members, addr)
			dropped = append(dropped, m)
			continue
		}
		if st.Err != nil || st.Name == "" {
			continue
		}
		if a := st.Report.GetAddress(); a != "" && !slices.Contains(advertised[st.Name], a) {
			advertised[st.Name] = append(advertised[st.Name], a)
		}
		if cur := byName[st.Name]; cur == nil || preferred(m, cur) {
			byName[st.Name] = m
		}
	}
	// A node that no longer answers keeps its member, so that calls on its IDs fail naming it.
	for name, m := range c.byName {
		if byName[name] == nil && m.status().Name == name {
			byName[name] = m
		}
	}
	kept := make(map[*member]bool, len(c.members)+len(byName))
	for _, m := range c.members {
		kept[m] = true
	}
	for _, m := range byName {
		kept[m] = true
	}
	for _, m := range c.byName {
		if !kept[m] && !slices.Contains(dropped, m) {
			dropped = append(dropped, m)
		}
	}
	for _, m := range dropped {
		if !kept[m] && !slices.Contains(c.retired, m) {
			c.retired = append(c.retired, m)
		}
	}
	c.byName = byName
	c.clashes = clashes(advertised)
}

// clashes returns the names of advertised (the addresses each name's answering nodes advertise)
// that nodes advertising more than one address report, with those addresses, sorted; nil for
// none.
func clashes(advertised map[string][]string) map[string][]string {
	var out map[string][]string
	for name, addrs := range advertised {
		if len(addrs) > 1 {
			slices.Sort(addrs)
			if out == nil {
				out = map[string][]string{}
			}
			out[name] = addrs
		}
	}
	return out
}

// clash is the error of a call on node name while nodes at several addresses report that name.
//
// +checklocks:c.mu
func (c *Cluster) clash(name string) error {
	addrs := c.clashes[name]
	if addrs == nil {
		return nil
	}
	return connect.NewError(connect.CodeUnavailable, &NodeError{Node: name, Err: fmt.Errorf(
		"nodes at %s all report the name %s: two nodes given one name, or one posing as another; calls on its IDs go nowhere until one is renamed or gone",
		strings.Join(addrs, " and "), name)})
}

// preferred reports whether m serves its node's IDs rather than cur, another address of the
// same node: a listed one, else the first address.
func preferred(m, cur *member) bool {
	ml, cl := m.status().Listed, cur.status().Listed
	if ml != cl {
		return ml
	}
	return m.addr < cur.addr
}

// probe asks the node for its report, within ctx, and records the answer; a failure is
// recorded unless caller, the context ctx derives from, ended first: a refresh cut short
// learns nothing of the nodes it did not hear from.
func (m *member) probe(ctx, caller context.Context) {
	res, err := m.client.nodes.GetNode(ctx, connect.NewRequest(&deltagymv1.GetNodeRequest{}))
	if err != nil && caller.Err() != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.checked = time.Now()
	if err != nil {
		m.err = err
		return
	}
	info := res.Msg.GetNode()
	if !nodeName(info.GetName()) {
		m.err = fmt.Errorf("it reports the node name %q, which no ID carries", info.GetName())
		return
	}
	m.name, m.info, m.err, m.placed = info.GetName(), info, nil, 0
}

func (m *member) setListed(listed bool) {
	m.mu.Lock()
	m.listed = listed
	m.mu.Unlock()
}

// status returns what the cluster knows of m.
func (m *member) status() NodeStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return NodeStatus{Name: m.name, Addr: m.addr, Listed: m.listed, Report: m.info, Err: m.err, CheckedAt: m.checked}
}

// load returns m's report for placement, with the sandboxes placed since; ok is false when m
// may take no new sandbox: unreachable, unlisted or draining.
func (m *member) load() (load *deltagymv1.NodeInfo, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil || m.info == nil || !m.listed || m.info.GetDraining() {
		return nil, false
	}
	i := m.info
	return &deltagymv1.NodeInfo{Sandboxes: i.GetSandboxes() + int32(min(m.placed, 1<<30)), MaxSandboxes: i.GetMaxSandboxes(), CpuLoad: i.GetCpuLoad(),
		MemoryAvailableBytes: i.GetMemoryAvailableBytes(), MemoryTotalBytes: i.GetMemoryTotalBytes()}, true
}

// place counts n more sandboxes on m until its next report.
func (m *member) place(n int) {
	m.mu.Lock()
	m.placed = max(m.placed+n, 0)
	m.mu.Unlock()
}

// unreachable returns the error of a call to m while it is unreachable, nil while it answers.
func (m *member) unreachable() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err == nil {
		return nil
	}
	return connect.NewError(connect.CodeUnavailable, &NodeError{Node: m.name, Addr: m.addr, Err: m.err})
}

// failed records the error of a call made within ctx: one the transport made (no server
// answered: the connection was refused, broke or timed out) marks m unreachable, asks for a
// refresh, and comes back as an Unavailable error naming the node.
func (m *member) failed(ctx context.Context, err error) error {
	if !transportFailure(ctx, err) {
		return err
	}
	var down *NodeError
	if errors.As(err, &down) {
		return err
	}
	m.mu.Lock()
	m.err = err
	name := m.name
	m.mu.Unlock()
	m.cl.kickRefresh()
	return connect.NewError(connect.CodeUnavailable, &NodeError{Node: name, Addr: m.addr, Err: err})
}

// transportFailure reports whether err, of a call made within ctx, is the transport's rather
// than a server's: Unavailable (connect's code for a connection refused or lost), a
// connection the peer broke (EPIPE, ECONNRESET), which connect reports as Canceled although
// ctx was not, or an answer cut short by the peer's end (a read that met EOF in the middle
// of a message), which it reports as Unknown.
func transportFailure(ctx context.Context, err error) bool {
	if err == nil || connect.IsWireError(err) {
		return false
	}
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		return true
	case connect.CodeCanceled:
		return ctx.Err() == nil && (errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET))
	case connect.CodeUnknown:
		return ctx.Err() == nil && errors.Is(err, io.ErrUnexpectedEOF)
	}
	return false
}

// WrapUnary implements connect.Interceptor: a call to an unreachable node fails at once, and
// a transport failure marks the node unreachable. GetNode, the refresh's own probe, passes.
func (m *member) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().Procedure == deltagymv1connect.NodeServiceGetNodeProcedure {
			return next(ctx, req)
		}
		if err := m.unreachable(); err != nil {
			return nil, err
		}
		res, err := next(ctx, req)
		return res, m.failed(ctx, err)
	}
}

// WrapStreamingClient implements connect.Interceptor: a stream's transport failure marks the
// node unreachable and names it.
func (m *member) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		return nodeConn{next(ctx, spec), ctx, m}
	}
}

// WrapStreamingHandler implements connect.Interceptor; a client has no handlers.
func (m *member) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// nodeConn is a client stream to a node of a Cluster.
type nodeConn struct {
	connect.StreamingClientConn
	ctx context.Context //nolint:containedctx // the stream's own, which its calls run within
	m   *member
}

func (c nodeConn) Send(msg any) error { return c.m.failed(c.ctx, c.StreamingClientConn.Send(msg)) }
func (c nodeConn) Receive(msg any) error {
	return c.m.failed(c.ctx, c.StreamingClientConn.Receive(msg))
}
func (c nodeConn) CloseResponse() error {
	return c.m.failed(c.ctx, c.StreamingClientConn.CloseResponse())
}

// NodeStatus is what a Cluster knows of one node.
type NodeStatus struct {
	// Name is the node's name, as it reports it; "" for an address that never answered.
	Name string
	// Addr is the address the cluster reaches it at: listed by the target, or found by its
	// DNS name with the target's port.
	Addr string
	// Listed reports whether the last discovery listed Addr. A node no longer listed is kept
	// while it answers, for calls on its sandboxes; it takes no new ones.
	Listed bool
	// Report is the node's last report (nil before the first); it stays when the node stops
	// answering.
	Report *deltagymv1.NodeInfo
	// Err is why the node is unreachable: its last GetNode, or a call's connection, failed.
	// Nil while it answers.
	Err error
	// CheckedAt is when the cluster last asked the node for its report.
	CheckedAt time.Time
}

// Nodes returns what the Cluster knows of each node, as of its last refresh and the calls
// since: one entry per node name, then the addresses that never answered, sorted by name and
// address.
func (c *Cluster) Nodes() []NodeStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]NodeStatus, 0, len(c.byName)+1)
	for _, m := range c.byName {
		out = append(out, m.status())
	}
	for _, m := range c.members {
		if st := m.status(); st.Name == "" {
			out = append(out, st)
		}
	}
	slices.SortFunc(out, func(a, b NodeStatus) int {
		if (a.Name == "") != (b.Name == "") {
			return cmp.Compare(b.Name, a.Name) // named ones first
		}
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Addr, b.Addr))
	})
	return out
}

// Node returns what the Cluster knows of the node called name.
func (c *Cluster) Node(name string) (NodeStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.byName[name]
	if m == nil {
		return NodeStatus{}, false
	}
	return m.status(), true
}

// NodeClient returns the Client of the node called name, for calls this type does not route
// (RegisterEnv, ImportImage: each node keeps its own catalog and images).
func (c *Cluster) NodeClient(name string) (*Client, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClientClosed
	}
	m := c.byName[name]
	if m == nil {
		return nil, connect.NewError(connect.CodeUnavailable, &NodeError{Node: name, Err: c.unknownNode()})
	}
	return m.client, nil
}

// unknownNode says that no node reports a name.
//
// +checklocks:c.mu
func (c *Cluster) unknownNode() error {
	names := make([]string, 0, len(c.byName))
	for n := range c.byName {
		names = append(names, n)
	}
	slices.Sort(names)
	var why []string // the addresses that do not answer: the node may be one of them
	for _, m := range c.members {
		if st := m.status(); st.Err != nil && st.Name == "" {
			why = append(why, (&NodeError{Addr: st.Addr, Err: st.Err}).Error())
		}
	}
	slices.Sort(why)
	msg := fmt.Sprintf("no node of %s reports that name (nodes: %s)", c.target, strings.Join(names, ", "))
	if len(names) == 0 {
		msg = fmt.Sprintf("no node of %s has answered", c.target)
	}
	if len(why) > 0 {
		msg += ": " + strings.Join(why, "; ")
	}
	if c.discoverErr != nil {
		return fmt.Errorf("%s; %w", msg, c.discoverErr)
	}
	return errors.New(msg)
}

// route returns the member that serves id: the one of the node id names; for an ID of no
// node, the only node, when there is one.
func (c *Cluster) route(id string) (*member, error) {
	node := NodeOf(id)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClientClosed
	}
	if node == "" {
		switch {
		case id == "":
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("no ID given"))
		case len(c.byName) == 1:
			for _, m := range c.byName {
				return m, nil
			}
		case len(c.byName) == 0:
			return nil, connect.NewError(connect.CodeUnavailable, c.unknownNode())
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(
			"%q names no node (a cluster's IDs are PREFIX-NODE-HEX, as sb-node-a-3f2a9c0d1e4b5a69), and the cluster has %d: give an ID its nodes made",
			id, len(c.byName)))
	}
	if err := c.clash(node); err != nil {
		return nil, err
	}
	m := c.byName[node]
	if m == nil {
		return nil, connect.NewError(connect.CodeUnavailable, &NodeError{Node: node, Err: c.unknownNode()})
	}
	return m, nil
}

// Owner returns the Client of the node that holds a sandbox or checkpoint, the node its ID
// names (an ID of no node: the only node, when the cluster has one; else an InvalidArgument
// error).
func (c *Cluster) Owner(id string) (*Client, error) {
	m, err := c.route(id)
	if err != nil {
		return nil, err
	}
	return m.client, nil
}

// Sandbox returns a handle for an existing sandbox, bound to the Client of the node that holds
// it (Owner). It does not contact the node.
func (c *Cluster) Sandbox(id string) (*Sandbox, error) {
	m, err := c.route(id)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}
	return m.client.Sandbox(id), nil
}

// GetSandbox describes a sandbox as its node knows it.
func (c *Cluster) GetSandbox(ctx context.Context, id string) (*deltagymv1.Sandbox, error) {
	sb, err := c.Sandbox(id)
	if err != nil {
		return nil, err
	}
	return sb.Info(ctx)
}

// ReleaseCheckpoint drops the caller's hold on a checkpoint, on its node.
func (c *Cluster) ReleaseCheckpoint(ctx context.Context, checkpointID string) error {
	m, err := c.route(checkpointID)
	if err != nil {
		return fmt.Errorf("releasing checkpoint %s: %w", checkpointID, err)
	}
	return m.client.ReleaseCheckpoint(ctx, checkpointID)
}

// DiffCheckpoints compares two checkpoints on the node of checkpointID, which
// fetches base from its node if it is another's.
func (c *Cluster) DiffCheckpoints(ctx context.Context, base, checkpointID string, opts ...DiffOption) (*deltagymv1.DiffCheckpointsResponse, error) {
	m, err := c.route(checkpointID)
	if err != nil {
		return nil, fmt.Errorf("diff of checkpoint %s against %s: %w", checkpointID, base, err)
	}
	return m.client.DiffCheckpoints(ctx, base, checkpointID, opts...)
}

// candidates returns the members that may take new sandboxes, but those of skip, sorted by
// name, with their loads.
func (c *Cluster) candidates(skip []*member) ([]*member, []*deltagymv1.NodeInfo, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, nil, ErrClientClosed
	}
	names := make([]string, 0, len(c.byName))
	for n := range c.byName {
		names = append(names, n)
	}
	slices.Sort(names)
	var ms []*member
	var loads []*deltagymv1.NodeInfo
	var why []string
	for _, n := range names {
		m := c.byName[n]
		if slices.Contains(skip, m) {
			continue
		}
		if c.clashes[n] != nil {
			why = append(why, fmt.Sprintf("%s reported by several nodes", n))
			continue
		}
		l, ok := m.load()
		if !ok {
			st := m.status()
			switch {
			case st.Err != nil:
				why = append(why, fmt.Sprintf("%s unreachable", n))
			case st.Report.GetDraining():
				why = append(why, fmt.Sprintf("%s draining", n))
			default:
				why = append(why, fmt.Sprintf("%s no longer listed", n))
			}
			continue
		}
		ms, loads = append(ms, m), append(loads, l)
	}
	if len(ms) == 0 {
		err := c.unknownNode()
		if len(why) > 0 {
			err = fmt.Errorf("%s", strings.Join(why, ", "))
		}
		return nil, nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("no node of %s takes new sandboxes: %w", c.target, err))
	}
	return ms, loads, nil
}

// placeOne chooses the node of the next sandbox (Spread of one), but those of skip, and counts
// it there.
func (c *Cluster) placeOne(skip []*member) (*member, error) {
	ms, loads, err := c.candidates(skip)
	if err != nil {
		return nil, err
	}
	for i, k := range Spread(loads, 1) {
		if k > 0 {
			ms[i].place(1)
			return ms[i], nil
		}
	}
	return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("no node of %s takes new sandboxes", c.target))
}

// Place returns the Client of the node a new sandbox goes to now: the least loaded of the live,
// listed nodes that are not draining (Spread), where the sandbox counts until the node's next
// report. Reset places so; Place is for callers that send their own ResetRequest.
func (c *Cluster) Place() (*Client, error) {
	m, err := c.placeOne(nil)
	if err != nil {
		return nil, err
	}
	return m.client, nil
}

// failOver reports whether a Reset that failed so may go to another node: its node is
// unreachable or said it is unavailable (draining, say), after the Client's own retries, or it
// is full.
func failOver(err error) bool {
	code := connect.CodeOf(err)
	return code == connect.CodeUnavailable || code == connect.CodeResourceExhausted
}

// Reset takes a warm sandbox of env on the least loaded node (Place) and starts an episode in
// it; the handle is bound to that node's Client. When the node turns out unreachable or
// unavailable, or refuses for lack of room, the Reset goes to the next node, until none is
// left. A node that
// took the sandbox but whose answer was lost to a broken connection keeps it until its lease
// expires.
func (c *Cluster) Reset(ctx context.Context, env string, opts ...EpisodeOption) (*Sandbox, error) {
	var tried []*member
	var last error
	for {
		m, err := c.placeOne(tried)
		if err != nil {
			if last != nil {
				return nil, last
			}
			return nil, fmt.Errorf("reset of env %q: %w", env, err)
		}
		sb, err := m.client.Reset(ctx, env, opts...)
		if err == nil {
			return sb, nil
		}
		m.place(-1)
		if !failOver(err) || ctx.Err() != nil {
			return nil, err
		}
		tried, last = append(tried, m), err
	}
}

// forkPart is the share of a Fork's children one node makes.
type forkPart struct {
	m *member
	n int
}

// forkParts splits a Fork of n children from a checkpoint held by owner over the nodes that may
// take sandboxes, by load (Spread): a node other than owner fetches the checkpoint's layers
// from it first. With no node to place on, every child goes to owner, which then says why it
// cannot take them.
func (c *Cluster) forkParts(owner *member, n int) []forkPart {
	ms, loads, err := c.candidates(nil)
	if err != nil || len(ms) == 0 {
		return []forkPart{{m: owner, n: n}}
	}
	var parts []forkPart
	for i, k := range Spread(loads, n) {
		if k > 0 {
			parts = append(parts, forkPart{m: ms[i], n: k})
		}
	}
	if len(parts) == 0 {
		return []forkPart{{m: owner, n: n}}
	}
	return parts
}

// movesNot reports whether err is a node's refusal of a checkpoint of another node that it
// cannot hold, which the owner can serve: its processes stay on their node (PROCESSES_STAY),
// or the owner is unreachable from it (NODE_UNAVAILABLE).
func movesNot(err error) bool {
	r := ErrorReason(err)
	return r == "PROCESSES_STAY" || r == "NODE_UNAVAILABLE"
}

// Fork creates n sandboxes at the state of checkpoint checkpointID, spread over the nodes by
// load: a GRPO group forked from one checkpoint lands on every node, in one call, each node's
// part made in parallel (a node fetches the checkpoint from its owner once, then holds it). A
// part that a node cannot make because the checkpoint cannot move to it (its processes have
// no CRIU images, so they stay on their node; the owner is out of its reach) is made on the
// owner instead. The
// children's handles are bound to the Clients of the nodes that made them, in the order of
// the nodes' names. Like Reset, every part carries an idempotency key (the key given, with the
// node's name) and is retried safely. When a part fails, the children of the others are kept
// and returned beside the error.
func (c *Cluster) Fork(ctx context.Context, checkpointID string, n int, opts ...EpisodeOption) (*ForkResult, error) {
	owner, err := c.route(checkpointID)
	if err != nil {
		return nil, fmt.Errorf("fork of checkpoint %s: %w", checkpointID, err)
	}
	key := episodeOptions(opts).key
	if key == "" {
		key = NewIdempotencyKey()
	}
	parts := c.forkParts(owner, n)
	results := make([]*ForkResult, len(parts))
	errs := make([]error, len(parts))
	var wg sync.WaitGroup
	for i, p := range parts {
		wg.Go(func() {
			p.m.place(p.n)
			partOpts := append(slices.Clone(opts), WithIdempotencyKey(key+"/"+p.m.status().Name))
			res, err := p.m.client.Fork(ctx, checkpointID, p.n, partOpts...)
			if err != nil && p.m != owner && movesNot(err) {
				p.m.place(-p.n)
				owner.place(p.n)
				p.m = owner
				res, err = owner.client.Fork(ctx, checkpointID, p.n, append(slices.Clone(opts), WithIdempotencyKey(key+"/"+owner.status().Name+"/for/"+parts[i].m.status().Name))...)
			}
			if err != nil {
				p.m.place(-p.n)
			}
			results[i], errs[i] = res, err
		})
	}
	wg.Wait()
	out := &ForkResult{CheckpointID: checkpointID}
	for _, res := range results {
		if res != nil {
			out.Sandboxes = append(out.Sandboxes, res.Sandboxes...)
		}
	}
	if err := errors.Join(errs...); err != nil {
		if len(out.Sandboxes) == 0 {
			return nil, err
		}
		return out, err
	}
	return out, nil
}

// each calls f for every node, in parallel, and returns the results in the order of the nodes'
// names, with the errors of those that failed, joined. A node that is unreachable fails at once.
func each[T any](c *Cluster, f func(*Client) (T, error)) ([]T, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClientClosed
	}
	if len(c.byName) == 0 {
		err := c.unknownNode()
		c.mu.Unlock()
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	names := make([]string, 0, len(c.byName))
	for n := range c.byName {
		names = append(names, n)
	}
	slices.Sort(names)
	ms := make([]*member, len(names))
	for i, n := range names {
		ms[i] = c.byName[n]
	}
	// An address the target lists that never answered is a node not asked: say so, so that
	// a merged list does not pass for the whole cluster's.
	var silent []error
	for _, m := range c.members {
		if st := m.status(); st.Name == "" && st.Err != nil {
			silent = append(silent, connect.NewError(connect.CodeUnavailable, &NodeError{Addr: st.Addr, Err: st.Err}))
		}
	}
	c.mu.Unlock()
	out := make([]T, len(ms))
	errs := make([]error, len(ms))
	var wg sync.WaitGroup
	for i, m := range ms {
		wg.Go(func() { out[i], errs[i] = f(m.client) })
	}
	wg.Wait()
	return out, errors.Join(append(errs, silent...)...)
}

// ListSandboxes lists the sandboxes leased on every node, node by node. When some nodes cannot
// be asked, it returns those of the others with an error naming the nodes that failed.
func (c *Cluster) ListSandboxes(ctx context.Context, f SandboxFilter) ([]*deltagymv1.Sandbox, error) {
	parts, err := each(c, func(cl *Client) ([]*deltagymv1.Sandbox, error) { return cl.ListSandboxes(ctx, f) })
	return slices.Concat(parts...), err
}

// ListCheckpoints lists the checkpoints every node holds, node by node. When some nodes cannot
// be asked, it returns those of the others with an error naming the nodes that failed.
func (c *Cluster) ListCheckpoints(ctx context.Context, f CheckpointFilter) ([]*deltagymv1.CheckpointSummary, error) {
	parts, err := each(c, func(cl *Client) ([]*deltagymv1.CheckpointSummary, error) { return cl.ListCheckpoints(ctx, f) })
	return slices.Concat(parts...), err
}

// Heartbeat renews the leases of the sandboxes with the given IDs, asking each node about its
// own. When some nodes cannot be asked (or an ID names no node the cluster knows), the result
// holds what the others said and the error names what failed.
func (c *Cluster) Heartbeat(ctx context.Context, sandboxIDs ...string) (*HeartbeatResult, error) {
	byNode := make(map[*member][]string)
	var order []*member
	var errs []error
	for _, id := range sandboxIDs {
		m, err := c.route(id)
		if err != nil {
			errs = append(errs, fmt.Errorf("heartbeat of sandbox %s: %w", id, err))
			continue
		}
		if byNode[m] == nil {
			order = append(order, m)
		}
		byNode[m] = append(byNode[m], id)
	}
	results := make([]*HeartbeatResult, len(order))
	perNode := make([]error, len(order))
	var wg sync.WaitGroup
	for i, m := range order {
		wg.Go(func() { results[i], perNode[i] = m.client.Heartbeat(ctx, byNode[m]...) })
	}
	wg.Wait()
	out := &HeartbeatResult{Leases: make(map[string]time.Time, len(sandboxIDs))}
	for i, r := range results {
		if perNode[i] != nil {
			errs = append(errs, perNode[i])
			continue
		}
		for id, t := range r.Leases {
			out.Leases[id] = t
		}
		out.Unknown = append(out.Unknown, r.Unknown...)
	}
	return out, errors.Join(errs...)
}

// Any returns the Client of a live node, chosen at random, for calls any node answers alike:
// the env catalog, and the ledger, which the nodes of a cluster share.
func (c *Cluster) Any() (*Client, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClientClosed
	}
	var live []*member
	for _, m := range c.byName {
		if m.status().Err == nil {
			live = append(live, m)
		}
	}
	if len(live) == 0 {
		return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("no node of %s answers: %w", c.target, c.unknownNode()))
	}
	return live[rand.N(len(live))].client, nil
}

// ListEnvs returns a live node's env catalog with the state of its warm pools.
func (c *Cluster) ListEnvs(ctx context.Context) ([]*deltagymv1.EnvInfo, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, fmt.Errorf("listing envs: %w", err)
	}
	return cl.ListEnvs(ctx)
}

// ListEpisodes returns one page of the shared ledger's episodes (Client.ListEpisodes), from a
// live node.
func (c *Cluster) ListEpisodes(ctx context.Context, f EpisodeFilter) ([]*deltagymv1.Episode, string, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, "", fmt.Errorf("listing episodes: %w", err)
	}
	return cl.ListEpisodes(ctx, f)
}

// Episodes iterates over the shared ledger's episodes (Client.Episodes), from a live node.
func (c *Cluster) Episodes(ctx context.Context, f EpisodeFilter) iter.Seq2[*deltagymv1.Episode, error] {
	cl, err := c.Any()
	if err != nil {
		return func(yield func(*deltagymv1.Episode, error) bool) { yield(nil, fmt.Errorf("listing episodes: %w", err)) }
	}
	return cl.Episodes(ctx, f)
}

// Trajectory returns an episode's trajectory from the shared ledger (Client.Trajectory).
func (c *Cluster) Trajectory(ctx context.Context, episodeID string) (*deltagymv1.GetTrajectoryResponse, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, fmt.Errorf("trajectory of episode %s: %w", episodeID, err)
	}
	return cl.Trajectory(ctx, episodeID)
}

// RunCheckpointTree returns a run's checkpoint tree from the shared ledger.
func (c *Cluster) RunCheckpointTree(ctx context.Context, run string) ([]*deltagymv1.CheckpointNode, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, fmt.Errorf("checkpoint tree of run %q: %w", run, err)
	}
	return cl.RunCheckpointTree(ctx, run)
}

// EpisodeCheckpointTree returns an episode's checkpoint tree from the shared ledger.
func (c *Cluster) EpisodeCheckpointTree(ctx context.Context, episodeID string) ([]*deltagymv1.CheckpointNode, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, fmt.Errorf("checkpoint tree of episode %s: %w", episodeID, err)
	}
	return cl.EpisodeCheckpointTree(ctx, episodeID)
}

// GroupAdvantages returns a group's advantages from the shared ledger (Client.GroupAdvantages).
func (c *Cluster) GroupAdvantages(ctx context.Context, group, rewardSource string) (*deltagymv1.GetGroupAdvantagesResponse, error) {
	cl, err := c.Any()
	if err != nil {
		return nil, fmt.Errorf("advantages of group %q: %w", group, err)
	}
	return cl.GroupAdvantages(ctx, group, rewardSource)
}

// ReportReward records a reward of an episode in the shared ledger (Client.ReportReward).
func (c *Cluster) ReportReward(ctx context.Context, episodeID, name string, value float64, source string) error {
	cl, err := c.Any()
	if err != nil {
		return fmt.Errorf("reporting reward %q of episode %s: %w", name, episodeID, err)
	}
	return cl.ReportReward(ctx, episodeID, name, value, source)
}

// Close stops the refreshes and closes every node's Client (which stops the heartbeats of
// their sandboxes' handles; the sandboxes stay on their nodes until closed or reaped). Close is
// idempotent; calls after it fail with ErrClientClosed.
func (c *Cluster) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	c.stop()
	<-c.done
	return c.closeClients()
}

// closeClients closes every Client the cluster dialled, once no refresh runs.
func (c *Cluster) closeClients() error {
	c.refreshing.Lock()
	defer c.refreshing.Unlock()
	c.mu.Lock()
	c.closed = true
	var clients []*Client
	for _, m := range c.retired {
		clients = append(clients, m.client)
	}
	for _, m := range c.members {
		clients = append(clients, m.client)
	}
	for _, m := range c.byName {
		clients = append(clients, m.client)
	}
	c.mu.Unlock()
	var errs []error
	closed := make(map[*Client]bool, len(clients))
	for _, cl := range clients {
		if !closed[cl] {
			closed[cl] = true
			errs = append(errs, cl.Close())
		}
	}
	return errors.Join(errs...)
}
