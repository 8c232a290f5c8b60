package nodeid_test

import (
	"strings"
	"testing"

	"github.com/deltagym/deltagym/internal/nodeid"
)

func TestNewAndNode(t *testing.T) {
	for _, node := range []string{"a", "node-1", "ip-10-0-0-1.ec2.internal", strings.Repeat("n", nodeid.MaxName)} {
		id := nodeid.New("sb", node)
		if got := nodeid.Node(id); got != node {
			t.Errorf("Node(%q) = %q, want %q", id, got, node)
		}
		if len(id) > 128 {
			t.Errorf("id %q is %d bytes, more than the API's 128", id, len(id))
		}
	}
	if id := nodeid.New("ck", ""); nodeid.Node(id) != "" || !strings.HasPrefix(id, "ck-") || len(id) != 19 {
		t.Errorf("New(ck, \"\") = %q: want ck-HEX16 naming no node", id)
	}
}

func TestNodeOfOtherShapes(t *testing.T) {
	for _, id := range []string{"", "sb-", "sb-3f2a9c0d1e4b5a69", "sb-fake-3", "sb--3f2a9c0d1e4b5a69",
		"sb-Node-3f2a9c0d1e4b5a69", "sb-node-3F2A9C0D1E4B5A69", "sb-node-3f2a9c0d1e4b5a6", "sb-.x-3f2a9c0d1e4b5a69",
		"sbnode3f2a9c0d1e4b5a69xx", "sb-node_1-3f2a9c0d1e4b5a69"} {
		if got := nodeid.Node(id); got != "" {
			t.Errorf("Node(%q) = %q, want none", id, got)
		}
	}
	if got := nodeid.Node("sb-a-b-3f2a9c0d1e4b5a69"); got != "a-b" {
		t.Errorf("Node of a dashed node = %q, want a-b", got)
	}
}

func TestCheckName(t *testing.T) {
	for _, ok := range []string{"a", "0", "node-1", "a.b", strings.Repeat("x", nodeid.MaxName)} {
		if err := nodeid.CheckName(ok); err != nil {
			t.Errorf("CheckName(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-a", "a-", ".a", "a.", "A", "a_b", "a b", "a/b", strings.Repeat("x", nodeid.MaxName+1)} {
		if err := nodeid.CheckName(bad); err == nil {
			t.Errorf("CheckName(%q) = nil, want an error", bad)
		}
	}
}

func TestFromHostname(t *testing.T) {
	for host, want := range map[string]string{"Worker_7.Example.COM": "worker-7.example.com", "--": "node", "": "node",
		"-x-": "x", strings.Repeat("h", 300): strings.Repeat("h", nodeid.MaxName)} {
		got := nodeid.FromHostname(host)
		if got != want {
			t.Errorf("FromHostname(%q) = %q, want %q", host, got, want)
		}
		if err := nodeid.CheckName(got); err != nil {
			t.Errorf("FromHostname(%q) = %q: %v", host, got, err)
		}
	}
}
