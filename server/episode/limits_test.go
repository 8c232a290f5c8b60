package episode

import (
	"errors"
	"strings"
	"testing"
)

// Strings the core keeps or echoes are bounded; a request past a bound is invalid.
func TestRequestBounds(t *testing.T) {
	long := func(n int) string { return strings.Repeat("x", n) }
	for _, tc := range []struct {
		name string
		req  ResetRequest
		ok   bool
	}{
		{name: "plain", req: ResetRequest{Env: "e", Run: "r", Group: "g", IdempotencyKey: "k", Options: map[string]string{"EXPECTED": "42"}}, ok: true},
		{name: "names at the bound", req: ResetRequest{Env: "e", Run: long(MaxName), Group: long(MaxName), IdempotencyKey: long(MaxIdempotencyKey)}, ok: true},
		{name: "long run", req: ResetRequest{Env: "e", Run: long(MaxName + 1)}},
		{name: "long group", req: ResetRequest{Env: "e", Group: long(MaxName + 1)}},
		{name: "run with NUL", req: ResetRequest{Env: "e", Run: "a\x00b"}},
		{name: "run not UTF-8", req: ResetRequest{Env: "e", Run: "\xff"}},
		{name: "long key", req: ResetRequest{Env: "e", IdempotencyKey: long(MaxIdempotencyKey + 1)}},
		{name: "long env name", req: ResetRequest{Env: long(maxEnvName + 1)}},
		{name: "option key with =", req: ResetRequest{Env: "e", Options: map[string]string{"A=B": "1"}}},
		{name: "empty option key", req: ResetRequest{Env: "e", Options: map[string]string{"": "1"}}},
		{name: "option value with NUL", req: ResetRequest{Env: "e", Options: map[string]string{"A": "b\x00c"}}},
		{name: "long option value", req: ResetRequest{Env: "e", Options: map[string]string{"A": long(MaxOptionValue + 1)}}},
		{name: "options too large in all", req: ResetRequest{Env: "e", Options: map[string]string{"A": long(MaxOptionValue), "B": long(MaxOptionValue), "C": "x"}}},
	} {
		err := checkReset(&tc.req)
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("%s: %v, want ok %v (or ErrInvalid)", tc.name, err, tc.ok)
		}
		if err != nil && len(err.Error()) > 300 {
			t.Errorf("%s: the error quotes the request: %d bytes", tc.name, len(err.Error()))
		}
	}
	if err := checkFork(&ForkRequest{CheckpointID: long(MaxID + 1), N: 1}); !errors.Is(err, ErrInvalid) {
		t.Errorf("fork of a long checkpoint id: %v", err)
	}
	if err := checkFork(&ForkRequest{SandboxID: "sb-1", N: 1, Run: long(MaxName + 1)}); !errors.Is(err, ErrInvalid) {
		t.Errorf("fork with a long run: %v", err)
	}
}
