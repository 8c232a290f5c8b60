package fscred

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: setfsuid to another uid needs CAP_SETUID")
	}
}

// creds is what /proc shows of one thread's filesystem credentials.
type creds struct {
	fsuid, fsgid   int
	capEff, capPrm uint64
}

func readCreds(t *testing.T, status string) creds {
	t.Helper()
	b, err := os.ReadFile(status)
	if err != nil {
		t.Fatal(err)
	}
	var c creds
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, ":")
		f := strings.Fields(v)
		switch k {
		case "Uid":
			c.fsuid, _ = strconv.Atoi(f[3])
		case "Gid":
			c.fsgid, _ = strconv.Atoi(f[3])
		case "CapEff":
			c.capEff, _ = strconv.ParseUint(f[0], 16, 64)
		case "CapPrm":
			c.capPrm, _ = strconv.ParseUint(f[0], 16, 64)
		}
	}
	return c
}

const capDACOverride = 1 << 1

// TestRun: fn runs with the ids asked for, with or without the file
// capabilities, and every thread of the process is back at fsuid 0 with
// all its capabilities afterwards, many runs later, concurrent ones too.
func TestRun(t *testing.T) {
	needRoot(t)
	for _, keep := range []bool{false, true} {
		var got creds
		err := Run(12345, 23456, keep, func() error {
			got = readCreds(t, "/proc/thread-self/status")
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if got.fsuid != 12345 || got.fsgid != 23456 {
			t.Errorf("keepCaps %v: fn ran with fsuid %d fsgid %d, want 12345 23456", keep, got.fsuid, got.fsgid)
		}
		if keep && got.capEff != got.capPrm {
			t.Errorf("keepCaps: fn ran with effective capabilities %x, want the permitted %x", got.capEff, got.capPrm)
		}
		if !keep && got.capEff&capDACOverride != 0 {
			t.Errorf("without keepCaps: fn ran with CAP_DAC_OVERRIDE (effective %x)", got.capEff)
		}
	}

	want := errors.New("fn failed")
	if err := Run(12345, 12345, true, func() error { return want }); !errors.Is(err, want) {
		t.Fatalf("Run returned %v, want fn's error", err)
	}

	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			if err := Run(10000+i, 20000+i, i%2 == 0, func() error { return nil }); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	tasks, err := filepath.Glob("/proc/self/task/*/status")
	if err != nil || len(tasks) == 0 {
		t.Fatalf("listing threads: %v", err)
	}
	for _, st := range tasks {
		c := readCreds(t, st)
		if c.fsuid != 0 || c.fsgid != 0 || c.capEff != c.capPrm {
			t.Errorf("thread %s left with fsuid %d fsgid %d, effective capabilities %x of %x", st, c.fsuid, c.fsgid, c.capEff, c.capPrm)
		}
	}
}

// BenchmarkRun: one Run with nothing to do, as the mounter (keepCaps) and
// as a user.
func BenchmarkRun(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: setfsuid to another uid needs CAP_SETUID")
	}
	for _, keep := range []bool{true, false} {
		b.Run("keepCaps="+strconv.FormatBool(keep), func(b *testing.B) {
			for b.Loop() {
				if err := Run(100000, 100000, keep, func() error { return nil }); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
