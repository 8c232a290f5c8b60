package swerex

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
)

// A call that its client ended (it went away, or its deadline passed) is not logged as an
// internal error, and says what ended it; an error of the server's own still is.
func TestClientGoneNotInternal(t *testing.T) {
	var logged bytes.Buffer
	h := New(Config{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	r := httptest.NewRequest("POST", "/swerex/sb-1/run_in_session", nil).WithContext(ctx)
	w := httptest.NewRecorder()
	h.writeError(w, r, fmt.Errorf("session command cut short: %w", context.Canceled))
	var e struct {
		Swerexception exceptionTransfer `json:"swerexception"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Swerexception.ExtraInfo["code"] != "canceled" {
		t.Fatalf("answer %d %s: want code canceled", w.Code, w.Body.Bytes())
	}
	if logged.Len() > 0 {
		t.Fatalf("a call its client ended was logged: %s", logged.String())
	}
	h.writeError(httptest.NewRecorder(), httptest.NewRequest("POST", "/swerex/sb-1/execute", nil), errors.New("a fault of the host"))
	if !strings.Contains(logged.String(), "level=ERROR msg=\"internal error\"") {
		t.Fatalf("an internal error was not logged: %q", logged.String())
	}
}
