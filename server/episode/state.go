package episode

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"slices"
	"sync"
	"time"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/server/ledger"
)

// box is one sandbox the core handed out: its lease, and its current episode, which changes
// only during a call holding the lease's turn (Begin), under mu (which readers such as
// Sandboxes take too).
type box struct {
	lease *envpool.Lease

	mu sync.Mutex
	// +checklocks:mu
	ep state
}

// state is an episode's state.
type state struct {
	id        string
	run       string
	group     string
	seed      *int64
	startCkpt string
	base      int // steps inherited from the start checkpoint
	own       int // the episode's own steps so far
	// agentBase and agentOwn count the agent's steps among base and own: setup steps
	// (StepRequest.Setup) are numbered with them but count against no budget.
	agentBase int
	agentOwn  int
	setupTime time.Duration // the own setup steps' time, which the time budget does not count
	total     float64
	started   time.Time
	ended     bool
	status    ledger.Status
	why       string // how it ended, in words, when a budget or a failure ended it
}

// current returns a copy of b's episode state.
func (b *box) current() state {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ep
}

// place returns where a checkpoint taken now would be: b's episode and its steps.
func (b *box) place() Place {
	b.mu.Lock()
	defer b.mu.Unlock()
	return Place{Env: b.lease.Env().Name(), Episode: b.ep.id, Run: b.ep.run, Group: b.ep.group, Own: b.ep.own, Steps: b.ep.base + b.ep.own,
		Agent: b.ep.agentBase + b.ep.agentOwn}.
		withTask(b.lease.Task())
}

func (b *box) describe() SandboxInfo {
	l := b.lease
	b.mu.Lock()
	defer b.mu.Unlock()
	return SandboxInfo{SandboxID: l.ID(), Env: l.Env().Name(), EpisodeID: b.ep.id, Run: b.ep.run, Group: b.ep.group,
		Done: b.ep.ended, NextStepIndex: b.ep.base + b.ep.own, StartCheckpoint: b.ep.startCkpt,
		LeaseExpires: l.Expires(), Created: l.Created()}
}

func sortByCreation(s []SandboxInfo) {
	slices.SortFunc(s, func(a, b SandboxInfo) int { return a.Created.Compare(b.Created) })
}

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// begin describes an episode to start: its run, group and seed, and the checkpoint it starts
// at and where that was taken.
type begin struct {
	run, group string
	seed       *int64
	ckpt       string
	from       Place
}

// startEpisode starts b's next episode and records it. An episode that starts at a
// checkpoint of a task works on that task; one that starts at a checkpoint of none keeps its
// sandbox's.
func (c *Core) startEpisode(b *box, s begin) string {
	if s.from.task != nil {
		b.lease.SetTask(*s.from.task)
	}
	now := time.Now()
	ep := newID("ep_")
	b.mu.Lock()
	b.ep = state{id: ep, run: s.run, group: s.group, seed: s.seed, startCkpt: s.ckpt, base: s.from.Steps,
		agentBase: s.from.Agent, started: now, status: ledger.StatusRunning}
	b.mu.Unlock()
	if c.rec != nil {
		row := ledger.EpisodeStart{ID: ep, Env: b.lease.Env().Name(), Run: s.run, Group: s.group, StartCheckpoint: s.ckpt,
			ParentEpisode: s.from.Episode, Sandbox: b.lease.ID(), StartedAt: now}
		if s.seed != nil {
			row.Seed = *s.seed
		}
		c.ledgerErr(c.rec.EpisodeStarted(row))
	}
	return ep
}

// handOver starts the first episode of a sandbox the pools just handed over, and keeps it.
func (c *Core) handOver(l *envpool.Lease, s begin) (*box, string) {
	b := &box{lease: l}
	ep := c.startEpisode(b, s)
	c.adopt(b)
	select {
	case <-l.Ended():
		// Its sandbox died before the core kept it (the pools' hook found nothing to end).
		if c.forget(b) {
			c.endEpisode(b, ended{status: ledger.StatusFailed, class: ledger.FailureInfra, msg: "its sandbox died (its init exited)"})
		}
	default:
	}
	return b, ep
}

// ended is how an episode ends; msg says why a failed one failed.
type ended struct {
	status ledger.Status
	class  ledger.FailureClass
	msg    string
	// why says how, where msg (a failure's) does not: the budget that truncated it.
	why string
}

// endEpisode ends b's running episode (if it runs) and records it.
func (c *Core) endEpisode(b *box, e ended) {
	b.mu.Lock()
	if b.ep.ended {
		b.mu.Unlock()
		return
	}
	b.ep.ended, b.ep.status, b.ep.why = true, e.status, cmp.Or(e.why, e.msg)
	ep, total := b.ep.id, b.ep.total
	b.mu.Unlock()
	if c.rec != nil {
		c.ledgerErr(c.rec.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: e.status, FailureClass: e.class, FailureMessage: e.msg,
			TotalReward: total, EndedAt: time.Now()}))
	}
}
