package server

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/deltagym/deltagym/envpool"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/ledger"
)

// session is the episode state of one leased sandbox (Lease.Value). Its fields change only
// during a call holding the lease's turn, under mu (which readers such as ListSandboxes take).
type session struct {
	mu        sync.Mutex
	episode   string
	run       string
	group     string
	seed      *int64
	startCkpt string
	base      int // steps inherited from the start checkpoint
	own       int // the episode's own steps so far
	total     float64
	started   time.Time
	ended     bool
	status    ledger.Status
}

// ckptMeta is where a checkpoint was taken, for Restore and Fork.
type ckptMeta struct {
	env     string
	episode string
	run     string
	group   string
	own     int // the episode's own steps when taken (ledger step_index)
	global  int // steps on its path when taken (the next step index after restoring it)
}

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// sessionOf returns the lease's session, nil while the lease is being handed over.
func sessionOf(l *envpool.Lease) *session {
	sess, _ := l.Value().(*session)
	return sess
}

// startEpisode attaches a new running episode to the lease and records it.
func (s *Server) startEpisode(l *envpool.Lease, run, group string, seed *int64, startCkpt string, from ckptMeta) *session {
	sess, _ := l.Value().(*session)
	if sess == nil {
		sess = &session{}
		l.SetValue(sess)
	}
	sess.mu.Lock()
	sess.episode = newID("ep_")
	sess.run, sess.group, sess.seed = run, group, seed
	sess.startCkpt, sess.base, sess.own, sess.total = startCkpt, from.global, 0, 0
	sess.started, sess.ended, sess.status = time.Now(), false, ledger.StatusRunning
	ep := sess.episode
	sess.mu.Unlock()
	if s.writer != nil {
		row := ledger.EpisodeStart{ID: ep, Env: l.Env().Name(), Run: run, Group: group, StartCheckpoint: startCkpt,
			ParentEpisode: from.episode, Sandbox: l.ID(), StartedAt: sess.started}
		if seed != nil {
			row.Seed = *seed
		}
		s.ledgerErr(s.writer.EpisodeStarted(row))
	}
	return sess
}

// endEpisode ends the running episode (if it runs) with status and records it; msg says why a
// failed one failed.
func (s *Server) endEpisode(sess *session, status ledger.Status, class ledger.FailureClass, msg string) {
	sess.mu.Lock()
	if sess.ended {
		sess.mu.Unlock()
		return
	}
	sess.ended, sess.status = true, status
	ep, total := sess.episode, sess.total
	sess.mu.Unlock()
	if s.writer != nil {
		s.ledgerErr(s.writer.EpisodeEnded(ledger.EpisodeEnd{ID: ep, Status: status, FailureClass: class, FailureMessage: msg,
			TotalReward: total, EndedAt: time.Now()}))
	}
}

func (s *Server) ledgerErr(err error) {
	if err != nil {
		s.log.Warn("recording to ledger", "err", err)
	}
}

// recordCheckpoint remembers where a checkpoint was taken and records it in the ledger.
func (s *Server) recordCheckpoint(env string, kind ledger.CheckpointKind, info sandbox.CheckpointInfo, sess *session) ckptMeta {
	meta := ckptMeta{env: env}
	if sess != nil {
		sess.mu.Lock()
		meta.episode, meta.run, meta.group, meta.own, meta.global = sess.episode, sess.run, sess.group, sess.own, sess.base+sess.own
		sess.mu.Unlock()
	}
	s.ckpts.Store(info.ID, meta)
	if s.writer != nil {
		s.ledgerErr(s.writer.Checkpoint(ledger.CheckpointRow{ID: info.ID, ParentID: info.Parent, Kind: kind, Env: env,
			Sandbox: info.SandboxID, EpisodeID: meta.episode, StepIndex: meta.own, CreatedAt: info.Created}))
	}
	return meta
}

// checkpointMeta returns what the server knows of checkpoint id; for checkpoints it did not
// record (taken before a restart), what the ledger recorded, else (no ledger, or a checkpoint
// the ledger never got) the env is the first one on the checkpoint's image.
func (s *Server) checkpointMeta(ctx context.Context, id string) (ckptMeta, error) {
	if v, ok := s.ckpts.Load(id); ok {
		if _, err := s.rt.Checkpoint(id); err != nil {
			return ckptMeta{}, err
		}
		return v.(ckptMeta), nil
	}
	info, err := s.rt.Checkpoint(id)
	if err != nil {
		return ckptMeta{}, err
	}
	// Taken before a restart: the ledger knows where (its env, episode and steps), so that
	// the steps after restoring it are numbered as before the restart.
	if s.store != nil {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		p, err := s.store.CheckpointPlace(ctx, id)
		cancel()
		if err == nil {
			meta := ckptMeta{env: p.Env, episode: p.Episode, run: p.Run, group: p.Group, own: p.Own, global: p.Global}
			s.ckpts.Store(id, meta)
			return meta, nil
		}
		if !errors.Is(err, ledger.ErrNotFound) {
			s.log.Warn("reading a checkpoint's place from the ledger", "checkpoint", id, "err", err)
		}
	}
	env, err := s.pools.EnvForImage(info.Image)
	if err != nil {
		return ckptMeta{}, err
	}
	return ckptMeta{env: env.Name()}, nil
}

