package episode

import (
	"sync"
	"time"
)

// recentIDs remembers ids for a while: each for at most ttl after it was added, and at most
// max of them (the oldest go first). Adding and looking up cost O(1) amortized.
type recentIDs struct {
	mu sync.Mutex
	// +checklocks:mu
	ttl time.Duration
	// +checklocks:mu
	max int
	// +checklocks:mu
	at map[string]time.Time // when each id was added
	// +checklocks:mu
	order []recentID // oldest first from head
	// +checklocks:mu
	head int
}

type recentID struct {
	id string
	at time.Time
}

func newRecentIDs(ttl time.Duration, max int) *recentIDs {
	return &recentIDs{ttl: ttl, max: max, at: map[string]time.Time{}}
}

// add remembers id from now on.
func (r *recentIDs) add(id string) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.at[id] = now
	r.order = append(r.order, recentID{id, now})
	r.trimLocked(now)
}

// has reports whether id is remembered.
func (r *recentIDs) has(id string) bool {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.trimLocked(now)
	_, ok := r.at[id]
	return ok
}

// len returns the number of ids remembered.
func (r *recentIDs) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.at)
}

// trimLocked forgets the ids older than ttl at now, and the oldest beyond max.
//
// +checklocks:r.mu
func (r *recentIDs) trimLocked(now time.Time) {
	for r.head < len(r.order) {
		e := r.order[r.head]
		if len(r.order)-r.head <= r.max && now.Sub(e.at) <= r.ttl {
			break
		}
		if r.at[e.id].Equal(e.at) { // not added again since
			delete(r.at, e.id)
		}
		r.order[r.head] = recentID{}
		r.head++
	}
	if r.head > 0 && 2*r.head >= len(r.order) {
		n := copy(r.order, r.order[r.head:])
		clear(r.order[n:])
		r.order, r.head = r.order[:n], 0
	}
}
