package deltagym

import (
	"context"
	"errors"
	"time"
)

// Bounds of the automatic heartbeat interval.
const (
	minKeepAlive     = 10 * time.Millisecond
	defaultKeepAlive = 10 * time.Second
)

// KeepAlive starts a background goroutine that renews the sandbox's lease
// every interval until Close (of the handle or of its Client). A zero
// interval means a third of the lease's remaining time (learnt with a
// heartbeat when the handle does not know it yet). Transient errors are retried at the next tick; the loop
// ends when the server no longer knows the sandbox, and LeaseErr then
// reports it. Calling KeepAlive again while it runs does nothing.
func (s *Sandbox) KeepAlive(interval time.Duration) error {
	if err := s.checkOpen(); err != nil {
		return err
	}
	if interval <= 0 && s.LeaseExpiry().IsZero() {
		// Learn the lease (handles from Fork or Client.Sandbox do not know it).
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := s.heartbeat(ctx)
		cancel()
		if err != nil {
			return err
		}
	}
	s.mu.Lock()
	if s.kaStop != nil {
		s.mu.Unlock()
		return nil
	}
	if interval <= 0 {
		interval = defaultKeepAlive
		if !s.leaseExpiry.IsZero() {
			interval = time.Until(s.leaseExpiry) / 3
		}
	}
	interval = max(interval, minKeepAlive)
	s.kaStop, s.kaDone, s.kaErr = make(chan struct{}), make(chan struct{}), nil
	stop, done := s.kaStop, s.kaDone
	s.mu.Unlock()

	s.c.mu.Lock()
	if s.c.closed {
		s.c.mu.Unlock()
		close(done)
		return ErrClientClosed
	}
	s.c.keepalive[s] = struct{}{}
	s.c.mu.Unlock()

	go s.keepAliveLoop(interval, stop, done)
	return nil
}

func (s *Sandbox) keepAliveLoop(interval time.Duration, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		hctx, hcancel := context.WithTimeout(ctx, max(interval, time.Second))
		exp, err := s.heartbeat(hctx)
		hcancel()
		if s.onBeat != nil {
			s.onBeat(exp, err)
		}
		if errors.Is(err, ErrLeaseLost) {
			s.mu.Lock()
			s.kaErr = err
			s.mu.Unlock()
			return
		}
	}
}

// LeaseErr returns why the keep-alive heartbeat stopped on its own (an error
// wrapping ErrLeaseLost), or nil.
func (s *Sandbox) LeaseErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kaErr
}

// stopKeepAlive stops the heartbeat loop, if any, and waits for it to end.
func (s *Sandbox) stopKeepAlive() {
	s.mu.Lock()
	stop, done := s.kaStop, s.kaDone
	if stop != nil {
		select {
		case <-stop:
		default:
			close(stop)
		}
	}
	s.mu.Unlock()
	if done != nil {
		<-done
	}
	s.c.mu.Lock()
	delete(s.c.keepalive, s)
	s.c.mu.Unlock()
}
