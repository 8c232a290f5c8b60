package server

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/internal/version"
)

// registerFlags binds the settings to flags of fs; def gives a flag's default: the value set,
// else the environment variable's, else the built-in one.
func (c *ClusterSettings) registerFlags(fs *flag.FlagSet, def func(v, env, d string) string) {
	fs.StringVar(&c.Node, "node-name", def(c.Node, "DELTAGYM_NODE_NAME", ""), "the node's `name`, carried by every sandbox and checkpoint ID it makes and stable across restarts "+
		"(lowercase letters, digits, '-' and '.'; in a cluster, the Kubernetes node's name) (default: the name the data directory keeps, else one made of the host name)")
	fs.StringVar(&c.AdvertiseAddr, "advertise-addr", def(c.AdvertiseAddr, "DELTAGYM_ADVERTISE_ADDR", ""), "the `host:port` other nodes and clients reach this node at, "+
		"reported by NodeService.GetNode (default: none, a node on its own)")
	fs.DurationVar(&c.DrainTimeout, "drain-timeout", c.DrainTimeout, "on SIGTERM, drain for up to this `duration` before shutting down: take no new sandboxes (Reset and Fork "+
		"fail with DRAINING, so that cluster clients place them elsewhere) while the sandboxes held run until their leases end (default 0: no drain; keep it, with "+
		"--shutdown-timeout, within the time the node is given to stop)")
	fs.BoolVar(&c.DigestAhead, "digest-ahead", c.DigestAhead, "hash each checkpoint's new layers in the background, so that another node "+
		"fetching the checkpoint need not wait for their digests (default: on with --peers)")
	fs.StringVar(&c.Peers, "peers", def(c.Peers, "DELTAGYM_PEERS", ""), "the cluster's nodes, which this node asks for their names and addresses so that "+
		"a call on another node's sandbox or checkpoint fails with WRONG_NODE giving the owner's address: dns:NAME:PORT (every address of NAME a node, "+
		"as a Kubernetes headless Service lists them) or a comma-separated list of `host:port` (default: none)")
}

// check refuses a node name or an address that cannot be one.
func (c *ClusterSettings) check() error {
	if c.Node != "" {
		if err := nodeid.CheckName(c.Node); err != nil {
			return fmt.Errorf("server: --node-name: %w", err)
		}
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("server: --drain-timeout %v is negative", c.DrainTimeout)
	}
	if a := c.AdvertiseAddr; a != "" {
		if host, port, err := net.SplitHostPort(a); err != nil || host == "" || port == "" {
			return fmt.Errorf("server: --advertise-addr %q: want host:port, as 10.0.0.7:8080", a)
		}
	}
	if c.Peers != "" {
		if err := deltagym.CheckClusterTarget(c.Peers); err != nil {
			return fmt.Errorf("server: --peers: %w", err)
		}
	}
	return nil
}

// dialPeers starts the discovery of the node's peers (--peers): the Go client's Cluster, which
// asks every node for its report with the node's own token, once before it returns (within a
// few seconds, whether they answer or not) and every DefaultRefresh after.
func (s *Server) dialPeers(ctx context.Context) error {
	if s.cfg.Cluster.Peers == "" {
		return nil
	}
	peers, err := deltagym.DialCluster(ctx, s.cfg.Cluster.Peers, deltagym.WithToken(s.token))
	if err != nil {
		return fmt.Errorf("discovering the peers (--peers): %w", err)
	}
	s.peers = peers
	var answering []string
	for _, n := range peers.Nodes() {
		if n.Err == nil {
			answering = append(answering, n.Name+"@"+n.Addr)
		}
	}
	s.log.Info("peers asked for their reports", "peers", s.cfg.Cluster.Peers, "answering", answering)
	return nil
}

// nodeNameFile is the file of the data directory that keeps the node's name.
const nodeNameFile = "node-name"

