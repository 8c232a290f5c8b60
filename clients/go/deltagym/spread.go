package deltagym

import (
	"container/heap"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// minHeadroom is the least share of a node's capacity its CPU or memory headroom counts for:
// a node at or past full CPU load still ranks, behind the others, rather than never.
const minHeadroom = 0.05

// Placement score. A node's score with k more sandboxes than its report counts is
//
//	score(k) = (sandboxes + k) / (capacity × headroom)
//
// the share of what it can take that it would hold: lower is emptier.
//
//   - capacity is max_sandboxes, the node's admission cap. A node with no cap counts as capped
//     at the largest cap of the nodes placed over, or at 1 when none has one: uncapped nodes
//     are then ranked by their sandboxes against one another.
//   - headroom is the scarcer of the node's free CPU, 1 − cpu_load (cpu_load: runnable threads
//     per CPU, the last minute's load average), and its free memory, memory_available /
//     memory_total (1 when the node reports no memory), each at least minHeadroom. A node
//     whose CPUs are half busy counts for half its capacity.
//
// Equal nodes so take equal shares; a node with more room, a larger cap or a quieter CPU takes
// more, in proportion.
func score(n *deltagymv1.NodeInfo, k int, capacity float64) float64 {
	head := max(1-n.GetCpuLoad(), minHeadroom)
	if total := n.GetMemoryTotalBytes(); total > 0 {
		head = min(head, max(float64(n.GetMemoryAvailableBytes())/float64(total), minHeadroom))
	}
	return float64(int(n.GetSandboxes())+k) / (capacity * head)
}

// Spread splits n new sandboxes over nodes by load, and returns how many go to each:
// counts[i] to nodes[i], summing to n. It fills like water: each sandbox in turn goes to the
// node whose score would be lowest with it (the score counts the sandboxes given so far), ties
// to the first node. A node capped at max_sandboxes gets none past its cap while another has
// room; when none has, the caps are set aside (the nodes refuse what they cannot take). A nil
// or draining node gets none; with no other, every count is 0.
//
// A Cluster places each Reset with Spread over its live nodes (n = 1).
func Spread(nodes []*deltagymv1.NodeInfo, n int) []int {
	counts := make([]int, len(nodes))
	if n <= 0 {
		return counts
	}
	largestCap := 0
	for _, nd := range nodes {
		largestCap = max(largestCap, int(nd.GetMaxSandboxes()))
	}
	fill := func(capped bool) int {
		h := &spreadHeap{}
		for i, nd := range nodes {
			if nd == nil || nd.GetDraining() {
				continue
			}
			capacity := float64(max(largestCap, 1))
			if c := int(nd.GetMaxSandboxes()); c > 0 {
				capacity = float64(c)
			}
			s := &spreadSlot{i: i, node: nd, capacity: capacity}
			if capped && nd.GetMaxSandboxes() > 0 {
				s.limited, s.limit = true, int(nd.GetMaxSandboxes()-nd.GetSandboxes())
				if counts[i] >= s.limit {
					continue // full
				}
			}
			s.next = score(nd, counts[i]+1, capacity)
			h.slots = append(h.slots, s)
		}
		heap.Init(h)
		placed := 0
		for placed < n && h.Len() > 0 {
			s := h.slots[0]
			counts[s.i]++
			placed++
			if s.limited && counts[s.i] >= s.limit {
				heap.Pop(h)
				continue
			}
			s.next = score(s.node, counts[s.i]+1, s.capacity)
			heap.Fix(h, 0)
		}
		return placed
	}
	if placed := fill(true); placed < n {
		// Every node with room is full now: the rest go by score alone.
		n -= placed
		fill(false)
	}
	return counts
}

// spreadSlot is a node in Spread's heap: its index, its score with one more sandbox, and, when
// limited, the most it may take.
type spreadSlot struct {
	i        int
	node     *deltagymv1.NodeInfo
	capacity float64
	next     float64
	limited  bool
	limit    int
}

// spreadHeap orders slots by next score, then index.
type spreadHeap struct{ slots []*spreadSlot }

func (h *spreadHeap) Len() int { return len(h.slots) }
func (h *spreadHeap) Less(a, b int) bool {
	if h.slots[a].next != h.slots[b].next {
		return h.slots[a].next < h.slots[b].next
	}
	return h.slots[a].i < h.slots[b].i
}
func (h *spreadHeap) Swap(a, b int) { h.slots[a], h.slots[b] = h.slots[b], h.slots[a] }
func (h *spreadHeap) Push(x any)    { h.slots = append(h.slots, x.(*spreadSlot)) }
func (h *spreadHeap) Pop() any {
	s := h.slots[len(h.slots)-1]
	h.slots = h.slots[:len(h.slots)-1]
	return s
}
