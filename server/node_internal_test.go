package server

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/deltagym/deltagym/internal/nodeid"
)

// TestNodeName: the node's name is --node-name's, else the one the data directory keeps, else
// one made of the host name; the name in use is kept for the next start.
func TestNodeName(t *testing.T) {
	dir := t.TempDir()
	host, err := os.Hostname()
	if err != nil {
		t.Skip(err)
	}
	kept := func() string {
		b, err := os.ReadFile(filepath.Join(dir, nodeNameFile))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	name, err := nodeName(dir, "")
	if err != nil || name != nodeid.FromHostname(host) || kept() != name+"\n" {
		t.Fatalf("first start: %q, %v (kept %q); want %q", name, err, kept(), nodeid.FromHostname(host))
	}
	if name, err = nodeName(dir, "node-7"); err != nil || name != "node-7" || kept() != "node-7\n" {
		t.Fatalf("--node-name node-7: %q, %v (kept %q)", name, err, kept())
	}
	if name, err = nodeName(dir, ""); err != nil || name != "node-7" {
		t.Fatalf("a restart without --node-name: %q, %v; want the kept node-7", name, err)
	}
	if err := os.WriteFile(filepath.Join(dir, nodeNameFile), []byte("Not A Name\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if name, err = nodeName(dir, ""); err != nil || name != nodeid.FromHostname(host) || kept() != name+"\n" {
		t.Fatalf("a kept name that is none: %q, %v (kept %q)", name, err, kept())
	}
}

// TestClusterFlags: --node-name, --advertise-addr and --peers refuse what cannot be a node's name or
// address, saying what they want.
func TestClusterFlags(t *testing.T) {
	for _, c := range []struct {
		s  ClusterSettings
		ok bool
	}{
		{ClusterSettings{}, true},
		{ClusterSettings{Node: "ip-10-0-0-1.ec2.internal", AdvertiseAddr: "10.0.0.1:8080"}, true},
		{ClusterSettings{AdvertiseAddr: "[fd00::1]:8080"}, true},
		{ClusterSettings{Node: "Node_A"}, false},
		{ClusterSettings{Node: "-a"}, false},
		{ClusterSettings{AdvertiseAddr: "10.0.0.1"}, false},
		{ClusterSettings{AdvertiseAddr: ":8080"}, false},
		{ClusterSettings{Peers: "dns:deltagym.deltagym.svc.cluster.local:8080"}, true},
		{ClusterSettings{Peers: "10.0.0.1:8080,10.0.0.2:8080"}, true},
		{ClusterSettings{Peers: "dns:deltagym"}, false},
		{ClusterSettings{Peers: "10.0.0.1:8080,10.0.0.2"}, false},
	} {
		if err := c.s.check(); (err == nil) != c.ok {
			t.Errorf("%+v: %v, want ok %v", c.s, err, c.ok)
		}
	}
}
