package episode

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/deltagym/deltagym/envpool"
)

// Bounds on the strings a client hands the core that it keeps (in episodes, checkpoint labels,
// idempotency caches) or echoes in errors: a request past one is refused before anything runs.
const (
	// MaxName bounds a run's or a group's name in bytes.
	MaxName = 256
	// MaxID bounds a sandbox or checkpoint id in bytes (the server's own are far shorter).
	MaxID = 128
	// MaxOptions bounds a Reset's task options: how many, each key's and value's bytes, and
	// all of them together (they reach the reset hook's environment).
	MaxOptions      = 64
	MaxOptionKey    = 128
	MaxOptionValue  = 32 << 10
	MaxOptionsBytes = 64 << 10
	// maxEnvName is the longest env name (envpool's names are at most 63 bytes).
	maxEnvName = 63
)

// checkName checks a run's or group's name.
func checkName(field, v string) error {
	if len(v) > MaxName {
		return fmt.Errorf("%s of %d bytes is longer than %d: %w", field, len(v), MaxName, ErrInvalid)
	}
	if !utf8.ValidString(v) || strings.ContainsRune(v, 0) {
		return fmt.Errorf("%s is not UTF-8 text without NUL: %w", field, ErrInvalid)
	}
	return nil
}

// checkID checks an id a request names, so that an error about it can quote it.
func checkID(field, id string) error {
	if len(id) > MaxID {
		return fmt.Errorf("%s of %d bytes is not an id of this server (at most %d): %w", field, len(id), MaxID, ErrInvalid)
	}
	return nil
}

// checkKey checks an idempotency key.
func checkKey(key string) error {
	if len(key) > MaxIdempotencyKey {
		return fmt.Errorf("idempotency_key of %d bytes is longer than %d: %w", len(key), MaxIdempotencyKey, ErrInvalid)
	}
	return nil
}

// checkReset checks what a Reset request carries besides its env's existence.
func checkReset(req *ResetRequest) error {
	if len(req.Env) > maxEnvName {
		return fmt.Errorf("env name of %d bytes is longer than %d: %w", len(req.Env), maxEnvName, ErrInvalid)
	}
	if err := checkOptions(req.Options); err != nil {
		return err
	}
	for _, err := range []error{checkName("run", req.Run), checkName("group_id", req.Group), checkKey(req.IdempotencyKey)} {
		if err != nil {
			return err
		}
	}
	return nil
}

// checkOptions checks a Reset's task options before anything runs: their bounds, and what
// makes an option (envpool.OptionKeyOK, no NUL in a value).
func checkOptions(opts map[string]string) error {
	if len(opts) > MaxOptions {
		return fmt.Errorf("%d options, more than %d: %w", len(opts), MaxOptions, ErrInvalid)
	}
	total := 0
	for k, v := range opts {
		switch {
		case len(k) > MaxOptionKey:
			return fmt.Errorf("option key of %d bytes is longer than %d: %w", len(k), MaxOptionKey, ErrInvalid)
		case len(v) > MaxOptionValue:
			return fmt.Errorf("option %s's value of %d bytes is longer than %d: %w", k, len(v), MaxOptionValue, ErrInvalid)
		case !envpool.OptionKeyOK(k):
			return fmt.Errorf("option %.64q is not a variable name (or uses the DELTAGYM_ prefix): %w", k, ErrInvalid)
		case strings.ContainsRune(v, 0):
			return fmt.Errorf("option %s's value holds NUL: %w", k, ErrInvalid)
		}
		total += len(k) + len(v)
	}
	if total > MaxOptionsBytes {
		return fmt.Errorf("options of %d bytes in all, more than %d: %w", total, MaxOptionsBytes, ErrInvalid)
	}
	return nil
}

// checkFork checks what a Fork request carries besides its source's existence.
func checkFork(req *ForkRequest) error {
	for _, err := range []error{checkID("checkpoint_id", req.CheckpointID), checkID("sandbox_id", req.SandboxID),
		checkName("run", req.Run), checkName("group_id", req.Group), checkKey(req.IdempotencyKey)} {
		if err != nil {
			return err
		}
	}
	return nil
}
