package ledger

import (
	"fmt"
	"time"
)

// EgressRow is one outbound connection of a sandbox through the egress proxy, allowed or
// refused (table egress, migration 0007).
type EgressRow struct {
	Env       string `json:"env"`
	Sandbox   string `json:"sandbox"`
	EpisodeID string `json:"episode_id,omitempty"` // the episode running in the sandbox, if any
	// Host and Port are the destination as the sandbox asked for it.
	Host string `json:"host"`
	Port int    `json:"port"`
	// Address is the IP address dialled or refused ("" when the name did not resolve).
	Address   string        `json:"address,omitempty"`
	Allowed   bool          `json:"allowed"`
	Reason    string        `json:"reason,omitempty"`
	BytesUp   int64         `json:"bytes_up"`
	BytesDown int64         `json:"bytes_down"`
	StartedAt time.Time     `json:"started_at"`
	Duration  time.Duration `json:"duration_ns"`
}

const insertEgress = `INSERT INTO egress (env, sandbox, episode_id, host, port, address, allowed, reason,
	bytes_up, bytes_down, started_at, duration_ns) VALUES ($1, $2, $3, $4, $5, $6::inet, $7, $8, $9, $10, $11, $12)`

func egressValues(r *EgressRow) []any {
	return []any{r.Env, r.Sandbox, nullStr(r.EpisodeID), r.Host, int32(r.Port), nullStr(r.Address), r.Allowed,
		nullStr(r.Reason), r.BytesUp, r.BytesDown, r.StartedAt, int64(r.Duration)}
}

// Egress records one connection through the egress proxy. Ids over MaxIDLen and ports outside
// 0-65535 are refused (ErrInvalid). A zero StartedAt means now.
func (w *Writer) Egress(r EgressRow) error {
	if r.Sandbox == "" || r.Host == "" || r.Port < 0 || r.Port > 65535 {
		return fmt.Errorf("egress row needs a sandbox, a host and a port: %w", ErrInvalid)
	}
	if len(r.EpisodeID) > MaxIDLen || len(r.Sandbox) > MaxIDLen || len(r.Env) > MaxIDLen || len(r.Host) > MaxIDLen {
		return fmt.Errorf("egress row: an id or host over %d bytes: %w", MaxIDLen, ErrInvalid)
	}
	if r.StartedAt.IsZero() {
		r.StartedAt = time.Now()
	}
	r.Host, r.Reason = text(r.Host), text(r.Reason) // a sandbox's request names the host
	return w.append(record{kind: recEgress, egress: &r})
}

func (e *enc) egress(r *EgressRow) {
	e.str(r.Env)
	e.str(r.Sandbox)
	e.str(r.EpisodeID)
	e.str(r.Host)
	e.i64(int64(r.Port))
	e.str(r.Address)
	e.bool(r.Allowed)
	e.str(r.Reason)
	e.i64(r.BytesUp)
	e.i64(r.BytesDown)
	e.time(r.StartedAt)
	e.i64(int64(r.Duration))
}

func (d *dec) egress() *EgressRow {
	return &EgressRow{Env: d.str(), Sandbox: d.str(), EpisodeID: d.str(), Host: d.str(), Port: int(d.i64()),
		Address: d.str(), Allowed: d.bool(), Reason: d.str(), BytesUp: d.i64(), BytesDown: d.i64(),
		StartedAt: d.time(), Duration: time.Duration(d.i64())}
}
