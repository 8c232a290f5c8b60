package initproc

import (
	"errors"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// CheckArgs takes a command right up to each of the init's limits and refuses it one past,
// as invalid input that names the limit.
func TestCheckArgsLimits(t *testing.T) {
	entries := func(n int) []string { return strings.Split(strings.Repeat("x,", n-1)+"x", ",") }
	// A payload of exactly MaxPayload bytes: the header, the cwd "/" and the two empty ends
	// take 16+2+1+1; one argument fills the rest, split to stay under MaxString.
	fill := MaxPayload - spawnHdrLen - 2 - 2
	var full []string
	for fill > 0 {
		n := min(fill-1, MaxString)
		full = append(full, strings.Repeat("a", n))
		fill -= n + 1
	}
	for _, tc := range []struct {
		name      string
		argv, env []string
		hint      string // "" when within the limits
	}{
		{"entries at the limit", entries(MaxEntries - 2), entries(2), ""},
		{"entries past the limit", entries(MaxEntries - 1), entries(2), "at most 4094"},
		{"argv alone past the limit", entries(6005), nil, "exec: 6005 argv entries: a command takes at most 4094"},
		{"argv and environment past the limit", entries(3), entries(4092), "exec: 3 argv entries and 4092 environment variables: a command"},
		{"payload at the limit", full, nil, ""},
		{"payload past the limit", append(full, "b"), nil, "(3 argv entries): a command takes at most 204800"},
		{"argument at the limit", []string{strings.Repeat("c", MaxString)}, nil, ""},
		{"argument past the limit", []string{strings.Repeat("c", MaxString+1)}, nil, "at most 131071"},
		{"variable past the limit", []string{"true"}, []string{"V=" + strings.Repeat("v", MaxString)}, "at most 131071"},
		{"empty argv", nil, nil, "empty argv"},
		{"empty argument", []string{"true", ""}, nil, "argv[1] is empty"},
		{"NUL in an argument", []string{"true", "a\x00"}, nil, "NUL"},
		{"NUL in a variable", []string{"true"}, []string{"A=x\x00"}, "NUL"},
	} {
		err := CheckArgs(tc.argv, tc.env, "/")
		switch {
		case tc.hint == "" && err != nil:
			t.Errorf("%s: %v, want ok", tc.name, err)
		case tc.hint != "" && (err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.hint)):
			t.Errorf("%s: %v, want invalid argument saying %q", tc.name, err, tc.hint)
		}
	}
}

// The init's own check counts the sandbox's variables with the request's, and says so.
func TestSpawnCheckCountsTheSandboxsVariables(t *testing.T) {
	err := checkArgs([]string{"true"}, make([]string, MaxEntries), "/", "the sandbox's own")
	if want := "exec: 1 argv entry and 4094 environment variables (the sandbox's own included): a command takes at most 4094"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("%v, want %q", err, want)
	}
}
