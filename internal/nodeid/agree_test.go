package nodeid_test

import (
	"strings"
	"testing"

	"github.com/deltagym/deltagym/clients/go/deltagym"
	"github.com/deltagym/deltagym/internal/nodeid"
)

// agreeIDs are IDs of every shape: the Go client, which routes each call to the node an ID
// names, reads them with a parser of its own (its module imports none of the server's) that
// must name the node this package does.
var agreeIDs = []string{
	"", "-", "sb", "sb-", "ck-", "sb-3f2a9c0d1e4b5a69", "sb-a-3f2a9c0d1e4b5a69", "ck-node-1-3f2a9c0d1e4b5a69",
	"sb-a-b-3f2a9c0d1e4b5a69", "sb-ip-10-0-0-1.ec2.internal-3f2a9c0d1e4b5a69", "sb--3f2a9c0d1e4b5a69",
	"sb-Node-3f2a9c0d1e4b5a69", "sb-node-3F2A9C0D1E4B5A69", "sb-node-3f2a9c0d1e4b5a6", "sb-node-3f2a9c0d1e4b5a690",
	"sb-.x-3f2a9c0d1e4b5a69", "sb-x.-3f2a9c0d1e4b5a69", "sb-x--3f2a9c0d1e4b5a69", "sb-node_1-3f2a9c0d1e4b5a69",
	"sbnode3f2a9c0d1e4b5a69xx", "sb-fake-3", "sb_nope", "x-y-z", "sb-\xff-3f2a9c0d1e4b5a69",
	"sb-" + strings.Repeat("n", nodeid.MaxName) + "-3f2a9c0d1e4b5a69", "sb-" + strings.Repeat("n", nodeid.MaxName+1) + "-3f2a9c0d1e4b5a69",
	"openenv-sb-node-a-3f2a9c0d1e4b5a69",
}

// TestClientAgrees checks the Go client's NodeOf against Node on a table of IDs and on IDs New
// makes.
func TestClientAgrees(t *testing.T) {
	ids := append([]string(nil), agreeIDs...)
	for _, node := range []string{"", "a", "node-7", "w.example.com", strings.Repeat("z", nodeid.MaxName)} {
		ids = append(ids, nodeid.New("sb", node), nodeid.New("ck", node))
	}
	for _, id := range ids {
		if got, want := deltagym.NodeOf(id), nodeid.Node(id); got != want {
			t.Errorf("ID %q: the Go client reads node %q, the server %q", id, got, want)
		}
	}
}

// FuzzClientAgrees: no ID makes the two parsers disagree.
func FuzzClientAgrees(f *testing.F) {
	for _, id := range agreeIDs {
		f.Add(id)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if got, want := deltagym.NodeOf(id), nodeid.Node(id); got != want {
			t.Errorf("ID %q: the Go client reads node %q, the server %q", id, got, want)
		}
	})
}