// onPoolCheckpoint records the checkpoints the pools take (pool and task ones; evaluate ones
// are recorded by Evaluate with their episode).
func (s *Server) onPoolCheckpoint(env string, kind envpool.CheckpointKind, info sandbox.CheckpointInfo) {
	if kind == envpool.KindEvaluate {
		return
	}
	s.recordCheckpoint(env, ledger.CheckpointKind(kind), info, nil)
}

// onLeaseEnd ends the episode of a sandbox whose lease ended other than by Close: truncated when
// the lease expired (its client went away and the episode just stops there), failed with class
// infra when the sandbox died under it or the server shut down with it running.
func (s *Server) onLeaseEnd(l *envpool.Lease, reason string) {
	s.closed.Store(l.ID(), struct{}{})
	sess := sessionOf(l)
	if sess == nil {
		return
	}
	if reason == envpool.EndExpired {
		s.endEpisode(sess, ledger.StatusTruncated, ledger.FailureNone, "")
		return
	}
	msg := "the server shut down while the episode ran"
	if reason == envpool.EndDied {
		s.log.Warn("episode failed: its sandbox died", "sandbox", l.ID(), "env", l.Env().Name())
		msg = "its sandbox died (its init exited)"
	}
	s.endEpisode(sess, ledger.StatusFailed, ledger.FailureInfra, msg)
}

func (s *Server) describe(l *envpool.Lease) *deltagymv1.Sandbox {
	sess := sessionOf(l)
	sess.mu.Lock()
	defer sess.mu.Unlock()
	state := deltagymv1.SandboxState_SANDBOX_STATE_READY
	if sess.ended {
		state = deltagymv1.SandboxState_SANDBOX_STATE_DONE
	}
	return &deltagymv1.Sandbox{SandboxId: l.ID(), Env: l.Env().Name(), EpisodeId: sess.episode, Run: sess.run,
		GroupId: sess.group, State: state, NextStepIndex: int32(sess.base + sess.own), StartCheckpointId: sess.startCkpt,
		LeaseExpireTime: timestamppb.New(l.Expires()), CreateTime: timestamppb.New(l.Created())}
}

// idempotency remembers the responses of Reset and Fork by key, so a retry returns the first
// call's response; concurrent calls with one key wait for the first. Failed calls are forgotten.
// A key reused for a different request (another n, another source) is refused: a retry must
// repeat its request.
type idempotency struct {
	mu sync.Mutex
	m  map[string]*idemEntry
}

type idemEntry struct {
	req  [32]byte // fingerprint of the request (requestPrint)
	done chan struct{}
	resp proto.Message
	err  error
	at   time.Time
}

// idempotencyTTL is how long a key is remembered.
const idempotencyTTL = time.Hour

func newIdempotency() *idempotency { return &idempotency{m: map[string]*idemEntry{}} }

func (c *idempotency) do(ctx context.Context, kind, key string, req proto.Message, f func() (proto.Message, error)) (proto.Message, error) {
	if key == "" {
		return f()
	}
	fp := requestPrint(req)
	key = kind + "\x00" + key
	c.mu.Lock()
	if e, ok := c.m[key]; ok {
		c.mu.Unlock()
		if e.req != fp {
			return nil, fmt.Errorf("idempotency key %q was first used for a different %s request; a retry must repeat its request, a new request needs a new key: %w", key[len(kind)+1:], kind, ErrInvalid)
		}
		select {
		case <-e.done:
			if e.err != nil {
				return c.do(ctx, kind, key[len(kind)+1:], req, f)
			}
			return e.resp, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	now := time.Now()
	for k, e := range c.m {
		select {
		case <-e.done:
			if now.Sub(e.at) > idempotencyTTL {
				delete(c.m, k)
			}
		default:
		}
	}
	e := &idemEntry{req: fp, done: make(chan struct{}), at: now}
	c.m[key] = e
	c.mu.Unlock()
	e.resp, e.err = f()
	if e.err != nil {
		c.mu.Lock()
		delete(c.m, key)
		c.mu.Unlock()
	}
	close(e.done)
	return e.resp, e.err
}

// requestPrint fingerprints a request without its idempotency key.
func requestPrint(req proto.Message) [32]byte {
	m := proto.Clone(req)
	if fd := m.ProtoReflect().Descriptor().Fields().ByName("idempotency_key"); fd != nil {
		m.ProtoReflect().Clear(fd)
	}
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	return sha256.Sum256(b)
}
