package deltagym

import "time"

// SetOnBeat installs a hook called after each keep-alive heartbeat of s, for
// tests; call it before KeepAlive.
func SetOnBeat(s *Sandbox, f func(expiry time.Time, err error)) { s.onBeat = f }

// WithOnRefresh sets a hook a Cluster calls after each refresh, for tests that wait for one.
func WithOnRefresh(f func()) Option { return func(c *config) { c.onRefresh = f } }

// TransportFailure is transportFailure, for tests.
var TransportFailure = transportFailure
