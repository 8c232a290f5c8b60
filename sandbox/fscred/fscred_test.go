package fscred

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/testenv"
)

func needRoot(t *testing.T) {
	t.Helper()
	testenv.Privileged(t, "setfsuid to another uid needs CAP_SETUID")
}

// creds is what /proc shows of one thread's filesystem credentials.
type creds struct {
	fsuid, fsgid   int
	capEff, capPrm uint64
}

func readCreds(status string) (creds, error) {
	b, err := os.ReadFile(status)
	if err != nil {
		return creds{}, err
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
	return c, nil
}

const (
	capDACOverride = 1 << 1
	capSysAdmin    = 1 << 21
)

// TestRun: fn runs with the ids asked for, with or without the file
// capabilities, and every thread of the process is back at fsuid 0 with
// all its capabilities afterwards, many runs later, concurrent ones too.
func TestRun(t *testing.T) {
	needRoot(t)
	for _, keep := range []bool{false, true} {
		var got creds
		err := Run(12345, 23456, keep, func() (err error) {
			got, err = readCreds("/proc/thread-self/status")
			return err
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
		c, err := readCreds(st)
		if err != nil {
			continue // a thread that has exited since
		}
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

// TestRunRestoresThread: the thread is handed back clean (run reports it so) after fn ran,
// after fn dropped a capability the kernel does not give back at fsuid 0, and after ids the
// kernel refuses (setfsuid and setfsgid report no failure: Run reads the ids back).
func TestRunRestoresThread(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name     string
		uid, gid int
		fn       func() error
		wantErr  bool
	}{
		{"fn does nothing", 12345, 23456, func() error { return nil }, false},
		{"fn drops CAP_SYS_ADMIN", 12345, 23456, func() error { return dropEffective(capSysAdmin) }, false},
		{"invalid uid", -1, 23456, func() error { return nil }, true},
		{"invalid gid", 12345, 1<<32 - 1, func() error { return nil }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan struct{})
			var err error
			var clean bool
			var after creds
			var readErr error
			go func() {
				defer close(done)
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				ran := false
				err, clean = run(tc.uid, tc.gid, true, func() error { ran = true; return tc.fn() })
				if tc.wantErr && ran {
					readErr = errors.New("fn ran with ids the kernel refused")
					return
				}
				after, readErr = readCreds("/proc/thread-self/status")
			}()
			<-done
			if readErr != nil {
				t.Fatal(readErr)
			}
			if (err != nil) != tc.wantErr {
				t.Fatalf("run returned %v, want an error: %v", err, tc.wantErr)
			}
			if !clean {
				t.Fatal("run reports the thread unclean")
			}
			if after.fsuid != 0 || after.fsgid != 0 || after.capEff != after.capPrm {
				t.Fatalf("thread left with fsuid %d fsgid %d, effective capabilities %x of %x", after.fsuid, after.fsgid, after.capEff, after.capPrm)
			}
		})
	}
}

// dropEffective clears bits of the calling thread's effective capabilities (the low word).
func dropEffective(bits uint32) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[0].Effective &^= bits
	return unix.Capset(&hdr, &data[0])
}
