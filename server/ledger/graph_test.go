package ledger

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestLinkGraphFollowsAcyclicLinks checks the links the graph's order follows against a plain
// search on random graphs with many cycles: an edge is followed exactly when its child does not
// reach its parent by parent_id and the edges followed before it, and the order walks every
// node once, each after every parent it follows.
func TestLinkGraphFollowsAcyclicLinks(t *testing.T) {
	t.Parallel()
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 7))
		n := 1 + rng.IntN(40)
		t0 := time.Unix(0, 0)
		nodes := make([]*GraphNode, n)
		for i := range nodes {
			nodes[i] = &GraphNode{CheckpointNode: CheckpointNode{CheckpointRow: CheckpointRow{
				ID: fmt.Sprintf("n%02d", i), CreatedAt: t0.Add(time.Duration(i) * time.Second)}}}
			if i > 0 && rng.IntN(4) > 0 {
				nodes[i].ParentID = fmt.Sprintf("n%02d", rng.IntN(i))
			}
		}
		var edges []CheckpointEdge
		for range rng.IntN(3 * n) {
			c, p := rng.IntN(n), rng.IntN(n+2) // n and n+1: outside the set
			if c != p {
				edges = append(edges, CheckpointEdge{ChildID: fmt.Sprintf("n%02d", c), ParentID: fmt.Sprintf("n%02d", p)})
			}
		}
		// The reference: the followed links as sets, each edge checked by a search.
		follows := make([]map[int]bool, n)
		for i := range follows {
			follows[i] = map[int]bool{}
		}
		has := make([]map[string]bool, n)
		for i, nd := range nodes {
			has[i] = map[string]bool{nd.ParentID: true}
			if nd.ParentID != "" {
				var p int
				fmt.Sscanf(nd.ParentID, "n%d", &p)
				follows[p][i] = true
			}
		}
		reaches := func(from, to int) bool {
			seen, stack := map[int]bool{from: true}, []int{from}
			for len(stack) > 0 {
				x := stack[len(stack)-1]
				stack = stack[:len(stack)-1]
				if x == to {
					return true
				}
				for y := range follows[x] {
					if !seen[y] {
						seen[y] = true
						stack = append(stack, y)
					}
				}
			}
			return false
		}
		for _, e := range edges {
			var c, p int
			fmt.Sscanf(e.ChildID, "n%d", &c)
			fmt.Sscanf(e.ParentID, "n%d", &p)
			if has[c][e.ParentID] {
				continue
			}
			has[c][e.ParentID] = true
			if p < n && !reaches(c, p) {
				follows[p][c] = true
			}
		}

		index := make(map[string]int32, n)
		for i, nd := range nodes {
			index[nd.ID] = int32(i)
		}
		out, pending := linkGraph(nodes, index, edges)
		for p := range n {
			var want []int32
			for c := range follows[p] {
				want = append(want, int32(c))
			}
			slices.Sort(want)
			if !slices.Equal(out[p], want) {
				t.Fatalf("seed %d: n%02d's followed children %v, want %v", seed, p, out[p], want)
			}
		}
		order := walkGraph(nodes, out, pending)
		if len(order) != n {
			t.Fatalf("seed %d: the order has %d of %d nodes", seed, len(order), n)
		}
		pos := map[string]int{}
		for i, nd := range order {
			if _, dup := pos[nd.ID]; dup {
				t.Fatalf("seed %d: %s twice in the order", seed, nd.ID)
			}
			pos[nd.ID] = i
		}
		for p := range n {
			for c := range follows[p] {
				if pos[nodes[p].ID] >= pos[nodes[c].ID] {
					t.Fatalf("seed %d: %s comes before %s, a parent it follows", seed, nodes[c].ID, nodes[p].ID)
				}
			}
		}
	}
}
