// Package fscred runs filesystem work with another host uid and gid as the
// filesystem credentials (fsuid, fsgid) of one locked OS thread, leaving the
// rest of the process as it is.
//
// Both the overlay mounter and the server's file actions need it: overlayfs
// works in its upper with its mounter's credentials, and a sandbox's files
// must be read and written as the sandbox's user (its host ids, seen through
// idmapped layers).
package fscred

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// Run runs fn with fsuid uid and fsgid gid. Moving fsuid away from 0 drops
// the file capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_MKNOD, …) from the
// effective set; keepCaps raises them again from the permitted set. The
// thread goes back to fsuid 0 with its capabilities afterwards and is handed
// back to the runtime; a thread that cannot be restored ends with its
// goroutine instead.
func Run(uid, gid int, keepCaps bool, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err, clean := run(uid, gid, keepCaps, fn)
		if clean {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

func run(uid, gid int, keepCaps bool, fn func() error) (err error, clean bool) {
	// setfsuid and setfsgid report no failure: the ids are read back
	// (an invalid id, -1, changes nothing and costs no credentials).
	unix.Setfsgid(gid)
	if g, _ := unix.SetfsgidRetGid(-1); g != gid {
		return fmt.Errorf("setfsgid %d: the thread's fsgid is %d", gid, g), restore()
	}
	unix.Setfsuid(uid)
	if u, _ := unix.SetfsuidRetUid(-1); u != uid {
		return fmt.Errorf("setfsuid %d: the thread's fsuid is %d", uid, u), restore()
	}
	if keepCaps {
		if err := RaiseCaps(); err != nil {
			return err, restore()
		}
	}
	err = fn()
	return err, restore()
}

// restore puts the thread back to fsuid and fsgid 0 with its effective
// capabilities its permitted ones, and reports whether it is.
//
// Each change of a thread's credentials is a new credential structure,
// freed after an RCU grace period, and a BPF program hooked to
// commit_creds (as on the VM this is developed on) makes each cost
// microseconds: under the rollback load test every file action and overlay
// mount runs here, so setfsuid, setfsgid and capset are a measurable share
// of the machine's CPU. Back at fsuid 0 the kernel raises the file
// capabilities from the permitted set itself, so the thread is already as
// it was: a capset only when capget finds otherwise, which spares one
// credential change per call (BenchmarkRun).
func restore() bool {
	unix.Setfsuid(0)
	unix.Setfsgid(0)
	if u, _ := unix.SetfsuidRetUid(-1); u != 0 {
		return false
	}
	if g, _ := unix.SetfsgidRetGid(-1); g != 0 {
		return false
	}
	return raiseCaps(false) == nil
}

// RaiseCaps makes the calling thread's effective capabilities its permitted
// ones.
func RaiseCaps() error { return raiseCaps(true) }

// raiseCaps is RaiseCaps; unless always, it sets nothing when they are
// already.
func raiseCaps(always bool) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	if !always && data[0].Effective == data[0].Permitted && data[1].Effective == data[1].Permitted {
		return nil
	}
	data[0].Effective = data[0].Permitted
	data[1].Effective = data[1].Permitted
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}
