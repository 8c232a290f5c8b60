package server_test

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/server"
)

// The start's log says what set the sandbox cap (the flag, when one did) and how the ledger
// acknowledges rows (--ledger-sync).
func TestStartLog(t *testing.T) {
	var log syncBuffer
	setup(t, func(c *server.Config) {
		c.Admission.Sandboxes = 64
		c.LedgerSync = true
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	for _, want := range []string{"sandboxes=64 ", "sandboxes_bounded_by=--max-sandboxes", "ledger_sync=true", `rows_acknowledged="once fsynced in the spool"`} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("the start's log lacks %s:\n%s", want, log.String())
		}
	}
}
