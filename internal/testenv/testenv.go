// Package testenv says which tier a test belongs to and skips it, with the reason, where that
// tier does not run.
//
// The unit tier is `go test -short` (make test-unit): tests that need no root, no Postgres and
// no network, and run in seconds; it runs the same for root and for any other user. The
// privileged tier needs root (namespaces, mounts, cgroups, ptrace, CRIU); the integration tier a
// Postgres that the tests start, or a built server. `go test` without -short runs every tier its
// user can (make test-privileged, make test): privileged tests skip, saying so, when not root.
package testenv

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"testing"

	"github.com/deltagym/deltagym/internal/locate"
)

// PrivilegedReason returns why a privileged test cannot run here ("" when it can): the unit
// tier (-short) runs none, and they need root. why says what needs root. For TestMain, where no
// testing.TB is at hand (testing.Short needs flag.Parse first).
func PrivilegedReason(why string) string {
	switch {
	case testing.Short():
		return "privileged test (" + why + "): not in the unit tier (-short)"
	case os.Geteuid() != 0:
		return "needs root: " + why
	}
	return ""
}

// Privileged skips t unless it may run as a privileged test; why says what needs root.
func Privileged(t testing.TB, why string) {
	t.Helper()
	if r := PrivilegedReason(why); r != "" {
		t.Skip(r)
	}
}

// IntegrationReason returns why an integration test cannot run here ("" when it can): the unit
// tier (-short) runs none. what names what it needs (a Postgres, a built server).
func IntegrationReason(what string) string {
	if testing.Short() {
		return "integration test (needs " + what + "): not in the unit tier (-short)"
	}
	return ""
}

// Integration skips t in the unit tier; what names what it needs.
func Integration(t testing.TB, what string) {
	t.Helper()
	if r := IntegrationReason(what); r != "" {
		t.Skip(r)
	}
}

var (
	initOnce sync.Once
	initPath string
	initErr  error
)

// Init returns the sandbox init for a privileged test: the one $DELTAGYM_INIT names, else the
// checkout's bin/dg-init, which `make init` builds, or brings up to date, first. It fails t when
// neither can be had.
func Init(t testing.TB) string {
	t.Helper()
	initOnce.Do(func() {
		if os.Getenv(locate.EnvInit) == "" {
			root := locate.Checkout()
			if root == "" {
				initErr = errors.New("not inside a checkout, and $" + locate.EnvInit + " is unset")
				return
			}
			if out, err := exec.Command("make", "-C", root, "init").CombinedOutput(); err != nil {
				initErr = fmt.Errorf("make init: %w\n%s", err, out)
				return
			}
		}
		initPath, initErr = locate.Init()
	})
	if initErr != nil {
		t.Fatalf("the sandbox init: %v", initErr)
	}
	return initPath
}