// nodeName returns the node's name: want (--node-name) when set, else the name dataDir keeps,
// else one made of the host name; the name returned is kept in dataDir for the next start, so
// that the IDs of the checkpoints kept across a restart go on naming this node.
func nodeName(dataDir, want string) (string, error) {
	path := filepath.Join(dataDir, nodeNameFile)
	kept, err := os.ReadFile(path)
	switch {
	case err == nil:
		if k := strings.TrimSpace(string(kept)); want == "" && nodeid.CheckName(k) == nil {
			return k, nil
		}
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("reading the node's name: %w", err)
	}
	name := want
	if name == "" {
		host, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("naming the node after its host (set --node-name): %w", err)
		}
		name = nodeid.FromHostname(host)
	}
	if strings.TrimSpace(string(kept)) == name {
		return name, nil
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(name+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("keeping the node's name: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", fmt.Errorf("keeping the node's name: %w", err)
	}
	return name, nil
}

// nodeService serves NodeService.
type nodeService struct{ s *Server }

// GetNode implements NodeService.GetNode.
func (n *nodeService) GetNode(_ context.Context, _ *connect.Request[deltagymv1.GetNodeRequest]) (*connect.Response[deltagymv1.GetNodeResponse], error) {
	return connect.NewResponse(&deltagymv1.GetNodeResponse{Node: n.s.nodeInfo()}), nil
}

// nodeInfo describes the node and its load now.
func (s *Server) nodeInfo() *deltagymv1.NodeInfo {
	s.mu.Lock()
	draining := s.closing || s.core.Draining()
	s.mu.Unlock()
	info := &deltagymv1.NodeInfo{
		Name: s.cfg.Cluster.Node, Address: s.cfg.Cluster.AdvertiseAddr, Version: version.Version, Draining: draining,
		Sandboxes: int32(s.core.Leased()), Checkpoints: int32(s.rt.Checkpoints()), MaxSandboxes: int32(max(s.rt.Caps().Sandboxes, 0)),
		Cpus: int32(runtime.NumCPU()), MeasuredAt: timestamppb.Now(),
	}
	if load, err := loadAverage(); err == nil {
		info.CpuLoad = load / float64(info.Cpus)
	}
	info.MemoryAvailableBytes, info.MemoryTotalBytes = memory()
	return info
}

// loadAverage reads the load average of the last minute.
func loadAverage() (float64, error) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, errors.New("/proc/loadavg is empty")
	}
	return strconv.ParseFloat(f[0], 64)
}

// memory reads MemAvailable and MemTotal of /proc/meminfo, in bytes; 0 for what it cannot read.
func memory() (available, total int64) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		kib, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		switch f[0] {
		case "MemAvailable:":
			available = kib << 10
		case "MemTotal:":
			total = kib << 10
		}
	}
	return available, total
}

// peerAddr returns the address of node name: the one it advertises in its report, else the one
// this node reached it at (--peers); "" when no peer reports that name.
func (s *Server) peerAddr(name string) string {
	if name == s.cfg.Cluster.Node {
		return s.cfg.Cluster.AdvertiseAddr
	}
	if s.peers == nil {
		return ""
	}
	st, ok := s.peers.Node(name)
	if !ok {
		return ""
	}
	return cmp.Or(st.Report.GetAddress(), st.Addr)
}

// BeginDrain makes the node take no new sandboxes: Reset and Fork fail with DRAINING and GetNode
// reports the node draining, while the sandboxes it holds run on. Drained waits for them.
func (s *Server) BeginDrain() {
	if !s.core.Draining() {
		s.log.Info("draining: no new sandboxes; waiting for the leased ones to end", "leased", s.core.Leased())
	}
	s.core.Drain()
}

// drainPoll is how often Drained looks at the sandboxes still leased.
const drainPoll = 100 * time.Millisecond

// Drained waits until no sandbox is leased (closed, or reaped when its lease ended), or ctx
// ends; it returns how many were still leased then.
func (s *Server) Drained(ctx context.Context) int {
	t := time.NewTicker(drainPoll)
	defer t.Stop()
	for {
		n := s.core.Leased()
		if n == 0 {
			return 0
		}
		select {
		case <-ctx.Done():
			return n
		case <-t.C:
		}
	}
}
